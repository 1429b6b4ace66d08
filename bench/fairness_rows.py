"""The table rows of the fairness groups (``bench/fairness.py``, ``bench/fairness_cap.py``):
``fair`` on in the coalescer column, ``fair`` off (the same run) in the baseline column."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from . import fairness as FR
from . import fairness_cap as CAP


class Table(Protocol):
    """What these rows need of ``bench.run.Rows``."""

    sizes: Any

    def spread(self, where: str, field: str) -> Any: ...

    def figure(self, figure: str, c: Any, b: Any, *, fmt: Callable[[float], str],
               target: str = "-", ok: Callable[[float], bool] | None = None,
               peers: str = "") -> None: ...


def _ms(v: float) -> str:
    return f"{v:,.1f} ms" if v < 1000 else f"{v / 1000:,.2f} s"


def _rate(v: float) -> str:
    return f"{v / 1000:.3g}k" if v >= 1000 else f"{v:.3g}"


def _pct(v: float) -> str:
    return f"{v:.1f} %"


def _bytes(v: float) -> str:
    return f"{v:,.0f} B"


def _count(v: float) -> str:
    return f"{v:,.0f}"


def _at_most(ceiling: float) -> Callable[[float], bool]:
    return lambda c: c <= ceiling


def rows(t: Table) -> None:
    fs = FR.sizes_of(t.sizes)
    _skew_rows(t, fs)
    _skew_work_rows(t, fs)
    _balanced_rows(t)
    _weights_rows(t, fs)
    _cap_rows(t, fs)
    _herd_rows(t, fs)
    _memory_rows(t, fs)


def _skew_rows(t: Table, fs: FR.FairSizes) -> None:
    head = (f"tenant a imports {fs.fair_import:,} keys, tenant b touches a key every "
            f"{FR.B_EVERY:g} s")
    for p in ("p50", "p99"):
        gate = p == "p99"
        t.figure(f"{head}: b's start lag {p}, fair (beside: fair off)",
                 t.spread("fair_skew.coalescer", f"b.{p}"),
                 t.spread("fair_skew.baseline", f"b.{p}"), fmt=_ms,
                 target="<= 50 ms" if gate else "-", ok=(lambda c: c <= 50) if gate else None)
    t.figure(f"{head}: b's start lag p99 with the import in another rule, no fair (beside: "
             "the import in b's rule, fair off)", t.spread("fair_skew.apart", "b.p99"),
             t.spread("fair_skew.baseline", "b.p99"), fmt=_ms)
    off = t.spread("fair_skew.baseline", "a.per_second")
    floor = 0.95 * off.median if off else float("inf")
    t.figure(f"{head}: a's import drained, keys/s, fair (beside: fair off)",
             t.spread("fair_skew.coalescer", "a.per_second"), off, fmt=_rate,
             target=">= 0.95x fair off", ok=lambda c: c >= floor)


def _skew_work_rows(t: Table, fs: FR.FairSizes) -> None:
    head = (f"tenant a imports {fs.fair_import_work:,} keys to a handler that waits "
            f"{FR.WORK_MS:g} ms, tenant b touches a key every {FR.B_EVERY:g} s")
    t.figure(f"{head}: b's start lag p99, fair (beside: fair off)",
             t.spread("fair_skew_work.coalescer", "b.p99"),
             t.spread("fair_skew_work.baseline", "b.p99"), fmt=_ms)
    t.figure(f"{head}: a's import drained, keys/s, fair (beside: fair off)",
             t.spread("fair_skew_work.coalescer", "a.per_second"),
             t.spread("fair_skew_work.baseline", "a.per_second"), fmt=_rate)


def _balanced_rows(t: Table) -> None:
    head = f"{FR.BALANCED_TENANTS} tenants with equal imports"
    for p in ("p50", "p99"):
        off = t.spread("fair_balanced.baseline", p)
        gate = p == "p99"
        t.figure(f"{head}: the worst tenant's start lag {p}, fair (beside: fair off)",
                 t.spread("fair_balanced.coalescer", p), off, fmt=_ms,
                 target="<= 1.1x fair off" if gate else "-",
                 ok=_at_most(1.1 * off.median) if gate and off else None)
    t.figure(f"{head}: drained, keys/s, fair (beside: fair off)",
             t.spread("fair_balanced.coalescer", "per_second"),
             t.spread("fair_balanced.baseline", "per_second"), fmt=_rate)


def _weights_rows(t: Table, fs: FR.FairSizes) -> None:
    shape = ":".join(str(w) for w in FR.WEIGHTS.values())
    t.figure(f"weights {shape}, all backlogged: the largest share error over the first "
             f"{fs.fair_weights:,} claims, fair (beside: fair off)",
             t.spread("fair_weights.coalescer", "max_error_percent"),
             t.spread("fair_weights.baseline", "max_error_percent"), fmt=_pct,
             target="<= 5 %", ok=lambda c: c <= 5)


def _cap_rows(t: Table, fs: FR.FairSizes) -> None:
    t.figure(f"max_running: {CAP.CAP} over {CAP.NODES} node processes, {fs.cap_claims:,} "
             "claims: moments with more runs of a tenant than the cap (beside: fair off)",
             t.spread("fair_cap.coalescer", "over_cap_moments"),
             t.spread("fair_cap.baseline", "over_cap_moments"), fmt=_count,
             target="0", ok=lambda c: c == 0)
    t.figure("max_running: the most runs of one tenant at once (beside: fair off)",
             t.spread("fair_cap.coalescer", "max_running_seen"),
             t.spread("fair_cap.baseline", "max_running_seen"), fmt=_count)


def _herd_rows(t: Table, fs: FR.FairSizes) -> None:
    head = (f"{fs.herd:,} keys of one rule due in the same second: another rule's start "
            "lag")
    for p in ("p50", "p99"):
        gate = p == "p99"
        t.figure(f"{head} {p} while they drain (beside: no herd)",
                 t.spread("herd.coalescer", f"during_herd.{p}"),
                 t.spread("herd.baseline", p), fmt=_ms, target="<= 20 ms" if gate else "-",
                 ok=(lambda c: c <= 20) if gate else None)
    t.figure(f"{fs.herd:,} keys of one rule due in the same second: drained, keys/s",
             t.spread("herd.coalescer", "herd_drain.per_second"), None, fmt=_rate)


def _memory_rows(t: Table, fs: FR.FairSizes) -> None:
    keys = f"{fs.memory_keys:,} keys over {FR.MEMORY_TENANTS} tenants"
    t.figure(f"Redis memory per pending key, {keys}, scheduled an hour ahead, fair (beside: "
             "fair off)", t.spread("fair_memory.coalescer", "pending_bytes_per_key"),
             t.spread("fair_memory.baseline", "pending_bytes_per_key"), fmt=_bytes,
             target="<= 150 B", ok=lambda c: c <= 150)
    t.figure(f"Redis memory per pending key, {keys}, due within the window, each in its "
             "tenant's queue, fair (beside: fair off)", t.spread("fair_memory.coalescer",
                                                         "bytes_per_key"),
             t.spread("fair_memory.baseline", "bytes_per_key"), fmt=_bytes)
    t.figure(f"Redis memory per due key, {fs.fair_groups:,} tenants of one key each, fair "
             "(beside: fair off; the difference is a tenant's cost)",
             t.spread("fair_memory.coalescer", "bytes_per_group_key"),
             t.spread("fair_memory.baseline", "bytes_per_group_key"), fmt=_bytes)
