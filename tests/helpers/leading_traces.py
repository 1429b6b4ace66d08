"""Playing touch traces of one key of an ``edge: leading`` rule through the coalescer's
real scripts (upsert, take, ack) on a real server, on a virtual clock
(``virtual_clock.py``), beside the reference model (``debounce_model.LeadingKey``).

A trace names when each touch comes (each carries an item, its label), how late the
poller claims a due key (its lag) and how long each refresh runs. The poller is
ideal but late by ``lag``: it polls at each due time it learns of plus the lag; it
learns the due time the server wrote (read from the key's state) and the one the
model has, so a due time either side gets wrong is polled and shows. At one instant,
a refresh that ends is acked first, then the touches of that instant are written,
then the poll claims. A divergence is any poll at which the two disagree: whether a
refresh starts, its due time, or the touches (items) it covers; or state left over.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from coalescer.store.key_states import pending
from coalescer.store.keys import ShardKeys
from coalescer.store.script_types import UpsertGroup
from tests.helpers.debounce_model import LeadingKey, Run
from tests.helpers.virtual_clock import VirtualClockScripts

RULE = "lead"
ITEMS_MAX = 1000


@dataclass(frozen=True)
class Trace:
    """Touch times (ms from the trace's start), the poller's lag, run durations (ms,
    used in turn), window and max_wait (ms)."""

    touches: tuple[int, ...]
    lag: int
    durations: tuple[int, ...]
    window: int
    max_wait: int


def random_trace(rng: random.Random) -> Trace:
    """Bursts of touches with gaps well inside, near and past the window, windows
    long against the lag or not, refreshes instant, short or longer than a window."""
    window = rng.choice([1000, 1000, 3000])
    max_wait = window * rng.choice([1, 2, 3, 10])
    t, touches = 0, []
    for _ in range(rng.randint(1, 14)):
        t += rng.choice([
            rng.randint(0, 5), rng.randint(1, window // 2), rng.randint(window - 3, window + 3),
            rng.randint(window, 3 * window), rng.randint(1, max_wait + window),
        ])
        touches.append(t)
    lag = rng.choice([0, 0, 1, 7, window // 3])
    durations = tuple(rng.choice([0, 1, 50, window // 2, 2 * window])
                      for _ in range(rng.randint(1, 3)))
    return Trace(tuple(touches), lag, durations, window, max_wait)


class Player:
    """Plays traces on ``scripts`` (a VirtualClockScripts) in shard ``shard``."""

    def __init__(self, scripts: VirtualClockScripts, shard: ShardKeys) -> None:
        self.scripts = scripts
        self.shard = shard
        self.played = 0

    async def play(self, trace: Trace, base: int) -> Played:
        """Play ``trace`` from virtual time ``base`` on a key of its own."""
        self.played += 1
        play = _Play(self, trace, base, f"k{self.played}:{base}")
        problems = await play.run()
        model = [Run(r.start - base, r.due - base, _in_order(r.labels), r.leading)
                 for r in play.model.runs]
        return Played(problems, play.real_runs, model)


@dataclass(frozen=True)
class Played:
    """A trace played: the divergences found (empty: none), the refreshes the server
    gave (times from the trace's base) and the model's."""

    problems: list[str]
    runs: list[Run]
    model_runs: list[Run]


def _in_order(labels: tuple[str, ...]) -> tuple[str, ...]:
    """Touch labels ("t0", "t1", ...) in touch order."""
    return tuple(sorted(labels, key=lambda label: int(label[1:])))


class _Play:
    def __init__(self, player: Player, trace: Trace, base: int, key: str) -> None:
        self.s, self.shard, self.trace, self.key = player.scripts, player.shard, trace, key
        self.base = base
        self.model = LeadingKey(trace.window, trace.max_wait)
        self.touches = [(base + t, f"t{i}") for i, t in enumerate(trace.touches)]
        self.polls: set[int] = set()
        self.running: tuple[int, int] | None = None  # (token, ends at)
        self.runs = 0
        self.problems: list[str] = []
        self.real_runs: list[Run] = []

    async def run(self) -> list[str]:
        while self.touches or self.polls or self.running is not None:
            now = min(self._times())
            await self.s.at(now)
            if self.running is not None and self.running[1] <= now:
                await self._finish(now)
                await self._learn(now)
            while self.touches and self.touches[0][0] == now:
                await self._touch(*self.touches.pop(0))
                await self._learn(now)
            if any(p <= now for p in self.polls):
                self.polls = {p for p in self.polls if p > now}
                await self._poll(now)
                await self._learn(now)
        left = await self.s.client.hget(self.shard.meta, self.key)
        if left is not None or self.model.due is not None:
            self.problems.append(f"left over: server {left!r}, model due {self.model.due}")
        return self.problems

    def _times(self) -> list[int]:
        times = list(self.polls)
        if self.touches:
            times.append(self.touches[0][0])
        if self.running is not None:
            times.append(self.running[1])
        return times

    async def _touch(self, at: int, label: str) -> None:
        group = UpsertGroup(RULE, self.trace.window, self.trace.max_wait, [self.key],
                            items={self.key: [label]}, items_max=ITEMS_MAX, leading=True)
        result = await self.s.upsert_keys(self.shard, [group])
        if result.failed:
            self.problems.append(f"touch {label} at {at} failed: {result.failed}")
        self.model.touch(at, label)

    async def _poll(self, now: int) -> None:
        _, claims = await self.s.take(self.shard, node_id="player", claim_lease_ms=10**9,
                                      limits=[(RULE, 10)], item_rules={RULE: ITEMS_MAX})
        expected = self.model.poll(now)
        mine = [c for c in claims if c.key == self.key]
        if expected is None and not mine:
            return
        if expected is None or len(mine) != 1:
            self.problems.append(f"poll at {now}: server claimed {mine}, model {expected}")
            return
        claim = mine[0]
        if (claim.due_ms, set(claim.items)) != (expected.due, set(expected.labels)):
            self.problems.append(f"poll at {now}: server due {claim.due_ms} items "
                                 f"{sorted(claim.items)}, model {expected}")
        self.real_runs.append(Run(now - self.base, claim.due_ms - self.base,
                                  _in_order(claim.items),
                                  claim.due_ms == claim.first_ms))
        duration = self.trace.durations[self.runs % len(self.trace.durations)]
        self.runs += 1
        self.running = (claim.token, now + duration)

    async def _finish(self, now: int) -> None:
        assert self.running is not None
        token, _ = self.running
        stale = await self.s.ack(self.shard, [(RULE, [(self.key, token)])],
                                 item_rules={RULE})
        if stale:
            self.problems.append(f"ack at {now} refused: {stale}")
        self.running = None
        self.model.finish()

    async def _learn(self, now: int) -> None:
        """Poll at each due time (plus the lag) that the server or the model has."""
        value = await self.s.client.hget(self.shard.meta, self.key)
        found = pending(value.decode() if isinstance(value, bytes) else value) if value else None
        for due in (found.due_ms if found else None, self.model.next_due()):
            if due is not None and self.running is None:
                self.polls.add(int(max(due, now)) + self.trace.lag)
