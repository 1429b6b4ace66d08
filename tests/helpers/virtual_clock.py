"""The coalescer's own scripts on a real server, reading the time from a key instead of
the server's clock: a property test sets the time of each call and so plays thousands
of traces of touches, claims and acks in seconds, each at exactly the times it names.
Only the clock read (``now_ms`` of _lib.lua) is replaced; every other line of every
script runs as written. For standalone servers (the clock key is not declared)."""

from __future__ import annotations

from typing import Any

from coalescer.store.script_calls import SCRIPT_NAMES, script_source
from coalescer.store.scripts import Scripts

CLOCK_READ = """local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end"""


def virtual_source(name: str, clock_key: str) -> str:
    """Script ``name`` with its clock read from ``clock_key`` (epoch ms)."""
    text = script_source(name)
    if CLOCK_READ not in text:
        raise AssertionError(f"{name}: the clock read of _lib.lua changed; update {__name__}")
    return text.replace(CLOCK_READ, "local function now_ms()\n"
                        f"  return tonumber(redis.call('GET', '{clock_key}'))\nend")


class VirtualClockScripts(Scripts):
    """``Scripts`` whose every script reads the time from ``clock_key``; ``at(ms)`` sets
    it for the calls that follow."""

    def __init__(self, redis: Any, clock_key: str) -> None:
        super().__init__(redis)
        self.clock_key = clock_key
        self._now: int | None = None
        self._scripts = {name: redis.register_script(virtual_source(name, clock_key))
                         for name in SCRIPT_NAMES}

    async def at(self, ms: int) -> None:
        if ms != self._now:
            await self._redis.set(self.clock_key, ms)
            self._now = ms
