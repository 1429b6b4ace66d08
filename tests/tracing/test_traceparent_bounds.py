"""A producer's ``traceparent`` is read only when it is no longer than any version of
the format can be: a longer one is left out before it is decoded or split."""

from __future__ import annotations

import pytest

from coalescer.common.traceparent import MAX_TRACEPARENT, read_traceparent
from coalescer.tracing.touches import span_context

GOOD = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


class Watched(str):
    """A header that counts the calls that would read it whole."""

    reads = 0

    def strip(self, chars: str | None = None) -> str:
        Watched.reads += 1
        return str.strip(self, chars)

    def split(self, sep: str | None = None, maxsplit: int = -1) -> list[str]:
        Watched.reads += 1
        return str.split(self, sep, maxsplit)


def test_a_traceparent_reads() -> None:
    ctx = span_context(GOOD)
    assert ctx is not None and f"{ctx.span_id:016x}" == "b7ad6b7169203331"
    assert read_traceparent(GOOD.encode()) == GOOD


@pytest.mark.parametrize("size", [MAX_TRACEPARENT + 1, 10 * MAX_TRACEPARENT, 1 << 20])
def test_a_long_traceparent_is_left_out_unread(size: int) -> None:
    Watched.reads = 0
    hostile = Watched(GOOD + "-" * (size - len(GOOD)))
    assert span_context(hostile) is None
    assert Watched.reads == 0
    assert read_traceparent(b"\xff" * size) is None  # never decoded


def test_a_traceparent_at_the_bound_is_read_whole() -> None:
    Watched.reads = 0
    assert span_context(Watched(GOOD + " " * (MAX_TRACEPARENT - len(GOOD)))) is not None
    assert Watched.reads >= 1
