"""Reading a namespace's state for people and tools: status, explain, history,
the next due keys and dead letters.

May import ``coalescer.worker`` (for the formats it records), ``coalescer.store``,
``coalescer.config`` and ``coalescer.common``; never the web or the CLI.
"""
