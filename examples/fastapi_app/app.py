"""A FastAPI app that touches a product's rating key on every review.

    uvicorn examples.fastapi_app.app:app        (from the repository's root)

Its coalescer is built and started by the app's lifespan, at each start-up, and closed
at shutdown (which writes the touches still buffered). ``worker=False``: this process
only touches; ``coalescer run`` nodes run the refreshes. The Redis URL is
$COALESCER_REDIS_URL, else the project's embedded server.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

from fastapi import Depends, FastAPI, HTTPException
from pydantic import BaseModel, Field

from coalescer import Coalescer
from coalescer.integrations.asgi import get_coalescer, lifespan

from . import ratings

RULES = Path(__file__).resolve().with_name("rules.yaml")

app = FastAPI(lifespan=lifespan(Coalescer.from_yaml, RULES, worker=False))

CoalescerDep = Annotated[Coalescer, Depends(get_coalescer)]


class Review(BaseModel):
    stars: int = Field(ge=1, le=5)


@app.post("/products/{product}/reviews", status_code=202)
def review(product: int, body: Review, coalescer: CoalescerDep) -> dict[str, Any]:
    ratings.add_review(product, body.stars)
    coalescer.touch(f"rating:product:{product}")  # the rating is recomputed once, later
    return {"product": product, "stars": body.stars}


@app.get("/products/{product}/rating")
def rating(product: int) -> dict[str, Any]:
    found = ratings.rating(product)
    if found is None:
        raise HTTPException(404, "no rating yet")
    return found
