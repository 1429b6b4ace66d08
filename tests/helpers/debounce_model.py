"""Reference models of a leading-edge debounce, per key, for the property tests.

``lodash_debounce`` is a port of lodash's ``debounce(f, wait, {leading: true, trailing:
true, maxWait})``: calls at given times, each invoke made at once (a function call
takes no time), with a trailing invoke only when a call came after the leading one.

``LeadingKey`` is the same contract as a coalescer key of a rule with ``edge: leading``
meets it, where a refresh is claimed by a poller and takes time:

- a touch of a quiet key (no touch of it within the window before, and no refresh of it
  waiting) is due at once: the leading refresh; touches before that refresh is claimed
  join it;
- touches after a refresh was claimed (while it runs, or after it ended but within the
  window of the last touch) make a trailing burst, due ``min(last + window, first +
  max_wait)``, ``first`` the burst's first touch; touches before its claim join it;
- a refresh starts when the poller claims it (at or after its due time) and only when
  none of the key runs.

With instant refreshes claimed at their due time, and bursts that never reach
max_wait, the two agree (a test holds them to that). The one deliberate difference:
lodash counts max_wait from its last invoke; a key counts it from the burst's first
touch after its last refresh was claimed, as a trailing rule does.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Run:
    """One refresh: when it started, the due time it had, the touches it covers."""

    start: float
    due: float
    labels: tuple[str, ...]
    leading: bool


def lodash_debounce(calls: Sequence[tuple[float, str]], wait: float,
                    max_wait: float) -> list[Run]:
    """The invokes of lodash's leading+trailing debounce with maxWait over ``calls``
    ((time, label), times strictly increasing, none equal to a timer's expiry): each
    with the labels of the calls since the previous invoke."""
    state = _Lodash(wait, max_wait)
    for time, label in calls:
        state.run_timers_until(time)
        state.call(time, label)
    state.run_timers_until(float("inf"))
    return state.runs


@dataclass
class _Lodash:
    wait: float
    max_wait: float
    last_call: float | None = None
    last_invoke: float = 0.0
    timer: float | None = None
    args: list[str] = field(default_factory=list)
    runs: list[Run] = field(default_factory=list)

    def should_invoke(self, time: float) -> bool:
        if self.last_call is None:
            return True
        since_call, since_invoke = time - self.last_call, time - self.last_invoke
        return since_call >= self.wait or since_call < 0 or since_invoke >= self.max_wait

    def remaining(self, time: float) -> float:
        assert self.last_call is not None
        return min(self.wait - (time - self.last_call),
                   self.max_wait - (time - self.last_invoke))

    def invoke(self, time: float, leading: bool) -> None:
        self.runs.append(Run(time, time, tuple(self.args), leading))
        self.args = []
        self.last_invoke = time

    def call(self, time: float, label: str) -> None:
        invoking = self.should_invoke(time)
        self.args.append(label)
        self.last_call = time
        if invoking:
            if self.timer is None:  # leadingEdge
                self.last_invoke = time
                self.timer = time + self.wait
                self.invoke(time, leading=True)
                return
            self.timer = time + self.wait  # maxing
            self.invoke(time, leading=False)
            return
        if self.timer is None:
            self.timer = time + self.wait

    def run_timers_until(self, until: float) -> None:
        while self.timer is not None and self.timer < until:
            time = self.timer
            if self.should_invoke(time):  # trailingEdge
                self.timer = None
                if self.args:
                    self.invoke(time, leading=False)
            else:
                self.timer = time + self.remaining(time)


@dataclass
class LeadingKey:
    """One key of a rule with ``edge: leading`` (see the module's docstring). Feed it
    events in time order: ``touch``, ``poll`` (the poller claims what is due) and
    ``finish`` (the running refresh ends)."""

    window: float
    max_wait: float
    last_touch: float | None = None
    due: float | None = None  # of the refresh waiting to be claimed
    first: float = 0.0  # the waiting burst's first touch
    leading: bool = False  # the waiting refresh is a leading one
    labels: list[str] = field(default_factory=list)
    running: Run | None = None
    runs: list[Run] = field(default_factory=list)

    def quiet(self, time: float) -> bool:
        return self.last_touch is None or time - self.last_touch >= self.window

    def touch(self, time: float, label: str) -> None:
        quiet = self.quiet(time)
        self.last_touch = time
        self.labels.append(label)
        if self.due is not None and self.leading:
            return  # joins the leading refresh, not claimed yet
        if self.due is not None:
            self.due = max(self.due, min(time + self.window, self.first + self.max_wait))
            return
        self.first = time
        self.leading = quiet and self.running is None
        self.due = time if self.leading else time + self.window

    def poll(self, time: float) -> Run | None:
        """The refresh the poller claims at ``time``, if one is due and none runs."""
        if self.running is not None or self.due is None or self.due > time:
            return None
        run = Run(time, self.due, tuple(self.labels), self.leading)
        self.runs.append(run)
        self.running, self.due, self.labels, self.leading = run, None, [], False
        return run

    def finish(self) -> None:
        self.running = None

    def next_due(self) -> float | None:
        return None if self.running is not None else self.due


def instant_runs(touches: Sequence[tuple[float, str]], window: float,
                 max_wait: float) -> list[Run]:
    """``LeadingKey`` with each refresh claimed at its due time and taking no time."""
    key = LeadingKey(window, max_wait)
    events = [(t, 1, label) for t, label in touches]
    heapq.heapify(events)
    while events or key.due is not None:
        due = key.next_due()
        if due is not None and (not events or due <= events[0][0]):
            key.poll(due)
            key.finish()
            continue
        time, _, label = heapq.heappop(events)
        key.touch(time, label)
        key.poll(time)  # a leading refresh starts at its touch
        key.finish()
    return key.runs
