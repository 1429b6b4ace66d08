"""The port an example's server listens on: ``--port``, else ``$PORT``, else the example's
own default (8080 for the stats app, 8090 for the webhook receiver; the sync app's
gunicorn.conf.py reads ``$PORT`` too, default 8000)."""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping

ENV_PORT = "PORT"
MAX_PORT = 65535


def add_port_option(parser: argparse.ArgumentParser, default: int) -> None:
    parser.add_argument("--port", type=int, default=None,
                        help=f"port to listen on (default ${ENV_PORT}, else {default})")


def chosen_port(parser: argparse.ArgumentParser, given: int | None, default: int,
                environ: Mapping[str, str] = os.environ) -> tuple[int, str]:
    """(the port, where it came from); a ``$PORT`` that is not a port exits naming it."""
    if given is not None:
        return given, "--port"
    value = environ.get(ENV_PORT)
    if not value:
        return default, f"the default; --port or ${ENV_PORT} changes it"
    if not value.isdigit() or int(value) > MAX_PORT:
        parser.error(f"${ENV_PORT} must be a port number (0 to {MAX_PORT}), not {value!r}")
    return int(value), f"${ENV_PORT}"


def announce(name: str, host: str, port: int, source: str) -> None:
    """One line saying where the example listens (printed before the server starts)."""
    print(f"{name} listening on http://{host}:{port} (port {port}: {source})", flush=True)
