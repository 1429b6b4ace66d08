"""Adapters that let the runner drive a client (conformance/README.md)."""
