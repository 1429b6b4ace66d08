"""The app's tests. The coalescer pytest plugin gives each test a namespace of its own
on a throwaway server and sets $COALESCER_NAMESPACE and $COALESCER_REDIS_URL to them, so
the coalescer that the app's lifespan builds touches the test's keys, never those of a
deployment running beside it; ``coalescer_factory`` then runs the refreshes."""

from __future__ import annotations

from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from coalescer.testing import Factory, assert_refreshed
from examples.fastapi_app.app import app


@pytest.fixture(autouse=True)
def database(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RATINGS_DB", str(tmp_path / "ratings.db"))


@pytest.mark.asyncio
async def test_reviews_refresh_the_rating_once(coalescer_factory: Factory,
                                               coalescer_namespace: str) -> None:
    with TestClient(app) as client:
        assert app.state.coalescer.config.namespace == coalescer_namespace
        for stars in (5, 4, 4):
            assert client.post("/products/7/reviews", json={"stars": stars}).status_code == 202
        assert client.get("/products/7/rating").status_code == 404  # not refreshed yet
    # The app has shut down: its coalescer wrote its touches. Run what is pending.
    async with coalescer_factory("rules.yaml") as c:
        claims = await c.drain()
    assert_refreshed(claims, ["rating:product:7"], exactly_once=True)
    with TestClient(app) as client:
        assert client.get("/products/7/rating").json() == {
            "product": 7, "reviews": 3, "stars": 4.33}


@pytest.mark.asyncio
async def test_a_refused_review_touches_nothing(coalescer_factory: Factory) -> None:
    with TestClient(app) as client:
        assert client.post("/products/7/reviews", json={"stars": 6}).status_code == 422
    async with coalescer_factory("rules.yaml") as c:
        assert await c.drain() == []  # this test's namespace: nothing of the test before
