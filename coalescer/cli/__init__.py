"""The ``coalescer`` command: the argument parser and its commands, error lines,
the demo and the multi-process supervisor.

The top layer: may import anything of coalescer.
"""

from __future__ import annotations

from coalescer.cli.main import main

__all__ = ["main"]
