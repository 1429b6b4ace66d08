"""Where the fair claim script's Redis time goes: the CPU time of each of its steps per
key claimed, 50,000 due keys of one tenant claimed 32 a call (``fair_claim_cost``'s
first comparison), beside the whole script without ``fair``.

A copy of the script with timers around its steps (``os.clock`` in the script, summed
in a hash of the bench's server); the timers cost a little themselves, so the steps add
up to somewhat more than the script takes untimed.

    .venv/bin/python -m bench.fair_claim_breakdown [DIR]
"""

from __future__ import annotations

import asyncio
import sys
import tempfile
from pathlib import Path
from typing import Any

from . import fair_claim_cost as cost
from .valkey import Server

PROF = "bench:fair-steps"
TIMERS = ("local function __t() return os.clock() * 1000000 end\n"
          f"local function __p(f, v) redis.call('HINCRBYFLOAT', '{PROF}', f, v) end\n")
# (text in the script, the same text with a timer around it: a step's name and its code)
STEPS = {
    "settings (weights, cap)": "  fair_settings(f)\n",
    "index: the sweep (reads, priorities, queues)": "  fair_index(f, got)\n  if start > 0",
    "index: the round below the sweep":
        "    fair_index(f, fair_missing(f, redis.call('ZRANGE', due_key, at, stop, "
        "'WITHSCORES')))\n",
    "index: the fast lane and gaps": "  fair_fast(c, f, due_key, n == 2 * FAIR_SWEEP)\n",
    "plan (start tags)": "  local cands, capped = fair_plan(f, limit)\n",
    "take (the claims below included)":
        "  local got = fair_take(c, f, r, due_key, inflight_key, cands)\n",
    "claims (as plain due order's)": "  claim_keys(c, r, due_key, inflight_key, ready)\n",
}


def _timed(source: str) -> str:
    source = source.replace("local function fair_specs(from)",
                            TIMERS + "local function fair_specs(from)", 1)
    for name, text in STEPS.items():
        assert text in source, text
        first, rest = text.split("\n", 1)
        indent = first[:len(first) - len(first.lstrip())]
        timed = (f"{indent}local __a = __t()\n{first}\n"
                 f"{indent}__p({name!r}, __t() - __a)\n{rest}")
        source = source.replace(text, timed, 1)
    return source.replace("local fair = fair_specs(5 + rules)",
                          "local __all = __t()\nlocal fair = fair_specs(5 + rules)", 1).replace(
        "redis.call('SET', KEYS[4],",
        "__p('the whole script', __t() - __all)\nredis.call('SET', KEYS[4],", 1)


def edit(name: str, source: str) -> str:
    return _timed(source) if name == "claim" else source


class _Keep:
    """The bench's server, keeping the timers' hash from the flush after each run."""

    def __init__(self, server: Server) -> None:
        self.server, self.url = server, server.url
        self.kept: dict[Any, float] = {}

    def client(self) -> Any:
        client = self.server.client()
        flush = client.flushall

        def keep_then_flush(*args: Any, **kwargs: Any) -> Any:
            self.kept = {k: float(v) for k, v in client.hgetall(PROF).items()}
            return flush(*args, **kwargs)

        client.flushall = keep_then_flush  # type: ignore[method-assign]
        return client


async def measure(server: Server) -> tuple[dict[str, float], float]:
    keep = _Keep(server)
    await cost.claim_all(keep, "steps", cost.Setup(edit=edit))  # type: ignore[arg-type]
    steps = {k if isinstance(k, str) else k.decode(): v / cost.N for k, v in keep.kept.items()}
    plain = await cost.claim_all(server, "plain", cost.Setup(fair=False))
    return steps, plain


def main() -> None:
    root = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(tempfile.mkdtemp())
    with Server(root) as server:
        steps, plain = asyncio.run(measure(server))
    print(f"µs of Redis CPU per key claimed, {cost.N:,} due keys, 32 a call:")
    for name, us in sorted(steps.items(), key=lambda kv: -kv[1]):
        print(f"  {name:48s} {us:6.2f}")
    print(f"  {'plain due order, the whole script (untimed)':48s} {plain:6.2f}")


if __name__ == "__main__":
    main()
