"""``python manage.py coalescer run|check|status|explain|...``: coalescer's command line
with Django set up first (manage.py does that before it runs a command), so handler
modules may import models at their top."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from coalescer.integrations.django.management.cli import django_parser, run


class Command(BaseCommand):
    help = ("coalescer's command line (run, check, status, explain, touch, ...) with "
            "Django set up: see 'manage.py coalescer --help'")

    def run_from_argv(self, argv: list[str]) -> None:
        """``manage.py coalescer ARGS``: every argument goes to coalescer's own parser."""
        prog = f"{os.path.basename(argv[0])} {argv[1]}"
        code = run(argv[2:], prog=prog, script=argv[0])
        if code:
            sys.exit(code)

    def print_help(self, prog_name: str, subcommand: str) -> None:
        """``manage.py help coalescer``: coalescer's own help."""
        django_parser(f"{prog_name} {subcommand}", sys.argv[0]).print_help()

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("args", nargs=argparse.REMAINDER, metavar="ARGS",
                            help="a coalescer subcommand and its arguments")

    def handle(self, *args: Any, **options: Any) -> None:
        """``call_command("coalescer", "check")``: CommandError on a failure, with the
        command's exit status as its returncode."""
        code = run([str(arg) for arg in args], prog="coalescer", script=sys.argv[0])
        if code:
            raise CommandError(f"coalescer {' '.join(map(str, args[:1]))} exited with "
                               f"status {code}", returncode=code)
