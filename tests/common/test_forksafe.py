"""Repair after a fork made without Python's hooks (libc ``fork()`` from C)."""

from __future__ import annotations

import logging
import os
import threading

import pytest

from coalescer.common import forksafe
from tests.helpers.forks import LIBC_FORK, child_exit_code, exit_code_in_fresh_interpreter


class Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def listening() -> Records:
    records = Records()
    logger = logging.getLogger("coalescer.common.forksafe")
    logger.addHandler(records)
    logger.setLevel(logging.INFO)
    return records


def hooks_run_once_after_a_libc_fork() -> int:
    hook_ran_in: list[int] = []
    os.register_at_fork(after_in_child=lambda: hook_ran_in.append(os.getpid()))

    def child() -> None:
        records = listening()
        assert hook_ran_in == []  # libc fork() skipped it
        assert forksafe.repair_after_foreign_fork() is True
        assert forksafe.repair_after_foreign_fork() is False
        assert hook_ran_in == [os.getpid()]
        assert records.messages == [
            f"process {os.getpid()}: forked without Python's fork hooks; ran them now"]
    return child_exit_code(child, LIBC_FORK)


def test_a_libc_fork_gets_pythons_after_fork_repair_once() -> None:
    assert exit_code_in_fresh_interpreter(hooks_run_once_after_a_libc_fork) == 0


def test_nothing_to_repair_after_os_fork_or_in_the_parent() -> None:
    def child() -> None:
        assert forksafe.repair_after_foreign_fork() is False
    assert forksafe.repair_after_foreign_fork() is False
    assert child_exit_code(child, os.fork) == 0


def a_threaded_libc_child_is_left_alone() -> int:
    def child() -> None:
        records = listening()
        release = threading.Event()
        other = threading.Thread(target=release.wait)
        other.start()
        try:
            assert forksafe.repair_after_foreign_fork() is False
        finally:
            release.set()
            other.join()
        assert len(records.messages) == 1
        assert "without Python's fork hooks and has 2 threads" in records.messages[0]
        assert "py-call-osafterfork" in records.messages[0]
        assert forksafe.repair_after_foreign_fork() is False  # warned once
    return child_exit_code(child, LIBC_FORK)


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads in /proc")
def test_a_libc_forked_child_already_running_threads_is_left_alone_with_a_warning() -> None:
    assert exit_code_in_fresh_interpreter(a_threaded_libc_child_is_left_alone) == 0
