"""The TypeScript client of clients/node, built for the tests that run it: ``npm ci``
and ``npm run build`` there when its ``dist/`` or ``node_modules/`` is missing, once
(under a file lock, so parallel test workers never build it twice at once)."""

from __future__ import annotations

import fcntl
import shutil
import subprocess
import tempfile
from pathlib import Path

CLIENT = Path(__file__).resolve().parents[2] / "clients" / "node"
LOCK = Path(tempfile.gettempdir()) / "coalescer-node-client-build.lock"
BUILD_TIMEOUT = 600


def _is_built() -> bool:
    return (CLIENT / "dist" / "index.js").exists() and (CLIENT / "node_modules").exists()


def unavailable() -> str | None:
    """Why the client cannot run here (None: it can), building it when needed."""
    if shutil.which("node") is None or shutil.which("npm") is None:
        return "node/npm not found on PATH"
    with LOCK.open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if _is_built():
            return None
        for command in (["npm", "ci", "--no-audit", "--no-fund"], ["npm", "run", "build"]):
            done = subprocess.run(command, cwd=CLIENT, capture_output=True, text=True,
                                  timeout=BUILD_TIMEOUT, check=False)
            if done.returncode != 0:
                return f"{' '.join(command)} failed in clients/node: {done.stderr.strip()[-300:]}"
    return None
