"""A coalescer for a Starlette or FastAPI app: started with the app, closed with it
(``lifespan``, or ``running`` inside an app's own lifespan), as ``app.state.coalescer``
and each request's ``request.state.coalescer`` (``get_coalescer``, also a FastAPI
dependency). Each start-up calls the factory again, so settings read from the
environment are those of that start-up. How to use it: docs/fastapi.md.

Needs Starlette (FastAPI brings it).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import TYPE_CHECKING, Any

from starlette.requests import HTTPConnection

if TYPE_CHECKING:
    from coalescer.coalescer import Coalescer

__all__ = ["STATE_NAME", "get_coalescer", "lifespan", "running"]

STATE_NAME = "coalescer"

Factory = Callable[..., "Coalescer"]


@asynccontextmanager
async def running(app: Any, factory: Factory, /, *args: Any,
                  **options: Any) -> AsyncIterator[Coalescer]:
    """``factory(*args, **options)``, started, as ``app.state.coalescer`` while the block
    runs; closed (its buffered touches written) when the block ends."""
    coalescer = factory(*args, **options)
    async with coalescer:
        setattr(app.state, STATE_NAME, coalescer)
        try:
            yield coalescer
        finally:
            delattr(app.state, STATE_NAME)


def lifespan(factory: Factory, /, *args: Any, **options: Any,
             ) -> Callable[[Any], AbstractAsyncContextManager[dict[str, Any]]]:
    """A lifespan that runs ``factory(*args, **options)``'s coalescer with the app:
    ``FastAPI(lifespan=lifespan(Coalescer.from_yaml, "rules.yaml", worker=False))``."""

    @asynccontextmanager
    async def app_lifespan(app: Any) -> AsyncIterator[dict[str, Any]]:
        async with running(app, factory, *args, **options) as coalescer:
            yield {STATE_NAME: coalescer}

    return app_lifespan


def get_coalescer(connection: HTTPConnection) -> Coalescer:
    """The app's coalescer, for a request or a websocket (``Depends(get_coalescer)``).

    RuntimeError when the app has none: its lifespan is not ``lifespan`` and does not
    use ``running``, or it has not started (a ``TestClient`` not used as ``with``)."""
    found = getattr(connection.state, STATE_NAME, None)
    if found is None:
        found = getattr(connection.app.state, STATE_NAME, None)
    if found is None:
        raise RuntimeError(
            "this app has no coalescer: give it coalescer.integrations.asgi.lifespan(...) "
            "as its lifespan, or use coalescer.integrations.asgi.running(app, ...) in its "
            "own; in a test, start the app's lifespan (`with TestClient(app) as client:`)")
    coalescer: Coalescer = found
    return coalescer
