"""Many threads touching at once (a threaded web server's request threads): nothing
accepted is lost, each key is written once, in few calls, the writers do not queue on
a lock while the buffer has room, and a full buffer still refuses; on a real
valkey-server."""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from types import TracebackType
from typing import Any

import pytest

from coalescer import BackpressureError, Coalescer, SyncCoalescer
from coalescer.store.keys import KeySpace
from coalescer.write.absorber import YIELD_BACKLOG, YIELD_EVERY, Absorber
from tests.conftest import RulesFactory
from tests.helpers.servers import ValkeyProcess

RULES = """\
namespace: {ns}
defaults: {{window: 1h, max_wait: 2h, absorb: 50ms}}
rules:
  - name: item
    match: "item:{{id}}"
    handler: handlers:refresh
"""

HANDLERS = """\
async def refresh(claim):
    pass
"""

THREADS = 16
KEYS_PER_THREAD = 1_250  # 20,000 keys between them


def writer(rules_file: RulesFactory, namespace: str, url: str, **options: Any) -> SyncCoalescer:
    path = rules_file(RULES.format(ns=namespace), HANDLERS)
    return SyncCoalescer.from_yaml(path, redis_url=url, worker=False, **options)


def absorber_of(sc: SyncCoalescer) -> Absorber:
    absorber: Absorber = sc.coalescer._run.absorber
    return absorber


def run_threads(write: Callable[[int], None]) -> None:
    """Run ``write(n)`` in THREADS threads released at once; re-raise the first error."""
    go = threading.Barrier(THREADS)
    errors: list[BaseException] = []

    def body(n: int) -> None:
        try:
            go.wait()
            write(n)
        except BaseException as exc:  # reported by the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=body, args=(n,), name=f"writer-{n}")
               for n in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


def keys_of(n: int) -> list[str]:
    return [f"item:{n}-{i}" for i in range(KEYS_PER_THREAD)]


def touching(sc: SyncCoalescer) -> Callable[[int], None]:
    """Thread ``n``'s request path: touch each of its keys once."""
    def write(n: int) -> None:
        for key in keys_of(n):
            sc.touch(key)
    return write


def upsert_calls(server: ValkeyProcess) -> int:
    stats = server.client().info("commandstats")
    return sum(int(stats.get(f"cmdstat_{name}", {}).get("calls", 0))
               for name in ("evalsha", "eval"))


def test_sixteen_threads_touching_distinct_keys_lose_none_and_write_each_once(
        rules_file: RulesFactory, namespace: str, own_server: ValkeyProcess) -> None:
    due = KeySpace(namespace, 1).shard(0).due("item")
    with writer(rules_file, namespace, own_server.url) as sc:
        calls_before = upsert_calls(own_server)
        run_threads(touching(sc))
        sc.flush()
        calls = upsert_calls(own_server) - calls_before
        absorber = absorber_of(sc)
        sample = sc.coalescer.metrics.registry.get_sample_value
        written = sample("coalescer_flush_batch_keys_sum")
        assert (absorber.fresh, absorber.absorbed, len(absorber)) == (20_000, 0, 0)
    held = set(own_server.client().zrange(due, 0, -1))
    assert held == {key for n in range(THREADS) for key in keys_of(n)}
    assert written == 20_000  # every key in one batch written once, none twice
    assert calls <= 20_000 // 20  # keys grouped into calls, not a round trip a touch


class CountingLock:
    """The absorber's lock, counting the acquisitions by the writer threads."""

    def __init__(self, lock: Any) -> None:
        self._lock = lock
        self.by_writers = 0

    def __enter__(self) -> bool:
        if threading.current_thread().name.startswith("writer-"):
            self.by_writers += 1
        entered: bool = self._lock.__enter__()
        return entered

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._lock.__exit__(kind, exc, tb)


def test_threads_touching_new_keys_take_no_lock_while_the_buffer_has_room(
        rules_file: RulesFactory, namespace: str, redis_url: str) -> None:
    with writer(rules_file, namespace, redis_url) as sc:
        absorber = absorber_of(sc)
        counting = CountingLock(absorber._lock)
        absorber._lock = counting  # type: ignore[assignment]
        run_threads(touching(sc))
        sc.flush()
        assert absorber.fresh == 20_000
    assert counting.by_writers == 0


def test_a_full_buffer_refuses_threads_and_keeps_every_key_it_accepted(
        rules_file: RulesFactory, namespace: str, own_server: ValkeyProcess) -> None:
    bound = 200
    accepted: list[list[str]] = [[] for _ in range(THREADS)]
    refused = [0] * THREADS

    def write(n: int) -> None:
        for key in keys_of(n):
            try:
                sc.touch(key)
            except BackpressureError:
                refused[n] += 1
                return
            accepted[n].append(key)

    with writer(rules_file, namespace, own_server.url, max_buffered=bound) as sc:
        own_server.stop()  # nothing can be written: the buffer fills
        run_threads(write)
        taken = [key for keys in accepted for key in keys]
        # exact under the lock near the bound; a thread switched out between its check
        # and its insert far from it may add one key past it
        assert bound <= len(taken) <= bound + THREADS
        assert len(absorber_of(sc)) == len(taken)
        assert sum(refused) == THREADS  # every thread met the full buffer
        own_server.start()
        sc.flush(timeout=20)
    due = KeySpace(namespace, 1).shard(0).due("item")
    assert set(own_server.client().zrange(due, 0, -1)) == set(taken)


@pytest.fixture
def yields(monkeypatch: pytest.MonkeyPatch) -> Iterator[Counter[str]]:
    """``time.sleep(0)`` calls (GIL yields) by thread name, made while the test runs."""
    counted: Counter[str] = Counter()
    sleep = time.sleep

    def counting(seconds: float) -> None:
        if seconds == 0:
            counted[threading.current_thread().name] += 1
        sleep(seconds)

    monkeypatch.setattr(time, "sleep", counting)
    yield counted


def test_touching_threads_yield_the_gil_while_keys_pile_up_unwritten(
        rules_file: RulesFactory, namespace: str, own_server: ValkeyProcess,
        yields: Counter[str]) -> None:
    with writer(rules_file, namespace, own_server.url) as sc:
        own_server.stop()  # the keys pile up in the buffer
        run_threads(touching(sc))
        by_writers = sum(n for name, n in yields.items() if name.startswith("writer-"))
        own_server.start()
        sc.flush(timeout=20)
    # at most once every YIELD_EVERY new keys (the counter is shared, unlocked), while
    # more than YIELD_BACKLOG keys wait in the buffer (not in a write in flight)
    assert 0 < by_writers <= THREADS * KEYS_PER_THREAD // YIELD_EVERY + THREADS


async def test_touches_on_the_flushers_own_loop_never_yield(
        rules_file: RulesFactory, namespace: str, own_server: ValkeyProcess,
        yields: Counter[str]) -> None:
    path = rules_file(RULES.format(ns=namespace), HANDLERS)
    async with Coalescer.from_yaml(path, redis_url=own_server.url, worker=False) as c:
        own_server.stop()
        for n in range(THREADS):
            for key in keys_of(n):
                c.touch(key)
        assert len(c._run.absorber) == THREADS * KEYS_PER_THREAD > YIELD_BACKLOG
        assert yields[threading.current_thread().name] == 0
        own_server.start()
        await c.flush()
