"""Many threads touching at once (a threaded web server's request threads): nothing
accepted is lost, each key is written once, in few calls, the writers do not queue on
a lock while the buffer has room, a full buffer still refuses, and touches pause for
the background writer only while it lags behind and Redis takes writes; on a real
valkey-server."""

from __future__ import annotations

import threading
from collections.abc import Callable
from types import TracebackType
from typing import Any

from coalescer import BackpressureError, Coalescer, SyncCoalescer
from coalescer.store.keys import KeySpace
from coalescer.write.absorber import Absorber
from coalescer.write.backpressure import GATE_BACKLOG
from tests.conftest import RulesFactory
from tests.helpers.servers import ValkeyProcess, poll_until

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


def held_loop(sc: SyncCoalescer) -> threading.Event:
    """Keep the SyncCoalescer's event loop (its background writer) busy until the
    returned event is set: it takes no batch meanwhile."""
    loop = sc._loop
    assert loop is not None
    busy, release = threading.Event(), threading.Event()

    def hold() -> None:
        busy.set()
        release.wait(30)

    loop.call_soon_threadsafe(hold)
    busy.wait(5)
    return release


def test_a_touch_pauses_for_the_writer_once_thousands_of_keys_came_in_since_its_last_batch(
        rules_file: RulesFactory, namespace: str, own_server: ValkeyProcess) -> None:
    over = 10
    keys = [f"item:{i}" for i in range(GATE_BACKLOG + over)]
    with writer(rules_file, namespace, own_server.url) as sc:
        absorber = absorber_of(sc)
        release = held_loop(sc)
        for key in keys:
            sc.touch(key)
        paused = absorber.waited_for_take
        for key in keys:  # buffered already: absorbed, never a pause
            sc.touch(key)
        assert absorber.waited_for_take == paused
        release.set()
        sc.flush()
        sc.coalescer.sync_metrics()
        sample = sc.coalescer.metrics.registry.get_sample_value
        assert sample("coalescer_touch_flusher_waits_total") == paused
    assert paused == over  # each new key past the backlog, none before it
    due = KeySpace(namespace, 1).shard(0).due("item")
    assert own_server.client().zcard(due) == len(keys)


def test_keys_held_after_their_write_do_not_make_touches_pause(
        rules_file: RulesFactory, namespace: str, own_server: ValkeyProcess) -> None:
    path = rules_file(RULES.format(ns=namespace).replace("absorb: 50ms", "absorb: 30m"),
                      HANDLERS)
    keys = [f"item:{i}" for i in range(GATE_BACKLOG + 1000)]
    with SyncCoalescer.from_yaml(path, redis_url=own_server.url, worker=False) as sc:
        sc.touch_many(keys)
        sc.flush()
        for key in keys:  # each held for 30 minutes: the writer finds nothing ready to take
            sc.touch(key)
        absorber = absorber_of(sc)
        assert absorber.fresh == 2 * len(keys)
        # each empty take the writer makes restarts the count: a touch waits only where
        # the writer had no turn for 4,000 new keys (once, on a loaded machine), not for
        # each of the 1,000 touches past them (as when only a batch with keys counted)
        assert absorber.waited_for_take <= 10


def test_sixteen_threads_pause_for_the_writer_and_lose_nothing(
        rules_file: RulesFactory, namespace: str, own_server: ValkeyProcess) -> None:
    with writer(rules_file, namespace, own_server.url) as sc:
        absorber = absorber_of(sc)
        release = held_loop(sc)

        def lag() -> None:  # the writer takes nothing until the threads are well past it
            poll_until(lambda: absorber.fresh > GATE_BACKLOG + 100)
            release.set()

        lagging = threading.Thread(target=lag)
        lagging.start()
        run_threads(touching(sc))
        lagging.join()
        sc.flush()
        assert absorber.waited_for_take >= 100
        assert len(absorber) == 0
    due = KeySpace(namespace, 1).shard(0).due("item")
    assert own_server.client().zcard(due) == THREADS * KEYS_PER_THREAD


def test_touches_never_pause_while_redis_is_down(
        rules_file: RulesFactory, namespace: str, own_server: ValkeyProcess) -> None:
    with writer(rules_file, namespace, own_server.url) as sc:
        own_server.stop()
        sc.touch("item:first")  # its write fails: the keys are given back
        sample = sc.coalescer.metrics.registry.get_sample_value
        poll_until(lambda: (sample("coalescer_redis_errors_total", {"loop": "flusher"})
                            or 0) >= 1)
        run_threads(touching(sc))
        absorber = absorber_of(sc)
        assert absorber.fresh == THREADS * KEYS_PER_THREAD + 1 > GATE_BACKLOG
        assert absorber.waited_for_take == 0
        own_server.start()
        sc.flush(timeout=20)
    due = KeySpace(namespace, 1).shard(0).due("item")
    assert own_server.client().zcard(due) == THREADS * KEYS_PER_THREAD + 1


async def test_touches_on_the_writers_own_loop_never_pause(
        rules_file: RulesFactory, namespace: str, own_server: ValkeyProcess) -> None:
    path = rules_file(RULES.format(ns=namespace), HANDLERS)
    async with Coalescer.from_yaml(path, redis_url=own_server.url, worker=False) as c:
        for n in range(THREADS):  # the loop takes no batch while this runs
            for key in keys_of(n):
                c.touch(key)
        absorber = c._run.absorber
        assert absorber.fresh == THREADS * KEYS_PER_THREAD > GATE_BACKLOG
        assert absorber.waited_for_take == 0
        await c.flush()
