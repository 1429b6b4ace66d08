"""Sources of touches besides ``touch()``: the ``Source`` interface, and the Redis
Streams source behind it.

May import ``coalescer.write``, ``coalescer.store``, ``coalescer.config`` and
``coalescer.common``.
"""
