"""What is kept in Redis and how: every key name (``keys``), the Lua scripts
(``lua/``) and their typed wrappers, the shape of stored key states, command
batching, the connection and the embedded server.

May import ``coalescer.config`` and ``coalescer.common``; never the write path, the
worker or the readers above it.
"""
