"""Leadership follows health: a node whose refreshes fail as a whole gives its shards up.

Every finished run of this node goes into its failure window (``failure_window``), which
judges it unhealthy; the rule (most of its recent runs failed, over enough distinct
keys), the hand-over, the cool-off and what the other nodes do meanwhile:
docs/operations.md, "A node whose refreshes fail". Here: the bench call
(``bench.lua``) benches this node only if another node it counts live still has a lease
and is not benched itself, in one atomic step, so of two failing nodes that judge
themselves at once one keeps leading; the cool-off (``COOL_OFF_LEASES`` leader leases,
doubled up to ``MAX_COOL_OFF_LEASES``) is timed by this node's own clock, and the other
nodes read the benched ones (the bench key holds each one's end, server time) when one
announces its bench and before handing back shards above their share.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from redis.exceptions import RedisError

from coalescer.common.plural import plural
from coalescer.store.keys import benched, node_leases, nodes_channel
from coalescer.store.script_types import Benched
from coalescer.worker.failure_window import FailureWindow, Verdict

if TYPE_CHECKING:
    from coalescer.worker.context import NodeContext
    from coalescer.worker.node_lease import NodeLease

log = logging.getLogger(__name__)

COOL_OFF_LEASES = 3  # leader leases a benched node asks for no shard, at the first bench
MAX_COOL_OFF_LEASES = 96  # doubled at each consecutive bench, up to this
READ_EVERY_LEASES = 1.0  # the benched nodes are read at most once a lease for a rebalance


class Health:
    """Judges this node's runs; benches it (its shards go to a healthy node) when they fail."""

    def __init__(self, ctx: NodeContext, *, node_lease: NodeLease,
                 give_up: Callable[[], int], on_read: Callable[[], None]) -> None:
        """``give_up`` hands back every shard this node leads and says how many;
        ``on_read`` is called after the benched nodes were read (for a rebalance)."""
        namespace = ctx.keyspace.namespace
        self._scripts = ctx.scripts
        self._node_id = ctx.node_id
        self._lease = ctx.leader_lease
        self._metrics = ctx.metrics
        self._benched_key, self._leases_key = benched(namespace), node_leases(namespace)
        self._channel = nodes_channel(namespace)
        self._node_lease = node_lease
        self._give_up = give_up
        self._on_read = on_read
        self.window = FailureWindow()
        self.fit = asyncio.Event()  # clear while benched: no shard is asked for
        self.fit.set()
        self._others: dict[str, float] = {}  # benched other nodes -> cool-off end, loop clock
        self._read_at = -math.inf  # loop clock: when the benched nodes were last read
        self._strikes = 0  # consecutive benches
        self._task: asyncio.Future[None] | None = None  # a bench call in flight
        self._reading: asyncio.Future[None] | None = None  # a read in flight
        self._next_try = 0.0  # loop clock: an unhealthy node that kept leading asks again
        self._cooling: asyncio.TimerHandle | None = None
        self._kept_logged = False
        self._closed = False
        self._shown = False  # what the gauge says: unhealthy

    # -- this node's runs --------------------------------------------------------------

    def record(self, key: str, *, failed: bool) -> None:
        """A run of ``key`` finished on this node (the runner's callback)."""
        self.window.record(key, failed=failed)
        self._judge()

    def tick(self) -> None:
        """About once a second: runs age out of the window."""
        self._judge()

    def _judge(self) -> None:
        if self._closed or not self.fit.is_set():
            return  # benched: the end of the cool-off judges again
        verdict = self.window.verdict()
        if verdict is None:
            self._show(unhealthy=False)
            self._kept_logged = False
            if self._strikes and self.window.healthy():
                self._strikes = 0
            return
        self._show(unhealthy=True)
        loop = asyncio.get_running_loop()
        if (self._task is None or self._task.done()) and loop.time() >= self._next_try:
            self._task = asyncio.ensure_future(self._bench(verdict))

    def _show(self, *, unhealthy: bool) -> None:
        """The gauge, set only when it changes (this runs once a refresh)."""
        if unhealthy != self._shown:
            self._metrics.node_unhealthy.set(1 if unhealthy else 0)
            self._shown = unhealthy

    async def _bench(self, verdict: Verdict) -> None:
        """Give the shards up to a healthy node if one can take them; else keep leading."""
        others = [node for node in self._node_lease.live if node != self._node_id]
        cool_off = self._cool_off()
        try:
            state = await self._scripts.bench(
                self._benched_key, self._leases_key, node_id=self._node_id,
                cool_off_ms=round(cool_off * 1000), others=others) if others else None
        except (RedisError, OSError, TimeoutError) as exc:
            self._metrics.redis_errors.labels("health").inc()
            self._keep(verdict, f"the bench call failed: {exc!r}")
            return
        if state is not None:
            self._note(state)
        if state is None or not state.benched:
            self._keep(verdict, "every other live node gave its shards up too" if others
                       else "no other live node to hand them to")
            return
        self._benched(verdict, cool_off)
        try:  # the others read the benched nodes now, not at their next rebalance
            await self._scripts.client.publish(self._channel, self._node_id)
        except (RedisError, OSError) as exc:
            log.debug("node %s: announcing its bench failed: %r", self._node_id, exc)

    def _cool_off(self) -> float:
        leases = min(COOL_OFF_LEASES * 2 ** self._strikes, MAX_COOL_OFF_LEASES)
        return float(leases * self._lease)

    def _keep(self, verdict: Verdict, why: str) -> None:
        """Unhealthy, but nobody can take the shards over: keep leading, ask again in a lease."""
        self._next_try = asyncio.get_running_loop().time() + self._lease
        if not self._kept_logged:
            log.warning("node %s: %s; keeps leading its shards: %s", self._node_id,
                        verdict.text(), why)
            self._kept_logged = True
        self._resume()

    def _benched(self, verdict: Verdict, cool_off: float) -> None:
        self.fit.clear()
        self._strikes += 1
        given = self._give_up()
        self._metrics.shards_given_up.inc(given)
        log.warning("node %s: %s; gave up the %s it led to a healthy node and asks for "
                    "none for %.0fs", self._node_id, verdict.text(),
                    plural(given, "shard"), cool_off)
        self.window.clear()  # what runs meanwhile (the claims it holds) is judged next
        self._kept_logged = False
        self._cooling = asyncio.get_running_loop().call_later(cool_off, self._cooled)

    def _cooled(self) -> None:
        """The cool-off ended: lead again, unless the runs since still say unhealthy."""
        self._cooling = None
        verdict = self.window.verdict()
        if verdict is None:
            log.info("node %s: its cool-off ended; it asks for shards again", self._node_id)
            self._resume()
            return
        self._task = asyncio.ensure_future(self._bench(verdict))

    def _resume(self) -> None:
        if self._cooling is not None:
            self._cooling.cancel()
            self._cooling = None
        if not self.fit.is_set():
            self.fit.set()
            self._show(unhealthy=self.window.verdict() is not None)

    def live_changed(self) -> None:
        """The live nodes changed: a benched node with nobody left to lead leads again."""
        if self.fit.is_set() or self.serving(self._node_lease.live, besides_me=True):
            return
        log.info("node %s: no live node that is not benched is left; it ends its "
                 "cool-off and asks for shards again", self._node_id)
        self._resume()

    # -- the other nodes' benches ------------------------------------------------------

    def serving(self, live: Iterable[str], *, besides_me: bool = False) -> int:
        """How many of ``live`` nodes may lead: those not benched (this node counts unless
        ``besides_me``)."""
        now = asyncio.get_running_loop().time()
        return sum(1 for node in live
                   if (node != self._node_id and self._others.get(node, 0.0) <= now)
                   or (node == self._node_id and not besides_me))

    def serving_nodes(self) -> int:
        """How many live nodes share the shards: at least 1."""
        return max(1, self.serving(self._node_lease.live))

    def read_due(self) -> bool:
        """Whether the benched nodes were read longer than a lease ago."""
        loop = asyncio.get_running_loop()
        return loop.time() - self._read_at > READ_EVERY_LEASES * self._lease

    def read(self) -> None:
        """Read the benched nodes (one read at a time), then call ``on_read``."""
        if self._reading is None or self._reading.done():
            self._reading = asyncio.ensure_future(self._read())

    async def _read(self) -> None:
        try:
            self._note(await self._scripts.bench(
                self._benched_key, self._leases_key, node_id=self._node_id,
                cool_off_ms=-1, others=()))
        except (RedisError, OSError, TimeoutError) as exc:
            self._metrics.redis_errors.labels("health").inc()
            log.debug("node %s: reading the benched nodes failed: %r", self._node_id, exc)
        self._read_at = asyncio.get_running_loop().time()
        self._on_read()

    def _note(self, state: Benched) -> None:
        now = asyncio.get_running_loop().time()
        self._others = {node: now + (ends - state.now_ms) / 1000
                        for node, ends in state.ends.items() if node != self._node_id}
        self._read_at = now

    def close(self) -> None:
        """Stop judging (the node stops claiming); idempotent."""
        self._closed = True
        for task in (self._task, self._reading):
            if task is not None:
                task.cancel()
        if self._cooling is not None:
            self._cooling.cancel()
