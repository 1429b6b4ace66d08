"""The statistics-refresh example: orders in SQLite, per-customer aggregates kept fresh."""
