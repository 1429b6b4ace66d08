"""Rules in code: ``Rules(...)``/``Rule(...)`` build the Config a rules file does, with the
same checks, each error naming the Python call at fault; a coalescer runs on them."""

from __future__ import annotations

import dataclasses
import importlib
import os
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from coalescer import Claim, Coalescer, ConfigError, Rule, Rules, SyncCoalescer
from coalescer.config.rules import Config
from coalescer.config.rules import Rule as RuleModel
from coalescer.testing import Factory, refreshed_keys
from tests.conftest import RulesFactory

RULES_YAML = """\
namespace: shop
shards: 4
leader_lease: 2s
claim_lease: 6s
history: 50
durability: {replicas: 1, timeout: 500ms}
limits: {pending_keys: 5000, dead_letters: 100, dead_letter_ttl: 168h}
defaults:
  window: 1s
  retry: {attempts: 3, backoff: 2s}
rules:
  - name: customer-stats
    match: "stats:customer:{customer_id}"
    handler: handlers:refresh_sync
    window: 300ms
    max_wait: 10s
    absorb: 0.1
    timeout: 1m
    concurrency: 4
    rate: 100/s
    items: {max: 50}
    isolation: process
  - name: totals
    match: "totals:*"
    handler: handlers:refresh_batch
    batch: {max: 20, wait: 200ms}
    retry: {max_backoff: 1h}
  - name: hook
    match: "hook:{id}"
    handler:
      http: {url: "http://127.0.0.1:9/stats/{id}", method: PUT, timeout: 5s,
             secret_env: HOOK_SECRET}
sources:
  - name: orders
    stream: "app:orders"
    key: "stats:customer:{customer_id}"
    item: "order:{order_id}"
"""

HANDLERS_PY = """\
def refresh_sync(claim):
    pass

async def refresh_batch(claims):
    pass
"""


def here() -> int:
    """The line this is called on."""
    return sys._getframe(1).f_lineno


def refresh(claim: Claim) -> None:
    """A handler for rules that are only checked."""


async def refresh_async(claim: Claim) -> None:
    """An async handler, which ``isolation: process`` refuses."""


def meaningful(rule: RuleModel) -> dict[str, Any]:
    """What a rule does, without where it was written."""
    fields = {f.name: getattr(rule, f.name) for f in dataclasses.fields(rule)}
    fields["isolation"] = rule.isolation is not None
    del fields["line"]
    return fields


def same_settings(first: Config, second: Config) -> None:
    for name in ("namespace", "shards", "leader_lease", "claim_lease", "history",
                 "durability", "limits"):
        assert getattr(first, name) == getattr(second, name), name
    assert [dataclasses.replace(s, line=0) for s in first.sources] == \
        [dataclasses.replace(s, line=0) for s in second.sources]


def test_rules_in_code_give_the_config_of_the_same_rules_file(
        rules_file: RulesFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("COALESCER_NAMESPACE", raising=False)
    from_file = Config.from_yaml(rules_file(RULES_YAML, HANDLERS_PY))
    handlers = sys.modules["handlers"]
    in_code = Rules(
        namespace="shop", shards=4, leader_lease=2, claim_lease=timedelta(seconds=6),
        history=50, durability={"replicas": 1, "timeout": "500ms"},
        limits={"pending_keys": 5000, "dead_letters": 100,
                "dead_letter_ttl": timedelta(days=7)},
        defaults={"window": "1s", "retry": {"attempts": 3, "backoff": 2}},
        rules=[
            Rule(name="customer-stats", match="stats:customer:{customer_id}",
                 handler=handlers.refresh_sync, window=timedelta(milliseconds=300),
                 max_wait="10s", absorb=0.1, timeout="1m", concurrency=4, rate="100/s",
                 items={"max": 50}, isolation="process"),
            Rule(name="totals", match="totals:*", handler="handlers:refresh_batch",
                 batch={"max": 20, "wait": "200ms"}, retry={"max_backoff": "1h"}),
            {"name": "hook", "match": "hook:{id}",
             "handler": {"http": {"url": "http://127.0.0.1:9/stats/{id}", "method": "PUT",
                                  "timeout": "5s", "secret_env": "HOOK_SECRET"}}},
        ],
        sources=[{"name": "orders", "stream": "app:orders",
                  "key": "stats:customer:{customer_id}", "item": "order:{order_id}"}],
    ).config.with_handlers()  # the path handler imports as a worker's would
    same_settings(in_code, from_file)
    assert [meaningful(rule) for rule in in_code.rules] == \
        [meaningful(rule) for rule in from_file.rules]


async def test_a_coalescer_runs_the_function_handler_of_rules_in_code(
        coalescer_factory: Factory, coalescer_url: str, coalescer_namespace: str) -> None:
    ran: list[str] = []

    async def refresh_user(claim: Claim) -> None:
        ran.append(claim.params["user_id"])

    rules = Rules(namespace=coalescer_namespace,
                  rules=[Rule(name="user", match="user:{user_id}", handler=refresh_user)])
    with SyncCoalescer(rules=rules, redis_url=coalescer_url) as writer:
        writer.touch("user:7")
        writer.flush()
    async with coalescer_factory(rules) as c:  # the test kit takes rules in code too
        c.touch("user:8")
        claims = await c.drain()
    assert sorted(refreshed_keys(claims)) == ["user:7", "user:8"]
    assert sorted(ran) == ["7", "8"]
    async with Coalescer(rules=rules, redis_url=coalescer_url, worker=False) as c:
        c.touch("user:9")
        assert refreshed_keys(await c.drain()) == ["user:9"]


@pytest.mark.parametrize(("fields", "field", "message"), [
    ({"windw": "2s"}, "rules[0].windw",
     "unknown field 'windw' in Rule(...) (did you mean 'window'?)"),
    ({"window": "2 parsecs"}, "rules[0].window", "bad duration '2 parsecs'"),
    ({"window": timedelta(seconds=-1)}, "rules[0].window", "negative duration"),
    ({"match": "user:{"}, "rules[0].match", "unbalanced '{' in pattern 'user:{'"),
    ({"retry": {"backof": 1}}, "rules[0].retry.backof", "unknown field 'backof' in retry"),
    ({"window": "5s", "max_wait": "1s"}, "rules[0].max_wait",
     "max_wait (1s) must be at least window (5s)"),
    ({"handler": 42}, "rules[0].handler",
     "handler must be a function (def or async def) or a 'module:function' path, got an "
     "integer (42)"),
    ({"handler": lambda claim, other: None}, "rules[0].handler",
     "takes 2 positional arguments; a handler takes one (the claim)"),
    ({"handler": "no colon"}, "rules[0].handler", "must have the form 'module:function'"),
    ({"handler": refresh_async, "isolation": "process"}, "rules[0].isolation",
     "isolation: process is for a plain (sync) function handler"),
    ({"handler": lambda claim: None, "isolation": "process"}, "rules[0].isolation",
     "cannot be imported by name"),
])
def test_an_error_of_a_rule_names_its_call_and_field(fields: dict[str, Any], field: str,
                                                      message: str) -> None:
    given: dict[str, Any] = {"name": "user", "match": "user:{id}", "handler": refresh}
    line = here() + 1
    rule = Rule(**(given | fields))
    with pytest.raises(ConfigError) as caught:
        Rules(rules=[rule])
    assert str(caught.value).startswith(f"{__file__}:{line}: {field}: ")
    assert message in str(caught.value)


def test_a_handler_path_that_does_not_import_is_an_error_where_a_worker_starts() -> None:
    line = here() + 1
    rules = Rules(rules=[Rule(name="user", match="user:{id}", handler="nowhere.at_all:f")])
    with pytest.raises(ConfigError) as caught:
        Coalescer(rules=rules)  # a worker imports its handlers
    assert str(caught.value).startswith(f"{__file__}:{line}: rules[0].handler: handler "
                                        "module 'nowhere.at_all' does not import")


def test_every_error_of_rules_in_code_is_found_at_once() -> None:
    first = here() + 1
    rules = [Rule(name="user", match="user:{id}", handler=refresh),
             Rule(name="user", match="other:{id}", handler=refresh, window=3)]
    top = here() + 2
    with pytest.raises(ConfigError) as caught:
        Rules(rules=rules, shards=0, defaults={"max_wait": "2s"}, nmespace="x")
    assert [str(error) for error in caught.value.errors] == [
        f"{__file__}:{first + 1}: rules[1].name: duplicate rule name 'user' (first used on "
        f"line {first}); rule names must be unique",
        f"{__file__}:{first + 1}: rules[1].window: max_wait (2s) must be at least window "
        "(3s); raise max_wait or shorten window",
        f"{__file__}:{top}: nmespace: unknown field 'nmespace' in Rules(...) (did you mean "
        "'namespace'?); allowed: namespace, shards, leader_lease, claim_lease, history, "
        "durability, limits, defaults, rules, sources",
        f"{__file__}:{top}: shards: must be a positive whole number (1, 2, ...), got 0",
    ]


CHILD_HANDLERS = """\
import os
import pathlib

def note_pid(claim):
    (pathlib.Path(__file__).parent / f"pid-{claim.key}").write_text(str(os.getpid()))
"""


async def test_a_function_handler_may_run_in_child_processes(
        coalescer_factory: Factory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "child_handlers.py").write_text(CHILD_HANDLERS)
    monkeypatch.syspath_prepend(tmp_path)
    monkeypatch.delitem(sys.modules, "child_handlers", raising=False)
    handlers = importlib.import_module("child_handlers")
    rules = Rules(rules=[Rule(name="user", match="user:{id}", handler=handlers.note_pid,
                              isolation="process")])
    assert rules.config.rules[0].handler_ref == "child_handlers:note_pid"  # what it imports
    async with coalescer_factory(rules) as c:
        c.touch("user:1")
        assert refreshed_keys(await c.drain()) == ["user:1"]
    assert int((tmp_path / "pid-user:1").read_text()) != os.getpid()


def test_rules_in_code_say_where_they_were_built_not_a_rules_file() -> None:
    rules = Rules(rules=[Rule(name="user", match="user:{id}", handler=refresh)])
    line = sys._getframe().f_lineno - 1
    config = rules.config
    assert config.built_in == __file__
    assert config.describe().splitlines()[0] == \
        f"rules: built in code, Rules(...) at {__file__}:{line}"
    assert "rules file" not in str(config.unknown_key("usr:1"))


def test_a_rules_file_is_named_as_one(rules_file: RulesFactory) -> None:
    path = rules_file(RULES_YAML, HANDLERS_PY)
    config = Config.from_yaml(path)
    assert config.built_in is None
    assert config.describe().splitlines()[0] == f"rules file: {path}"


def test_a_coalescer_takes_its_rules_once() -> None:
    rules = Rules(rules=[Rule(name="user", match="user:{id}", handler=refresh)])
    with pytest.raises(TypeError, match="give the rules once"):
        Coalescer(rules.config, rules=rules)
    with pytest.raises(TypeError, match="give the rules once"):
        Coalescer()


def test_coalescer_namespace_replaces_the_namespace_of_rules_in_code(
        monkeypatch: pytest.MonkeyPatch) -> None:
    rule = Rule(name="user", match="user:{id}", handler=refresh)
    monkeypatch.setenv("COALESCER_NAMESPACE", "tenant-b")
    rules = Rules(namespace="shop", rules=[rule])
    assert rules.config.namespace == "tenant-b"
    monkeypatch.setenv("COALESCER_NAMESPACE", "tenant-c")  # read when a coalescer is built
    assert Coalescer(rules=rules, worker=False).config.namespace == "tenant-c"
    monkeypatch.delenv("COALESCER_NAMESPACE")
    assert rules.config.namespace == "shop"
    monkeypatch.setenv("COALESCER_NAMESPACE", "not a namespace")
    line = here() + 2
    with pytest.raises(ConfigError) as caught:
        Rules(namespace="shop", rules=[rule])
    assert str(caught.value).startswith(f"<Rules(...) at {__file__}:{line}>: namespace: "
                                        "$COALESCER_NAMESPACE is 'not a namespace'")


OTHER_MODULE = """\
from coalescer import Rule

def refresh(claim):
    pass

BAD = Rule(name="bad", match="bad:{id}", handler=refresh, window="1 fortnight")
GOOD = Rule(name="good", match="good:{id}", handler=refresh)
"""


def test_each_error_names_the_file_of_its_own_call(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "far_rules.py").write_text(OTHER_MODULE)
    monkeypatch.syspath_prepend(tmp_path)
    monkeypatch.delitem(sys.modules, "far_rules", raising=False)
    far_rules = importlib.import_module("far_rules")  # written just now

    line = here() + 2
    with pytest.raises(ConfigError) as caught:
        Rules(rules=[far_rules.BAD, far_rules.GOOD], defaults={"absorb": "3s"})
    assert sorted(str(error) for error in caught.value.errors) == sorted([
        f"{tmp_path / 'far_rules.py'}:6: rules[0].window: bad duration '1 fortnight': "
        "expected a number of seconds >= 0 (e.g. 2 or 0.25), or a string with a unit: "
        '"50ms", "2s", "1.5s", "5m", "2h", "1d"',
        f"{__file__}:{line}: defaults.absorb: absorb (3s) must be shorter than window (2s); "
        "lengthen window or shorten absorb",
    ])
