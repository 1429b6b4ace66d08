"""`SyncCoalescer`: touch and flush from plain threads, as Django or Flask do."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from coalescer import ClosedError, Coalescer, SyncCoalescer, UnknownKeyError
from coalescer.store.embedded import EmbeddedServer
from coalescer.store.keys import KeySpace
from tests.helpers.e2e import line_rules
from tests.helpers.forks import LIBC_FORK, exit_code, exit_code_in_fresh_interpreter, in_child
from tests.helpers.servers import wait_until

RULES = """\
namespace: {ns}
defaults:
  window: 30s
  max_wait: 60s
  absorb: 10ms
rules:
  - name: item
    match: "item:{{id}}"
    handler: {{mod}}:refresh
"""

THREADS = 8
KEYS_PER_THREAD = 50


@pytest.fixture
def rules(tmp_path: Path, namespace: str) -> Path:
    return line_rules(tmp_path, f"sync_{namespace}", RULES.format(ns=namespace))


@pytest.fixture
def r(redis_url: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    yield client
    client.close()


def test_threads_touch_and_flush_blocks_until_redis_holds_them(
        rules: Path, namespace: str, redis_url: str, r: redis.Redis) -> None:
    due = KeySpace(namespace, 1).shard(0).due("item")
    missing: dict[int, list[str]] = {}
    errors: list[BaseException] = []
    with SyncCoalescer.from_yaml(rules, redis_url=redis_url) as sc:
        def write_path(n: int) -> None:
            try:
                keys = [f"item:{n}-{i}" for i in range(KEYS_PER_THREAD)]
                for key in keys:
                    sc.touch(key)
                    sc.touch("item:hot")
                sc.flush()
                # flush returned: Redis holds every key this thread touched
                missing[n] = [k for k in [*keys, "item:hot"] if r.zscore(due, k) is None]
            except BaseException as exc:  # surfaced below
                errors.append(exc)

        threads = [threading.Thread(target=write_path, args=(n,)) for n in range(THREADS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        with pytest.raises(UnknownKeyError):
            sc.touch("nope:1")
    assert errors == []
    assert missing == {n: [] for n in range(THREADS)}
    assert r.zcard(due) == THREADS * KEYS_PER_THREAD + 1


def test_context_manager_and_idempotent_close(
        rules: Path, namespace: str, redis_url: str, r: redis.Redis) -> None:
    due = KeySpace(namespace, 1).shard(0).due("item")
    with SyncCoalescer.from_yaml(rules, redis_url=redis_url) as sc:
        assert sc.coalescer.worker is False  # a write path by default
        sc.touch("item:1")
    # a clean shutdown flushes first
    assert r.zscore(due, "item:1") is not None
    with pytest.raises(ClosedError):
        sc.touch("item:2")
    sc.close()
    sc.close()

    sc = SyncCoalescer.from_yaml(rules, redis_url=redis_url)
    sc.start()
    sc.touch("item:3")
    sc.flush()
    assert r.zscore(due, "item:3") is not None
    sc.close()
    sc.close()
    with pytest.raises(ClosedError):
        sc.touch("item:4")
    assert r.zcard(due) == 2


# -- fork: gunicorn --preload, uwsgi, Celery prefork ------------------------------------

FORK_RULES = """\
namespace: {ns}
shards: {shards}
rules:
  - name: item
    match: "item:{{id}}"
    handler: {{mod}}:refresh
  - name: held
    match: "held:{{id}}"
    window: 2m
    max_wait: 5m
    absorb: 1m
    handler: {{mod}}:refresh
"""

WORKER_HANDLER = """\
import os


def refresh(claim):
    with open({log!r}, "a") as f:
        f.write(f"{{os.getpid()}} {{claim.key}}\\n")
"""


def fork_rules(tmp_path: Path, namespace: str, shards: int = 1) -> Path:
    return line_rules(tmp_path, f"fork_{namespace}",
                      FORK_RULES.format(ns=namespace, shards=shards))


def scheduled(r: redis.Redis, namespace: str, shards: int, keys: list[str]) -> list[str]:
    """The keys of ``keys`` (rule ``item``) that Redis has not scheduled."""
    space = KeySpace(namespace, shards)
    return [k for k in keys if r.zscore(space.shard(space.shard_of(k)).due("item"), k) is None]


def worker(sc: SyncCoalescer, keys_per_thread: list[list[str]]) -> None:
    """A forked worker: threads touch and flush at once (racing to start it again)."""
    errors: list[BaseException] = []

    def write_path(keys: list[str]) -> None:
        try:
            for key in keys:
                sc.touch(key)
            sc.flush(timeout=10)
        except BaseException as exc:
            errors.append(exc)
    pool = [threading.Thread(target=write_path, args=(keys,)) for keys in keys_per_thread]
    for thread in pool:
        thread.start()
    for thread in pool:
        thread.join(30)
    assert errors == []
    sc.close(timeout=10)


@pytest.mark.parametrize("shards", [1, 4])
def test_forked_child_touches_and_flushes_and_the_parent_keeps_its_own_touches(
        tmp_path: Path, namespace: str, redis_url: str, r: redis.Redis, shards: int) -> None:
    rules = fork_rules(tmp_path, namespace, shards)
    space = KeySpace(namespace, shards)
    held_meta = space.shard(space.shard_of("held:p")).meta
    child_keys = [f"item:child-{i}" for i in range(40)]
    with SyncCoalescer.from_yaml(rules, redis_url=redis_url) as sc:
        sc.touch("item:parent-1")
        sc.flush()
        sc.touch("held:p")
        sc.flush()
        written = r.hget(held_meta, "held:p")
        sc.touch("held:p")  # held for absorb (1m): in the parent's buffer at the fork

        def child() -> None:
            for key in child_keys:
                sc.touch(key)
            sc.flush(timeout=10)
            with redis.Redis.from_url(redis_url, decode_responses=True) as mine:
                assert scheduled(mine, namespace, shards, child_keys) == []
            sc.close(timeout=10)

        assert exit_code(in_child(child)) == 0
        assert scheduled(r, namespace, shards, child_keys) == []
        # The child started with an empty buffer: it did not write the parent's touch.
        assert r.hget(held_meta, "held:p") == written
        # The parent's connections still work, and its buffered touch is written once.
        sc.touch("item:parent-2")
        sc.flush()
        assert r.hget(held_meta, "held:p") != written
    assert scheduled(r, namespace, shards, ["item:parent-1", "item:parent-2"]) == []


def test_several_forked_children_at_once_like_gunicorn_workers(
        tmp_path: Path, namespace: str, redis_url: str, r: redis.Redis) -> None:
    rules = fork_rules(tmp_path, namespace)
    children, threads = 4, 3

    def keys_of(n: int, t: int) -> list[str]:
        return [f"item:w{n}-t{t}-{i}" for i in range(30)]

    with SyncCoalescer.from_yaml(rules, redis_url=redis_url) as sc:
        sc.touch("item:parent-0")

        pids = [in_child(lambda n=n: worker(sc, [keys_of(n, t) for t in range(threads)]))
                for n in range(children)]
        for i in range(20):  # the parent goes on meanwhile, on its own connections
            sc.touch(f"item:parent-{i}")
            sc.flush()
        assert [exit_code(pid) for pid in pids] == [0] * children
        sc.touch("item:parent-last")
        sc.flush()
    every = [k for n in range(children) for t in range(threads) for k in keys_of(n, t)]
    assert scheduled(r, namespace, 1, every) == []
    parents = [f"item:parent-{i}" for i in range(20)] + ["item:parent-last"]
    assert scheduled(r, namespace, 1, parents) == []
    due = KeySpace(namespace, 1).shard(0).due("item")
    assert r.zcard(due) == len(every) + len(parents)


def test_created_only_before_the_fork_is_started_in_the_child(
        tmp_path: Path, namespace: str, redis_url: str, r: redis.Redis) -> None:
    sc = SyncCoalescer.from_yaml(fork_rules(tmp_path, namespace), redis_url=redis_url)

    def child() -> None:
        with pytest.raises(ClosedError, match=r"not started; call start\(\)"):
            sc.touch("item:early")
        with sc:
            sc.touch("item:child")
            sc.flush(timeout=10)

    assert exit_code(in_child(child)) == 0
    assert scheduled(r, namespace, 1, ["item:child"]) == []
    assert scheduled(r, namespace, 1, ["item:early"]) == ["item:early"]
    with sc:  # the parent starts its own afterwards
        sc.touch("item:parent")
    assert scheduled(r, namespace, 1, ["item:parent"]) == []


def test_unstarted_sync_coalescer_says_to_call_start(
        tmp_path: Path, namespace: str, redis_url: str) -> None:
    sc = SyncCoalescer.from_yaml(fork_rules(tmp_path, namespace), redis_url=redis_url)
    with pytest.raises(ClosedError, match=r"touch\('item:1'\): .*not started; call start\(\)"):
        sc.touch("item:1")
    with pytest.raises(ClosedError, match=r"flush\(\): .*not started; call start\(\)"):
        sc.flush()
    sc.close()  # closing an unstarted one is a no-op


async def test_unstarted_coalescer_says_to_await_start(
        tmp_path: Path, namespace: str, redis_url: str) -> None:
    c = Coalescer.from_yaml(fork_rules(tmp_path, namespace), redis_url=redis_url)
    with pytest.raises(ClosedError, match=r"touch\('item:1'\): .*not started; await start\(\)"):
        c.touch("item:1")
    with pytest.raises(ClosedError, match=r"touch_many\(\): .*not started; await start\(\)"):
        c.touch_many(["item:1"])
    with pytest.raises(ClosedError, match=r"flush\(\): .*not started; await start\(\)"):
        await c.flush()


@pytest.mark.parametrize("started_in_parent", [True, False])
async def test_worker_coalescer_in_a_forked_child(
        tmp_path: Path, namespace: str, redis_url: str, started_in_parent: bool) -> None:
    log = tmp_path / "refreshes.log"
    (tmp_path / f"w_{namespace}.py").write_text(WORKER_HANDLER.format(log=str(log)))
    sys.path.insert(0, str(tmp_path))
    rules = tmp_path / "rules.yaml"
    rules.write_text(f"namespace: {namespace}\nrules:\n  - name: job\n    match: 'job:{{id}}'\n"
                     f"    window: 100ms\n    handler: w_{namespace}:refresh\n"
                     "    isolation: thread\n")  # the handler's pid: the forked node's
    c = Coalescer.from_yaml(rules, redis_url=redis_url, worker=True)
    if started_in_parent:
        await c.start()
        parent_node = c.node_id

    async def child_main() -> None:
        if started_in_parent:
            with pytest.raises(ClosedError, match="is a fork; await start"):
                c.touch("job:early")
            with pytest.raises(ClosedError, match="is a fork; await start"):
                await c.flush()
        async with c:
            assert c.node_id.endswith(f":{os.getpid()}")
            c.touch("job:child")
            await c.flush()
            await wait_until(lambda: f"{os.getpid()} job:child" in read(log), timeout=20)

    def read(path: Path) -> str:
        return path.read_text() if path.exists() else ""

    try:
        pid = in_child(lambda: asyncio.run(child_main()))
        if started_in_parent:
            assert c.node_id == parent_node
            await c.close()  # hands the shard's lease over to the child
        await wait_until(lambda: os.waitpid(pid, os.WNOHANG)[0] == pid, timeout=60)
    finally:
        await c.close()
        sys.path.remove(str(tmp_path))
    assert read(log).splitlines() == [f"{pid} job:child"]


def users(root: Path) -> list[int]:
    """The pids registered as users of the embedded server in ``root``."""
    return sorted(int(p.name.split(".", 1)[0]) for p in (root / "users").iterdir())


def test_embedded_server_registrations_stay_per_process_across_fork(tmp_path: Path) -> None:
    root = tmp_path / ".coalescer"
    server = EmbeddedServer(root)
    url = server.acquire()
    parent = os.getpid()

    def child() -> None:
        server.release()  # the parent's registration: left to the parent
        assert users(root) == [parent]
        assert server.acquire() == url
        assert users(root) == sorted([parent, os.getpid()])
        server.release()
        assert users(root) == [parent]

    try:
        assert exit_code(in_child(child)) == 0
        assert users(root) == [parent]
        with redis.Redis.from_url(url) as client:
            assert client.ping()
    finally:
        server.release()
    assert users(root) == []
    assert not (root / "server.json").exists()  # the last user stopped it


def test_sync_coalescer_on_the_embedded_server_in_a_forked_child(
        tmp_path: Path, namespace: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("COALESCER_REDIS_URL", raising=False)
    root = tmp_path / ".coalescer"
    sc = SyncCoalescer.from_yaml(fork_rules(tmp_path, namespace), embedded_root=root)
    parent = os.getpid()

    def child() -> None:
        sc.touch("item:child")
        assert users(root) == sorted([parent, os.getpid()])
        sc.close(timeout=10)
        assert users(root) == [parent]

    with sc:
        url = sc.coalescer.redis_url
        assert exit_code(in_child(child)) == 0
        assert users(root) == [parent]
        sc.touch("item:parent")
        sc.flush()
        with redis.Redis.from_url(url, decode_responses=True) as r:
            assert scheduled(r, namespace, 1, ["item:child", "item:parent"]) == []
    assert users(root) == []


def test_start_in_a_forked_child_like_a_post_fork_hook(
        tmp_path: Path, namespace: str, redis_url: str, r: redis.Redis) -> None:
    """gunicorn's post_fork, uwsgi's @postfork and Celery's worker_process_init call
    start() in the child."""
    with SyncCoalescer.from_yaml(fork_rules(tmp_path, namespace), redis_url=redis_url) as sc:
        sc.touch("item:parent")
        sc.flush()

        def child() -> None:
            sc.start()
            sc.touch("item:child")
            sc.flush(timeout=10)
            sc.close(timeout=10)

        pid = in_child(child)
        assert exit_code(pid) == 0
        sc.touch("item:parent-after")
        sc.flush()
    assert scheduled(r, namespace, 1, ["item:parent", "item:child", "item:parent-after"]) == []


def started_in_a_child_forked_from_c(rules: str, redis_url: str) -> int:
    """uwsgi's master (without py-call-osafterfork) imports the app, then forks its
    workers from C, skipping Python's fork hooks, before it serves anything: the
    coalescer exists, with no thread yet. start() in the child sees the new pid itself;
    the master's own coalescer works after."""
    sc = SyncCoalescer.from_yaml(rules, redis_url=redis_url)

    def child() -> None:
        sc.start()
        sc.touch("item:child")
        sc.flush(timeout=10)
        sc.close(timeout=10)

    code = exit_code(in_child(child, fork=LIBC_FORK))
    with sc:
        sc.touch("item:parent-after")
        sc.flush()
    return code


def test_start_in_a_child_forked_from_c_like_uwsgis_master(
        tmp_path: Path, namespace: str, redis_url: str, r: redis.Redis) -> None:
    # In a fresh interpreter: a libc fork copies every lock another thread holds at that
    # instant, and a test worker runs threads of its own.
    rules = str(fork_rules(tmp_path, namespace))
    assert exit_code_in_fresh_interpreter(started_in_a_child_forked_from_c, rules,
                                          redis_url) == 0
    assert scheduled(r, namespace, 1, ["item:child", "item:parent-after"]) == []


def test_a_sync_coalescer_never_closed_writes_its_touches_at_exit(
        tmp_path: Path, namespace: str, redis_url: str, r: redis.Redis) -> None:
    # absorb 20s: nothing is written before the process exits, unless at exit
    rules = line_rules(tmp_path, f"sync_{namespace}",
                       RULES.format(ns=namespace).replace("absorb: 10ms", "absorb: 20s"))
    script = ("import sys\nfrom coalescer import SyncCoalescer\n"
              "sc = SyncCoalescer.from_yaml(sys.argv[1], redis_url=sys.argv[2])\n"
              "sc.start()\nsc.touch('item:left-open')\n")
    done = subprocess.run([sys.executable, "-c", script, str(rules), redis_url],
                          check=False, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    due = KeySpace(namespace, 1).shard(0).due("item")
    assert r.zscore(due, "item:left-open") is not None
