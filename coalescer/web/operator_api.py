"""The operator's reach over HTTP: a rule's keys by capture and state
(``GET /rules/{rule}/keys``), bulk actions as jobs (``POST /rules/{rule}/bulk``,
``GET /bulk``, ``GET`` and ``DELETE /bulk/{id}``) and the audit log (``GET /audit``);
their parameters and answers: docs/http.md, "Key search, bulk actions and the audit log".

A job lives in the memory of the node that runs it (the last ``KEPT`` are kept): a
node that stops ends its jobs, which an operator starts again (the keys they changed
stay changed, and a new job finds only what is left). That is the simple design a
bulk action by filter needs: it resumes by running it again, not from a checkpoint.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import secrets
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from redis.exceptions import RedisError

from coalescer.coalescer import Coalescer
from coalescer.common.audit_log import operator_action
from coalescer.common.json_depth import TooDeep, loads_bounded
from coalescer.errors import ClosedError
from coalescer.query.bulk import DEFAULT_RATE, BulkProgress, action_state
from coalescer.query.key_search import PageSize, SearchError, make_filter
from coalescer.web.requests import Refusal

TIMEOUT = 10.0
KEPT = 50  # finished jobs kept
MAX_RUNNING = 4  # jobs running at once on a node
MAX_RATE = 1_000_000
_IDS = itertools.count(1)


@dataclass
class Job:
    """A bulk action running (or run) on this node."""

    id: str
    progress: BulkProgress
    who: str
    task: asyncio.Task[None] | None = None

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "url": f"/bulk/{self.id}", "who": self.who,
                "stopping": self.progress.stop.is_set() and self.progress.status == "running",
                **self.progress.to_json()}


def _one(request: web.Request, name: str) -> str | None:
    values = request.query.getall(name, [])
    if len(values) > 1:
        raise Refusal(400, f"the query parameter {name!r} is given more than once")
    return values[0] if values else None


def _number(request: web.Request, name: str, default: int) -> int:
    raw = _one(request, name)
    if raw is None:
        return default
    if not raw.isascii() or not raw.isdigit() or len(raw) > 9:
        raise Refusal(400, f"{name} must be a whole number, got {raw[:20]!r}", part=name)
    return int(raw)


def _searched(exc: SearchError) -> Refusal:
    status = 404 if exc.part == "rule" else 400
    return Refusal(status, str(exc).replace("--", "", 1) if exc.part != "rule" else str(exc),
                   part=exc.part)


class OperatorRoutes:
    """The handlers of the key search, the bulk jobs and the audit log."""

    def __init__(self, node: Coalescer,
                 read_body: Callable[[web.Request], Awaitable[bytes]],
                 who: Callable[[web.Request], str]) -> None:
        self._node = node
        self._read_body = read_body
        self._who = who
        self._jobs: dict[str, Job] = {}

    def register(self, app: web.Application) -> None:
        app.router.add_get("/rules/{rule}/keys", self.keys)
        app.router.add_post("/rules/{rule}/bulk", self.start_bulk)
        app.router.add_get("/bulk", self.list_jobs)
        app.router.add_get("/bulk/{id}", self.job)
        app.router.add_delete("/bulk/{id}", self.stop_job)
        app.router.add_get("/audit", self.audit)
        app.on_shutdown.append(self._stop_all)

    async def keys(self, request: web.Request) -> web.Response:
        allowed = {"where", "state", "cursor", "limit", "scan"}
        extra = sorted(set(request.query) - allowed)
        if extra:
            raise Refusal(400, f"unknown query parameter {extra[0]!r}; allowed: "
                               f"{', '.join(sorted(allowed))}", part=extra[0])
        rule = request.match_info["rule"]
        try:
            search = make_filter(self._node.config, rule, state=_one(request, "state"),
                                 where=request.query.getall("where", []))
            size = PageSize(scan=_number(request, "scan", 1000),
                            limit=_number(request, "limit", 100))
            async with _redis("search the keys"):
                page = await self._node.query.keys(search, _one(request, "cursor"), size)
        except SearchError as exc:
            raise _searched(exc) from None
        return web.json_response({"rule": rule, "state": search.state,
                                  "where": dict(search.where), **page.to_json()})

    async def start_bulk(self, request: web.Request) -> web.Response:
        body = _body(await self._read_body(request))
        rule = request.match_info["rule"]
        try:
            action = str(body.get("action", ""))
            state = action_state(action, _text_or_none(body, "state"))
            search = make_filter(self._node.config, rule, state=state,
                                 where=_where(body.get("where", {})))
        except SearchError as exc:
            raise _searched(exc) from None
        progress = BulkProgress(action, search, dry_run=_flag(body, "dry_run"),
                                rate=_rate(body))
        if sum(j.progress.status == "running" for j in self._jobs.values()) >= MAX_RUNNING:
            raise Refusal(429, f"{MAX_RUNNING} bulk actions run on this node already: stop "
                               "one (DELETE /bulk/ID) or wait for one to end")
        job = Job(f"{next(_IDS)}-{secrets.token_hex(4)}", progress, self._who(request))
        job.task = asyncio.create_task(self._run(job), name=f"coalescer bulk {job.id}")
        self._keep(job)
        return web.json_response(job.to_json(), status=202)

    async def _run(self, job: Job) -> None:
        async def cancel(keys: list[str]) -> int:
            return int((await self._node.cancel_many(keys)).done)

        progress = job.progress
        try:
            await self._node.query.bulk(progress, cancel)
        except Exception as exc:  # kept on the job, for GET /bulk/{id}
            progress.status, progress.error = "failed", repr(exc)
        if not progress.dry_run:
            operator_action(progress.action, progress.search.describe(), progress.done,
                            job.who, sink=self._node.audit,
                            detail=json.dumps({"bulk": progress.status, "job": job.id,
                                               "matched": progress.matched}))

    def _keep(self, job: Job) -> None:
        self._jobs[job.id] = job
        ended = [j for j in self._jobs.values() if j.progress.status != "running"]
        for old in ended[:max(0, len(self._jobs) - KEPT)]:
            del self._jobs[old.id]

    def _found(self, request: web.Request) -> Job:
        job = self._jobs.get(request.match_info["id"])
        if job is None:
            raise Refusal(404, f"no bulk action {request.match_info['id']!r} on this node "
                               "(GET /bulk lists them)")
        return job

    async def list_jobs(self, request: web.Request) -> web.Response:
        return web.json_response({"jobs": [j.to_json() for j in reversed(self._jobs.values())]})

    async def job(self, request: web.Request) -> web.Response:
        return web.json_response(self._found(request).to_json())

    async def stop_job(self, request: web.Request) -> web.Response:
        job = self._found(request)
        job.progress.stop.set()
        return web.json_response(job.to_json())

    async def _stop_all(self, app: web.Application) -> None:
        tasks = [j.task for j in self._jobs.values() if j.task is not None and not j.task.done()]
        for job in self._jobs.values():
            job.progress.stop.set()
        if tasks:
            await asyncio.wait(tasks, timeout=TIMEOUT)

    async def audit(self, request: web.Request) -> web.Response:
        extra = sorted(set(request.query) - {"n", "before"})
        if extra:
            raise Refusal(400, f"unknown query parameter {extra[0]!r}; allowed: before, n")
        limit = _number(request, "n", 50)
        try:
            async with _redis("read the audit log"):
                found = await self._node.query.audit(limit, _one(request, "before"))
        except ValueError as exc:
            raise Refusal(400, str(exc)) from None
        return web.json_response({"entries": [r.to_json() for r in found]})


class _redis:
    """Redis trouble as a 503 naming what could not be done."""

    def __init__(self, what: str) -> None:
        self._what = what
        self._timeout = asyncio.timeout(TIMEOUT)

    async def __aenter__(self) -> None:
        await self._timeout.__aenter__()

    async def __aexit__(self, kind: Any, exc: Any, tb: Any) -> None:
        try:
            await self._timeout.__aexit__(kind, exc, tb)
        except TimeoutError:
            raise Refusal(503, f"cannot {self._what}: Redis did not answer in time") from None
        if isinstance(exc, ClosedError):
            raise Refusal(503, f"the node is not running: {exc}") from None
        if isinstance(exc, RedisError | OSError):
            raise Refusal(503, f"cannot {self._what}: {exc!r}") from None


def _body(raw: bytes) -> dict[str, Any]:
    try:
        body = loads_bounded(raw.decode("utf-8"))
    except (UnicodeDecodeError, TooDeep, ValueError):
        raise Refusal(400, 'the body must be a JSON object such as {"action": "retry", '
                           '"where": {"org": "42"}, "dry_run": true}') from None
    if not isinstance(body, dict):
        raise Refusal(400, 'the body must be a JSON object such as {"action": "retry"}')
    extra = sorted(set(body) - {"action", "where", "state", "dry_run", "rate"})
    if extra:
        raise Refusal(400, f"unknown field {extra[0]!r}; allowed: action, where, state, "
                           "dry_run, rate", part=extra[0])
    return body


def _text_or_none(body: dict[str, Any], name: str) -> str | None:
    value = body.get(name)
    if value is not None and not isinstance(value, str):
        raise Refusal(400, f"{name} must be text, got {json.dumps(value)[:40]}", part=name)
    return value


def _where(value: Any) -> dict[str, str]:
    if not isinstance(value, dict) or not all(
            isinstance(k, str) and isinstance(v, str | int) and not isinstance(v, bool)
            for k, v in value.items()):
        raise Refusal(400, 'where must be an object of captures and their values, such as '
                           '{"org": "42"}', part="where")
    return {k: str(v) for k, v in value.items()}


def _flag(body: dict[str, Any], name: str) -> bool:
    value = body.get(name, False)
    if not isinstance(value, bool):
        raise Refusal(400, f"{name} must be true or false", part=name)
    return value


def _rate(body: dict[str, Any]) -> int:
    value = body.get("rate", DEFAULT_RATE)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_RATE:
        raise Refusal(400, f"rate must be keys a second, 0 (no limit) to {MAX_RATE}",
                      part="rate")
    return value
