"""A worker node's wiring: one shared context, the parts built from it, started and
stopped together.

``worker.context.NodeContext`` holds what every part of a node shares (its scripts,
key space, metrics, id and rules); ``worker.handlers`` holds what runs the handlers;
``Node`` builds the runner,
the rules registry watch, the node lease, one poller, adopter and leadership per shard,
the wake listener, the lead log and the node's health (a node whose refreshes fail as
a whole gives its shards up: ``worker.health``), starts their loops and stops them in
order.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Callable, Coroutine
from dataclasses import replace
from typing import Any

from redis.exceptions import RedisError

from coalescer.store.layout import LayoutInfo
from coalescer.worker.adopter import Adopter
from coalescer.worker.context import NodeContext
from coalescer.worker.health import Health
from coalescer.worker.invoke import Invoke
from coalescer.worker.lead_log import LeadLog
from coalescer.worker.leadership import Leadership, Standing
from coalescer.worker.mover import Mover
from coalescer.worker.node_lease import NodeLease
from coalescer.worker.paused import PausedRules
from coalescer.worker.poller import Poller
from coalescer.worker.registry import RegistryWatch
from coalescer.worker.runner import Runner
from coalescer.worker.summary import RefreshSummary
from coalescer.worker.wakeups import SUBSCRIBED, WakeListener

log = logging.getLogger(__name__)

RECORD_TIMEOUT = 5.0  # seconds for the results of the last refreshes at close

# Starts a named background loop; the caller owns (and at close cancels) its task.
Spawn = Callable[[str, Coroutine[Any, Any, None]], None]


class Node:
    """A worker node's parts, built from one context, run and stopped together."""

    def __init__(self, ctx: NodeContext, *, invokers: dict[str, Invoke], pubsub: Any) -> None:
        """``pubsub`` is the client whose connection the wake listener subscribes on."""
        self.paused = PausedRules(ctx.scripts.client, ctx.keyspace.namespace,
                                  [r.name for r in ctx.rules], ctx.metrics, self.poke_all)
        self.ctx = ctx = replace(ctx, paused=self.paused)
        self.led: set[int] = set()
        self.span = ctx.keyspace.span  # the shards led or stood by for: 0 .. span - 1
        self.lead_log = LeadLog(ctx.node_id, self.span, self.led)
        self.summary = RefreshSummary(ctx.node_id, ctx.metrics, [r.name for r in ctx.rules])
        self.runner = Runner(ctx, invokers=invokers, on_slot_free=self.slot_freed,
                             on_finish=self._finished)
        self.registry = RegistryWatch(ctx)
        self.node_lease = NodeLease(ctx, on_live=self._live_changed, on_lapse=self._lapsed)
        self.health = Health(ctx, node_lease=self.node_lease, give_up=self._give_up,
                             on_read=self.rebalance)
        self.standing = Standing(lease=self.node_lease, health=self.health)
        self.mover = Mover(ctx, self.led)
        self.leaderships = [self._shard(ctx, shard) for shard in range(self.span)]
        routes: dict[str, Callable[[Any], None]] = {
            ls_.poller_channel: ls_.on_message for ls_ in self.leaderships}
        self._reading: asyncio.Task[Any] | None = None
        if ctx.layouts is not None:
            ctx.layouts.on_change(self._layout_changed)
            routes[ctx.layouts.channel] = self._layout_announced
        routes[self.node_lease.channel] = self._node_announced
        routes[self.paused.channel] = self.paused.announced
        self.wakeups = WakeListener(pubsub, routes, self.poke_all, ctx.metrics)
        self._spawn: Spawn | None = None

    def _shard(self, ctx: NodeContext, shard: int) -> Leadership:
        keys = ctx.keyspace.shard(shard)
        poller = Poller(ctx, shard=keys, runner=self.runner,
                        hand_over=lambda rules: self._hand_over(shard, rules),
                        others_claiming=lambda: self._others_claiming(shard))
        adopter = Adopter(ctx, shard=keys, runner=self.runner, sleep_cap=poller.sleep_cap,
                          clock=poller.clock)
        return Leadership(ctx, poller=poller, standing=self.standing, adopter=adopter,
                          lead_log=self.lead_log)

    def _node_announced(self, message: Any) -> None:
        """A node joined, left or gave its shards up: read the leases and the benched
        nodes now (and share the shards again)."""
        if message != SUBSCRIBED:
            self.node_lease.poke(str(message))
            if str(message) != self.ctx.node_id:
                self.health.read()

    def _finished(self, key: str, failed: bool) -> None:
        self.health.record(key, failed=failed)

    def _give_up(self) -> int:
        """Hand back every shard led (this node's refreshes fail); how many."""
        led = [ls_ for ls_ in self.leaderships if ls_.leading]
        for ls_ in led:
            ls_.hand_back()
        return len(led)

    def _layout_announced(self, _message: Any) -> None:
        """The layout changed (or its channel's subscription began: a change may have
        been missed): read it again, once at a time."""
        if self._reading is not None and not self._reading.done():
            return
        assert self.ctx.layouts is not None
        self._reading = asyncio.ensure_future(self.ctx.layouts.refresh())
        self._reading.add_done_callback(self._layout_read)

    def _layout_read(self, task: asyncio.Task[Any]) -> None:
        if not task.cancelled() and task.exception() is not None:
            log.warning("node %s: reading the shard layout failed: %r (read again at the "
                        "next announcement or reconnect)", self.ctx.node_id, task.exception())

    def _layout_changed(self, info: LayoutInfo) -> None:
        """The layout changed: stand by for the shards it adds (a reshard began) or
        stop leading the ones it drops (a reshard to fewer shards ended)."""
        span = info.keyspace(self.ctx.keyspace.namespace).span
        if span != self.span:
            log.info("node %s: shards 0-%d now (was 0-%d)", self.ctx.node_id, span - 1,
                     self.span - 1)
        for ls_ in self.leaderships[span:]:
            ls_.stop()
        for shard in range(span):
            if shard >= len(self.leaderships):
                self.leaderships.append(self._shard(self.ctx, shard))
            elif shard >= self.span:
                self.leaderships[shard] = self._shard(self.ctx, shard)
            else:
                continue
            self._start_shard(self.leaderships[shard])
        self.span = self.lead_log.total = span
        self.mover.poke()

    def _start_shard(self, ls_: Leadership) -> None:
        self.wakeups.add_route(ls_.poller_channel, ls_.on_message)
        if self._spawn is not None:
            self._spawn(f"shard {ls_.shard}", ls_.run())

    def _live_changed(self, live: int) -> None:
        self.registry.nudge(live)
        self.health.live_changed()
        self.rebalance()

    def _lapsed(self) -> None:
        """Our node lease lapsed: every led shard stops claiming now."""
        for ls_ in self.leaderships:
            ls_.lapse()

    def rebalance(self) -> None:
        """Above the fair share (``ceil(shards / live nodes)``, benched nodes left out):
        hand back the highest shards led, so that the other nodes get theirs (once the
        benched nodes were read within a lease: the shards a benched node gave up are
        not handed back to it)."""
        share = math.ceil(self.span / self.health.serving_nodes())
        surplus = len(self.led) - share
        if surplus <= 0:
            return
        if self.health.read_due():
            self.health.read()  # which calls rebalance again
            return
        for shard in sorted(self.led, reverse=True)[:surplus]:
            self.leaderships[shard].hand_back()

    def start(self, spawn: Spawn) -> None:
        """Start every loop of the node through ``spawn``."""
        self._spawn = spawn
        spawn("node lease", self.node_lease.run())
        spawn("wakeups", self.wakeups.run())
        # the paused rules are read now, not only once the subscription is confirmed (a
        # new connection's round trips, which a slow link makes seconds): nothing is
        # claimed until a first read; the confirmation reads them again
        self.paused.announced(SUBSCRIBED)
        spawn("results", self.runner.results_loop())
        spawn("renew", self.runner.renew_loop())
        for ls_ in self.leaderships:
            spawn(f"shard {ls_.shard}", ls_.run())
        spawn("registry", self.registry.run())
        spawn("mover", self.mover.run())

    def leads(self) -> list[int]:
        """The shards this node leads now."""
        return sorted(self.led)

    def slot_freed(self) -> None:
        """The runner freed handler slots: wake the pollers and starved adopters. The
        first poller woken takes the slot, so the one that claimed least recently is
        woken first: shards with keys waiting are claimed from at even rates (a fair
        rule's order then holds across them), not one shard's backlog before the others'."""
        waiting = [ls_ for ls_ in self.leaderships if ls_.poller.waits_for_slots]
        if len(waiting) > 1:
            waiting.sort(key=lambda x: x.poller.served)
        for ls_ in waiting:
            ls_.poller.slots_freed()
        for ls_ in self.leaderships:
            if ls_.adopter is not None and ls_.adopter.starved:
                ls_.adopter.poke()

    def _hand_over(self, shard: int, rules: list[int]) -> bool:
        """Wake the pollers of other shards that wait for a slot of one of ``rules``,
        the one that claimed least recently first; whether there was one."""
        waiting = [ls_.poller for ls_ in self.leaderships
                   if ls_.poller.shard_keys.shard != shard and ls_.poller.waits_for(rules)]
        for poller in sorted(waiting, key=lambda p: p.served):
            poller.poke()
        return bool(waiting)

    def _others_claiming(self, shard: int) -> bool:
        """Whether the poller of another shard has a claim call under way."""
        return any(ls_.poller.claiming for ls_ in self.leaderships
                   if ls_.poller.shard_keys.shard != shard)

    def poke_all(self) -> None:
        """Wake the poller of every shard led (the wake channel reconnected, or a rule
        was resumed; standbys hear of a reconnect from their channel's subscription, see
        wakeups.py) and every adopter."""
        for ls_ in self.leaderships:
            if ls_.leading:
                ls_.poller.poke()
            if ls_.adopter is not None:
                ls_.adopter.poke()

    def tick(self) -> None:
        """About once a second: hand back shards above the fair share, the leadership line
        and the refresh summary, when due."""
        self.health.tick()
        self.rebalance()
        self.lead_log.tick()
        self.summary.tick()

    def stop_claiming(self) -> None:
        """Stop every shard's claims now; ``release()`` waits for the leases to go."""
        self.health.close()
        self.paused.close()
        for ls_ in self.leaderships:
            ls_.stop()

    async def release(self) -> None:
        """Wait until every shard released its lease, then log the leadership line."""
        try:
            await asyncio.gather(*(ls_.stopped() for ls_ in self.leaderships))
            await self.node_lease.leave()
        finally:
            self.lead_log.tick(final=True)

    async def finish(self, grace: float) -> None:
        """Let running refreshes end within ``grace``, record their results (within
        ``RECORD_TIMEOUT``) and log what the summary has not reported yet."""
        await self.runner.drain(grace)
        try:
            await asyncio.wait_for(self.runner.flush_results(), RECORD_TIMEOUT)
        except (RedisError, OSError, TimeoutError) as exc:
            log.warning("shutdown: record results failed: %r", exc)
        finally:
            self.summary.tick(final=True)
