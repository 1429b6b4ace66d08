"""The status table of `coalescer status` reads like the JSON it comes from."""

from __future__ import annotations

from redis.asyncio import Redis

from coalescer.config.rules import Config
from coalescer.query.status import format_status, gather_status, shard_summary
from coalescer.store.keys import KeySpace, node_leases
from tests.conftest import RulesFactory
from tests.helpers.e2e import server_ms

STATUS = {
    "namespace": "app",
    "shards": [{"shard": 0, "leader": "web-1:4242", "epoch": 3},
               {"shard": 1, "leader": None, "epoch": None}],
    "rules": {"user-stats": {"pending": 12, "in_flight": 3, "dead": 1, "next_due_ms": 11_500},
              "org-stats": {"pending": 0, "in_flight": 0, "dead": 0, "next_due_ms": None}},
    "dead_letters": [{"key": "stats:user:9", "rule": "user-stats", "since_ms": 9_000,
                      "attempts": 5, "error": "RuntimeError: db down"}],
}


def test_table_shows_leaders_counts_next_due_and_dead_letters() -> None:
    text = format_status(STATUS, now_ms=10_000)
    lines = text.splitlines()
    assert "namespace app" in lines[0]
    assert lines[1] == "shards: 2 — web-1:4242 leads 1; unled: 1"
    assert not any(line.split() == ["0", "web-1:4242"] for line in lines)
    every = format_status(STATUS, now_ms=10_000, every_shard=True).splitlines()
    assert any(line.split() == ["0", "web-1:4242"] for line in every)
    assert any(line.split() == ["1", "(none)"] for line in every)
    row = next(line for line in lines if line.startswith("user-stats"))
    assert row.split()[:4] == ["user-stats", "12", "3", "1"] and "in 1.5s" in row
    assert next(line for line in lines if line.startswith("org-stats")).endswith("-")
    assert "  stats:user:9  [user-stats] after 5 attempts: RuntimeError: db down" in lines
    one = {**STATUS, "dead_letters": [{**STATUS["dead_letters"][0], "attempts": 1}]}
    assert "after 1 attempt: RuntimeError" in format_status(one, now_ms=10_000)


def _shards(leaders: list[str | None]) -> list[dict[str, object]]:
    return [{"shard": i, "leader": leader, "epoch": 1 if leader else None}
            for i, leader in enumerate(leaders)]


def test_the_shard_summary_counts_leaders_and_lists_unled_shards_as_ranges() -> None:
    even = _shards(["node-b", "node-a"] * 256)
    assert shard_summary(even) == "shards: 512 — node-a leads 256, node-b leads 256; unled: none"
    gaps = _shards(["n1"] * 100 + [None] * 28 + ["n2"] * 2 + [None] + ["n1"] * 2 + [None])
    assert shard_summary(gaps) == "shards: 134 — n1 leads 102, n2 leads 2; unled: 100-127, 130, 133"
    scattered = _shards([None, "n"] * 1000)
    assert shard_summary(scattered) == (
        "shards: 2000 — n leads 1000; unled: 0, 2, 4, 6, 8, 10, 12, 14 and 992 more")
    crowd = _shards([f"node-{i}" for i in range(10)] * 3)
    assert shard_summary(crowd).endswith("node-5 leads 3, 4 more nodes lead 12; unled: none")
    assert shard_summary(_shards([None])) == "shards: 1 — no leader anywhere; unled: 0"


def test_no_dead_letter_section_when_there_are_none() -> None:
    quiet = {**STATUS, "dead_letters": []}
    assert "DEAD LETTERS" not in format_status(quiet, now_ms=10_000)


def test_the_dead_letter_section_says_when_more_exist_than_it_lists() -> None:
    all_shown = format_status(STATUS, now_ms=10_000)
    assert "DEAD LETTERS (1 dead letter; re-queue with" in all_shown
    many = {**STATUS, "rules": {**STATUS["rules"],
                                "user-stats": {**STATUS["rules"]["user-stats"], "dead": 135}}}
    text = format_status(many, now_ms=10_000)
    assert "DEAD LETTERS (1 of 135 shown; every one with `coalescer dead list`;" in text


async def test_a_leader_whose_node_lease_lapsed_shows_as_such_until_taken_over(
        redis_client: Redis, namespace: str, rules_file: RulesFactory) -> None:
    config = Config.from_yaml(rules_file(f"""\
namespace: {namespace}
shards: 4
rules:
  - name: stats
    match: "stats:{{id}}"
    handler: handlers:refresh
""", "def refresh(claim):\n    pass\n"))
    space = KeySpace(namespace, 4)
    dead = "n1\x1b[2J"  # a hostile node id: shown escaped
    now_ms = await server_ms(redis_client)
    await redis_client.zadd(node_leases(namespace),
                            {dead: now_ms - 10_000, "n2": now_ms + 60_000})
    for shard, node in enumerate([dead, dead, "n2", "n2"]):
        await redis_client.set(space.shard(shard).leader, f"7|{node}")

    status = await gather_status(redis_client, config)
    assert [s["lease_lapsed"] for s in status["shards"]] == [True, True, False, False]
    text = format_status(status, now_ms=now_ms, every_shard=True)
    assert "\x1b" not in text
    lines = text.splitlines()
    assert lines[1] == (r"shards: 4 — n1\x1b[2J leads 2 (lease lapsed, takeover pending), "
                        "n2 leads 2; unled: none")
    assert lines[lines.index("SHARD  LEADER") + 1].split(None, 1) == [
        "0", r"n1\x1b[2J (lease lapsed, takeover pending)"]
    assert lines[lines.index("SHARD  LEADER") + 3].split() == ["2", "n2"]

    await redis_client.set(space.shard(0).leader, "8|n2")  # a standby took one over
    await redis_client.zrem(node_leases(namespace), dead)  # and forgot the node
    status = await gather_status(redis_client, config)
    assert [s["lease_lapsed"] for s in status["shards"]] == [False, True, False, False]
    assert shard_summary(status["shards"]).startswith(
        "shards: 4 — n2 leads 3, n1\x1b[2J leads 1 (lease lapsed, takeover pending)")
