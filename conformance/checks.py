"""Comparing what Redis holds for a key (its ``explain`` JSON) with a case's EXPECT."""

from __future__ import annotations

from typing import Any

PLAIN = ("state", "due_reason", "attempts")


def compare(key: str, info: dict[str, Any], expect: dict[str, Any], marks: dict[str, int],
            now: int) -> list[str]:
    """What differs, one line each (empty: all holds). ``now``: the server clock at the
    check, the latest a touch made before it can have been taken."""
    wrong = [f"{key}: {name} is {info.get(name)!r}, expected {expect[name]!r}"
             for name in PLAIN if name in expect and info.get(name) != expect[name]]
    wrong += _items(key, info.get("items"), expect)
    if "scheduled" in expect and (info.get("scheduled_ms") is not None) != expect["scheduled"]:
        wrong.append(f"{key}: scheduled_ms is {info.get('scheduled_ms')!r}, expected "
                     f"{'a time' if expect['scheduled'] else 'none'}")
    if "due" in expect:
        wrong += _due(key, info.get("due_ms"), expect["due"], marks, now)
    if "due_from_first_ms" in expect:
        wrong += _from_first(key, info, int(expect["due_from_first_ms"]))
    unknown = set(expect) - {*PLAIN, "items", "items_count", "items_overflowed", "scheduled",
                             "due", "due_from_first_ms"}
    if unknown:
        wrong.append(f"{key}: the case expects fields the runner does not know: "
                     f"{sorted(unknown)}")
    return wrong


def _items(key: str, items: dict[str, Any] | None, expect: dict[str, Any]) -> list[str]:
    if not {"items", "items_count", "items_overflowed"} & set(expect):
        return []
    if items is None:
        return [f"{key}: its rule has no items, the case expects some"]
    pending = items["pending_items"]
    wrong = []
    if "items" in expect and pending != sorted(expect["items"]):
        wrong.append(f"{key}: items {pending!r}, expected {sorted(expect['items'])!r}")
    if "items_count" in expect and len(pending) != expect["items_count"]:
        wrong.append(f"{key}: {len(pending)} items {pending!r}, expected "
                     f"{expect['items_count']}")
    if "items_overflowed" in expect and items["pending_overflowed"] != expect["items_overflowed"]:
        wrong.append(f"{key}: items overflowed is {items['pending_overflowed']}, expected "
                     f"{expect['items_overflowed']}")
    return wrong


def _due(key: str, due: int | None, expect: dict[str, Any], marks: dict[str, int],
         now: int) -> list[str]:
    """``{"after": MARK, "ms": N}``: due between MARK + N and the check's clock + N (the
    touch was taken between the two); ``{"at": MS}``: due exactly then."""
    if due is None:
        return [f"{key}: no due time, expected one ({expect})"]
    if "at" in expect:
        at = int(expect["at"])
        return [] if due == at else [f"{key}: due at {due}, expected {at} ({due - at:+d} ms)"]
    low = marks[expect["after"]] + int(expect.get("ms", 0))
    high = now + int(expect.get("ms", 0))
    if low <= due <= high:
        return []
    return [f"{key}: due at {due}, expected between {low} and {high} "
            f"({expect['after']} + {expect.get('ms', 0)} ms and the check's clock + that)"]


def _from_first(key: str, info: dict[str, Any], ms: int) -> list[str]:
    """The due time is exactly ``ms`` after the burst's first touch."""
    due, first = info.get("due_ms"), info.get("first_touch_ms")
    if due is None or first is None or due - first != ms:
        return [f"{key}: due {due} is not first touch {first} + {ms} ms"]
    return []
