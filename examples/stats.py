"""Example refresh handlers used by rules.yaml (and `coalescer demo --rules rules.yaml`).

A real handler recomputes an aggregate (a SQL GROUP BY, a search document, a
cached report) from the source of truth. These are the demo's own handlers
(``coalescer/cli/demo_app/handlers.py``, shipped in the package so that the demo
runs wherever coalescer is installed): each records its call, so the demo can show
what happened.
"""

from __future__ import annotations

from coalescer.cli.demo_app.handlers import REFRESHED, refresh_org, refresh_user

__all__ = ["REFRESHED", "refresh_org", "refresh_user"]
