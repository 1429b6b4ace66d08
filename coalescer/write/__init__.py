"""The write path: ``touch()`` into the in-process absorber, the flusher that
writes touches to Redis in batches, the keys written lately, and what a failed
write keeps or drops.

May import ``coalescer.store``, ``coalescer.config`` and ``coalescer.common``.
"""
