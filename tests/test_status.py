"""The status table of `coalescer status` reads like the JSON it comes from."""

from __future__ import annotations

from coalescer.status import format_status

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
    assert any(line.split() == ["0", "web-1:4242"] for line in lines)
    assert any(line.split() == ["1", "(none)"] for line in lines)
    row = next(line for line in lines if line.startswith("user-stats"))
    assert row.split()[:4] == ["user-stats", "12", "3", "1"] and "in 1.5s" in row
    assert next(line for line in lines if line.startswith("org-stats")).endswith("-")
    assert any("stats:user:9" in line and "5 attempts" in line and "db down" in line
               for line in lines)


def test_no_dead_letter_section_when_there_are_none() -> None:
    quiet = {**STATUS, "dead_letters": []}
    assert "DEAD LETTERS" not in format_status(quiet, now_ms=10_000)
