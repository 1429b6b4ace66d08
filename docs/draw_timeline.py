"""Draw docs/burst-timeline.svg: one key through a burst, a refresh, retries, a dead letter.

Run from the repository root: ``python docs/draw_timeline.py``. Standard library only.
The times follow the rules for a rule with window 1 s, max_wait 4 s and
retry {attempts: 3, backoff: 1s}; the two backoff delays are drawn jittered (0.8 s, 1.4 s).
"""

from __future__ import annotations

from html import escape
from pathlib import Path

WIDTH, HEIGHT = 1200, 420
X0, PX_PER_S, END = 150, 100, 10.2
WINDOW, MAX_WAIT = 1.0, 4.0
FONT = "DejaVu Sans, Helvetica, Arial, sans-serif"

BURST = (0.0, 0.6, 1.2, 1.7, 2.3, 2.8, 3.4)  # touches before the refresh
DURING = (4.5, 4.9)  # touches while the refresh runs
# (start, end, kind, label): the key's state over time
STATES = (
    (0.0, 4.0, "pending", "pending: the due time moves with each touch"),
    (4.0, 5.3, "success", "refresh ✓"),
    (5.3, 5.9, "pending", ""),
    (5.9, 6.3, "failure", "✗"),
    (6.3, 7.1, "backoff", "backoff"),
    (7.1, 7.5, "failure", "✗"),
    (7.5, 8.9, "backoff", "backoff"),
    (8.9, 9.3, "failure", "✗"),
    (9.3, END, "dead", "dead"),
)
FILL = {"pending": "#f4c542", "success": "#2f9e44", "failure": "#e03131",
        "backoff": "url(#hatch)", "dead": "#343a40"}
TEXT = {"pending": "#3b2f00", "success": "#fff", "failure": "#fff", "backoff": "#343a40",
        "dead": "#fff"}
TRIES = ((4.65, "token 7"), (6.1, "try 1 · token 8"), (7.3, "try 2 · token 9"),
         (9.1, "try 3 · token 10"))
BADGES = ((1.0, "1"), (4.0, "2"), (4.7, "3"), (6.7, "4"), (9.75, "5"))
NOTES = (
    "Each touch moves the due time to touch + window (trailing-edge debounce): "
    "the refresh waits for a quiet second.",
    "The burst keeps going, but it began at 0 s: the refresh starts at first touch + "
    "max_wait (4 s), never later.",
    "Touches during the refresh are recorded, not dropped: exactly one more refresh, "
    "a window after the last of them.",
    "A failed refresh is retried after a backoff (1 s, 2 s, 4 s ... jittered to 50-100%), "
    "each try with a larger fencing token.",
    "After retry.attempts tries (3 here) the key is dead-lettered; "
    "coalescer dead retry KEY, or a new touch, re-queues it.",
)
LEGEND = (("pending", "pending (waiting for its due time)"), ("success", "refresh succeeded"),
          ("failure", "refresh failed"), ("backoff", "retry backoff"),
          ("dead", "dead letter"))


def x(t: float) -> float:
    return X0 + t * PX_PER_S


def text(tx: float, ty: float, body: str, size: int = 14, *, anchor: str = "start",
         fill: str = "#212529", weight: str = "normal") -> str:
    return (f'<text x="{tx:.1f}" y="{ty:.1f}" font-size="{size}" text-anchor="{anchor}" '
            f'fill="{fill}" font-weight="{weight}">{escape(body)}</text>')


def badge(cx: float, cy: float, label: str) -> str:
    return (f'<circle cx="{cx:.1f}" cy="{cy:.1f}" r="10" fill="#5f3dc4"/>'
            + text(cx, cy + 4.5, label, 13, anchor="middle", fill="#fff", weight="bold"))


def touches() -> list[str]:
    out = [text(20, 78, "touch(key)", 14, weight="bold")]
    for t in BURST + DURING:
        colour = "#1c7ed6" if t in BURST else "#e8590c"
        out.append(f'<line x1="{x(t):.1f}" y1="64" x2="{x(t):.1f}" y2="84" '
                   f'stroke="{colour}" stroke-width="3"/>')
        out.append(f'<circle cx="{x(t):.1f}" cy="64" r="4" fill="{colour}"/>')
    out.append(text(x(4.35), 58, "touched while refreshing", 12, fill="#e8590c"))
    return out


def window_bar(t: float, lane: int, colour: str, cap: float | None) -> list[str]:
    y = 96 + lane * 12
    end = t + WINDOW
    shown = min(end, cap) if cap is not None else end
    out = [f'<rect x="{x(t):.1f}" y="{y}" width="{x(shown) - x(t):.1f}" height="7" rx="2" '
           f'fill="{colour}" opacity="0.75"/>',
           f'<line x1="{x(shown):.1f}" y1="{y - 2}" x2="{x(shown):.1f}" y2="{y + 9}" '
           f'stroke="{colour}" stroke-width="2"/>']
    if shown < end:  # the part the max-wait cap cut off
        out.append(f'<rect x="{x(shown):.1f}" y="{y}" width="{x(end) - x(shown):.1f}" '
                   f'height="7" rx="2" fill="none" stroke="{colour}" stroke-dasharray="3 2"/>')
    return out


def windows() -> list[str]:
    out = [text(20, 108, "window", 14, weight="bold"),
           text(20, 124, "ends at the due time", 11, fill="#868e96")]
    for i, t in enumerate(BURST):
        out += window_bar(t, i % 2, "#1c7ed6", BURST[0] + MAX_WAIT)
    for i, t in enumerate(DURING):
        out += window_bar(t, i % 2, "#e8590c", None)
    cap = x(BURST[0] + MAX_WAIT)
    out.append(f'<line x1="{cap:.1f}" y1="44" x2="{cap:.1f}" y2="190" stroke="#c2255c" '
               'stroke-width="2" stroke-dasharray="6 4"/>')
    out.append(text(cap - 6, 48, "max-wait cap = first touch + 4 s", 13, anchor="end",
                    fill="#c2255c", weight="bold"))
    return out


def states() -> list[str]:
    out = [text(20, 172, "key state", 14, weight="bold")]
    for start, end, kind, label in STATES:
        out.append(f'<rect x="{x(start):.1f}" y="150" width="{x(end) - x(start):.1f}" '
                   f'height="36" fill="{FILL[kind]}" stroke="#fff" stroke-width="1.5"/>')
        if label:
            mid = (x(start) + x(end)) / 2
            out.append(text(mid, 173, label, 14, anchor="middle", fill=TEXT[kind], weight="bold"))
    out.append(text(x(5.6), 145, "re-armed", 12, anchor="middle", fill="#7a5c00"))
    for t, label in TRIES:
        out.append(text(x(t), 204, label, 12, anchor="middle", fill="#495057"))
    return out


def axis() -> list[str]:
    out = [f'<line x1="{x(0):.1f}" y1="216" x2="{x(END):.1f}" y2="216" stroke="#868e96"/>']
    for second in range(int(END) + 1):
        out.append(f'<line x1="{x(second):.1f}" y1="212" x2="{x(second):.1f}" y2="220" '
                   'stroke="#868e96"/>')
        out.append(text(x(second), 235, f"{second} s", 12, anchor="middle", fill="#868e96"))
    out.append(text(20, 235, "server clock", 12, fill="#868e96"))
    return out


def notes() -> list[str]:
    out = [badge(x(t), 134, label) for t, label in BADGES]
    for i, note in enumerate(NOTES):
        y = 268 + i * 27
        out.append(badge(32, y - 5, str(i + 1)))
        out.append(text(52, y, note, 14))
    lx = 20.0
    for kind, label in LEGEND:
        out.append(f'<rect x="{lx:.1f}" y="397" width="18" height="14" fill="{FILL[kind]}" '
                   'stroke="#adb5bd"/>')
        out.append(text(lx + 24, 409, label, 12, fill="#495057"))
        lx += 36 + len(label) * 6.6
    return out


def svg() -> str:
    head = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" '
        f'viewBox="0 0 {WIDTH} {HEIGHT}" font-family="{FONT}">',
        '<defs><pattern id="hatch" width="8" height="8" patternUnits="userSpaceOnUse" '
        'patternTransform="rotate(45)"><rect width="8" height="8" fill="#e9ecef"/>'
        '<line x1="0" y1="0" x2="0" y2="8" stroke="#adb5bd" stroke-width="3"/></pattern></defs>',
        f'<rect width="{WIDTH}" height="{HEIGHT}" fill="#fff"/>',
        text(20, 26, "One key through a burst", 17, weight="bold"),
        text(272, 26, "rule: window 1 s, max_wait 4 s, retry {attempts: 3, backoff: 1s}",
             14, fill="#495057"),
    ]
    body = touches() + windows() + states() + axis() + notes()
    return "\n".join([*head, *body, "</svg>", ""])


def main() -> None:
    out = Path(__file__).with_name("burst-timeline.svg")
    out.write_text(svg(), encoding="utf-8")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
