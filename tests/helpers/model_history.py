"""The recorded history of a model run, and the checks a user would make on it.

Every time here is the Redis server clock (``TIME``), in microseconds, so records
written by several processes compare. A touch is known to have reached Redis
between ``t0`` (TIME read before ``touch()``) and ``t1`` (TIME read after
``flush()`` returned). A run is one call of the handler: ``start`` is TIME read
as it began, ``end`` as it ended (or when its node was SIGKILLed). A cancel took
effect between its ``t0`` and ``t1``; a touch it may have followed may go unrefreshed
(the guarantees hold for the touches after a key's last cancel).

Each check returns a list of violations (empty when the history is correct),
each a one-line sentence naming the key.
"""

from __future__ import annotations

import itertools
import json
import math
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

FAILED = ("fail", "cancelled", "killed")
MS = 1000  # microseconds per millisecond
ACK_LAG = 1000 * MS  # how long after a run ends its result surely reached Redis
# how long after a failover a claim may still lapse unseen: its nodes' connections to the
# new primary are coming back, and its renewals (or its replica's confirmation) late
SETTLE_AFTER_FAILOVER = 2000 * MS


@dataclass(frozen=True)
class Touch:
    key: str
    t0: int
    t1: int


@dataclass(frozen=True)
class Scheduled:
    """A touch of ``key`` with a time of its own (``at``), made between ``t0`` and ``t1``:
    the key is due at ``due`` (server clock, us), or when it reached Redis if that is later.
    It is in ``History.touches`` too, as a touch like any other."""

    key: str
    t0: int
    t1: int
    due: int


@dataclass(frozen=True)
class Cancel:
    key: str
    t0: int
    t1: int
    state: str  # what the cancel found the key in (CancelOutcome.states)


@dataclass(frozen=True)
class ItemTouch:
    """A touch of ``key`` carrying ``item`` (each item is touched once in a run), made
    between ``t0`` and ``t1``; ``seq0`` and ``seq1`` are the fencing-token counter of
    the key's shard read with them: a claim with a token up to ``seq0`` was made before
    the touch, one above ``seq1`` after it reached Redis."""

    key: str
    item: str
    t0: int
    t1: int
    seq0: int
    seq1: int


@dataclass
class Run:
    key: str
    token: int
    attempt: int
    start: int
    pid: int
    last_touch_ms: int
    due_ms: int
    end: int | None = None
    result: str | None = None
    killed_after: bool = False  # its process was SIGKILLed, or a failover may undo its end
    items: tuple[str, ...] = ()
    overflowed: bool = False

    @property
    def failed(self) -> bool:
        return self.result in FAILED


@dataclass(frozen=True)
class Rule:
    window_ms: int
    max_wait_ms: int
    attempts: int
    leading: bool = False  # edge: leading: a quiet key's first touch is due at once


@dataclass
class History:
    touches: list[Touch] = field(default_factory=list)
    kills: list[tuple[int, int]] = field(default_factory=list)  # (pid, TIME after the kill)
    cancels: list[Cancel] = field(default_factory=list)
    item_touches: list[ItemTouch] = field(default_factory=list)
    scheduled: list[Scheduled] = field(default_factory=list)  # touches with a time of their own
    failovers: list[tuple[int, int]] = field(default_factory=list)  # (TIME before, after)

    def runs(self, log: Path) -> dict[str, list[Run]]:
        """The runs in the handlers' log, per key in start order, kills applied."""
        runs: dict[tuple[str, int], Run] = {}
        for line in log.read_text().splitlines() if log.exists() else []:
            rec = json.loads(line)
            ident = (rec["key"], rec["token"])
            if rec["ev"] == "start":
                runs[ident] = Run(rec["key"], rec["token"], rec["attempt"], rec["t"],
                                  rec["pid"], rec["last"], rec["due"],
                                  items=tuple(rec.get("items", ())),
                                  overflowed=rec.get("over", False))
            else:
                runs[ident].end, runs[ident].result = rec["t"], rec["result"]
        for run in runs.values():
            self._apply_kills(run)
        out: dict[str, list[Run]] = defaultdict(list)
        for run in sorted(runs.values(), key=lambda r: r.start):
            out[run.key].append(run)
        return out

    def _apply_kills(self, run: Run) -> None:
        for pid, when in self.kills:
            if pid == run.pid and when > run.start:
                run.killed_after = True
                if run.end is None:
                    run.end, run.result = when, "killed"
        # A run's result is recorded (ack or failure) a moment after it ends. If the
        # primary dies before its replica holds it, the new primary still has the claim:
        # it lapses and is recovered as if the run's node had died.
        for before, after in self.failovers:
            if run.start < after and (run.end is None or run.end > before - ACK_LAG):
                run.killed_after = True

    def scheduled_between(self, key: str, a: float, b: float) -> bool:
        """May a touch of ``key`` with a time of its own have reached Redis between
        ``a`` and ``b``?"""
        return any(s.key == key and s.t1 > a and s.t0 < b for s in self.scheduled)

    def touches_of(self, key: str) -> list[Touch]:
        return sorted((t for t in self.touches if t.key == key), key=lambda t: t.t0)

    def killed_between(self, a: int, b: float) -> bool:
        """Can a claim that no handler saw lie between ``a`` and ``b``? A SIGKILLed node's
        can; so can one made during or just after a failover, which its node could not
        renew (or its replica confirmed late) and stopped before it started."""
        return (any(a < when <= b for _, when in self.kills)
                or any(before < b and after + SETTLE_AFTER_FAILOVER > a
                       for before, after in self.failovers))

    def cancelled_between(self, key: str, a: int, b: float = math.inf,
                          states: tuple[str, ...] | None = None) -> bool:
        """Can a cancel of ``key`` (found in one of ``states``) have taken effect
        after ``a`` and before ``b``?"""
        return any(c.key == key and c.t1 > a and c.t0 < b
                   and (states is None or c.state in states) for c in self.cancels)


# -- lost update: every touch is followed by a refresh that starts after it ----------------


def _covers(run: Run, touch: Touch) -> bool:
    """Did ``run`` certainly start after the touch reached Redis?

    Certain when it started after ``t1``; inside the touch's uncertainty interval,
    when the claim says it covers a touch made at or after ``t0``.
    """
    if run.start > touch.t1:
        return True
    return run.start > touch.t0 and run.last_touch_ms * MS >= touch.t0 - MS


def check_no_lost_update(history: History, runs: dict[str, list[Run]],
                         rules: dict[str, Rule], rule_of: Any) -> list[str]:
    """lost update: a touch is followed by a successful refresh, or by its last failed try,
    unless a cancel of its key came after it (every touch after a key's last cancel is)."""
    out = []
    for touch in history.touches:
        rule = rules[rule_of(touch.key)]
        after = [r for r in runs.get(touch.key, []) if _covers(r, touch)]
        if any(r.result == "ok" or (r.failed and r.attempt >= rule.attempts) for r in after):
            continue
        if history.cancelled_between(touch.key, touch.t0):
            continue  # a cancel after it dropped it (or may have)
        seen = [(r.attempt, r.result) for r in after]
        out.append(f"lost update: {touch.key} touched at {touch.t0}..{touch.t1} us: no "
                   "refresh that "
                   f"started after it succeeded or was dead-lettered (after it: {seen})")
    return out


# -- coalescing: one refresh per burst, never early, the max-wait cap ----------------------


def _allowed(history: History, chain: list[Touch], max_wait_ms: int) -> int:
    """The most first tries a chain of touches may get: ceil(T / M) + 1, for each of the
    bursts the cancels among its touches cut it into (a cancel ends a burst)."""
    parts, start = [], 0
    for i in range(1, len(chain)):
        if history.cancelled_between(chain[i].key, chain[i - 1].t0, chain[i].t1):
            parts.append(chain[start:i])
            start = i
    parts.append(chain[start:])
    return sum(math.ceil((p[-1].t1 - p[0].t0) / (max_wait_ms * MS)) + 1 for p in parts)


def _chains(touches: list[Touch], window_ms: int) -> list[list[Touch]]:
    """Runs of touches whose gaps are certainly shorter than the window."""
    chains: list[list[Touch]] = []
    for touch in touches:
        if chains and touch.t1 - chains[-1][-1].t0 < window_ms * MS:
            chains[-1].append(touch)
        else:
            chains.append([touch])
    return chains


def check_coalescing(history: History, runs: dict[str, list[Run]], rules: dict[str, Rule],
                     rule_of: Any) -> list[str]:
    """coalescing: at most ceil(T / M) + 1 first tries per burst of length T; none early."""
    out = []
    for key in {t.key for t in history.touches}:
        rule = rules[rule_of(key)]
        firsts = [r for r in runs.get(key, []) if r.attempt == 1]
        for chain in _chains(history.touches_of(key), rule.window_ms):
            a, b = chain[0].t0, chain[-1].t1
            horizon = b + rule.window_ms * MS * 3 // 2
            if history.scheduled_between(key, a, horizon):
                continue  # a time of its own decides instead (check_schedules)
            n = sum(1 for r in firsts if a < r.start <= horizon)
            allowed = _allowed(history, chain, rule.max_wait_ms)
            if n > allowed:
                out.append(f"coalescing: {key}: a burst of {len(chain)} touches over "
                           f"{(b - a) / MS:.0f} ms got {n} refreshes (at most {allowed})")
        out += _never_early(key, history, runs.get(key, []), rule)
    return out


def _never_early(key: str, history: History, runs: list[Run], rule: Rule) -> list[str]:
    """A first try starts only after a touch, not before min(last + W, first + M), and is
    due no later than its burst's first touch + M (the max-wait cap is kept)."""
    out = []
    for i, run in enumerate(runs):
        if run.attempt != 1:
            continue
        since = runs[i - 1].due_ms * MS if i else 0  # its claim came after its due time
        burst = [t for t in history.touches_of(key) if t.t1 > since and t.t0 < run.start]
        if history.scheduled_between(key, since, run.start):
            continue  # due at a time of its own, not by window and cap (check_schedules)
        if not burst:
            out.append(f"coalescing: {key}: refresh (token {run.token}) started with no "
                       "touch since "
                       "the previous one")
            continue
        # certainly in this burst: after the previous start, before this one, and not
        # after the last touch this claim says it covers (a touch that reached Redis
        # between the claim and the handler's start belongs to the next burst)
        certain = [t for t in burst if t.t1 < run.start and t.t0 <= run.last_touch_ms * MS
                   and (not i or t.t0 > runs[i - 1].start)
                   and not history.cancelled_between(key, t.t0, run.start)]
        if i and history.killed_between(runs[i - 1].start, run.start):
            certain = []  # a claim that no handler saw (its node was killed) may lie between
        out += _due_bounds(key, run, burst, certain, rule)
    return out


def _due_bounds(key: str, run: Run, burst: list[Touch], certain: list[Touch],
                rule: Rule) -> list[str]:
    window, cap = rule.window_ms * MS, rule.max_wait_ms * MS
    # a leading rule's refresh may be due at its burst's first touch (checked exactly by
    # tests/edges/test_leading_model.py); here only that it follows a touch and the cap
    due = burst[0].t0 + (0 if rule.leading else window)
    if certain:
        if not rule.leading:
            due = max(due, min(max(t.t0 for t in certain) + window, burst[0].t0 + cap))
        if run.due_ms * MS > min(t.t1 for t in certain) + cap + MS:
            return [f"coalescing: {key}: refresh (token {run.token}) was due {run.due_ms} ms, past "
                    f"its burst's first touch + max_wait"]
    if run.start < due - MS:
        return [f"coalescing: {key}: refresh (token {run.token}) started "
                f"{(due - run.start) / MS:.1f} ms before its burst was due"]
    return []


# -- schedule: no refresh before a key's scheduled time, unless a plain touch made it due earlier


def check_schedules(history: History, runs: dict[str, list[Run]]) -> list[str]:
    """schedule: a first try claimed after a touch with a time of its own certainly reached
    Redis is due no earlier than that time, unless a plain touch, another schedule or a
    cancel of its key may have come after it. (That a refresh follows each such touch
    is the lost-update check's: they are in ``touches``.)"""
    timed = {Touch(s.key, s.t0, s.t1) for s in history.scheduled}
    out = []
    for key in sorted({s.key for s in history.scheduled}):
        mine = [s for s in history.scheduled if s.key == key]
        plain = [t for t in history.touches_of(key) if t not in timed]
        for run in runs.get(key, []):
            out += _before_its_time(key, run, mine, plain, history)
    return out


def _before_its_time(key: str, run: Run, mine: list[Scheduled], plain: list[Touch],
                     history: History) -> list[str]:
    due = run.due_ms * MS
    before = [s for s in mine if s.t1 <= due]  # surely in Redis before the run was due
    if run.attempt != 1 or not before:
        return []
    last = max(before, key=lambda s: s.t1)
    if due >= last.due - MS:
        return []
    if any(t.t1 > last.t0 and t.t0 < run.start for t in plain) \
            or any(s is not last and s.t1 > last.t0 and s.t0 < run.start for s in mine) \
            or history.cancelled_between(key, last.t0, run.start):
        return []
    return [f"schedule: {key}: refresh (token {run.token}) was due {run.due_ms} ms, before the "
            f"time {last.due // MS} ms its touch at {last.t0}..{last.t1} us asked for"]


# -- exclusion: never two refreshes of a key at once ---------------------------------------


def check_exclusion(runs: dict[str, list[Run]]) -> list[str]:
    """exclusion: the runs of a key never overlap."""
    out = []
    for key, rs in runs.items():
        for prev, run in itertools.pairwise(rs):
            if prev.end is None or run.start < prev.end:
                out.append(f"exclusion: {key}: token {run.token} started at {run.start} "
                           "while token "
                           f"{prev.token} ran ({prev.start}..{prev.end})")
    return out


def check_tokens_grow(runs: dict[str, list[Run]]) -> list[str]:
    """exclusion: each run of a key has a larger fencing token than every run of it before
    (a store that keeps the largest token seen refuses none of them), failovers too."""
    out = []
    for key, rs in runs.items():
        for prev, run in itertools.pairwise(rs):
            if run.token <= prev.token:
                out.append(f"exclusion: {key}: token {run.token} started after token {prev.token}")
    return out


# -- retries, then a dead letter -----------------------------------------------------------


def check_retries(history: History, runs: dict[str, list[Run]], rules: dict[str, Rule],
                  rule_of: Any) -> list[str]:
    """retries: a failed try below the limit is retried with the next attempt; never more."""
    out = []
    for key, rs in runs.items():
        limit = rules[rule_of(key)].attempts
        for run in rs:
            if run.attempt > limit:
                out.append(f"retries: {key}: attempt {run.attempt} ran (the limit is {limit})")
        for prev, run in zip([*rs], [*rs[1:], None], strict=True):
            out += _successor(key, prev, run, limit, history)
    return out


def _successor(key: str, prev: Run, run: Run | None, limit: int,
               history: History) -> list[str]:
    if prev.killed_after or (run is not None and history.killed_between(prev.start, run.start)):
        return []  # a SIGKILL may cost an attempt that no handler saw
    if history.cancelled_between(key, prev.start, run.start if run else math.inf, ("pending",)):
        return []  # a cancel dropped its retry, attempts and all
    if prev.failed and prev.attempt < limit:
        if run is None or run.attempt != prev.attempt + 1:
            nxt = run.attempt if run else "none"
            return [f"retries: {key}: attempt {prev.attempt} failed ({prev.result}); the next try "
                    f"was attempt {nxt}, not {prev.attempt + 1}"]
    elif run is not None and run.attempt != 1:
        return [f"retries: {key}: attempt {run.attempt} followed a final or successful try"]
    return []


def expected_dead(history: History, runs: dict[str, list[Run]], rules: dict[str, Rule],
                  rule_of: Any) -> tuple[set[str], set[str]]:
    """(keys that must be dead-lettered now, keys whose state the history leaves open)."""
    must, unsure = set(), set()
    for key, rs in runs.items():
        last = rs[-1]
        if any(after + SETTLE_AFTER_FAILOVER > last.start for _, after in history.failovers):
            unsure.add(key)  # a claim no handler saw may have used its last attempt
            continue
        later = [t for t in history.touches_of(key) if t.t1 > last.start]
        if any(history.cancelled_between(key, t.t0) for t in later):
            unsure.add(key)  # a cancel may have dropped the re-arm of those touches
            continue
        if later and all(t.t0 > last.start for t in later):
            continue  # touched after its last try began: re-armed, not dead
        if later or (last.killed_after and last.result != "killed"):
            unsure.add(key)  # finished, then its node died: was its result recorded?
        elif last.failed and last.attempt >= rules[rule_of(key)].attempts:
            must.add(key)
    return must, unsure


def check_dead_letters(history: History, runs: dict[str, list[Run]], rules: dict[str, Rule],
                       rule_of: Any, dead: list[dict[str, Any]]) -> list[str]:
    """retries: exactly the keys whose last try failed at the limit are dead, after that many."""
    must, unsure = expected_dead(history, runs, rules, rule_of)
    listed = {d["key"]: d for d in dead}
    out = [f"retries: {key} exhausted its retries but is not dead-lettered"
           for key in sorted(must - set(listed))]
    for key, entry in sorted(listed.items()):
        limit = rules[rule_of(key)].attempts
        if key not in must and key not in unsure:
            out.append(f"retries: {key} is dead-lettered, but its last try did not fail at "
                       f"attempt {limit}")
        elif key not in unsure and entry["attempts"] != limit:
            out.append(f"retries: {key} is dead-lettered after {entry['attempts']} attempts, "
                       f"not {limit}")
    return out


def timeline(history: History, runs: dict[str, list[Run]], key: str) -> str:
    """One key's touches, runs and kills in time order, in ms from its first event."""
    events: list[tuple[int, str]] = [(t.t0, f"touch (reached Redis by +{(t.t1 - t.t0) / MS:.1f})")
                                     for t in history.touches_of(key)]
    events += [(t.t0, f"touch with item {t.item!r} (by +{(t.t1 - t.t0) / MS:.1f}, tokens "
                      f"{t.seq0}..{t.seq1})") for t in history.item_touches if t.key == key]
    for r in runs.get(key, []):
        got = f", items {list(r.items)}{' overflowed' if r.overflowed else ''}" if (
            r.items or r.overflowed) else ""
        events.append((r.start, f"start token {r.token} attempt {r.attempt} pid {r.pid} "
                                f"(due {r.due_ms}, last touch {r.last_touch_ms}{got})"))
        if r.end is not None:
            events.append((r.end, f"end token {r.token}: {r.result}"))
    events += [(when, f"SIGKILL pid {pid}") for pid, when in history.kills]
    for before, after in history.failovers:
        events += [(before, "failover: replica cut off"), (after, "failover: flushed after it")]
    events += [(s.t0, f"schedule for {s.due // MS} ms") for s in history.scheduled
               if s.key == key]
    events += [(c.t0, f"cancel (found {c.state}, done by +{(c.t1 - c.t0) / MS:.1f})")
               for c in history.cancels if c.key == key]
    events.sort()
    origin = events[0][0] if events else 0
    return "\n".join(f"  {(t - origin) / MS:9.1f} ms  {what}" for t, what in events)


# -- cancels: a cancelled pending key runs again only after a new touch --------------------


def check_cancels(history: History, runs: dict[str, list[Run]]) -> list[str]:
    """What a cancel dropped stays dropped.

    A key that a cancel found pending (its refresh, or retry, dropped) is refreshed again
    only for a touch that came after that cancel began. After any cancel, a first try
    that covers only touches made before it starts only if it is the refresh that was
    running then (which finishes as usual, and logs its start a moment after its claim):
    one at most, and only when the key was running (with a re-arm dropped or not).
    """
    out = []
    for c in history.cancels:
        if c.state == "pending":
            out += _refreshed_without_touch(c, history.touches_of(c.key), runs.get(c.key, []))
        stale = [r for r in runs.get(c.key, []) if r.start > c.t1 and r.attempt == 1
                 and r.last_touch_ms * MS < c.t0 - MS]
        allowed = 1 if c.state in ("running", "rearm", "buffered") else 0
        if len(stale) > allowed:
            out.append(f"cancel: {c.key} was cancelled at {c.t0}..{c.t1} us (found "
                       f"{c.state}), yet tokens {[r.token for r in stale]} started after it "
                       f"for touches made before it")
    return out


def _refreshed_without_touch(c: Cancel, touches: list[Touch], runs: list[Run]) -> list[str]:
    return [f"cancel: {c.key} was cancelled while pending at {c.t0}..{c.t1} us, yet token "
            f"{run.token} (attempt {run.attempt}) started at {run.start} with no touch since"
            for run in runs
            if run.start > c.t1 and not any(t.t1 > c.t0 and t.t0 < run.start for t in touches)]


# -- rates: no more refresh starts than a rule's rate allows -------------------------------


def check_rate(runs: dict[str, list[Run]], rule_of: Any, rule: str, per_second: float,
               burst: int) -> list[str]:
    """A rule's refresh starts (every attempt, on every node) in any one second of the
    server clock number at most ``per_second`` plus the bucket's ``burst``, plus one: a
    handler logs its start a moment after the claim that took the token, and a stalled
    process can log two starts closer together than their tokens were granted."""
    starts = sorted(r.start for key, rs in runs.items() if rule_of(key) == rule for r in rs)
    most, first = 0, 0
    for i, t in enumerate(starts):
        while starts[first] <= t - 1_000_000:
            first += 1
        most = max(most, i - first + 1)
    allowed = math.floor(per_second) + burst + 1
    if most > allowed:
        return [f"rate: rule {rule} started {most} refreshes within one second "
                f"(at most {allowed})"]
    return []


# -- items: each reaches the first refresh claimed after its touch -------------------------


def check_group_cap(runs: dict[str, list[Run]], rule_of: Any, rule: str, cap: int) -> list[str]:
    """fair: the runs of one group (a key's second ':' segment, the rules' fair capture)
    of ``rule`` never number more than ``cap`` at once, from their start to their end
    (a SIGKILLed node's run ends at the kill; one with no end runs on)."""
    events: dict[str, list[tuple[float, int, str]]] = defaultdict(list)
    for key, rs in runs.items():
        if rule_of(key) != rule:
            continue
        group = key.split(":")[1]
        for run in rs:
            events[group].append((run.start, 1, key))
            events[group].append((math.inf if run.end is None else run.end, -1, key))
    out = []
    for group, evs in events.items():
        going = 0
        for t, step, key in sorted(evs, key=lambda e: (e[0], e[1])):  # ends first
            going += step
            if going > cap:
                out.append(f"fair: group {group} of rule {rule}: {going} runs at once at "
                           f"{t} (its cap is {cap}), the last {key}")
    return out


def check_items(history: History, runs: dict[str, list[Run]]) -> list[str]:
    """Every item touched reaches exactly the first refresh claimed after its touch (or
    that refresh is told the items overflowed), and again each try after a failed one
    until one succeeds; never a refresh claimed before its touch; a refresh gets only
    items touched with its key, each once."""
    out = []
    for touch in history.item_touches:
        key_runs = runs.get(touch.key, [])
        if _cancelled_after(history, touch) or _scheduled_after(history, touch, key_runs):
            out += _early(touch, key_runs)  # dropped (or not): only an early refresh is wrong
        else:
            out += _item_path(touch, key_runs)
    touched = {(t.key, t.item) for t in history.item_touches}
    for key, rs in runs.items():
        for run in rs:
            if len(set(run.items)) != len(run.items):
                out.append(f"items: {key}: token {run.token} got an item twice: {run.items}")
            out += [f"items: {key}: token {run.token} got {item!r}, never touched with it"
                    for item in run.items if (key, item) not in touched]
    return out


def _cancelled_after(history: History, touch: ItemTouch) -> bool:
    """Whether a cancel that dropped something in Redis may have come after ``touch``
    (a cancel drops the items touched before it, with the refresh they were for)."""
    return any(c.key == touch.key and c.t1 >= touch.t0 and c.state in ("pending", "rearm")
               for c in history.cancels)


def _scheduled_after(history: History, touch: ItemTouch, runs: list[Run]) -> bool:
    """Whether a touch with a time of its own may have come after ``touch`` and before
    the first refresh surely claimed after it: it replaces the key's pending items (a
    failed try's stay), as a re-created task its payload."""
    later = [r.start for r in runs if r.token > touch.seq1]
    until = min(later) if later else math.inf
    return any(s.key == touch.key and s.t1 >= touch.t0 and s.t0 <= until
               for s in history.scheduled)


def _name(touch: ItemTouch) -> str:
    return f"items: {touch.key} item {touch.item!r} (touched {touch.t0}..{touch.t1} us)"


def _early(touch: ItemTouch, runs: list[Run]) -> list[str]:
    early = [r.token for r in runs if r.token <= touch.seq0 and touch.item in r.items]
    if early:
        return [f"{_name(touch)} reached token {early[0]}, claimed before it was touched"]
    return []


def _item_path(touch: ItemTouch, runs: list[Run]) -> list[str]:
    name = _name(touch)
    early = _early(touch, runs)
    if early:
        return early
    holder: Run | None = None  # the last run it reached (or whose overflow stood for it)
    certain = True  # whether it surely was pending until ``holder``'s claim
    for run in (r for r in runs if r.token > touch.seq0):
        has = touch.item in run.items
        if holder is None:
            if has or run.overflowed:
                holder, certain = run, has or run.token > touch.seq1
            elif run.token > touch.seq1:
                return [f"{name}: the first refresh claimed after it (token {run.token}) "
                        "neither got it nor was told items overflowed"]
            continue
        problem, holder = _next_try(name, holder, run, has, certain)
        if problem or holder is None:
            return problem
        certain = True
    return [] if holder is not None else [f"{name}: no refresh ever got it"]


def _next_try(name: str, holder: Run, run: Run, has: bool,
              certain: bool) -> tuple[list[str], Run | None]:
    """After ``holder`` got the item, what ``run`` (the next claim) must get: nothing once
    ``holder`` surely succeeded, the item (or an overflow) again after a failed try."""
    done = holder.result == "ok" and not holder.killed_after
    if done or not certain:
        if has and done and certain:
            return [f"{name}: delivered again to token {run.token} after token "
                    f"{holder.token} succeeded"], None
        return [], run if has else None
    if holder.result == "ok":  # its node died after it: was its success recorded?
        return [], run if has else None
    if has or run.overflowed:
        return [], run
    return [f"{name}: token {holder.token} failed ({holder.result}), and the next try "
            f"(token {run.token}) neither got it again nor was told items overflowed"], None
