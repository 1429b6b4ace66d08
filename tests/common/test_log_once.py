"""A line per kind of event at most once a minute, with the count left out."""

from __future__ import annotations

import logging

import pytest

from coalescer.common.log_once import KINDS, LogOnce


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [record.getMessage() for record in caplog.records]


def test_one_line_per_kind_per_minute(caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    once = LogOnce(logging.getLogger("t.log_once"), clock=clock)
    caplog.set_level(logging.WARNING, logger="t.log_once")
    logged = [once.warning("a", "bad %s", n) for n in range(1000)]
    assert logged == [True] + [False] * 999
    assert once.warning("b", "other %s", 1)  # another kind has its own minute
    clock.now += 59.9
    assert not once.warning("a", "bad %s", "late")
    clock.now += 0.1
    assert once.warning("a", "bad %s", "again")
    assert lines(caplog) == ["bad 0", "other 1",
                             "bad again (and 1000 more like it, not logged, since the "
                             "last such line)"]


def test_the_kinds_remembered_are_bounded(caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    once = LogOnce(logging.getLogger("t.log_once"), clock=clock)
    for n in range(KINDS * 3):
        clock.now += 0.001
        assert once.warning(f"kind-{n}", "x")
    assert len(once._window) == KINDS


def test_a_kind_may_have_a_few_lines_a_minute(caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    once = LogOnce(logging.getLogger("t.log_once"), lines=3, clock=clock)
    caplog.set_level(logging.WARNING, logger="t.log_once")
    assert [once.warning("a", "n=%d", n) for n in range(10)] == [True] * 3 + [False] * 7
    clock.now += 60
    assert once.warning("a", "n=%d", 10)
    assert lines(caplog) == ["n=0", "n=1", "n=2",
                             "n=10 (and 7 more like it, not logged, since the last such line)"]
