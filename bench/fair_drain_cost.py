"""Where a whole import's Redis time goes, ``fair`` on against off: the skew figure of
``fairness.py`` (one tenant imports 200,000 keys while another touches a key every
0.25 s; one node, a no-op handler), on a fresh valkey-server a run, rounds alternating
which side goes first. Each run reads ``INFO commandstats`` after the drain: a script's
time (``evalsha``) includes the commands it ran, which are listed apart too.

    .venv/bin/python -m bench.fair_drain_cost [--quick] [--rounds N]

The machine's speed drifts by a quarter from one run to the next, and every time here
drifts with it. So each run also reads its *control*: the Redis time of the timelines'
and the history's writes (``RPUSH``, ``PEXPIRE``, ``XADD``), the same calls for the same
keys on both sides. Prints each run's drain, script time and control, then per key
imported the commands whose Redis time differs most between the sides: medians over the
rounds of each run's times scaled to the median control (the same machine speed).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
from pathlib import Path

from . import common as C
from . import fairness as FR
from .valkey import Server, commandstats

Usage = dict[str, tuple[int, int]]  # command -> (calls, microseconds)
CONTROL = ("rpush", "pexpire", "xadd")  # the same calls, keys and values on both sides


async def one_run(root: Path, sizes: C.Sizes, fair: bool) -> tuple[float, Usage]:
    """One skew run: the import's drain (s) and the server's command usage."""
    with Server(root) as server:
        out = await FR.skew(server, sizes, fair)
        with server.client() as client:
            calls, usec = commandstats(client), commandstats(client, "usec")
    return out["a"]["drain_s"], {name: (calls[name], usec[name]) for name in calls}


def control(usage: Usage) -> int:
    return sum(usage.get(name, (0, 0))[1] for name in CONTROL)


def scaled(runs: list[Usage], speed: float) -> Usage:
    """Per command, the median over ``runs`` of calls and of microseconds, each run's
    time scaled by ``speed`` over its control."""
    names = {name for run in runs for name in run}
    return {name: (int(statistics.median(r.get(name, (0, 0))[0] for r in runs)),
                   int(statistics.median(r.get(name, (0, 0))[1] * speed / control(r)
                                         for r in runs)))
            for name in names}


def report(keys: int, found: dict[bool, list[tuple[float, Usage]]]) -> None:
    for side in (True, False):
        for drain, usage in found[side]:
            print(f"fair {'on ' if side else 'off'}: drain {drain:6.2f} s, scripts "
                  f"{usage.get('evalsha', (0, 0))[1] / 1e6:6.2f} s of Redis time, control "
                  f"{control(usage) / 1e6:5.2f} s")
    speed = statistics.median(control(u) for runs in found.values() for _, u in runs)
    on, off = (scaled([u for _, u in found[side]], speed) for side in (True, False))
    print(f"\nmedians, µs of Redis time per key imported ({keys:,} keys), at the same "
          "machine speed:")
    print(f"{'command':24} {'fair on':>9} {'fair off':>9} {'more':>7}  calls on / off")
    rows = sorted(on.keys() | off.keys(),
                  key=lambda n: -(on.get(n, (0, 0))[1] - off.get(n, (0, 0))[1]))
    for name in rows[:12]:
        (c_on, u_on), (c_off, u_off) = on.get(name, (0, 0)), off.get(name, (0, 0))
        print(f"{name:24} {u_on / keys:9.2f} {u_off / keys:9.2f} {(u_on - u_off) / keys:7.2f}"
              f"  {c_on:,} / {c_off:,}")


async def measure(rounds: int, sizes: C.Sizes) -> dict[bool, list[tuple[float, Usage]]]:
    found: dict[bool, list[tuple[float, Usage]]] = {True: [], False: []}
    with tempfile.TemporaryDirectory() as root:
        for n in range(rounds):
            for side in ((True, False) if n % 2 == 0 else (False, True)):
                found[side].append(await one_run(Path(root), sizes, side))
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a 40,000-key import")
    parser.add_argument("--rounds", type=int, default=3, help="runs of each side")
    args = parser.parse_args()
    sizes = C.Sizes.quick() if args.quick else C.Sizes()
    found = asyncio.run(measure(args.rounds, sizes))
    report(FR.sizes_of(sizes).fair_import, found)


if __name__ == "__main__":
    main()
