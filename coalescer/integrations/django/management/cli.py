"""The ``coalescer`` command line inside Django: the same subcommands, options, help
and exit codes, named ``manage.py coalescer`` and with ``settings.COALESCER_RULES`` as
the default rules file (``--rules PATH`` still wins)."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

from django.core.exceptions import ImproperlyConfigured

from coalescer.cli.check_cmd import EXIT_ERROR
from coalescer.cli.main import main
from coalescer.cli.parser import IN_CODE, build_parser
from coalescer.config.rules_source import is_module_ref, load_rules
from coalescer.errors import ConfigError
from coalescer.integrations.django.conf import DEFAULT_RULES, RULES_SETTING, rules_setting
from coalescer.worker.isolation import start_fork_server

# Django's own options, applied by manage.py before the command runs
DJANGO_OPTIONS = ("--settings", "--pythonpath")
FORKSERVER_SETUP = "coalescer.integrations.django.management.forkserver_setup"


def run(argv: Sequence[str], *, prog: str, script: str) -> int:
    """Run ``coalescer ARGV`` in this process, where Django is set up; its exit status.
    ``script`` (manage.py's path) starts the children of ``run --processes N``."""
    argv = without_django_options(argv)
    try:
        parser = django_parser(prog, script)
    except ImproperlyConfigured as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return EXIT_ERROR
    args = parser.parse_args(argv)  # bad usage exits 2 here, as for the plain command
    problem = missing_rules(args, prog)
    if problem is not None:
        print(problem, file=sys.stderr)
        return EXIT_ERROR
    if args.command == "run" and args.processes == 1:
        set_up_handler_children(args.rules)
    return main(argv, parser=parser)


def set_up_handler_children(rules: str) -> None:
    """With a rule that may run in child processes in ``rules`` (a plain function runs
    there by default): start the fork server its handler processes are forked from,
    with Django set up in it, then the handler modules imported (and so their
    models). A rules file that does not load is left to the command, which reports it."""
    try:
        config = load_rules(rules, import_handlers=False)  # a file, or module:attribute
    except ConfigError:
        return
    isolated = [rule for rule in config.rules if rule.isolation is not None]
    if isolated:
        start_fork_server([(rule.handler_ref, _folder(rule.isolation.base_dir))
                           for rule in isolated if rule.isolation is not None],
                          first=[FORKSERVER_SETUP])


def _folder(base_dir: Path | None) -> str | None:
    return str(base_dir) if base_dir is not None else None


def without_django_options(argv: Sequence[str]) -> list[str]:
    """``argv`` less ``--settings X`` and ``--pythonpath X`` (either spelling)."""
    kept: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
        elif arg in DJANGO_OPTIONS:
            skip = True
        elif not arg.startswith(tuple(f"{option}=" for option in DJANGO_OPTIONS)):
            kept.append(arg)
    return kept


def django_parser(prog: str, script: str) -> argparse.ArgumentParser:
    """The command's parser named ``prog``, the setting's rules file as its default."""
    parser = build_parser(prog)
    rules = rules_setting()
    if rules is not None:
        for sub in _subparsers(parser):
            _default_rules(sub, rules)
    parser.set_defaults(child_command=(sys.executable, os.path.abspath(script), "coalescer"))
    return parser


def _subparsers(parser: argparse.ArgumentParser) -> Iterator[argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield sub
                yield from _subparsers(sub)


def _default_rules(parser: argparse.ArgumentParser, rules: str) -> None:
    for action in parser._actions:
        if action.dest == "rules" and action.default == DEFAULT_RULES:
            action.default = rules
            action.help = f"rules file (default {rules}, from settings.{RULES_SETTING})" + IN_CODE


def missing_rules(args: argparse.Namespace, prog: str) -> str | None:
    """The error line when the rules file the setting names is used and is missing (rules
    in code, ``module.path:attribute``, report their own errors when loaded)."""
    rules = rules_setting()
    if rules is None or getattr(args, "rules", None) != rules or getattr(args, "path", None):
        return None
    if Path(rules).exists() or is_module_ref(rules):
        return None
    return (f"{prog} {args.command}: settings.{RULES_SETTING} names {rules}, which does not "
            "exist: set it to the rules file's path (e.g. BASE_DIR / 'rules.yaml'), or "
            "give --rules PATH")
