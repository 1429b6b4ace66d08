"""The app's management commands: ``coalescer``."""
