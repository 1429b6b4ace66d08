"""``GET /openapi.json``: the HTTP API as an OpenAPI 3 document, built from the routes
the node really serves (their paths and methods) and ``OPERATIONS``, which describes
each one. A route ``OPERATIONS`` does not describe is served under its own path with
``"x-undescribed": true`` (tests/web/test_openapi.py fails for it, as for an entry of
``OPERATIONS`` that no route serves). docs/http.md is the long form of every answer."""

from __future__ import annotations

import re
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as package_version
from typing import Any

from aiohttp import web

from coalescer.web.requests import PRIORITY_FIELD, TIME_FIELDS

PATH = "/openapi.json"
_ERROR = {"$ref": "#/components/schemas/Error"}
_ANY = {"type": "object", "additionalProperties": True}


def _json(description: str, schema: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"description": description,
            "content": {"application/json": {"schema": schema or _ANY}}}


def _errors(*codes: int) -> dict[str, Any]:
    what = {400: "bad input: the error names the field", 401: "missing or wrong token",
            403: "a cross-site request, or a token whose role may not do this",
            404: "no such key, rule or job", 409: "the key's state forbids it",
            413: "body over the limit", 415: "not application/json",
            422: "keys or items that cannot be touched", 429: "a quota is reached",
            503: "Redis cannot be reached, or the node is shutting down"}
    return {str(c): _json(what[c], _ERROR) for c in codes}


def _op(summary: str, ok: dict[str, Any], *errors: int, **extra: Any) -> dict[str, Any]:
    return {"summary": summary, "responses": {**ok, **_errors(401, *errors)}, **extra}


def _query(name: str, description: str, kind: str = "string") -> dict[str, Any]:
    return {"name": name, "in": "query", "required": False, "description": description,
            "schema": {"type": kind}}


def _body(schema: dict[str, Any]) -> dict[str, Any]:
    return {"required": True, "content": {"application/json": {"schema": schema}}}


_TIME = {"oneOf": [{"type": "string"}, {"type": "number"}],
         "description": "at: ISO-8601 with an offset or epoch seconds; delay: seconds or a "
                        "duration such as \"30s\""}
TOUCH = {
    "type": "object", "additionalProperties": False,
    "properties": {
        "keys": {"type": "array", "items": {"type": "string", "minLength": 1}},
        "items": {"type": "array", "items": {"type": "array", "minItems": 2, "maxItems": 2,
                                             "items": {"type": "string"}}},
        **dict.fromkeys(TIME_FIELDS, _TIME),
        PRIORITY_FIELD: {"oneOf": [{"type": "string"}, {"type": "number"}],
                         "description": "seconds or a duration such as \"30s\": among due "
                                        "keys, claimed as if due that much earlier"}},
    "description": "keys, items ([KEY, ITEM] pairs) or both; at or delay, not both; "
                   "priority"}

OPERATIONS: dict[tuple[str, str], dict[str, Any]] = {
    ("post", "/touch"): _op(
        "Touch keys (and items), all or none", {"202": _json("accepted: {\"accepted\": N}")},
        400, 403, 413, 415, 422, 429, 503, requestBody=_body(TOUCH)),
    ("get", "/healthz"): _op("Whether this node is healthy",
                             {"200": _json("{\"ok\": true}")}, 503),
    ("get", "/status"): _op("The deployment's status (coalescer status --json)",
                            {"200": _json("status")}, 503),
    ("get", "/metrics"): _op("Prometheus metrics", {"200": {
        "description": "text exposition format", "content": {"text/plain": {}}}}),
    ("get", "/keys/{key}"): _op("Where one key stands (coalescer explain --json)",
                                {"200": _json("the key's explain JSON")}, 404, 422, 503),
    ("get", "/keys/{key}/timeline"): _op(
        "The key's recent events, and which refresh covered a write at a time "
        "(coalescer timeline --json)", {"200": _json("the key's timeline JSON")}, 400, 404,
        422, 503, parameters=[_query("at", "a write's time: epoch seconds or ISO 8601")]),
    ("delete", "/keys/{key}"): _op(
        "Cancel the key's pending refresh",
        {"200": _json("{\"cancelled\": true, \"key\", \"state\"}")}, 403, 404, 422, 503),
    ("post", "/keys/{key}/run"): _op(
        "Make the key's pending refresh due now",
        {"200": _json("{\"run\": true, \"key\", \"state\"}")}, 403, 404, 409, 503),
    ("post", "/rules/{rule}/pause"): _op(
        "Pause a rule on every node", {"200": _json("{\"rule\", \"paused\", \"changed\"}")},
        403, 404, 503),
    ("post", "/rules/{rule}/resume"): _op(
        "Resume a paused rule", {"200": _json("{\"rule\", \"paused\", \"changed\"}")},
        403, 404, 503),
    ("delete", "/rules/{rule}/scheduled"): _op(
        "Cancel the rule's keys scheduled after a time",
        {"200": _json("{\"rule\", \"after\", \"dry_run\", \"cancelled\"}")}, 400, 403, 404,
        503, parameters=[_query("after", "a time (required)"),
                         _query("dry_run", "1: count only")]),
    ("get", "/rules/{rule}/fair"): _op("A fair rule's weights and cap",
                                       {"200": _json("the settings in force")}, 404, 503),
    ("post", "/rules/{rule}/fair"): _op(
        "Change a fair rule's weights and cap at runtime",
        {"200": _json("the settings in force")}, 400, 403, 404, 503,
        requestBody=_body({"type": "object", "properties": {
            "weights": {"type": "object", "additionalProperties": {"type": "number"}},
            "max_running": {"type": "integer"}, "reset": {"type": "boolean"}}})),
    ("get", "/rules/{rule}/keys"): _op(
        "A page of the rule's keys by capture and state",
        {"200": _json("{\"rule\", \"state\", \"where\", \"keys\", \"examined\", "
                      "\"cursor\"}")}, 400, 404, 503,
        parameters=[_query("where", "CAPTURE=VALUE (repeatable)"),
                    _query("state", "pending, scheduled, in-flight, dead or paused"),
                    _query("cursor", "from the last page"), _query("limit", "keys", "integer"),
                    _query("scan", "entries examined at most", "integer")]),
    ("post", "/rules/{rule}/bulk"): _op(
        "Start a bulk action on the rule's keys", {"202": _json("the job")}, 400, 403, 404,
        503, requestBody=_body(_ANY)),
    ("get", "/bulk"): _op("This node's bulk jobs, newest first", {"200": _json("jobs")}),
    ("get", "/bulk/{id}"): _op("One bulk job's progress", {"200": _json("the job")}, 404),
    ("delete", "/bulk/{id}"): _op("Stop a bulk job", {"200": _json("the job")}, 403, 404),
    ("get", "/audit"): _op("The audit log, newest first", {"200": _json("entries")}, 503,
                           parameters=[_query("n", "entries", "integer"),
                                       _query("before", "an entry id")]),
    ("get", "/whoami"): _op("The caller's token name and role",
                            {"200": _json("{\"name\", \"role\", \"auth\"}")}),
    ("get", "/"): _op("The status page", {"200": {"description": "HTML",
                                                  "content": {"text/html": {}}}}),
    ("get", "/history"): _op("Recent refreshes (the page's)", {"200": _json("history")}, 503),
    ("get", "/due"): _op("Due keys (the page's)", {"200": _json("due keys")}, 503),
    ("post", "/dead/retry"): _op("Retry dead-lettered keys (the page's)",
                                 {"200": _json("how many")}, 400, 403, 503,
                                 requestBody=_body(_ANY)),
    ("get", PATH): _op("This document", {"200": _json("an OpenAPI 3 document")}),
}

_PARAM = re.compile(r"\{(\w+)[^}]*\}")


def served(app: web.Application) -> set[tuple[str, str]]:
    """The (method, path) pairs ``app`` serves (HEAD, which aiohttp adds to each GET,
    left out), paths as OpenAPI writes them."""
    out = set()
    for route in app.router.routes():
        path = route.resource.canonical if route.resource is not None else ""
        if route.method != "HEAD" and path:
            out.add((route.method.lower(), _PARAM.sub(r"{\1}", path)))
    return out


def _with_path_params(path: str, operation: dict[str, Any]) -> dict[str, Any]:
    names = _PARAM.findall(path)
    if not names:
        return operation
    params = [{"name": n, "in": "path", "required": True, "schema": {"type": "string"}}
              for n in names]
    return {**operation, "parameters": params + operation.get("parameters", [])}


def document(app: web.Application, version: str) -> dict[str, Any]:
    """The OpenAPI 3 document of ``app``'s routes."""
    paths: dict[str, dict[str, Any]] = {}
    for method, path in sorted(served(app)):
        operation = OPERATIONS.get((method, path), {
            "summary": "(not described)", "x-undescribed": True,
            "responses": {"default": _json("see docs/http.md")}})
        paths.setdefault(path, {})[method] = _with_path_params(path, operation)
    return {
        "openapi": "3.0.3",
        "info": {"title": "coalescer HTTP API", "version": version,
                 "description": "Touch keys, read status and explain keys, operator "
                                "controls. Long form: docs/http.md."},
        "components": {
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
            "schemas": {"Error": {"type": "object", "required": ["error"],
                                  "properties": {"error": {"type": "string"}},
                                  "additionalProperties": True}}},
        "security": [{"bearer": []}, {}],
        "paths": paths}


def register(app: web.Application) -> None:
    """Serve ``GET /openapi.json`` on ``app`` (call it after every other route)."""
    try:
        version = package_version("coalescer")
    except PackageNotFoundError:  # a source tree that is not installed
        version = "0+unknown"

    async def serve(request: web.Request) -> web.Response:
        return web.json_response(document(request.app, version))

    app.router.add_get(PATH, serve)
