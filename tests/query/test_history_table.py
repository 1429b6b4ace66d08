"""`coalescer history`'s table: every column lines up under its header, whatever the
widths of the tokens, rules and nodes in it."""

from __future__ import annotations

from coalescer.query.history import Refresh, format_history


def _refresh(token: int, *, rule: str = "item", node: str = "n1", outcome: str = "success",
             error: str = "") -> Refresh:
    return Refresh(id=f"{token}-0", key=f"item:{token}", rule=rule, node=node, token=token,
                   attempt=1, start_ms=1_700_000_000_000, duration_ms=12, outcome=outcome,
                   error=error)


def test_the_columns_line_up_for_tokens_of_every_width() -> None:
    refreshes = [_refresh(7), _refresh(123_456_789_012_345),
                 _refresh(42, rule="a-rule-with-a-long-name", node="node-with-a-long-name-1"),
                 _refresh(9, outcome="cancelled")]
    head, *rows = format_history(refreshes).splitlines()
    token_end = head.index("TOKEN") + len("TOKEN")
    node_at, key_at, rule_at = head.index("NODE"), head.index("KEY"), head.index("RULE")
    for row, r in zip(rows, refreshes, strict=True):
        token = "-" if r.outcome == "cancelled" else str(r.token)
        assert row[:token_end].endswith(" " + token), (head, row)
        assert row[node_at:].startswith(r.node + " "), (head, row)
        assert row[key_at:] == r.key, (head, row)
        assert row[rule_at:].startswith(r.rule + " "), (head, row)
    assert len({len(row) - len(r.key) for row, r in zip(rows, refreshes, strict=True)}) == 1


def test_an_error_stays_on_its_own_line_below_its_refresh() -> None:
    _head, row, error = format_history([_refresh(5, outcome="failure",
                                                error="RuntimeError: db down")]).splitlines()
    assert row.endswith("item:5") and error.strip() == "error: RuntimeError: db down"
