"""Running one case: its servers, its adapter, its steps, what Redis holds after."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from typing import Any

from coalescer.config.rules import Config
from coalescer.query.explain import describe_state, rule_settings
from coalescer.query.layout_read import current_space, home_of
from coalescer.store import keys as key_names
from coalescer.store.connection import Connection, connect
from coalescer.store.script_types import OVERFLOW
from conformance import reshard
from conformance.adapter_process import AdapterError, AdapterProcess
from conformance.checks import compare
from conformance.servers import Servers, Target
from conformance.vectors import Case, resolve_times

OP_FIELDS = ("op", "expect", "error", "until_s")


class CaseFailure(Exception):
    """A step's outcome differs from the case's."""


@dataclass
class Result:
    case: Case
    ok: bool
    message: str = ""
    stderr: str = ""
    seconds: float = 0.0


@dataclass
class CaseRun:
    """The state of one case while its steps run."""

    case: Case
    target: Target
    adapter: AdapterProcess
    namespace: str = field(default_factory=lambda: "cf" + uuid.uuid4().hex[:10])
    marks: dict[str, int] = field(default_factory=dict)
    moves: dict[str, reshard.SlotMove] = field(default_factory=dict)
    conn: Connection | None = None

    @property
    def rules(self) -> str:
        return self.case.rules.replace("{ns}", self.namespace)

    @property
    def config(self) -> Config:
        """The case's rules, in the case's namespace whatever $COALESCER_NAMESPACE says."""
        config = Config.from_string(self.rules, source=self.case.id, import_handlers=False)
        return replace(config, namespace=self.namespace)

    async def redis(self) -> Any:
        if self.conn is None:
            self.conn = await connect(self.target.url)
        return self.conn.client

    async def server_ms(self) -> int:
        sec, usec = await (await self.redis()).time()
        return int(sec) * 1000 + int(usec) // 1000

    async def step(self, n: int, step: dict[str, Any]) -> None:
        kinds: dict[str, Callable[[Any], Awaitable[None]]] = {
            "op": self.op, "mark": self.mark, "check": self.check,
            "check_pending": self.check_pending, "check_version": self.check_version,
            "check_asked": self.check_asked, "server": self.server}
        kind = next((k for k in kinds if k in step), None)
        try:
            if kind is None:
                raise CaseFailure("a step the runner does not know")
            await kinds[kind](step if kind in ("op", "server") else step[kind])
        except CaseFailure as exc:
            raise CaseFailure(f"step {n} {step}: {exc}") from None

    async def mark(self, name: str) -> None:
        self.marks[name] = await self.server_ms()

    # -- the adapter's ops -------------------------------------------------------------

    async def op(self, step: dict[str, Any]) -> None:
        request = {k: v for k, v in step.items() if k not in OP_FIELDS[1:]}
        request = resolve_times(request, self.marks)
        if request["op"] == "open":
            request |= {"url": self.target.url, "namespace": self.namespace,
                        "rules": self.rules, "cluster": self.target.cluster}
        timeout = int(request.get("timeout_ms", 10_000)) / 1000 + 20
        answer = await self.adapter.request(request, timeout)
        if "until_s" in step:
            answer = await self._until(request, answer, step, timeout)
        _judge(answer, step)

    async def _until(self, request: dict[str, Any], answer: dict[str, Any],
                     step: dict[str, Any], timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + float(step["until_s"])
        while _error_code(answer) != step.get("error") and time.monotonic() < deadline:
            await asyncio.sleep(0.1)  # the client's quota count runs on its own clock
            answer = await self.adapter.request(request, timeout)
        return answer

    # -- what Redis holds --------------------------------------------------------------

    async def check(self, expected: dict[str, dict[str, Any]]) -> None:
        redis, config = await self.redis(), self.config
        now = await self.server_ms()
        wrong: list[str] = []
        for key, expect in expected.items():
            info = await explain_fields(redis, config, key)
            wrong += compare(key, info, resolve_times(expect, self.marks), self.marks, now)
        if wrong:
            raise CaseFailure("; ".join(wrong))

    async def check_pending(self, expected: dict[str, int]) -> None:
        redis = await self.redis()
        space = await current_space(redis, self.config)
        for rule, count in expected.items():
            held = 0
            for shard in space.all_shards():
                held += int(await redis.zcard(shard.due(rule)))
            if held != count:
                raise CaseFailure(f"rule {rule!r}: {held} keys pending, expected {count}")

    async def check_version(self, expected: str | None) -> None:
        stored = await (await self.redis()).get(key_names.protocol_version(self.namespace))
        if stored != expected:
            raise CaseFailure(f"protocol version {stored!r} stored, expected {expected!r}")

    async def check_asked(self, name: str, timeout: float = 10.0) -> None:
        """The client followed an ASK to the slot's target (its writes run on their
        own: this waits for one, ``timeout`` seconds at most)."""
        move = self.moves[name]
        deadline = time.monotonic() + timeout
        while reshard.asking_calls(move.target) <= move.asking_before:
            if time.monotonic() > deadline:
                raise CaseFailure(f"the target of slot {move.slot} took no ASKING in "
                                  f"{timeout:g} s: no write followed the ASK redirection")
            await asyncio.sleep(0.05)

    # -- the servers -------------------------------------------------------------------

    async def server(self, step: dict[str, Any]) -> None:
        action = step["server"]
        if action == "set-config":
            self.target.set_config(step["config"])
        elif action in ("misconf", "misconf-lift"):
            await asyncio.to_thread(self.target.misconf, lift=action == "misconf-lift")
        elif action == "set-version":
            await (await self.redis()).set(key_names.protocol_version(self.namespace),
                                           step["version"])
        elif action == "reshard":
            await self.reshard(step)
        else:
            raise CaseFailure(f"a server action the runner does not know: {action!r}")

    async def reshard(self, step: dict[str, Any]) -> None:
        """Move the slot of ``key``'s shard: phase begin, keys or end (reshard.py)."""
        name, phase = step["key"], step["phase"]
        if phase == "begin":
            space = await current_space(await self.redis(), self.config)
            slot = reshard.slot_of(space.shard(space.shard_of(name)).meta)
            self.moves[name] = reshard.begin(self.target.masters, slot)
        elif phase == "keys":
            reshard.move_keys(self.moves[name])
        else:
            reshard.end(self.target.masters, self.moves[name])
        if self.conn is not None:  # the runner's own client learns the new map
            await self.conn.close()
            self.conn = None

    async def close(self) -> None:
        for move in self.moves.values():
            reshard.abandon(move)
        if self.conn is not None:
            await self.conn.close()


async def explain_fields(redis: Any, config: Config, key: str) -> dict[str, Any]:
    """The fields of ``key``'s explain JSON (``coalescer explain --json``) a case
    compares: its state part and its items, read one command at a time (a Redis
    Cluster client pipelines no TIME)."""
    rule = config.rule_for(key)
    space = await current_space(redis, config)
    sk = space.shard(await home_of(redis, space, key))
    sec, usec = await redis.time()
    now = int(sec) * 1000 + int(usec) // 1000
    scores = {"inflight": await redis.zscore(sk.inflight(rule.name), key),
              "dead": await redis.zscore(sk.dead(rule.name), key)}
    info = {"key": key, "shard": sk.shard, "now_ms": now, "rule": rule_settings(rule)}
    info |= describe_state(await redis.hget(sk.meta, key), rule, scores, now)
    info["items"] = None
    if rule.items is not None:
        pending = set(await redis.smembers(sk.items(key)))
        info["items"] = {"pending_items": sorted(pending - {OVERFLOW}),
                         "pending_overflowed": OVERFLOW in pending}
    return info


def _error_code(answer: dict[str, Any]) -> str | None:
    return None if answer.get("ok") else str(answer["error"].get("code"))


def _judge(answer: dict[str, Any], step: dict[str, Any]) -> None:
    code = _error_code(answer)
    if "error" in step:
        if code != step["error"]:
            raise CaseFailure(f"expected error {step['error']}, got {answer}")
        return
    if code is not None:
        raise CaseFailure(f"expected ok, got {answer}")
    wrong = {k: answer.get(k) for k, v in step.get("expect", {}).items() if answer.get(k) != v}
    if wrong:
        raise CaseFailure(f"expected {step['expect']}, got {answer}")


async def run_case(case: Case, command: str, servers: Servers) -> Result:
    """Run ``case`` with the adapter ``command``; never raises for a failing case."""
    started = time.monotonic()
    target = await asyncio.to_thread(Target, case.servers, servers)
    adapter = AdapterProcess(command)
    run = CaseRun(case, target, adapter)
    try:
        await adapter.start()
        for n, step in enumerate(case.steps):
            await run.step(n, step)
        await adapter.close()
        return Result(case, True, seconds=time.monotonic() - started)
    except (CaseFailure, AdapterError) as exc:
        await adapter.close(timeout=5.0)
        return Result(case, False, str(exc), adapter.stderr(),
                      seconds=time.monotonic() - started)
    finally:
        await run.close()
        adapter.discard()
        target.close()
