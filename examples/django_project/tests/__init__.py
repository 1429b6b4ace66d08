"""The shop's tests (pytest-django)."""
