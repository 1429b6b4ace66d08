"""`coalescer check`: every error and warning of a rules file, and what it understood."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import sys
from typing import Any

from coalescer.cli.check_details import (
    describe_sources,
    handler_lines,
    source_errors,
    source_json,
)
from coalescer.common.plural import plural
from coalescer.common.redact import redact
from coalescer.config.namespace_env import namespace_origin
from coalescer.config.rules import CheckReport, Config
from coalescer.config.rules_source import check_rules

EXIT_ERROR = 1


def namespace_noted(text: str, namespace: str) -> str:
    """``text`` saying, on its line "namespace[:] NAME", that the namespace came from
    $COALESCER_NAMESPACE when it did."""
    origin = namespace_origin(namespace)
    if origin is None:
        return text
    return re.sub(rf"^(namespace:? {re.escape(namespace)})", rf"\1 {origin}", text, count=1,
                  flags=re.MULTILINE)


def cmd_check(args: argparse.Namespace) -> int:
    """Every error and warning of the rules file, one line each, in file order; exit 1
    when there are errors."""
    path = args.path or args.rules
    report = _with_source_errors(check_rules(path, os.environ,
                                             import_handlers=args.import_handlers))
    if args.json:
        print(json.dumps(_check_json(path, report), indent=2))
        return EXIT_ERROR if report.errors or report.config is None else 0
    found = [(e.line or 0, str(e)) for e in report.errors]
    found += [(w.line or 0, str(w)) for w in report.warnings]
    for _, text in sorted(found, key=lambda item: item[0]):
        print(redact(text), file=sys.stderr)
    warned = f", {plural(len(report.warnings), 'warning')}" if report.warnings else ""
    if report.errors or report.config is None:
        print(f"{plural(len(report.errors), 'error')}{warned} in {path}", file=sys.stderr)
        return EXIT_ERROR
    print(f"{report.config.source}: OK" + (f" ({warned[2:]})" if warned else ""))
    print(namespace_noted(report.config.describe(), report.config.namespace))
    _print_details(args, report.config)
    return 0


def _with_source_errors(report: CheckReport) -> CheckReport:
    """``report`` with the errors that make `run` refuse its sources here (a driver
    not installed): such a file fails the check too."""
    extra = source_errors(report)
    if not extra:
        return report
    return dataclasses.replace(report, config=None, errors=(*report.errors, *extra))


def _print_details(args: argparse.Namespace, config: Config) -> None:
    """After the rules: a line per source; with ``-v``, how each handler runs."""
    sources = describe_sources(config)
    if sources:
        print(sources)
    if getattr(args, "verbose", False):
        print("handlers:")
        print(handler_lines(config))


def _problem(problem: Any) -> dict[str, Any]:
    return {"file": problem.file, "line": problem.line, "field": problem.field,
            "message": redact(problem.message)}


def _check_json(path: str, report: Any) -> dict[str, Any]:
    """``check --json``: ok, every error and warning, and the rules understood."""
    config = report.config
    return {"file": path, "ok": not report.errors and config is not None,
            "errors": [_problem(e) for e in report.errors],
            "warnings": [_problem(w) for w in report.warnings],
            "rules": [{"name": r.name, "match": r.pattern.source} for r in config.rules]
            if config is not None else [],
            "sources": source_json(config.sources, config.namespace) if config is not None else []}
