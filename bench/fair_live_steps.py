"""Where the server's time goes while a 200,000-key import drains, with ``fair`` on and
off: the fairness bench's skew figure (``bench.fairness.skew``: tenant ``a`` imports,
tenant ``b`` touches a key every 0.25 s), in alternating rounds of three systems:

- ``off``: the rule without ``fair``;
- ``fair``: the rule with ``fair``, its scripts as built;
- ``steps``: ``fair`` with its claim script timed step by step (the timers of
  ``bench.fair_claim_breakdown``, which cost a little themselves).

Each run reports the import's drain, the server's CPU seconds over the run (``INFO cpu``)
and per key started, the claim calls the node made and the keys they claimed, and the
quiet tenant's lag p99. The steps runs add each step's server µs per key claimed. The
drain is compared within each round (off's drain over fair's): this machine's speed
drifts from round to round by more than the difference measured.

    .venv/bin/python -m bench.fair_live_steps [ROUNDS] [DIR]
"""

from __future__ import annotations

import asyncio
import contextlib
import statistics
import sys
import tempfile
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from coalescer.store.claim_scripts import ClaimScripts

from . import common as C
from . import fair_claim_breakdown as BD
from . import fairness as FR
from .script_edits import edited_scripts
from .valkey import Server

SYSTEMS = ("off", "fair", "steps")
ROUNDS = 3


@contextlib.contextmanager
def counted_claims() -> Iterator[Counter[str]]:
    """Count the claim calls of the clients made inside, and the keys they claimed."""
    counts: Counter[str] = Counter()
    claim = ClaimScripts.claim

    async def counting(self: ClaimScripts, *args: Any, **kwargs: Any) -> Any:
        batch = await claim(self, *args, **kwargs)
        counts["calls"] += 1
        counts["claimed"] += len(batch.claims)
        return batch

    ClaimScripts.claim = counting  # type: ignore[method-assign]
    try:
        yield counts
    finally:
        ClaimScripts.claim = claim  # type: ignore[method-assign]


def cpu_seconds(server: Server) -> float:
    with server.client() as r:
        cpu = r.info("cpu")
    return float(cpu["used_cpu_user"]) + float(cpu["used_cpu_sys"])


def step_times(server: Server) -> dict[str, float]:
    """The timed steps' server µs so far (and forget them)."""
    with server.client() as r:
        found = r.hgetall(BD.PROF)
        r.delete(BD.PROF)
    return {(k.decode() if isinstance(k, bytes) else k): float(v) for k, v in found.items()}


async def run(server: Server, sizes: C.Sizes, system: str) -> dict[str, Any]:
    """One skew run of ``system`` (see the module)."""
    step_times(server)
    before = cpu_seconds(server)
    timers = edited_scripts(BD.edit) if system == "steps" else contextlib.nullcontext()
    with counted_claims() as counts, timers:
        out = await FR.skew(server, sizes, system != "off")
    cpu = cpu_seconds(server) - before
    keys = out["a"]["started"] + len(FR.STARTS.times.get("b", []))
    row = {"system": system, "drain_s": out["a"]["drain_s"], "quiet_p99_ms": out["b"].get("p99"),
           "server_cpu_s": cpu, "server_us_per_key": cpu * 1e6 / max(keys, 1),
           "calls": counts["calls"], "claimed": counts["claimed"]}
    if system == "steps":
        row["steps_us_per_key"] = {name: us / max(counts["claimed"], 1)
                                   for name, us in step_times(server).items()}
    return row


async def measure(server: Server, sizes: C.Sizes, rounds: int) -> list[list[dict[str, Any]]]:
    """``rounds`` rounds of every system, each round in the other order than the last."""
    found = []
    for n in range(rounds):
        order = SYSTEMS if n % 2 == 0 else tuple(reversed(SYSTEMS))
        by_system = {system: await run(server, sizes, system) for system in order}
        found.append([by_system[s] for s in SYSTEMS])
    return found


def report(found: list[list[dict[str, Any]]]) -> str:
    lines = [f"{'round':>5} {'system':6} {'drain s':>8} {'server s':>9} {'µs/key':>7} "
             f"{'calls':>6} {'keys/call':>9} {'quiet p99 ms':>12}"]
    for n, rows in enumerate(found):
        for row in rows:
            p99 = row["quiet_p99_ms"]
            lines.append(
                f"{n:5d} {row['system']:6} {row['drain_s']:8.2f} {row['server_cpu_s']:9.2f} "
                f"{row['server_us_per_key']:7.1f} {row['calls']:6d} "
                f"{row['claimed'] / max(row['calls'], 1):9.1f} "
                f"{p99 if p99 is None else round(p99, 1)!s:>12}")
    ratios = [rows[0]["drain_s"] / rows[1]["drain_s"] for rows in found if rows[1]["drain_s"]]
    lines.append("drain, off over fair in each round: "
                 + ", ".join(f"{r:.2f}x" for r in ratios)
                 + (f" (median {statistics.median(ratios):.2f}x)" if ratios else ""))
    extra = [rows[1]["server_us_per_key"] - rows[0]["server_us_per_key"] for rows in found]
    lines.append("server µs per key, fair less off in each round: "
                 + ", ".join(f"{e:+.1f}" for e in extra))
    steps: dict[str, list[float]] = {}
    for rows in found:
        for name, us in rows[2]["steps_us_per_key"].items():
            steps.setdefault(name, []).append(us)
    lines.append("the timed claim script, server µs per key claimed (median of the rounds):")
    for name, values in sorted(steps.items(), key=lambda kv: -statistics.median(kv[1])):
        lines.append(f"  {name:48s} {statistics.median(values):6.2f}")
    return "\n".join(lines)


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else ROUNDS
    root = Path(sys.argv[2]) if len(sys.argv) > 2 else Path(tempfile.mkdtemp())
    with Server(root) as server:
        found = asyncio.run(measure(server, C.Sizes(), rounds))
    print(report(found))


if __name__ == "__main__":
    main()
