"""The FastAPI example: an app whose lifespan runs its coalescer, and its own tests."""
