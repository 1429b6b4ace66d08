"""Time ``coalescer check`` on many rules: the whole check of a rules file (read, validate,
import handlers, lint), and the unreachable-rule lint alone, indexed against the pairwise
lint it replaced (every rule compared with every earlier rule).

    .venv/bin/python -m bench.check [--sizes 100,1000,10000] [--old-up-to 1000]

Prints seconds (median of 3) per size and the ratio old / new. The pairwise lint is
quadratic, so it only runs up to ``--old-up-to`` rules.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from coalescer.config.lint import ConfigWarning, RuleMatch, unreachable
from coalescer.config.patterns import KeyPattern, covers
from coalescer.config.rules import check_file

Lint = Callable[[str, Sequence[RuleMatch]], list[ConfigWarning]]


def pairwise(file: str, matches: Sequence[RuleMatch]) -> list[ConfigWarning]:
    """The lint before the index: which rules are shadowed, by every earlier rule."""
    found: list[ConfigWarning] = []
    for position, rule in enumerate(matches):
        earlier = matches[:position]
        if any(covers([e.pattern], rule.pattern) for e in earlier) or (
                len(earlier) > 1 and covers([e.pattern for e in earlier], rule.pattern)):
            found.append(ConfigWarning(rule.name, file, rule.line))
    return found


_SHAPES = ["t{n}:orders:{{id}}", "t{n}:user:{{id}}:daily", "t{n}:stats:*", "t{n}:{{x}}"]


def rules(count: int) -> list[RuleMatch]:
    """Rules as a large file has them: one per tenant and kind, a few wildcards."""
    return [RuleMatch(index=i, name=f"r{i}", line=3 * i + 3,
                      pattern=KeyPattern.compile(_SHAPES[i % 4].format(n=i // 4)))
            for i in range(count)]


def rules_file(count: int, folder: Path) -> Path:
    """A rules file of ``count`` rules of the shapes above, one handler for all."""
    lines = ["namespace: bench", "defaults: {window: 1s, max_wait: 5s}", "rules:"]
    lines += [f'- {{name: r{i}, match: "{_SHAPES[i % 4].format(n=i // 4)}", '
              "handler: examples.stats:refresh_user}" for i in range(count)]
    path = folder / "rules.yaml"
    path.write_text("\n".join(lines) + "\n")
    return path


def check_seconds(count: int, repeats: int = 3) -> float:
    """The whole check of a file of ``count`` rules, as `coalescer check` runs it."""
    runs = []
    with tempfile.TemporaryDirectory() as folder:
        path = rules_file(count, Path(folder))
        for _ in range(repeats):
            t0 = time.perf_counter()
            report = check_file(path, os.environ)
            runs.append(time.perf_counter() - t0)
            assert not report.errors, report.errors[:3]
    return statistics.median(runs)


def seconds(lint: Lint, count: int, repeats: int = 3) -> float:
    matches = rules(count)
    runs = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        lint("rules.yaml", matches)
        runs.append(time.perf_counter() - t0)
    return statistics.median(runs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="100,1000,10000")
    parser.add_argument("--old-up-to", type=int, default=1000)
    args = parser.parse_args()
    print("rules | whole check s | lint: indexed s | pairwise s | ratio pairwise/indexed")
    for count in (int(s) for s in args.sizes.split(",")):
        whole = check_seconds(count)
        new = seconds(unreachable, count)
        old = seconds(pairwise, count) if count <= args.old_up_to else None
        ratio = f"{old / new:.1f}" if old is not None and new else "-"
        print(f"{count} | {whole:.3f} | {new:.3f} | {'skipped' if old is None else f'{old:.3f}'}"
              f" | {ratio}")


if __name__ == "__main__":
    main()
