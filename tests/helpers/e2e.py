"""Helpers of the end-to-end tests: recording handlers, rules files, node processes.

In-process tests load rules whose handler lives in a module generated per test
(a unique name, so two tests never share a cached import); that module holds a
``Recorder`` the test reads. Subprocess nodes get a handler module that writes
one line per refresh start and end to a file: ``PHASE NODE KEY TOKEN ATTEMPT``.
"""

from __future__ import annotations

import asyncio
import importlib
import os
import signal
import subprocess
import sys
import textwrap
from collections import defaultdict
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from coalescer import Claim
from coalescer.store.keys import KeySpace

REPO = Path(__file__).resolve().parents[2]

Hook = Callable[[Claim], Awaitable[None]]


class Recorder:
    """What the handler of an in-process test saw, in start order."""

    def __init__(self) -> None:
        self.calls: list[Claim] = []
        self.start_ms: list[int] = []      # server clock at each start, when ``clock`` is set
        self.succeeded: list[Claim] = []
        self.active: dict[str, int] = defaultdict(int)
        self.max_active: dict[str, int] = defaultdict(int)
        self.hook: Hook | None = None
        self.clock: Callable[[], Awaitable[int]] | None = None

    async def refresh(self, claim: Claim) -> None:
        self.active[claim.key] += 1
        self.max_active[claim.key] = max(self.max_active[claim.key], self.active[claim.key])
        try:
            if self.clock is not None:
                self.start_ms.append(await self.clock())
            self.calls.append(claim)
            if self.hook is not None:
                await self.hook(claim)
            self.succeeded.append(claim)
        finally:
            self.active[claim.key] -= 1

    def hold_first(self) -> asyncio.Event:
        """Hold the first refresh until the returned event is set (later ones run)."""
        gate = asyncio.Event()

        async def hold(claim: Claim) -> None:
            if len(self.calls) == 1:
                await gate.wait()
        self.hook = hold
        return gate

    def of(self, key: str) -> list[Claim]:
        return [c for c in self.calls if c.key == key]

    def started(self, key: str) -> list[int]:
        return [t for c, t in zip(self.calls, self.start_ms, strict=True) if c.key == key]


RECORDER_MODULE = """\
from tests.helpers.e2e import Recorder

rec = Recorder()


async def refresh(claim):
    await rec.refresh(claim)
"""


def recorder_rules(folder: Path, name: str, yaml_text: str) -> tuple[Path, Recorder]:
    """Write a recorder module ``name`` and rules.yaml (``{mod}`` = the module) in ``folder``.

    Returns the rules path and the module's Recorder (imported here, so it is the
    same object the coalescer's handler uses).
    """
    (folder / f"{name}.py").write_text(RECORDER_MODULE)
    path = folder / "rules.yaml"
    path.write_text(textwrap.dedent(yaml_text).replace("{mod}", name))
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))
    importlib.invalidate_caches()
    module = importlib.import_module(name)
    rec: Recorder = module.rec
    return path, rec


async def server_ms(redis: Any) -> int:
    """The Redis server clock, epoch milliseconds."""
    seconds, micros = await redis.time()
    return int(seconds) * 1000 + int(micros) // 1000


async def settled(redis: Any, namespace: str, shards: int = 1) -> bool:
    """True when no key of any shard has state left (nothing pending, running or dead)."""
    space = KeySpace(namespace, shards)
    for sk in space.all_shards():
        if await redis.hlen(sk.meta):
            return False
    return True


def leader_node(value: str | None) -> str | None:
    """The node id of a leader lease value "EPOCH|NODE-ID"."""
    return value.split("|", 1)[1] if value else None


# -- subprocess nodes --------------------------------------------------------------

LINE_HANDLER = """\
import asyncio
import os
from pathlib import Path


def _line(*parts):
    with open(os.environ["E2E_LOG"], "a") as f:
        f.write(" ".join(str(p) for p in parts) + "\\n")


def _blocks(claim):
    mode = os.environ.get("E2E_BLOCK", "")
    return mode == "gate" or (mode == "first" and claim.attempt == 1)


async def refresh(claim):
    node = os.environ["E2E_NODE"]
    _line("start", node, claim.key, claim.token, claim.attempt)
    if _blocks(claim):
        gate = Path(os.environ.get("E2E_GATE", "/nonexistent/gate"))
        while not gate.exists():
            await asyncio.sleep(0.01)
    _line("done", node, claim.key, claim.token, claim.attempt)


def fail(claim):
    raise RuntimeError("refresh failed on purpose: " + claim.key)
"""


def line_rules(folder: Path, name: str, yaml_text: str) -> Path:
    """Write the line-writing handler module ``name`` and rules.yaml ({mod}) in ``folder``."""
    (folder / f"{name}.py").write_text(LINE_HANDLER)
    path = folder / "rules.yaml"
    path.write_text(textwrap.dedent(yaml_text).replace("{mod}", name))
    return path


def read_lines(log: Path) -> list[tuple[str, str, str, int, int]]:
    """(phase, node, key, token, attempt) of every line written so far."""
    if not log.exists():
        return []
    out = []
    for line in log.read_text().splitlines():
        parts = line.split()
        if len(parts) == 5:
            out.append((parts[0], parts[1], parts[2], int(parts[3]), int(parts[4])))
    return out


def clean_env(**extra: str) -> dict[str, str]:
    """os.environ without COALESCER_* settings, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("COALESCER_")}
    env.update(extra)
    return env


def coalescer_cmd() -> list[str]:
    """The `coalescer` console script of this interpreter's environment."""
    script = Path(sys.executable).parent / "coalescer"
    if script.exists():
        return [str(script)]
    return [sys.executable, "-m", "coalescer.cli"]


class NodeProcs:
    """`coalescer run` child processes of one test; every one is killed at teardown."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self, rules: Path, redis_url: str, node_id: str,
              **env: str) -> subprocess.Popen[bytes]:
        out = (self.folder / f"node-{node_id}.log").open("ab")
        cmd = [sys.executable, "-m", "coalescer.cli", "run", "--rules", str(rules),
               "--redis", redis_url, "--node-id", node_id, "--http", "off"]
        proc = subprocess.Popen(cmd, cwd=self.folder, stdin=subprocess.DEVNULL, stdout=out,
                                stderr=subprocess.STDOUT, env=clean_env(E2E_NODE=node_id, **env))
        out.close()
        self.procs.append(proc)
        return proc

    def log(self, node_id: str) -> str:
        path = self.folder / f"node-{node_id}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def stop_all(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
            proc.wait()
