"""A rule's ``edge:``: when a burst's refresh runs.

``trailing`` (the default): a window after the burst's last touch (capped by
``max_wait``). ``leading``: the first touch of a quiet key (no touch of it within the
window before) is due at once; touches that come after that refresh started make one
trailing refresh, due as a trailing rule's burst is. See docs/rules.md.
"""

from __future__ import annotations

TRAILING = "trailing"
LEADING = "leading"
EDGES = (TRAILING, LEADING)

# The edge as the rules schema keeps it among a rule's numeric settings.
EDGE_CODES = {TRAILING: 0.0, LEADING: 1.0}


def edge_name(code: float) -> str:
    """The edge a schema setting's code stands for."""
    return LEADING if code == EDGE_CODES[LEADING] else TRAILING
