"""keys_page.lua, registered once per client and wrapped by a small typed function:
a page of a rule's per-shard set, from where the page before it ended (beside
``store/scripts.py``, which holds the scripts of the other steps)."""

from __future__ import annotations

import weakref
from typing import Any

from coalescer.store.script_calls import script_source

_registered: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()


def _script(redis: Any) -> Any:
    script = _registered.get(redis)
    if script is None:
        script = _registered[redis] = redis.register_script(script_source("keys_page"))
    return script


async def set_page(redis: Any, set_key: str, after: tuple[str, str] | None,
                   count: int) -> list[tuple[str, str]]:
    """Up to ``count`` (member, score) entries of the sorted set ``set_key``, in its
    order, right after the entry ``after`` (score, member) of the page before (None:
    from the start); see keys_page.lua for what happens when that entry is gone."""
    score, member = after if after is not None else ("", "")
    flat = await _script(redis)(keys=[set_key], args=[score, member, count])
    texts = [v.decode("utf-8", "surrogateescape") if isinstance(v, bytes) else str(v)
             for v in flat]
    return list(zip(texts[::2], texts[1::2], strict=True))
