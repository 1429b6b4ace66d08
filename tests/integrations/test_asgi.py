"""coalescer.integrations.asgi: the app's coalescer starts and closes with a Starlette or
FastAPI app's lifespan, built anew at each start-up; routes reach it by get_coalescer."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Annotated, Any

import pytest
from fastapi import Depends, FastAPI
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from coalescer import Coalescer
from coalescer.integrations.asgi import get_coalescer, lifespan, running

RULES = """\
namespace: {ns}
rules:
  - name: item
    match: "item:{{id}}"
    handler: builtins:id
"""


@pytest.fixture
def rules(tmp_path: Path, namespace: str) -> Path:
    path = tmp_path / "rules.yaml"
    path.write_text(RULES.format(ns=namespace))
    return path


def fastapi_app(rules: Path, redis_url: str) -> FastAPI:
    app = FastAPI(lifespan=lifespan(Coalescer.from_yaml, rules, redis_url=redis_url,
                                    worker=False))

    @app.post("/items/{item}")
    def touch(item: int, c: Annotated[Coalescer, Depends(get_coalescer)]) -> dict[str, Any]:
        c.touch(f"item:{item}")
        return {"namespace": c.config.namespace}

    return app


async def pending(rules: Path, redis_url: str, namespace: str) -> int:
    """The keys pending in ``namespace`` (the rules file's, replaced)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("COALESCER_NAMESPACE", namespace)
        async with Coalescer.from_yaml(rules, redis_url=redis_url, worker=False) as c:
            count: int = (await c.query.status())["rules"]["item"]["pending"]
            return count


async def test_each_start_up_builds_a_coalescer_that_reads_the_environment_then(
        rules: Path, redis_url: str, namespace: str, monkeypatch: pytest.MonkeyPatch) -> None:
    app = fastapi_app(rules, redis_url)
    for run in ("a", "b"):
        monkeypatch.setenv("COALESCER_NAMESPACE", f"{namespace}-{run}")
        with TestClient(app) as client:
            assert client.post("/items/1").json() == {"namespace": f"{namespace}-{run}"}
            assert client.post("/items/2").status_code == 200
        assert not hasattr(app.state, "coalescer")  # closed with the app
    for run in ("a", "b"):  # closing wrote the buffered touches
        assert await pending(rules, redis_url, f"{namespace}-{run}") == 2


async def test_running_inside_an_apps_own_lifespan(rules: Path, redis_url: str,
                                                   namespace: str) -> None:
    events: list[str] = []

    @asynccontextmanager
    async def own(app: Starlette) -> AsyncIterator[None]:
        events.append("own start")
        async with running(app, Coalescer.from_yaml, rules, redis_url=redis_url,
                           worker=False) as c:
            events.append(f"coalescer {c.config.namespace}")
            yield
        events.append("own stop")

    async def touch(request: Request) -> JSONResponse:
        get_coalescer(request).touch("item:3")
        return JSONResponse({"ok": True})

    app = Starlette(lifespan=own, routes=[Route("/touch", touch, methods=["POST"])])
    with TestClient(app) as client:
        assert app.state.coalescer.config.namespace == namespace
        assert client.post("/touch").json() == {"ok": True}
    assert events == ["own start", f"coalescer {namespace}", "own stop"]
    assert await pending(rules, redis_url, namespace) == 1


def test_a_route_of_an_app_without_a_coalescer_says_how_to_give_it_one() -> None:
    app = FastAPI()

    @app.get("/")
    def index(c: Annotated[Coalescer, Depends(get_coalescer)]) -> None:
        raise AssertionError("not reached")

    with TestClient(app, raise_server_exceptions=True) as client, \
            pytest.raises(RuntimeError) as caught:
        client.get("/")
    assert str(caught.value) == (
        "this app has no coalescer: give it coalescer.integrations.asgi.lifespan(...) as "
        "its lifespan, or use coalescer.integrations.asgi.running(app, ...) in its own; in "
        "a test, start the app's lifespan (`with TestClient(app) as client:`)")
