"""The adapter a case drives: a child process spoken to in line-JSON (README.md)."""

from __future__ import annotations

import asyncio
import json
import os
import tempfile
from typing import IO, Any

ANSWER_TIMEOUT = 30.0  # seconds an answer may take beyond the op's own timeout
LINE_LIMIT = 16 * 1024 * 1024  # bytes of one answer line, at most


class AdapterError(Exception):
    """The adapter broke the protocol: no answer, a line that is no JSON, a wrong id."""


class AdapterProcess:
    """One started adapter command; ``request`` sends one op and reads its answer."""

    def __init__(self, command: str) -> None:
        self.command = command
        self._proc: asyncio.subprocess.Process | None = None
        self._stderr: IO[bytes] = tempfile.TemporaryFile()  # noqa: SIM115 (closed in close)
        self._next_id = 0

    async def start(self) -> None:
        """Start it; the case names the namespace (the environment's override is left
        out)."""
        env = {k: v for k, v in os.environ.items() if k != "COALESCER_NAMESPACE"}
        self._proc = await asyncio.create_subprocess_shell(
            self.command, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            stderr=self._stderr, limit=LINE_LIMIT, env=env)

    async def request(self, op: dict[str, Any], timeout: float = ANSWER_TIMEOUT) -> dict[str, Any]:
        """Send ``op`` with a new id; its answer, checked for form and id."""
        proc = self._proc
        assert proc is not None and proc.stdin is not None and proc.stdout is not None
        self._next_id += 1
        rid = self._next_id
        line = json.dumps({"id": rid, **op}) + "\n"
        try:
            proc.stdin.write(line.encode())
            await proc.stdin.drain()
            raw = await asyncio.wait_for(proc.stdout.readline(), timeout)
        except (TimeoutError, ConnectionError) as exc:
            raise AdapterError(f"no answer to {line.strip()} within {timeout:g} s: "
                               f"{exc!r}") from exc
        if not raw:
            raise AdapterError(f"the adapter exited before answering {line.strip()}")
        return _checked(raw, rid)

    async def close(self, timeout: float = 15.0) -> None:
        """Close its stdin and wait for it to exit (killed past ``timeout``)."""
        proc = self._proc
        if proc is None:
            return
        if proc.stdin is not None and not proc.stdin.is_closing():
            proc.stdin.close()
        try:
            await asyncio.wait_for(proc.wait(), timeout)
        except TimeoutError:
            proc.kill()
            await proc.wait()

    def stderr(self, limit: int = 4000) -> str:
        """The last ``limit`` characters the adapter wrote to stderr."""
        self._stderr.seek(0)
        return self._stderr.read().decode("utf-8", "replace")[-limit:]

    def discard(self) -> None:
        self._stderr.close()


def _checked(raw: bytes, rid: int) -> dict[str, Any]:
    try:
        answer = json.loads(raw)
    except ValueError as exc:
        raise AdapterError(f"an answer that is not JSON: {raw[:200]!r}") from exc
    if not isinstance(answer, dict) or answer.get("id") != rid:
        raise AdapterError(f"an answer without id {rid}: {raw[:200]!r}")
    if answer.get("ok") is not True and not isinstance(answer.get("error"), dict):
        raise AdapterError(f"an answer neither ok nor with an error object: {raw[:200]!r}")
    return answer
