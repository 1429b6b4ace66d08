"""The Python client's conformance adapter: one JSON request a line on stdin, one
answer a line on stdout (conformance/README.md).

    python -m conformance.adapters.python_adapter
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
from typing import Any

from coalescer import Coalescer
from coalescer.config.rules import Config
from coalescer.errors import (
    BackpressureError,
    ClosedError,
    CoalescerError,
    EvictionPolicyError,
    InvalidItemError,
    InvalidKeyError,
    InvalidScheduleError,
    ProtocolVersionError,
    QuotaExceededError,
    RedisRefusesWritesError,
    UnknownKeyError,
)

CLIENT = "coalescer-python"
DEFAULT_FLUSH_MS = 10_000

# the client's errors and the adapter protocol's codes, the first match wins
CODES: tuple[tuple[type[BaseException], str], ...] = (
    (QuotaExceededError, "QUOTA"),
    (BackpressureError, "BACKPRESSURE"),
    (EvictionPolicyError, "EVICTION_POLICY"),
    (ProtocolVersionError, "VERSION"),
    (UnknownKeyError, "UNKNOWN_KEY"),
    (InvalidKeyError, "BAD_INPUT"),
    (InvalidItemError, "BAD_INPUT"),
    (InvalidScheduleError, "BAD_INPUT"),
    (ClosedError, "CLOSED"),
    (TimeoutError, "TIMEOUT"),
)


class BadRequest(Exception):
    """A request the adapter cannot read."""


def error_code(exc: BaseException) -> str:
    """The adapter protocol's code for ``exc``."""
    if isinstance(exc, RedisRefusesWritesError):
        return exc.code
    if isinstance(exc, BadRequest):
        return "BAD_INPUT"
    return next((code for kind, code in CODES if isinstance(exc, kind)), "INTERNAL")


def _time(request: dict[str, Any]) -> dict[str, Any]:
    """``at`` and ``delay`` of a touch request as the Python client takes them (epoch
    ms and ms as numbers become seconds; text is passed as is)."""
    out: dict[str, Any] = {}
    for name in ("at", "delay"):
        value = request.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int | str):
            raise BadRequest(f"{name} must be an integer of ms or text, not {value!r}")
        out[name] = value / 1000 if isinstance(value, int) else value
    return out


class Adapter:
    """One client, opened by ``open`` and closed by ``close``."""

    def __init__(self) -> None:
        self.client: Coalescer | None = None

    def _open_client(self) -> Coalescer:
        if self.client is None:
            raise ClosedError("no open: send open first")
        return self.client

    async def handle(self, request: dict[str, Any]) -> dict[str, Any]:
        ops = {"hello": self.hello, "open": self.open, "touch": self.touch,
               "flush": self.flush, "cancel": self.cancel, "close": self.close}
        op = ops.get(str(request.get("op")))
        if op is None:
            return {"unsupported": str(request.get("op"))}
        return await op(request)

    async def hello(self, _: dict[str, Any]) -> dict[str, Any]:
        return {"client": CLIENT, "protocol": 1}

    async def flush(self, request: dict[str, Any]) -> dict[str, Any]:
        timeout = int(request.get("timeout_ms", DEFAULT_FLUSH_MS)) / 1000
        await asyncio.wait_for(self._open_client().flush(), timeout)
        return {}

    async def cancel(self, request: dict[str, Any]) -> dict[str, Any]:
        outcome = await self._open_client().cancel_many(_keys(request))
        return {"cancelled": len(outcome.cancelled), "states": outcome.states}

    async def close(self, _: dict[str, Any]) -> dict[str, Any]:
        client, self.client = self._open_client(), None
        await client.close()
        return {}

    async def open(self, request: dict[str, Any]) -> dict[str, Any]:
        config = Config.from_string(str(request["rules"]), source="<open rules>",
                                    import_handlers=False)
        if config.namespace != request.get("namespace", config.namespace):
            raise BadRequest(f"the rules name namespace {config.namespace!r}, the request "
                             f"{request['namespace']!r}")
        client = Coalescer(config, redis_url=str(request["url"]), worker=False)
        await client.start()
        self.client = client
        return {}

    async def touch(self, request: dict[str, Any]) -> dict[str, Any]:
        client, keys, times = self._open_client(), _keys(request), _time(request)
        items = request.get("items") or {}
        if not isinstance(items, dict):
            raise BadRequest(f"items must be an object of key -> [item, ...], not {items!r}")
        pairs = [(str(key), str(item)) for key, listed in items.items() for item in listed]
        keep = bool(request.get("keep_items", False))
        if pairs:
            client.touch_items(pairs, keys=keys, keep_items=keep, **times)
        else:
            client.touch_many(keys, keep_items=keep, **times)
        return {"touched": len(set(keys) | set(items))}


def _keys(request: dict[str, Any]) -> list[str]:
    keys = request.get("keys", [])
    if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
        raise BadRequest(f"keys must be a list of strings, not {keys!r}")
    return keys


async def answer(adapter: Adapter, line: str) -> dict[str, Any]:
    """The answer line's object for one request line."""
    try:
        request = json.loads(line)
    except ValueError as exc:
        return {"id": None, "ok": False, "error": {"code": "BAD_INPUT", "message": str(exc)}}
    rid = request.get("id") if isinstance(request, dict) else None
    try:
        if not isinstance(request, dict):
            raise BadRequest("a request is a JSON object")
        fields = await adapter.handle(request)
    except Exception as exc:  # every error is an answer: the runner judges it
        return {"id": rid, "ok": False,
                "error": {"code": error_code(exc), "message": str(exc) or repr(exc)}}
    if "unsupported" in fields:
        return {"id": rid, "ok": False, "error": {
            "code": "UNSUPPORTED", "message": f"unknown op {fields['unsupported']!r}"}}
    return {"id": rid, "ok": True, **fields}


async def main() -> None:
    adapter, loop = Adapter(), asyncio.get_running_loop()
    while True:
        line = await loop.run_in_executor(None, sys.stdin.readline)
        if not line:
            break
        if not line.strip():
            continue
        reply = await answer(adapter, line)
        sys.stdout.write(json.dumps(reply) + "\n")
        sys.stdout.flush()
        if reply.get("ok") and json.loads(line).get("op") == "close":
            break
    if adapter.client is not None:  # stdin closed without close: nothing waits
        with contextlib.suppress(CoalescerError):
            await adapter.client.close(flush_timeout=0)


if __name__ == "__main__":
    asyncio.run(main())
