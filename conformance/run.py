"""python -m conformance.run --adapter CMD: run the vectors against a client's adapter.

Exits 0 when every case run passed, 1 otherwise (each failure printed with what was
expected and what the adapter or Redis answered), 2 for bad options.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import Sequence

from conformance.case_run import Result, run_case
from conformance.servers import Servers
from conformance.vectors import LEVELS, Case, load


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m conformance.run", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--adapter", required=True,
                   help="the adapter command, run with a shell in this directory")
    p.add_argument("--level", type=int, action="append", choices=LEVELS,
                   help="a level to run (repeatable; default: all)")
    p.add_argument("--case", action="append", help="a case's name (repeatable)")
    p.add_argument("--fast", action="store_true",
                   help="leave out the cases marked slow (a client passes a level only "
                        "with them)")
    p.add_argument("--json", action="store_true", help="one JSON result line per case")
    return p


def chosen(cases: list[Case], names: Sequence[str] | None, fast: bool) -> list[Case]:
    if names:
        return [c for c in cases if c.name in names]
    return [c for c in cases if not (fast and c.slow)]


def report(result: Result, as_json: bool) -> str:
    if as_json:
        return json.dumps({"case": result.case.id, "ok": result.ok, "message": result.message,
                           "seconds": round(result.seconds, 2)})
    if result.ok:
        return f"ok    {result.case.id} ({result.seconds:.1f} s)"
    lines = [f"FAIL  {result.case.id}: {result.message}"]
    if result.stderr.strip():
        lines.append("      adapter stderr:\n" + result.stderr.rstrip())
    return "\n".join(lines)


async def run_all(cases: list[Case], command: str, as_json: bool) -> int:
    servers = Servers()
    failed = 0
    try:
        for case in cases:
            result = await run_case(case, command, servers)
            failed += not result.ok
            print(report(result, as_json), flush=True)
    finally:
        await asyncio.to_thread(servers.stop)
    if not as_json:
        print(f"{len(cases) - failed} of {len(cases)} cases passed")
    return 1 if failed else 0


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    cases = chosen(load(tuple(args.level or LEVELS)), args.case, args.fast)
    if not cases:
        print("no case chosen", file=sys.stderr)
        return 2
    return asyncio.run(run_all(cases, args.adapter, args.json))


if __name__ == "__main__":
    sys.exit(main())
