"""How much of a burst's tracing is kept, and for how long."""

from __future__ import annotations

KEEP = 8  # span contexts kept at each end of a burst (the others are counted)
TTL_MS = 24 * 3600 * 1000  # contexts no refresh took are gone after a day
