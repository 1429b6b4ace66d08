"""How much of a burst's tracing is kept, and for how long."""

from __future__ import annotations

KEEP = 8  # span contexts kept at each end of a burst (the others are counted)
GRACE_MS = 15 * 60 * 1000  # contexts in Redis outlive their key's due time by this much
# at most (every step that drops the key deletes them sooner: see store/lua/traces_put.lua)
MAX_KEYS = 100_000  # keys whose contexts a node holds before writing them (more: the
# new keys' contexts are counted, not kept)
CONTEXT_BYTES = 56  # one W3C traceparent and its separator, as traces_put.lua keeps it
MAX_BYTES_PER_KEY = (2 * KEEP + 1) * CONTEXT_BYTES + 24  # the most one key's traces
# value holds in Redis (first and last KEEP, a failed try's, the count): what a byte
# budget of the keys' state may add per key with tracing on

