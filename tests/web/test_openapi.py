"""GET /openapi.json: an OpenAPI 3 document of the HTTP API that names every route the
node serves, each described, and no route it does not serve."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest_asyncio

from coalescer import Coalescer
from coalescer.web import openapi
from coalescer.web.api import HttpApi
from coalescer.web.requests import PRIORITY_FIELD, TIME_FIELDS

RULES = """\
namespace: {ns}
rules:
  - name: stats
    match: "stats:{{id}}"
    handler: builtins:print
"""


@pytest_asyncio.fixture
async def served(rules_file: Callable[..., Path], namespace: str,
                 redis_url: str) -> AsyncIterator[tuple[HttpApi, dict[str, Any]]]:
    async with Coalescer.from_yaml(rules_file(RULES.format(ns=namespace)),
                                   redis_url=redis_url, worker=False) as c:
        api = HttpApi(c, port=0)
        await api.start()
        try:
            async with aiohttp.ClientSession() as http, \
                    http.get(f"{api.url}{openapi.PATH}") as response:
                assert response.status == 200
                assert response.content_type == "application/json"
                yield api, await response.json()
        finally:
            await api.close()


def operations(doc: dict[str, Any]) -> dict[tuple[str, str], dict[str, Any]]:
    return {(method, path): op for path, ops in doc["paths"].items()
            for method, op in ops.items()}


async def test_every_route_the_node_serves_is_described_and_no_other(
        served: tuple[HttpApi, dict[str, Any]]) -> None:
    api, doc = served
    routes = openapi.served(api.make_app())
    documented = operations(doc)
    assert set(documented) == routes
    undescribed = sorted(k for k, op in documented.items() if op.get("x-undescribed"))
    assert not undescribed, (f"routes not described in coalescer/web/openapi.py "
                             f"OPERATIONS: {undescribed}")
    stale = sorted(set(openapi.OPERATIONS) - routes)
    assert not stale, f"OPERATIONS describes routes the node does not serve: {stale}"
    assert ("post", "/touch") in routes and ("get", "/openapi.json") in routes


async def test_the_document_is_openapi_3_with_its_parameters_and_answers(
        served: tuple[HttpApi, dict[str, Any]]) -> None:
    _, doc = served
    assert doc["openapi"].startswith("3.")
    assert doc["info"]["title"] and doc["info"]["version"]
    for (method, path), op in operations(doc).items():
        assert op["summary"] and op["responses"], (method, path)
        declared = {p["name"] for p in op.get("parameters", []) if p["in"] == "path"}
        assert declared == set(openapi._PARAM.findall(path)), (method, path)
        for answer in op["responses"].values():
            assert answer["description"], (method, path)
            for media in answer.get("content", {}).values():
                ref = media.get("schema", {}).get("$ref")
                assert ref is None or ref.split("/")[-1] in doc["components"]["schemas"]
    touch = operations(doc)[("post", "/touch")]
    body = touch["requestBody"]["content"]["application/json"]["schema"]
    assert set(body["properties"]) == {"keys", "items", *TIME_FIELDS, PRIORITY_FIELD}
    assert {"202", "400", "422", "429"} <= set(touch["responses"])


def test_a_route_nobody_described_is_served_marked_undescribed() -> None:
    from aiohttp import web

    async def handler(request: web.Request) -> web.Response:
        return web.Response()

    app = web.Application()
    app.router.add_get("/touch-new/{thing:.+}", handler)
    app.router.add_post("/touch", handler)
    doc = openapi.document(app, "1")
    assert doc["paths"]["/touch-new/{thing}"]["get"]["x-undescribed"] is True
    assert doc["paths"]["/touch-new/{thing}"]["get"]["parameters"][0]["name"] == "thing"
    assert "x-undescribed" not in doc["paths"]["/touch"]["post"]
