"""A worker node: leadership per shard, the rules registry, the claim protocol
(``claims``), the poller and the adopter that claim due keys, the runner that runs
handlers, handler invocation, webhooks, wake-ups, drain, the periodic refresh summary
line; ``context``, what a node's parts share (importing none of them), and ``node``, which
wires the parts together.

May import ``coalescer.write``, ``coalescer.store``, ``coalescer.config`` and
``coalescer.common``; never the readers, the web or the CLI.
"""
