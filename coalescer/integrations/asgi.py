"""A coalescer for a Starlette or FastAPI app: started with the app, closed with it.

``lifespan(factory, *args, **options)`` is a lifespan for ``FastAPI(lifespan=...)`` or
``Starlette(lifespan=...)``; ``running(app, factory, *args, **options)`` is the same as
an ``async with`` block inside an app's own lifespan. At each start-up both call
``factory(*args, **options)`` (``Coalescer.from_yaml`` with the rules file, say) and
start what it returns, so settings read from the environment when a coalescer is built
(``$COALESCER_NAMESPACE``, ``$COALESCER_REDIS_URL``) are those of that start-up: each
``TestClient(app)`` of a test gets the test's own. At shutdown the coalescer closes,
writing the touches still buffered.

The coalescer is ``app.state.coalescer`` and, for each request, ``request.state.coalescer``
(the lifespan's state); ``get_coalescer`` returns it, as a FastAPI dependency
(``Depends(get_coalescer)``) or called with the request.

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
