"""coalescer: debounce and coalesce refreshes of aggregates, on Redis."""
