"""Random programs of every script that adds to or takes from a fair rule's due set
(touches with priorities and times of their own, claims in fair and in plain order,
acks, failures, cancels, run-nows, dead-letter requeues, recoveries of lapsed claims,
hastens) keep the fair index whole after each step: every pending key is in the due
set (none lost) and sits in its group's queue, no later than its score in the due set
(else the claim would not take it while the due set says it is due, and the poller
would claim again and again), and a group with a pending key is in the order or wakes
no later than that key is due. At the end every key still pending is claimed: no group
is stranded."""

from __future__ import annotations

import random
from typing import Any

import pytest

from coalescer.store.script_types import CancelGroup, Failure, UpsertGroup
from tests.store.test_fair_order import RULE, lead, spec
from tests.store.test_scripts import Shard, shard  # noqa: F401 (shard: a fixture)

GROUPS = {"a": 12, "b": 6, "c": 3}
KEYS = [f"t:{g}:{i}" for g, n in GROUPS.items() for i in range(n)]
STEPS = 300
LONG_LEASE = 30_000
DRAIN_ROUNDS = 1000


class Program:
    """One random program on one shard, and the claims it holds."""

    def __init__(self, s: Shard, seed: int) -> None:
        self.s, self.rng = s, random.Random(seed)
        self.fair = spec(cap=self.rng.choice([0, 1, 2]), weights={"a": 3},
                         priority_ms=self.rng.choice([0, 20]))
        self.running: dict[str, int] = {}
        self.indexed = True  # the last claim that ran was in fair order
        self.log: list[str] = []

    async def touch(self) -> None:
        keys = self.rng.sample(KEYS, self.rng.randint(1, 5))
        now = await self.s.now()
        times = {k: self.rng.choice(["p30", "p5", "d20", "d20p40", f"a{now - 5}"])
                 for k in keys if self.rng.random() < 0.4}
        window = self.rng.choice([0, 0, 5, 30])
        await self.s.scripts.upsert(self.s.keys, [UpsertGroup(RULE, window, 200, keys,
                                                              schedules=times or None)])
        self.log.append(f"touch {keys} window {window} {times}")

    async def claim(self) -> None:
        plain = self.rng.random() < 0.1  # a node without `fair` (a rolling deploy)
        limit, lease = self.rng.randint(0, 3), self.rng.choice([LONG_LEASE, LONG_LEASE, 20])
        batch = await self.s.scripts.claim(
            self.s.keys, leader=self.s.leader, node_id="n1", claim_lease_ms=lease,
            sleep_cap_ms=1000, limits=[(RULE, limit)], fair={} if plain else {RULE: self.fair})
        if limit:  # a claim of limit 0 leaves the index as it is
            self.indexed = not plain
        self.running |= {c.key: c.token for c in batch.claims}
        self.log.append(f"claim {'plain ' if plain else ''}{limit} lease {lease}: "
                        f"{[c.key for c in batch.claims]}")

    async def finish(self) -> None:
        if not self.running:
            return
        key = self.rng.choice(list(self.running))
        token = self.running.pop(key)
        if self.rng.random() < 0.5:
            await self.s.scripts.ack(self.s.keys, [(RULE, [(key, token)])])
            self.log.append(f"ack {key}")
        else:
            delay = self.rng.choice([0, 10, 40])
            await self.s.scripts.fail(self.s.keys, [(RULE, 2, [Failure(key, token, delay, "x")])])
            self.log.append(f"fail {key} retry in {delay} ms")

    async def operate(self) -> None:
        kind = self.rng.choice(["cancel", "run_now", "requeue", "recover", "hasten"])
        if kind == "cancel":
            keys = self.rng.sample(KEYS, 2)
            await self.s.scripts.cancel(self.s.keys, [CancelGroup(RULE, keys)])
        elif kind == "run_now":
            keys = [self.rng.choice(KEYS)]
            await self.s.scripts.run_now(self.s.keys, RULE, keys[0])
        elif kind == "requeue":
            keys = await self.s.r.zrange(self.s.keys.dead(RULE), 0, 1)
            if keys:
                await self.s.scripts.requeue(self.s.keys, RULE, keys)
        elif kind == "recover":
            keys = []
            await self.s.scripts.recover(self.s.keys, [RULE], 10, [3])
            self.running = {k: t for k, t in self.running.items()
                            if (await self.s.state(k) or "").startswith(f"R|{t}|")}
        else:
            keys = []
            await self.s.scripts.hasten(self.s.keys, [RULE], 2)
        self.log.append(f"{kind} {keys}")

    async def step(self) -> None:
        await self.rng.choice([self.touch] * 4 + [self.claim] * 3 + [self.finish] * 2
                              + [self.operate] * 2)()
        if self.indexed:
            await self.check()

    async def check(self) -> None:
        """The index is whole (see the module); else the steps that led there."""
        r, prefix = self.s.r, self.s.keys.fair(RULE)
        order = dict(await r.zrange(prefix + "groups", 0, -1, withscores=True))
        heads = dict(await r.zrange(prefix + "heads", 0, -1, withscores=True))
        due = dict(await r.zrange(self.s.keys.due(RULE), 0, -1, withscores=True))
        states = dict(zip(KEYS, await r.hmget(self.s.keys.meta, KEYS), strict=True))
        lost = [k for k, v in states.items() if v and v[0] not in "RD" and k not in due]
        assert not lost, f"pending keys out of the due set: {lost}\n" + "\n".join(
            self.log[-25:])
        for g in GROUPS:
            queue: dict[Any, float] = dict(await r.zrange(prefix + "q:" + g, 0, -1,
                                                          withscores=True))
            missing = [k for k in due if k.split(":")[1] == g and k not in queue]
            behind = [k for k, score in queue.items() if k in due and score > due[k]]
            pending = [score for k, score in queue.items() if k in due]
            late = pending and g not in order and heads.get(g, float("inf")) > min(pending)
            assert not missing and not behind and not late, (
                f"group {g}: pending keys not in its queue {missing}, queued later than "
                f"their due score {behind}; queue {queue}; "
                f"in the order {order.get(g)}, wakes at {heads.get(g)}\n"
                + "\n".join(self.log[-25:]))

    async def drain(self) -> list[str]:
        """Finish every claim, then claim in fair order (and finish) until no key is due;
        what is still due after DRAIN_ROUNDS claims."""
        for key, token in self.running.items():
            await self.s.scripts.ack(self.s.keys, [(RULE, [(key, token)])])
        due: list[str] = []
        for _ in range(DRAIN_ROUNDS):
            now = await self.s.now()
            due = [k for k, score in await self.s.r.zrange(self.s.keys.due(RULE), 0, -1,
                                                            withscores=True) if score <= now]
            if not due:
                break
            batch = await self.s.scripts.claim(
                self.s.keys, leader=self.s.leader, node_id="n1", claim_lease_ms=LONG_LEASE,
                sleep_cap_ms=1000, limits=[(RULE, 3)], fair={RULE: self.fair})
            for c in batch.claims:
                await self.s.scripts.ack(self.s.keys, [(RULE, [(c.key, c.token)])])
            if not batch.claims:  # a key re-touched since it was scored: due a bit later
                await self.s.after(now)
            await self.check()
        return due


@pytest.mark.parametrize("seed", range(8))
async def test_random_programs_keep_the_fair_index_whole(shard: Shard, seed: int) -> None:  # noqa: F811
    program = Program(shard, seed)
    await lead(shard, program.fair)  # publishes the rule's order: writes index from now on
    for _ in range(STEPS):
        await program.step()
    assert await program.drain() == []
