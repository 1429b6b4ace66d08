"""`coalescer explain KEY` and GET /keys/{key}: where one key stands, and why.

A key of a rule with a rate that is due and not yet claimed waits for the rate:
the explanation says so, with how many of the rule's keys on its shard are due
now (one more call, made only then).

``gather_explain`` reads everything about a key in one pipelined round trip to
its shard: its state (the meta hash field, see store/lua/_lib.lua), its scores in its
rule's due, in-flight and dead sets, the server clock, and the shard's history.
``format_explain`` turns that dict into lines a person reads at a glance.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from redis.asyncio.cluster import RedisCluster

from coalescer.common.plural import plural
from coalescer.common.printable import printable_values
from coalescer.config.durations import format_duration
from coalescer.config.rules import Config, Rule
from coalescer.config.schema import MAX_HISTORY
from coalescer.query.fair_status import explain_fair, explain_fair_lines
from coalescer.query.history import (
    CANCELLED,
    HistoryQuery,
    clock,
    format_duration_ms,
    read_history,
)
from coalescer.query.layout_read import current_space, home_of
from coalescer.query.workers import add_workers, explain_worker_lines
from coalescer.store import key_states as states
from coalescer.store import keys as key_names
from coalescer.store.hints import CommandHints
from coalescer.store.keys import KeySpace, ShardKeys
from coalescer.store.script_types import OVERFLOW

LAST_REFRESHES = 5
EVERY_ENTRY = 3 * MAX_HISTORY  # all of a key's entries: its streams are 3 at most
SLACK_MS = 1  # rounding of window / max_wait to whole ms


def rule_settings(rule: Rule) -> dict[str, Any]:
    """A rule's resolved settings (durations in seconds)."""
    return {"name": rule.name, "match": rule.pattern.source, "handler": rule.handler_ref,
            "window": rule.window, "max_wait": rule.max_wait, "absorb": rule.absorb,
            "timeout": rule.timeout, "concurrency": rule.concurrency,
            "retry": {"attempts": rule.retry.attempts, "backoff": rule.retry.backoff,
                      "max_backoff": rule.retry.max_backoff},
            "rate": None if rule.rate is None else str(rule.rate),
            "batch": ({"max": rule.batch.max, "wait": rule.batch.wait}
                      if rule.batch is not None else None),
            "items": {"max": rule.items.max} if rule.items is not None else None,
            "edge": rule.edge}


def _item_state(pending: set[str], claimed: set[str]) -> dict[str, Any]:
    """A key's items: those waiting for its next claim, and those of its current claim
    (kept until a success; a retry gets them again), each sorted, "" (an overflow)
    left out and told apart."""
    return {"pending": len(pending - {OVERFLOW}), "pending_overflowed": OVERFLOW in pending,
            "claimed": len(claimed - {OVERFLOW}), "claimed_overflowed": OVERFLOW in claimed,
            "pending_items": sorted(pending - {OVERFLOW}),
            "claimed_items": sorted(claimed - {OVERFLOW})}


def _num(text: str) -> int | None:
    return int(text) if text.lstrip("-").isdigit() else None


def due_reason(rule: Rule, first: int, last: int, attempts: int, due: int) -> str:
    """Why a pending key is due when it is: window, max_wait, retry or requeued."""
    if attempts > 0:
        return "retry"
    if rule.leading and due == first:
        return "leading"
    by_window = last + round(rule.window * 1000)
    by_cap = first + round(rule.max_wait * 1000)
    if abs(due - by_cap) <= SLACK_MS and by_cap < by_window:
        return "max_wait"
    if abs(due - by_window) <= SLACK_MS:
        return "window"
    return "requeued"


def _pending(value: str, rule: Rule) -> dict[str, Any]:
    p = states.pending(value) or states.Pending(0, 0, 0, 0)
    first, last, attempts, due = p.first_ms, p.last_ms, p.attempts, p.due_ms
    state = "backoff" if attempts > 0 else "pending"
    return {"state": state, "first_touch_ms": first, "last_touch_ms": last,
            "attempts": attempts, "due_ms": due,
            "due_reason": "scheduled" if p.scheduled else due_reason(rule, first, last,
                                                                      attempts, due),
            "scheduled_ms": due if p.scheduled else None,
            "priority_ms": p.priority_ms or None}  # a touch's own: see docs/concepts.md


def _running(value: str, lease_until: float | None, now: int) -> dict[str, Any]:
    token, first, last, attempt, due, rdue, rfirst, rlast, node = states.fields(value, 9)
    again = None
    scheduled = rdue.startswith("S")  # the touch had a time of its own
    rdue = rdue.removeprefix("S").split("!")[0]  # "!PRIORITY": the re-arm's priority
    if _num(rdue) is not None:
        again = {"first_touch_ms": _num(rfirst), "last_touch_ms": _num(rlast),
                 "due_ms": _num(rdue), "scheduled_ms": _num(rdue) if scheduled else None}
    return {"state": "running", "first_touch_ms": _num(first), "last_touch_ms": _num(last),
            "attempts": (_num(attempt) or 1) - 1, "due_ms": _num(due),
            "running": {"node": node or None, "token": _num(token), "attempt": _num(attempt),
                        "lease_left_ms": None if lease_until is None
                        else int(lease_until) - now,
                        "touched_again": again}}


def _dead(value: str, since: float | None) -> dict[str, Any]:
    first, last, attempts, error = states.fields(value, 4)
    return {"state": "dead", "first_touch_ms": _num(first), "last_touch_ms": _num(last),
            "attempts": _num(attempts),
            "dead": {"since_ms": None if since is None else int(since), "error": error}}


def describe_state(value: str | None, rule: Rule, scores: dict[str, float | None],
                   now: int) -> dict[str, Any]:
    """The state part of an explanation, from the key's meta field and set scores."""
    if not value:
        return {"state": "idle", "first_touch_ms": None, "last_touch_ms": None, "attempts": 0}
    found = states.kind(value)
    if found == "running":
        return _running(value, scores["inflight"], now)
    if found == "dead":
        return _dead(value, scores["dead"])
    return _pending(value, rule)


@dataclasses.dataclass(frozen=True, kw_only=True)
class KeyRead:
    """One pipelined read of a key's place: its rule, the layout, its shard, and a
    pipeline holding the server clock (where the pipeline may send TIME), the key's
    state and its scores in the rule's in-flight and dead sets; a caller adds its own
    commands, then ``execute()``."""

    redis: Any
    rule: Rule
    space: KeySpace
    shard: ShardKeys
    pipe: Any
    cluster: bool

    @classmethod
    async def start(cls, redis: Any, config: Config, key: str) -> KeyRead:
        rule = config.rule_for(key)
        space = await current_space(redis, config)
        sk = space.shard(await home_of(redis, space, key))
        pipe = redis.pipeline(transaction=False)
        cluster = isinstance(redis, RedisCluster)  # a Cluster's pipeline refuses TIME
        if not cluster:
            pipe.time()
        pipe.hget(sk.meta, key)
        pipe.zscore(sk.inflight(rule.name), key)
        pipe.zscore(sk.dead(rule.name), key)
        return cls(redis=redis, rule=rule, space=space, shard=sk, pipe=pipe,
                   cluster=cluster)

    async def execute(self) -> tuple[int, list[Any]]:
        """The server's time in ms, and the answers (state, in-flight, dead, then the
        caller's)."""
        answers = await self.pipe.execute()
        sec, usec = await self.redis.time() if self.cluster else answers.pop(0)
        return int(sec) * 1000 + int(usec) // 1000, answers


async def gather_explain(redis: Any, config: Config, key: str) -> dict[str, Any]:
    """Everything about ``key``; UnknownKeyError if no rule matches it."""
    read = await KeyRead.start(redis, config, key)
    rule, space, sk = read.rule, read.space, read.shard
    if rule.items is not None:
        read.pipe.smembers(sk.items(key))
        read.pipe.smembers(sk.claimed_items(key))
    now, (value, inflight, dead, *item_sets) = await read.execute()
    # the key's entries in every stream that may hold them (a reshard leaves them behind)
    mine = await read_history(redis, config, HistoryQuery(key=key, limit=EVERY_ENTRY))
    info: dict[str, Any] = {"key": key, "shard": sk.shard, "now_ms": now,
                            "rule": rule_settings(rule)}
    info |= describe_state(value, rule, {"inflight": inflight, "dead": dead}, now)
    info["items"] = _item_state(*item_sets) if item_sets else None
    await add_workers(redis, config, rule, space.shard(0), info)
    if info["state"] == "backoff":
        failed = next((r for r in mine if r.failed), None)
        info["last_error"] = failed.error if failed else None
    if rule.rate is not None and info["state"] in ("pending", "backoff") \
            and info["due_ms"] <= now and not info["no_worker"]:
        info["rate_wait"] = {"rate": str(rule.rate), "due_now": await redis.zcount(
            sk.due(rule.name), "-inf", now)}
    info["fair"] = await explain_fair(redis, config, rule, key, space)
    info["last_refreshes"] = [r.to_json() for r in mine[:LAST_REFRESHES]]
    info["rule_paused"] = await redis.sismember(key_names.paused_rules(config.namespace),
                                                rule.name) == 1
    return info


# -- formatting ---------------------------------------------------------------------------


def _ago(ms: int | None, now: int) -> str:
    if ms is None:
        return "-"
    delta = (now - ms) / 1000
    return f"{delta:.1f}s ago" if delta >= 0 else f"in {-delta:.1f}s"


def _scheduled(due: int, now: int) -> str:
    """A due time a touch set itself (at/delay)."""
    when = f"in {(due - now) / 1000:.1f} s" if due >= now else \
        f"{(now - due) / 1000:.1f} s ago, waiting to be claimed"
    return f"scheduled for {clock(due)} ({when})"


def _due(info: dict[str, Any]) -> str:
    now, rule, due = info["now_ms"], info["rule"], info["due_ms"]
    when = _ago(due, now) if due < now else f"in {(due - now) / 1000:.1f}s"
    reasons = {
        "window": f"window: last touch + {format_duration(rule['window'])}",
        "max_wait": f"max wait: first touch + {format_duration(rule['max_wait'])} "
                    "(the burst kept going)",
        "retry": f"retry backoff after attempt {info['attempts']} of "
                 f"{rule['retry']['attempts']} failed",
        "requeued": "re-queued (coalescer retry, an expired claim, or changed rules)",
        "leading": "the leading edge: the first touch of a quiet key runs at once",
    }
    return f"due {when} ({clock(due)}), by {reasons[info['due_reason']]}"


def _state_lines(info: dict[str, Any], hints: CommandHints) -> list[str]:
    state, now = info["state"], info["now_ms"]
    if state == "idle":
        return ["idle: nothing pending, running or dead (its next touch starts a burst)"]
    if state in ("pending", "backoff"):
        lines = [f"{state}: {_due(info)}" if info.get("scheduled_ms") is None
                 else f"{state}: {_scheduled(info['scheduled_ms'], now)}"]
        if "rate_wait" in info:
            wait = info["rate_wait"]
            lines.append(f"waits for the rule's rate ({wait['rate']} refresh starts, "
                         f"cluster-wide), with {plural(wait['due_now'], 'key')} of the rule "
                         "due on this shard")
        if state == "backoff":
            lines.append(f"last error: {info.get('last_error') or '(not in the history)'}")
        if info.get("rule_paused"):
            lines.append(f"{state}, but its rule is paused: it runs once the rule is resumed "
                         f"({hints.command('resume', info['rule']['name'])}{hints.note})")
        return lines
    if state == "running":
        run = info["running"]
        lease = run["lease_left_ms"]
        lines = [f"running on node {run['node'] or '(unknown)'}, token {run['token']}, "
                 f"attempt {run['attempt']}, lease "
                 + (f"{lease / 1000:.1f}s left" if lease is not None else "unknown")]
        if run["touched_again"]:
            again = run["touched_again"]
            when = (_ago(again["due_ms"], now) if again.get("scheduled_ms") is None
                    else _scheduled(again["scheduled_ms"], now))
            lines.append(f"touched again while running: runs again {when}")
        return lines
    dead = info["dead"]
    return [f"dead since {_ago(dead['since_ms'], now)} after "
            f"{plural(info['attempts'], 'attempt')}: "
            f"{dead['error']}",
            f"re-queue with {hints.command('dead retry', info['key'])}{hints.note}, "
            "or touch it"]


def _rule_lines(rule: dict[str, Any]) -> list[str]:
    retry = rule["retry"]
    return [f"rule       {rule['name']}  (match {rule['match']}, handler {rule['handler']})",
            f"           window {format_duration(rule['window'])}, max_wait "
            f"{format_duration(rule['max_wait'])}, absorb {format_duration(rule['absorb'])}, "
            f"timeout {format_duration(rule['timeout'])}, concurrency {rule['concurrency']}",
            f"           retry {retry['attempts']} attempts, backoff "
            f"{format_duration(retry['backoff'])} doubling up to "
            f"{format_duration(retry['max_backoff'])}"
            + (f"; rate {rule['rate']}" if rule.get("rate") else "")] + (
                [f"           batch up to {rule['batch']['max']} keys a call, waiting up to "
                 f"{format_duration(rule['batch']['wait'])} for more"] if rule.get("batch")
                else []) + (
                [f"           items: up to {rule['items']['max']} a refresh"]
                if rule.get("items") else []) + (
                ["           edge: leading (a quiet key's first touch runs at once)"]
                if rule.get("edge") == "leading" else [])


def _items_line(items: dict[str, Any]) -> str:
    """How many items wait for the next claim and how many the current one holds (the
    items themselves are in ``--json``)."""
    line = f"{plural(items['pending'], 'item')} pending" + (
        " (overflowed: the next refresh is told so)" if items["pending_overflowed"] else "")
    if items["claimed"] or items["claimed_overflowed"]:
        line += (f"; {plural(items['claimed'], 'item')} held by the current claim (a retry "
                 "gets them again)" + (", overflowed" if items["claimed_overflowed"] else ""))
    return line


def _refresh_line(r: dict[str, Any]) -> str:
    if r["outcome"] == CANCELLED:
        due = f" (due {clock(r['due_ms'])})" if r["due_ms"] is not None else ""
        return f"  {clock(r['start_ms'])}  cancelled by node {r['node']}: its refresh{due} dropped"
    line = (f"  {clock(r['start_ms'])}  {r['outcome']:<8} {format_duration_ms(r['duration_ms'])}"
            f"  attempt {r['attempt'] if r['attempt'] is not None else '-'}, "
            f"token {r['token']}, node {r['node']}")
    if r.get("batch"):
        line += f", batch of {r['batch']}"
    return f"{line}\n      error: {r['error']}" if r["error"] else line


def format_explain(info: dict[str, Any], *, hints: CommandHints | None = None) -> str:
    """An explanation dict (``gather_explain``) as a few readable lines. ``hints``: the
    options the command it suggests needs (see coalescer.store.hints). Keys, names and
    errors are shown with their control characters escaped."""
    info = printable_values(info)
    now = info["now_ms"]
    lines = [f"{info['key']}  (shard {info['shard']})", *_rule_lines(info["rule"])]
    state = _state_lines(info, hints or CommandHints())
    state += explain_worker_lines(info, hints or CommandHints())
    lines.append(f"state      {state[0]}")
    lines += [f"           {line}" for line in state[1:]]
    lines += [f"fair       {line}" for line in explain_fair_lines(info.get("fair"))]
    if info["first_touch_ms"] is not None:
        lines.append(f"burst      first touch {_ago(info['first_touch_ms'], now)}, last touch "
                     f"{_ago(info['last_touch_ms'], now)}; attempts so far {info['attempts']}")
    if info.get("priority_ms"):
        lines.append(f"priority   {format_duration(info['priority_ms'] / 1000)} (its touches'"
                     ": claimed among due keys as if due that much earlier)")
    if info.get("items"):
        lines.append(f"items      {_items_line(info['items'])}")
    refreshes = info["last_refreshes"]
    lines.append("last refreshes" + ("" if refreshes else ": none in the history"))
    lines += [_refresh_line(r) for r in refreshes]
    return "\n".join(lines)

