"""Touch on commit with Django: a real SQLite database, a real server, SyncCoalescer."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import django
import pytest
import redis
from django.db import connection, transaction

from coalescer import InvalidKeyError, SyncCoalescer, UnknownKeyError
from coalescer.integrations.django import touch_on_commit
from coalescer.store.keys import KeySpace
from tests.helpers.django_db import configure

# Default settings: a 2s window, concurrency 16, 5 attempts.
RULES = """\
namespace: {ns}
rules:
  - name: user
    match: "stats:user:{{id}}"
    handler: builtins:id
"""

RulesFactory = Callable[..., Path]


@pytest.fixture(scope="module", autouse=True)
def django_db(tmp_path_factory: pytest.TempPathFactory) -> None:
    configure(tmp_path_factory.mktemp("django"))
    with connection.cursor() as cursor:
        cursor.execute("CREATE TABLE IF NOT EXISTS orders (user_id INTEGER)")


@pytest.fixture
def c(rules_file: RulesFactory, namespace: str, redis_url: str) -> Iterator[SyncCoalescer]:
    with SyncCoalescer.from_yaml(rules_file(RULES.format(ns=namespace)),
                                 redis_url=redis_url) as coalescer:
        yield coalescer


def place(c: SyncCoalescer, user_id: int) -> None:
    with connection.cursor() as cursor:
        cursor.execute("INSERT INTO orders VALUES (%s)", [user_id])
    touch_on_commit(f"stats:user:{user_id}", coalescer=c)


def pending(c: SyncCoalescer, redis_url: str) -> list[str]:
    """The keys Redis holds as pending, once every earlier touch is flushed."""
    c.flush()
    sk = KeySpace(c.coalescer.config.namespace, 1).shard(0)
    with redis.Redis.from_url(redis_url, decode_responses=True) as r:
        return sorted(r.zrange(sk.due("user"), 0, -1))


def test_keys_are_touched_once_the_atomic_block_commits(c: SyncCoalescer,
                                                       redis_url: str) -> None:
    with transaction.atomic():
        place(c, 1)
        place(c, 2)
        assert pending(c, redis_url) == []  # not committed yet
    assert pending(c, redis_url) == ["stats:user:1", "stats:user:2"]


def test_keys_of_a_rolled_back_block_are_dropped(c: SyncCoalescer, redis_url: str) -> None:
    with pytest.raises(RuntimeError), transaction.atomic():
        place(c, 1)
        raise RuntimeError("the request failed")
    assert pending(c, redis_url) == []


def test_a_rolled_back_savepoint_drops_only_its_keys(c: SyncCoalescer, redis_url: str) -> None:
    with transaction.atomic():
        place(c, 1)
        with pytest.raises(ValueError), transaction.atomic():
            place(c, 2)
            raise ValueError("undo 2")
        with transaction.atomic():
            place(c, 3)
    assert pending(c, redis_url) == ["stats:user:1", "stats:user:3"]


def test_in_autocommit_outside_atomic_keys_are_touched_at_once(c: SyncCoalescer,
                                                               redis_url: str) -> None:
    assert connection.get_autocommit()
    place(c, 5)
    assert pending(c, redis_url) == ["stats:user:5"]


def test_a_key_that_could_never_be_touched_is_refused_at_the_call(
        c: SyncCoalescer, redis_url: str) -> None:
    with transaction.atomic():
        place(c, 1)
        with pytest.raises(UnknownKeyError, match=r"no rule in .* matches key 'orders:1'"):
            touch_on_commit("stats:user:2", "orders:1", coalescer=c)
        with pytest.raises(InvalidKeyError):
            touch_on_commit("stats:user:\ud800", coalescer=c)
    assert pending(c, redis_url) == ["stats:user:1"]


def test_using_names_the_database_whose_commit_counts(c: SyncCoalescer,
                                                      redis_url: str) -> None:
    with pytest.raises(django.db.utils.ConnectionDoesNotExist, match="other"):
        touch_on_commit("stats:user:1", coalescer=c, using="other")
    with transaction.atomic(using="default"):
        touch_on_commit("stats:user:1", coalescer=c, using="default")
        assert pending(c, redis_url) == []
    assert pending(c, redis_url) == ["stats:user:1"]
