"""The webhook example: another service refreshed by a signed HTTP request."""
