"""The example app's tests: run `pytest` in examples/fastapi_app."""
