"""The rules file: its model (``Config``, ``Rule``), the YAML reader, the schema,
``check`` and its lints, durations, key patterns and key templates.

May import ``coalescer.common`` and ``coalescer.errors``; nothing that talks to Redis.
"""
