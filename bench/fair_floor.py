"""The fair order against the cheapest it could be: exact per-tenant queues, emulated.

The claim script keeps an index that is a hint (store/lua/_fair.lua): it copies each due
key into its tenant's queue, looks for keys put back below its sweep, and checks that
each key it pops is still due. The one design that would skip all of that keeps each
tenant's queue exact as keys are written: every script that adds or removes a due key
of a fair rule would update that key's queue too (the touch script, and so every writer,
Python and TypeScript; acks, retries, recovery, cancels, moves and the queries). Before
building that, this module measures what it could gain, for the fairness bench's drain
figures (``bench.fairness.skew`` and ``balanced``, as the ``floor`` system of their
groups):

- the touch script copies each key it schedules into its tenant's queue, scored by its
  due time, and puts the tenant in the order at the virtual time (one more ZADD a key);
- the claim script pops only keys due by now from those queues: no sweep, no fast lane,
  no round below the sweep, no check that a popped key is still due.

Only touches are emulated (no retries, cancels, moves or priorities, each of which the
real design would pay for), for rule ``t`` of the bench's one shard: what this measures
is a lower bound on that design's cost, not a working implementation of it.
"""

from __future__ import annotations

from typing import Any

from coalescer.store.keys import ShardKeys

from . import common as C
from . import fairness as FR
from .script_edits import edited_scripts
from .valkey import Server

QUEUES = FR.SHARD.fair(FR.RULE)  # the rule's fair prefix in the bench's one shard


def upsert_edit(shard: ShardKeys) -> tuple[str, str]:
    """The touch script's edit for rule ``t`` of ``shard``: after the ZADD of a group's
    keys to due:t, each key into its tenant's queue, and the tenant into the order."""
    return ("  each_chunk('ZADD', due_key, p.adds)\n",
            f"""  each_chunk('ZADD', due_key, p.adds)
  if due_key == '{shard.due(FR.RULE)}' then
    local pre, by = '{shard.fair(FR.RULE)}', {{}}
    for i = 1, #p.adds, 2 do
      local g = string.match(p.adds[i + 1], '^t:([^:]*):') or ''
      local t = by[g] or {{}}
      by[g] = t
      t[#t + 1], t[#t + 2] = p.adds[i], p.adds[i + 1]
    end
    for g, t in pairs(by) do
      each_chunk('ZADD', pre .. 'q:' .. g, t)
      if not redis.call('ZSCORE', pre .. 'groups', g) then
        local v = tonumber(redis.call('HGET', pre .. 'state', 'v')) or 0
        local fin = tonumber(redis.call('ZSCORE', pre .. 'tags', g))
        redis.call('ZADD', pre .. 'groups', math.max(v, fin or v), g)
      end
    end
  end
""")


_POP = ("      local popped = redis.call('ZRANGE', f.prefix .. 'q:' .. x.g, '-inf', "
        "int(c.now), 'BYSCORE', 'LIMIT', 0, x.take, 'WITHSCORES')\n"
        "      local ks = {}\n"
        "      for i = 1, #popped, 2 do ks[#ks + 1] = popped[i] end\n"
        "      if #ks > 0 then redis.call('ZREM', f.prefix .. 'q:' .. x.g, unpack(ks)) end\n")
_CHECK = ("  local scores, ready = redis.call('ZMSCORE', due_key, unpack(keys)), {}\n"
          "  for i = 1, #keys do\n    if scores[i] then ready[#ready + 1] = keys[i] end\n"
          "  end\n")
_QUEUED = "redis.call('ZCARD', f.prefix .. 'q:' .. {}) > 0"
# The claim script's edits: (its text, the floor's); a group stays in the order while its
# queue holds keys not yet due
CLAIM = (
    ("  fair_sweep(c, f, due_key)\n", ""),
    ("      local n = redis.call('ZCARD', f.prefix .. 'q:' .. g)\n",
     "      local n = redis.call('ZCOUNT', f.prefix .. 'q:' .. g, '-inf', int(f.now))\n"),
    ("      if have == 0 then redis.call('ZREM', groups, g) end\n",
     f"      if have == 0 and not ({_QUEUED.format('g')}) then "
     "redis.call('ZREM', groups, g) end\n"),
    ("      local popped = redis.call('ZPOPMIN', f.prefix .. 'q:' .. x.g, x.take)\n", _POP),
    (_CHECK, "  local ready = keys\n"),
    ("      if x.n > x.popped then\n",
     f"      if x.n > x.popped or {_QUEUED.format('x.g')} then\n"),
    ("  f.v, f.meta = tonumber(st[1]) or 0, c.meta\n",
     "  f.v, f.meta, f.now = tonumber(st[1]) or 0, c.meta, c.now\n"),
)
# The import process's first line: the same scripts there
PRELUDE = ("import bench.fair_floor as _floor, bench.script_edits as _edits; "
           "_edits.install(_floor.floor_source)\n")


def _edit(source: str, edits: tuple[tuple[str, str], ...]) -> str:
    for old, new in edits:
        if old not in source:
            raise RuntimeError(f"the floor's edit no longer finds {old.strip()!r}")
        source = source.replace(old, new, 1)
    return source


def floor_source(name: str, source: str, shard: ShardKeys = FR.SHARD) -> str:
    """Script ``name``'s text as the floor runs it, for rule ``t`` of ``shard``."""
    if name == "upsert":
        return _edit(source, (upsert_edit(shard),))
    if name == "claim":
        return _edit(source, CLAIM)
    return source


async def skew(server: Server, sizes: C.Sizes) -> dict[str, Any]:
    """``bench.fairness.skew`` with ``fair`` on, the floor's scripts in the node and in
    the import's process."""
    with edited_scripts(floor_source):
        return await FR.skew(server, sizes, True, prelude=PRELUDE)


async def balanced(server: Server, sizes: C.Sizes) -> dict[str, Any]:
    """``bench.fairness.balanced`` with ``fair`` on and the floor's scripts."""
    with edited_scripts(floor_source):
        return await FR.balanced(server, sizes, True)
