"""The parts behind ``Coalescer``, one job each: the state they share (``core``), what
one start owns (``run``), touching (``touching``), cancelling (``cancelling``),
draining (``draining``) and a node's start and close (``lifecycle``).

May import the layers below the façade (``coalescer.query``, ``coalescer.worker``,
``coalescer.sources``, ``coalescer.write``, ``coalescer.claim``, ``coalescer.store``,
``coalescer.tracing``, ``coalescer.config``, ``coalescer.common``, ``coalescer.errors``);
never ``coalescer.coalescer`` or ``coalescer.sync``, which import these parts.
"""
