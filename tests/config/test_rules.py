"""The rules-file loader: defaults, matching, handlers, and every refusal."""

from __future__ import annotations

import asyncio
import inspect
import itertools
import os
import random
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from textwrap import dedent

import pytest

from coalescer import Coalescer, SyncCoalescer
from coalescer.config.handler_import import HandlerImport
from coalescer.config.patterns import KeyPattern, covers
from coalescer.config.rules import Config, HttpHandler, RetryPolicy, Rule, check_file
from coalescer.errors import ConfigError, UnknownKeyError
from tests.helpers.servers import wait_until

HANDLERS = """\
CALLS = []

async def refresh_async(claim):
    CALLS.append(("async", claim))

def refresh_sync(claim):
    CALLS.append(("sync", claim))

NOT_CALLABLE = 42
"""


@pytest.fixture(autouse=True)
def _restore_sys_path() -> Iterator[None]:
    saved = list(sys.path)
    yield
    sys.path[:] = saved


@pytest.fixture
def module(tmp_path: Path) -> Iterator[str]:
    """A handler module in tmp_path under a name no other test uses."""
    name = f"handlers_{uuid.uuid4().hex}"
    (tmp_path / f"{name}.py").write_text(HANDLERS)
    yield name
    sys.modules.pop(name, None)


def write(tmp_path: Path, text: str, name: str = "rules.yaml") -> Path:
    path = tmp_path / name
    path.write_text(dedent(text))
    return path


def refused(tmp_path: Path, text: str) -> tuple[ConfigError, Path]:
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        Config.from_yaml(path)
    return info.value, path


def assert_refused(tmp_path: Path, text: str, *, line: int | None, field: str | None,
                   fragment: str) -> ConfigError:
    error, path = refused(tmp_path, text)
    assert error.file == str(path)
    assert (error.line, error.field) == (line, field), error
    assert fragment in error.message, error.message
    assert str(path) in str(error)
    return error


# --- loading and defaults ---------------------------------------------------------


def test_minimal_file_gets_every_default(tmp_path: Path) -> None:
    path = write(tmp_path, """\
        rules:
          - name: all
            match: "*"
            handler: json:dumps
        """)
    config = Config.from_yaml(path)
    assert (config.namespace, config.shards) == ("coalescer", 1)
    assert (config.leader_lease, config.claim_lease) == (3.0, 5.0)
    assert config.source == str(path)
    (rule,) = config.rules
    assert (rule.window, rule.max_wait, rule.absorb, rule.timeout) == (2.0, 30.0, 0.05, 30.0)
    assert rule.concurrency == 16
    assert rule.retry == RetryPolicy(attempts=5, backoff=1.0, max_backoff=300.0)
    assert rule.line == 2
    assert rule.handler_ref == "json:dumps"


def test_spec_example_loads(tmp_path: Path) -> None:
    package = f"myapp_{uuid.uuid4().hex}"
    (tmp_path / package).mkdir()
    (tmp_path / package / "__init__.py").write_text("")
    (tmp_path / package / "stats.py").write_text("async def refresh_user(claim):\n    pass\n")
    path = write(tmp_path, f"""\
        namespace: coalescer
        shards: 1
        leader_lease: 3s
        claim_lease: 5s
        defaults:
          window: 2s
          max_wait: 30s
          absorb: 50ms
          timeout: 30s
          concurrency: 16
          retry: {{attempts: 5, backoff: 1s, max_backoff: 5m}}
        rules:
          - name: user-stats
            match: "stats:user:{{user_id}}"
            window: 2s
            handler: {package}.stats:refresh_user
          - name: org-stats
            match: "stats:org:{{org_id}}"
            window: 10s
            max_wait: 2m
            handler:
              http:
                url: "http://127.0.0.1:9000/refresh/{{org_id}}"
                method: POST
                timeout: 5s
                secret_env: ORG_HOOK_SECRET
        """)
    try:
        config = Config.from_yaml(path)
    finally:
        for name in [m for m in sys.modules if m.startswith(package)]:
            del sys.modules[name]
    user, org = config.rules
    assert inspect.iscoroutinefunction(user.handler)
    assert user.handler_ref == f"{package}.stats:refresh_user"
    assert (org.window, org.max_wait) == (10.0, 120.0)
    assert org.handler == HttpHandler(url="http://127.0.0.1:9000/refresh/{org_id}",
                                      method="POST", timeout=5.0,
                                      secret_env="ORG_HOOK_SECRET")
    assert org.handler_ref == "POST http://127.0.0.1:9000/refresh/{org_id}"
    assert (user.line, org.line) == (13, 17)


def test_defaults_apply_and_rules_override(tmp_path: Path) -> None:
    config = Config.from_yaml(write(tmp_path, """\
        namespace: myapp.prod-1
        shards: 4
        leader_lease: 2s
        claim_lease: 10s
        defaults:
          window: 5s
          concurrency: 4
          retry: {attempts: 3}
        rules:
          - name: a
            match: "a:{id}"
            handler: json:dumps
          - name: b
            match: "b:{id}"
            handler: json:dumps
            window: 1s
            absorb: 0
            timeout: 90s
            retry: {backoff: 2s}
        """))
    assert (config.namespace, config.shards) == ("myapp.prod-1", 4)
    assert (config.leader_lease, config.claim_lease) == (2.0, 10.0)
    a, b = config.rules
    assert (a.window, a.concurrency, a.absorb, a.timeout) == (5.0, 4, 0.05, 30.0)
    assert a.retry == RetryPolicy(attempts=3, backoff=1.0, max_backoff=300.0)
    assert (b.window, b.concurrency, b.absorb, b.timeout) == (1.0, 4, 0.0, 90.0)
    assert b.retry == RetryPolicy(attempts=3, backoff=2.0, max_backoff=300.0)


def test_empty_defaults_block_is_allowed(tmp_path: Path) -> None:
    config = Config.from_yaml(write(tmp_path, """\
        defaults:
        rules:
          - {name: a, match: "*", handler: "json:dumps"}
        """))
    assert config.rules[0].window == 2.0


def test_yaml_anchors_and_merge_keys(tmp_path: Path) -> None:
    config = Config.from_yaml(write(tmp_path, """\
        rules:
          - &base {name: a, match: "a:*", handler: "json:dumps", window: 7s}
          - <<: *base
            name: b
            match: "b:*"
        """))
    assert [(r.name, r.window) for r in config.rules] == [("a", 7.0), ("b", 7.0)]


# --- matching ---------------------------------------------------------------------


MATCHING = """\
    rules:
      - name: user
        match: "stats:user:{user_id}"
        handler: json:dumps
      - name: user-any
        match: "stats:user:*"
        handler: json:dumps
      - name: pair
        match: "pair:{a}:{b}"
        handler: json:dumps
      - name: catch-all
        match: "*"
        handler: json:dumps
    """


def test_first_match_wins_in_file_order(tmp_path: Path) -> None:
    config = Config.from_yaml(write(tmp_path, MATCHING))
    rule, params = config.match("stats:user:42")
    assert (rule.name, params) == ("user", {"user_id": "42"})
    rule, params = config.match("stats:user:42:daily")
    assert (rule.name, params) == ("user-any", {})
    rule, params = config.match("pair:x:y")
    assert (rule.name, params) == ("pair", {"a": "x", "b": "y"})
    rule, params = config.match("pair:x:y:z")
    assert (rule.name, params) == ("catch-all", {})
    assert config.match("")[0].name == "catch-all"


def test_match_agrees_with_rule_params(tmp_path: Path) -> None:
    config = Config.from_yaml(write(tmp_path, MATCHING))
    for key in ["stats:user:1", "stats:user:", "pair:a:b", "pair::b", "zzz", "a\nb"]:
        rule, params = config.match(key)
        earlier = config.rules[: config.rules.index(rule)]
        assert all(r.params(key) is None for r in earlier)
        assert rule.params(key) == params
        assert config.rule_for(key) is rule  # the touch() path: the same rule, no captures


def test_unknown_key_is_refused_with_its_name(tmp_path: Path) -> None:
    config = Config.from_yaml(write(tmp_path, """\
        rules:
          - {name: user, match: "stats:user:{id}", handler: "json:dumps"}
        """))
    with pytest.raises(UnknownKeyError) as info:
        config.match("stats:org:1")
    assert info.value.key == "stats:org:1"
    assert "stats:org:1" in str(info.value)
    with pytest.raises(UnknownKeyError):
        config.match("stats:user:1:2")
    with pytest.raises(UnknownKeyError) as info:
        config.rule_for("stats:org:1")
    assert info.value.key == "stats:org:1"


def test_unknown_key_names_the_rules_file_and_the_closest_rule(tmp_path: Path) -> None:
    path = write(tmp_path, """\
        rules:
          - {name: orders, match: "orders:{id}", handler: "json:dumps"}
          - {name: user-stats, match: "stats:user:{user_id}", handler: "json:dumps"}
        """)
    config = Config.from_yaml(path)
    with pytest.raises(UnknownKeyError) as info:
        config.rule_for("stat:user:1")
    assert isinstance(info.value, KeyError)
    assert str(info.value) == (f"no rule in {path} matches key 'stat:user:1' "
                               "(closest: 'stats:user:{user_id}' of rule user-stats)")
    with pytest.raises(UnknownKeyError) as info:
        config.match("zzzzzzzzzzzzzzzzzzzz")  # like no rule: none is suggested
    assert str(info.value) == f"no rule in {path} matches key 'zzzzzzzzzzzzzzzzzzzz'"


def test_unknown_key_of_rules_not_from_a_file_names_no_file() -> None:
    config = Config.from_string(
        'rules:\n  - {name: orders, match: "orders:{id}", handler: "json:dumps"}\n')
    with pytest.raises(UnknownKeyError) as info:
        config.rule_for("order:1")
    assert str(info.value) == ("no rule matches key 'order:1' "
                               "(closest: 'orders:{id}' of rule orders)")


def test_rule_by_name(tmp_path: Path) -> None:
    config = Config.from_yaml(write(tmp_path, MATCHING))
    assert config.rule("pair").pattern.names == ("a", "b")
    with pytest.raises(KeyError):
        config.rule("nope")


# --- handlers ---------------------------------------------------------------------


def test_sync_and_async_handlers_import_from_the_rules_folder(
        tmp_path: Path, module: str, monkeypatch: pytest.MonkeyPatch) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    path = write(tmp_path, f"""\
        rules:
          - {{name: s, match: "s:*", handler: "{module}:refresh_sync"}}
          - {{name: a, match: "a:*", handler: "{module}:refresh_async"}}
        """)
    config = Config.from_yaml(path)
    sync_rule, async_rule = config.rules
    assert callable(sync_rule.handler)
    assert not inspect.iscoroutinefunction(sync_rule.handler)
    assert inspect.iscoroutinefunction(async_rule.handler)
    assert sys.path[0] == str(tmp_path.resolve())
    assert callable(async_rule.handler)
    sync_rule.handler("c1")
    asyncio.run(async_rule.handler("c2"))
    assert sys.modules[module].CALLS == [("sync", "c1"), ("async", "c2")]


def test_relative_rules_path(tmp_path: Path, module: str,
                             monkeypatch: pytest.MonkeyPatch) -> None:
    folder = tmp_path / "conf"
    folder.mkdir()
    (tmp_path / f"{module}.py").rename(folder / f"{module}.py")
    write(folder, f"rules: [{{name: s, match: '*', handler: '{module}:refresh_sync'}}]\n")
    monkeypatch.chdir(tmp_path)
    config = Config.from_yaml(Path("conf") / "rules.yaml")
    assert config.source == str(Path("conf") / "rules.yaml")
    assert config.rules[0].handler is sys.modules[module].refresh_sync


def test_from_string_imports_from_base_dir(tmp_path: Path, module: str) -> None:
    text = f"rules: [{{name: s, match: '*', handler: '{module}:refresh_async'}}]\n"
    config = Config.from_string(text, base_dir=tmp_path)
    assert config.source == "<string>"
    assert inspect.iscoroutinefunction(config.rules[0].handler)


def test_from_string_errors_name_the_source() -> None:
    with pytest.raises(ConfigError) as info:
        Config.from_string("rules: []\n", source="inline.yaml")
    assert (info.value.file, info.value.line, info.value.field) == ("inline.yaml", 1, "rules")
    with pytest.raises(ConfigError) as info:
        Config.from_string("rules: []\n")
    assert info.value.file == "<string>"


def test_nested_attribute_handler() -> None:
    text = "rules: [{name: s, match: '*', handler: 'os:path.basename'}]"
    config = Config.from_string(text)
    assert config.rules[0].handler_ref == "os:path.basename"
    assert config.rules[0].handler is os.path.basename


# --- describe, retry delays, urls -------------------------------------------------


def test_describe_lists_every_resolved_setting(tmp_path: Path) -> None:
    config = Config.from_yaml(write(tmp_path, """\
        namespace: app
        rules:
          - name: user
            match: "stats:user:{id}"
            handler: json:dumps
            absorb: 10ms
          - name: hook
            match: "hook:{id}"
            handler: {http: {url: "https://example.com/h/{id}", secret_env: S}}
        """))
    text = config.describe()
    for fragment in ["app", "shards: 1", "leader_lease: 3s", "claim_lease: 5s", "1. user",
                     "2. hook", "stats:user:{id}", "json:dumps", "window: 2s",
                     "max_wait: 30s", "absorb: 10ms", "timeout: 30s", "concurrency: 16",
                     "attempts 5", "backoff 1s", "max_backoff 5m", "line 3",
                     "POST https://example.com/h/{id}", "$S", str(config.source)]:
        assert fragment in text, fragment


def test_retry_delay_grows_caps_and_jitters() -> None:
    policy = RetryPolicy(attempts=10, backoff=1.0, max_backoff=5.0)
    rng = random.Random(7)
    for attempt, base in [(1, 1.0), (2, 2.0), (3, 4.0), (4, 5.0), (9, 5.0), (5000, 5.0)]:
        delays = [policy.delay(attempt, rng) for _ in range(200)]
        assert all(0.5 * base <= d <= base for d in delays)
        assert max(delays) - min(delays) > 0.3 * base  # jittered, not fixed
    assert 0.5 <= policy.delay(1) <= 1.0


def test_retry_delay_is_reproducible_with_a_seed() -> None:
    policy = RetryPolicy(attempts=3, backoff=0.5, max_backoff=60.0)
    assert policy.delay(3, random.Random(1)) == policy.delay(3, random.Random(1))


def test_http_url_substitutes_quoted_captures() -> None:
    handler = HttpHandler(url="http://h/refresh/{org_id}?x={kind}")
    assert handler.url_for({"org_id": "a/b c", "kind": "é&"}) == \
        "http://h/refresh/a%2Fb%20c?x=%C3%A9%26"


def test_config_and_rules_are_frozen(tmp_path: Path) -> None:
    config = Config.from_yaml(write(tmp_path, MATCHING))
    rule: Rule = config.rules[0]
    with pytest.raises(AttributeError):
        rule.window = 1.0  # type: ignore[misc]
    with pytest.raises(AttributeError):
        config.shards = 2  # type: ignore[misc]


# --- refusals: files and YAML -----------------------------------------------------


def test_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError) as info:
        Config.from_yaml(path)
    assert info.value.file == str(path)
    assert "not found" in info.value.message
    assert "--rules PATH" in info.value.message
    assert str(path) in str(info.value)


def test_directory_instead_of_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        Config.from_yaml(tmp_path)
    assert info.value.file == str(tmp_path)


def test_yaml_syntax_error_has_its_line(tmp_path: Path) -> None:
    assert_refused(tmp_path, """\
        rules:
          - name: a
            match: "*
            handler: json:dumps
        """, line=5, field=None, fragment="(started on line 3)")


def test_yaml_indentation_error_has_its_line(tmp_path: Path) -> None:
    assert_refused(tmp_path, """\
        namespace: x
        rules:
          - name: a
           match: b
        """, line=4, field=None, fragment="YAML syntax error")


def test_empty_file(tmp_path: Path) -> None:
    assert_refused(tmp_path, "", line=None, field=None, fragment="empty")


def test_top_level_not_a_mapping(tmp_path: Path) -> None:
    assert_refused(tmp_path, "- a\n- b\n", line=1, field=None,
                   fragment="the top level must be a mapping, got a list")


def test_bad_tag_is_refused(tmp_path: Path) -> None:
    assert_refused(tmp_path, """\
        namespace: !!python/name:os.system x
        rules: []
        """, line=1, field="namespace", fragment="cannot read value")


def _laughs() -> bytes:
    """The "billion laughs": nine levels of ten aliases each, 10**9 strings expanded."""
    lines = ['l0: &l0 ["lol","lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    lines += [f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 10)}]" for i in range(1, 10)]
    return ("\n".join(lines) + "\nrules: *l9\n").encode()


def _merge_laughs() -> bytes:
    """The same bomb built from merge keys (``<<``), which the loader applies itself."""
    lines = ["l0: &l0 {a: 1, b: 2, c: 3, d: 4, e: 5, f: 6, g: 7, h: 8, i: 9, j: 10}"]
    lines += [f"l{i}: &l{i} {{<<: [{', '.join([f'*l{i - 1}'] * 10)}]}}" for i in range(1, 10)]
    return ("\n".join(lines) + "\nrules:\n  - <<: *l9\n    name: a\n").encode()


RULES_OK = b'rules:\n  - name: a\n    match: "*"\n    handler: json:dumps\n'

HOSTILE = {
    # name: (file content, line, fragment)
    "deep flow list": (b"rules: " + b"[" * 5000 + b"]" * 5000, 1, "nested more than 50"),
    "deep flow mapping": (b"rules: " + b"{a: " * 3000 + b"1" + b"}" * 3000, 1,
                          "nested more than 50"),
    "deep block lists": (b"rules:\n" + b"".join(b"  " * i + b"-\n" for i in range(300)), 51,
                         "nested more than 50"),
    "deep through aliases": (b"".join(f"a{i}: &a{i} [[[[[[[[[[*a{i - 1}]]]]]]]]]]\n".encode()
                                      for i in range(1, 12)).replace(b"*a0", b"1"),
                             4, "nested more than 50"),
    "billion laughs": (_laughs(), 6, "aliases are expanded"),
    "billion laughs by merge keys": (_merge_laughs(), 6, "aliases are expanded"),
    "value holding itself": (b"rules: &r\n  - *r\n", 1, "contains itself"),
    "NUL byte": (RULES_OK.replace(b"name: a", b"name: a\x00"), 2, "U+0000"),
    "control character": (RULES_OK.replace(b"json", b"js\x07on"), 4, "U+0007"),
    "not UTF-8": (RULES_OK.replace(b"match", b"m\xffatch"), 3, "byte 0xff in column 6"),
    "binary": (bytes(range(256)) * 4, 2, "byte 0x80 in column 118"),
    "tab indentation": (RULES_OK.replace(b"    match", b"\tmatch"), 3, "tab character"),
    "unclosed quote": (RULES_OK.replace(b'"*"', b'"*'), 5, "started on line 3"),
    "python tag": (b"namespace: !!python/object/apply:os.system [ls]\n" + RULES_OK, 1,
                   "could not determine a constructor"),
    "huge": (b"#" * (2 * 1024 * 1024), None, "larger than 1024 KiB"),
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_hostile_files_get_one_line_with_file_and_line(tmp_path: Path, name: str) -> None:
    data, line, fragment = HOSTILE[name]
    path = tmp_path / "rules.yaml"
    path.write_bytes(data)
    with pytest.raises(ConfigError) as info:
        Config.from_yaml(path)
    error = info.value
    assert (error.file, error.line) == (str(path), line), error
    assert fragment in error.message
    assert "\n" not in str(error)
    assert str(error).startswith(f"{path}:{line}: " if line else f"{path}: ")


def test_errors_never_quote_a_huge_value(tmp_path: Path) -> None:
    error = assert_refused(tmp_path, "shards: " + "9" * 500_000 + "x\nrules: []\n",
                           line=1, field="shards", fragment="positive whole number")
    assert len(str(error)) < 500


def test_a_url_password_is_not_shown(tmp_path: Path) -> None:
    path = write(tmp_path, """\
        rules:
          - name: a
            match: "*"
            handler: {http: {url: "http://user:s3cret@127.0.0.1:9/hook"}}
        """)
    config = Config.from_yaml(path)
    assert "s3cret" not in config.describe()
    assert "http://user:***@127.0.0.1:9/hook" in config.describe()
    assert "s3cret" not in config.rule("a").handler_ref
    error = assert_refused(tmp_path, """\
        rules:
          - name: a
            match: "*"
            handler: {http: {url: "ftp://user:s3cret@127.0.0.1:9/hook"}}
        """, line=4, field="rules[0].handler.http.url", fragment="ftp://user:***@")
    assert "s3cret" not in str(error)


# --- refusals: fields -------------------------------------------------------------


RULE = '  - {name: a, match: "*", handler: "json:dumps"}\n'


@pytest.mark.parametrize(
    ("text", "line", "field", "fragment"),
    [
        ("namespac: x\nrules:\n" + RULE, 1, "namespac", "did you mean 'namespace'"),
        ("defaults:\n  windw: 2s\nrules:\n" + RULE, 2, "defaults.windw", "allowed: window"),
        ("defaults:\n  retry:\n    tries: 2\nrules:\n" + RULE, 3, "defaults.retry.tries",
         "allowed: attempts, backoff, max_backoff"),
        ("rules:\n  - name: a\n    match: x\n    handler: json:dumps\n    windo: 1s\n", 5,
         "rules[0].windo", "unknown field 'windo' in a rule"),
        ("rules:\n  - {name: a, match: x, handler: json:dumps, retry: {attempt: 2}}\n", 2,
         "rules[0].retry.attempt", "did you mean 'attempts'"),
        ("rules:\n  - name: a\n    match: x\n    handler:\n      http:\n        url: http://h/\n"
         "        verb: GET\n", 7, "rules[0].handler.http.verb", "allowed: url, method"),
        ("rules:\n  - name: a\n    match: x\n    handler:\n      grpc: {}\n", 5,
         "rules[0].handler.grpc", "allowed: http"),
        ("rules:\n  - name: a\n    name: b\n    match: x\n    handler: json:dumps\n", 3,
         "rules[0].name", "given twice"),
        ("1: x\nrules:\n" + RULE, 1, None, "field names must be plain strings"),
    ],
)
def test_unknown_and_duplicate_fields(tmp_path: Path, text: str, line: int, field: str,
                                      fragment: str) -> None:
    assert_refused(tmp_path, text, line=line, field=field, fragment=fragment)


@pytest.mark.parametrize(
    ("missing", "field"),
    [("name", "rules[1].name"), ("match", "rules[1].match"), ("handler", "rules[1].handler")],
)
def test_missing_rule_fields(tmp_path: Path, missing: str, field: str) -> None:
    entries = {"name": "name: b", "match": "match: 'b:*'", "handler": "handler: json:dumps"}
    del entries[missing]
    body = "\n    ".join(entries.values())
    assert_refused(tmp_path, f"rules:\n{RULE}  - {body}\n", line=3, field=field,
                   fragment=f"missing the required field '{missing}'")


@pytest.mark.parametrize(
    ("text", "line", "field", "fragment"),
    [
        ("namespace: x\n", 1, "rules", "missing the required field 'rules'"),
        ("rules: []\n", 1, "rules", "rules is empty"),
        ("rules:\n", 1, "rules", "must be a list of rules, got nothing"),
        ("rules: {a: 1}\n", 1, "rules", "must be a list of rules, got a mapping"),
        ("rules:\n" + RULE + "  - just-a-string\n", 3, "rules[1]",
         "a rule must be a mapping, got a string"),
        ("defaults: [1]\nrules:\n" + RULE, 1, "defaults", "defaults must be a mapping"),
        ("rules:\n  - {name: a, match: x, handler: json:dumps, retry: 3}\n", 2,
         "rules[0].retry", "retry must be a mapping, got an integer"),
    ],
)
def test_bad_structure(tmp_path: Path, text: str, line: int, field: str,
                       fragment: str) -> None:
    assert_refused(tmp_path, text, line=line, field=field, fragment=fragment)


# --- refusals: values -------------------------------------------------------------


def rule_with(setting: str) -> str:
    return f"rules:\n  - name: a\n    match: x\n    handler: json:dumps\n    {setting}\n"


@pytest.mark.parametrize(
    ("text", "line", "field", "fragment"),
    [
        (rule_with("window: 2 days"), 5, "rules[0].window", "bad duration '2 days'"),
        (rule_with("window: 0"), 5, "rules[0].window", "must be longer than 0"),
        (rule_with("window: 0ms"), 5, "rules[0].window", "must be longer than 0"),
        (rule_with("timeout: 0s"), 5, "rules[0].timeout", "must be longer than 0"),
        (rule_with("max_wait: -1"), 5, "rules[0].max_wait", "negative duration -1"),
        (rule_with("absorb: yes"), 5, "rules[0].absorb", "bad duration True"),
        (rule_with("retry: {backoff: soon}"), 5, "rules[0].retry.backoff", "bad duration"),
        ("defaults:\n  absorb: '5x'\nrules:\n" + RULE, 2, "defaults.absorb", "bad duration"),
        ("leader_lease: soon\nrules:\n" + RULE, 1, "leader_lease", '"50ms"'),
        ("claim_lease: 0\nrules:\n" + RULE, 1, "claim_lease", "must be longer than 0"),
        (rule_with("concurrency: 0"), 5, "rules[0].concurrency", "positive whole number"),
        (rule_with("concurrency: '8'"), 5, "rules[0].concurrency", "positive whole number"),
        (rule_with("concurrency: 1.5"), 5, "rules[0].concurrency", "positive whole number"),
        (rule_with("concurrency: true"), 5, "rules[0].concurrency", "positive whole number"),
        (rule_with("retry: {attempts: 0}"), 5, "rules[0].retry.attempts",
         "positive whole number"),
        ("defaults:\n  retry:\n    attempts: -2\nrules:\n" + RULE, 3,
         "defaults.retry.attempts", "positive whole number"),
        ("shards: 0\nrules:\n" + RULE, 1, "shards", "positive whole number"),
        ("shards: two\nrules:\n" + RULE, 1, "shards", "positive whole number"),
        ("shards: 100000\nrules:\n" + RULE, 1, "shards", "at most 16384"),
    ],
)
def test_bad_values(tmp_path: Path, text: str, line: int, field: str, fragment: str) -> None:
    assert_refused(tmp_path, text, line=line, field=field, fragment=fragment)


@pytest.mark.parametrize(
    ("text", "line", "field", "fragment"),
    [
        # the rule's own setting is blamed before one from defaults or the built-ins
        (rule_with("window: 40ms"), 5, "rules[0].window", "absorb (50ms) must be shorter"),
        (rule_with("absorb: 2s"), 5, "rules[0].absorb", "than window (2s)"),
        (rule_with("{window: 1s, absorb: 1s}").replace("    {", "    <<: {"), 5,
         "rules[0].absorb", "must be shorter"),
        ("defaults:\n  absorb: 3s\nrules:\n" + RULE, 2, "defaults.absorb",
         "absorb (3s) must be shorter than window (2s)"),
        ("defaults:\n  absorb: 1s\nrules:\n" + rule_with("window: 1s").split("\n", 1)[1], 7,
         "rules[0].window", "must be shorter"),
        (rule_with("max_wait: 1s"), 5, "rules[0].max_wait",
         "max_wait (1s) must be at least window (2s)"),
        (rule_with("window: 1m"), 5, "rules[0].window",
         "max_wait (30s) must be at least window (1m)"),
        ("defaults:\n  max_wait: 3s\nrules:\n" + rule_with("window: 4s").split("\n", 1)[1], 7,
         "rules[0].window", "must be at least"),
        (rule_with("retry: {backoff: 10m}"), 5, "rules[0].retry.backoff",
         "backoff (10m) must not exceed retry max_backoff (5m)"),
        ("defaults:\n  retry: {backoff: 10s}\nrules:\n"
         + rule_with("retry: {max_backoff: 5s}").split("\n", 1)[1], 7,
         "rules[0].retry.max_backoff", "must not exceed"),
    ],
)
def test_inconsistent_settings(tmp_path: Path, text: str, line: int, field: str,
                               fragment: str) -> None:
    assert_refused(tmp_path, text, line=line, field=field, fragment=fragment)


def test_max_wait_equal_to_window_is_allowed(tmp_path: Path) -> None:
    config = Config.from_yaml(write(tmp_path, rule_with("{window: 5s, max_wait: 5s}")
                                    .replace("    {", "    <<: {")))
    assert config.rules[0].max_wait == config.rules[0].window == 5.0


# --- refusals: names and patterns -------------------------------------------------


@pytest.mark.parametrize(
    ("text", "line", "field", "fragment"),
    [
        ("rules:\n" + RULE + "  - name: x\n    match: y\n    handler: json:dumps\n"
         "  - name: a\n    match: z\n    handler: json:dumps\n", 6, "rules[2].name",
         "duplicate rule name 'a' (first used on line 2)"),
        ("rules:\n  - {name: 'user stats', match: x, handler: json:dumps}\n", 2,
         "rules[0].name", "letters, digits, '_', '.' and '-'"),
        ("rules:\n  - {name: 'a{b}', match: x, handler: json:dumps}\n", 2, "rules[0].name",
         "Redis keys"),
        ("rules:\n  - {name: 12, match: x, handler: json:dumps}\n", 2, "rules[0].name",
         "must be a non-empty string, got an integer"),
        ("rules:\n  - {name: '', match: x, handler: json:dumps}\n", 2, "rules[0].name",
         "non-empty string"),
        ("namespace: 'my ns'\nrules:\n" + RULE, 1, "namespace", "letters, digits"),
        ("namespace: 'a:b'\nrules:\n" + RULE, 1, "namespace", "Redis keys"),
        ("rules:\n  - name: a\n    match: 'stats:{'\n    handler: json:dumps\n", 3,
         "rules[0].match", "unbalanced '{'"),
        ("rules:\n  - name: a\n    match: '{a}:{a}'\n    handler: json:dumps\n", 3,
         "rules[0].match", "appears twice"),
        ("rules:\n  - name: a\n    match: 'x:{1}'\n    handler: json:dumps\n", 3,
         "rules[0].match", "not an identifier"),
        ("rules:\n  - name: a\n    match: 'x:{}'\n    handler: json:dumps\n", 3,
         "rules[0].match", "empty braces"),
        ("rules:\n  - name: a\n    match: ''\n    handler: json:dumps\n", 3,
         "rules[0].match", "non-empty string"),
        ("rules:\n  - name: a\n    match: [x]\n    handler: json:dumps\n", 3,
         "rules[0].match", "got a list"),
    ],
)
def test_bad_names_and_patterns(tmp_path: Path, text: str, line: int, field: str,
                                fragment: str) -> None:
    assert_refused(tmp_path, text, line=line, field=field, fragment=fragment)


# --- refusals: handlers -----------------------------------------------------------


def handler_rule(handler: str) -> str:
    return f"rules:\n  - name: a\n    match: 'x:{{id}}'\n    handler: {handler}\n"


@pytest.mark.parametrize("ref", ["json", "'json:'", ":dumps", "my-app:f", "a:b:c", "a:1f",
                                 "a..b:f", "'json: dumps'"])
def test_handler_not_module_function(tmp_path: Path, ref: str) -> None:
    assert_refused(tmp_path, handler_rule(ref), line=4, field="rules[0].handler",
                   fragment="must have the form 'module:function'")


def test_handler_module_does_not_import(tmp_path: Path) -> None:
    error = assert_refused(tmp_path, handler_rule("no_such_module_xyz:f"), line=4,
                           field="rules[0].handler", fragment="does not import")
    assert "ModuleNotFoundError" in error.message
    assert str(tmp_path.resolve()) in error.message


def test_handler_module_raises_on_import(tmp_path: Path) -> None:
    name = f"broken_{uuid.uuid4().hex}"
    (tmp_path / f"{name}.py").write_text("raise RuntimeError('boom')\n")
    error = assert_refused(tmp_path, handler_rule(f"{name}:f"), line=4,
                           field="rules[0].handler", fragment="does not import")
    assert "RuntimeError: boom" in error.message


def test_handler_module_with_syntax_error(tmp_path: Path) -> None:
    name = f"broken_{uuid.uuid4().hex}"
    (tmp_path / f"{name}.py").write_text("def f(:\n")
    assert_refused(tmp_path, handler_rule(f"{name}:f"), line=4, field="rules[0].handler",
                   fragment="SyntaxError")


def test_handler_attribute_missing(tmp_path: Path, module: str) -> None:
    assert_refused(tmp_path, handler_rule(f"{module}:nope"), line=4,
                   field="rules[0].handler", fragment="has no attribute 'nope'")


def test_handler_not_callable(tmp_path: Path, module: str) -> None:
    assert_refused(tmp_path, handler_rule(f"{module}:NOT_CALLABLE"), line=4,
                   field="rules[0].handler", fragment="is int, not a function")


def test_handler_of_wrong_type(tmp_path: Path) -> None:
    assert_refused(tmp_path, handler_rule("[a]"), line=4, field="rules[0].handler",
                   fragment="non-empty string")


def http_rule(*lines: str) -> str:
    body = "".join(f"\n        {line}" for line in lines)
    return handler_rule("\n      http:" + body)


@pytest.mark.parametrize(
    ("lines", "line", "field", "fragment"),
    [
        (("method: POST",), 6, "rules[0].handler.http.url", "missing the required field 'url'"),
        (("url: ftp://h/x",), 6, "rules[0].handler.http.url", "absolute http:// or https://"),
        (("url: /refresh/{id}",), 6, "rules[0].handler.http.url", "absolute http://"),
        (("url: 'http://h/{org}'",), 6, "rules[0].handler.http.url",
         "{org}, which is not a capture of the rule's pattern 'x:{id}' (its captures: {id})"),
        (("url: 'http://h/{id'",), 6, "rules[0].handler.http.url", "unbalanced brace"),
        (("url: http://h/", "method: GET"), 7, "rules[0].handler.http.method",
         "use one of POST, PUT, PATCH"),
        (("url: http://h/", "timeout: 0"), 7, "rules[0].handler.http.timeout",
         "must be longer than 0"),
        (("url: http://h/", "timeout: fast"), 7, "rules[0].handler.http.timeout",
         "bad duration"),
        (("url: http://h/", "secret_env: 'MY SECRET'"), 7, "rules[0].handler.http.secret_env",
         "environment variable"),
    ],
)
def test_bad_http_handler(tmp_path: Path, lines: tuple[str, ...], line: int, field: str,
                          fragment: str) -> None:
    assert_refused(tmp_path, http_rule(*lines), line=line, field=field, fragment=fragment)


def test_http_handler_not_a_mapping(tmp_path: Path) -> None:
    assert_refused(tmp_path, handler_rule("{http: 'http://h/'}"), line=4,
                   field="rules[0].handler.http", fragment="must be a mapping, got a string")


def test_http_handler_defaults_and_method_case(tmp_path: Path) -> None:
    config = Config.from_yaml(write(tmp_path, http_rule("url: 'https://h/r/{id}'",
                                                         "method: put")))
    handler = config.rules[0].handler
    assert handler == HttpHandler(url="https://h/r/{id}", method="PUT")
    assert (handler.timeout, handler.secret_env) == (None, None)


# --- handler signatures: a handler is called with one argument, the claim --------------


SIGNATURES = """\
import functools

def no_args():
    pass

async def two_args(a, b):
    pass

def keyword_only(*, claim):
    pass

def two_required(claim, other, extra=1):
    pass

def one(claim):
    pass

async def one_async(claim):
    pass

def one_with_extra(claim, extra=1):
    pass

def star(*args):
    pass

class Refresher:
    def __call__(self, claim):
        pass

class NoArgs:
    def __call__(self):
        pass

INSTANCE = Refresher()
BAD_INSTANCE = NoArgs()
PARTIAL = functools.partial(two_args, "bound")
BAD_PARTIAL = functools.partial(two_required, extra=2)
"""


@pytest.fixture
def signatures(tmp_path: Path) -> Iterator[str]:
    name = f"signatures_{uuid.uuid4().hex}"
    (tmp_path / f"{name}.py").write_text(SIGNATURES)
    yield name
    sys.modules.pop(name, None)


@pytest.mark.parametrize("attr", ["one", "one_async", "one_with_extra", "star", "INSTANCE",
                                  "PARTIAL"])
def test_a_handler_taking_the_claim_is_accepted(tmp_path: Path, signatures: str,
                                                attr: str) -> None:
    config = Config.from_yaml(write(tmp_path, handler_rule(f"{signatures}:{attr}")))
    assert config.rules[0].handler is getattr(sys.modules[signatures], attr)
    assert config.rules[0].window == 2.0  # the default settings


def test_a_builtin_without_a_readable_signature_is_accepted(tmp_path: Path) -> None:
    config = Config.from_yaml(write(tmp_path, handler_rule("builtins:next")))
    assert config.rules[0].handler is next


@pytest.mark.parametrize(
    ("attr", "says"),
    [
        ("no_args", "takes 0 positional arguments; a handler takes one (the claim)"),
        ("two_args", "takes 2 positional arguments; a handler takes one (the claim)"),
        ("two_required", "requires 2 positional arguments; a handler takes one (the claim)"),
        ("keyword_only", "has required keyword-only arguments ('claim'); a handler takes one "
                         "positional argument (the claim)"),
        ("BAD_INSTANCE", "takes 0 positional arguments; a handler takes one (the claim)"),
        ("BAD_PARTIAL", "takes 2 positional arguments; a handler takes one (the claim)"),
        # the class itself, not an instance: calling it builds a Refresher()
        ("Refresher", "takes 0 positional arguments; a handler takes one (the claim)"),
    ],
)
def test_a_handler_that_cannot_take_the_claim_is_refused(tmp_path: Path, signatures: str,
                                                         attr: str, says: str) -> None:
    error = assert_refused(tmp_path, handler_rule(f"{signatures}:{attr}"), line=4,
                           field="rules[0].handler", fragment=says)
    assert error.message == f"{signatures}:{attr} {says}"
    assert str(error) == f"{tmp_path / 'rules.yaml'}:4: rules[0].handler: {error.message}"


# --- every error at once --------------------------------------------------------------


def test_every_error_is_reported_in_file_order(tmp_path: Path, signatures: str) -> None:
    error, path = refused(tmp_path, f"""\
        shards: 0
        defaults:
          window: -5
          absorb: 3s
        rules:
          - name: a
            match: "a:{{id}}"
            handler: {signatures}:no_args
            timeout: "-2s"
            windw: 1s
          - name: a
            match: "b:{{"
            handler: no_such_module_xyz:f
          - just-a-string
          - name: ok
            match: "c:*"
            handler: {signatures}:one
            concurrency: 0
        """)
    found = [(e.line, e.field) for e in error.errors]
    assert found == [
        (1, "shards"), (3, "defaults.window"), (8, "rules[0].handler"),
        (9, "rules[0].timeout"), (10, "rules[0].windw"), (11, "rules[1].name"),
        (12, "rules[1].match"), (13, "rules[1].handler"), (14, "rules[2]"),
        (18, "rules[3].concurrency"),
    ], error
    assert (error.line, error.field) == (1, "shards")  # the first one, for callers of one
    assert str(error).splitlines() == [str(e) for e in error.errors]
    assert all(line.startswith(f"{path}:") for line in str(error).splitlines())
    assert "duplicate rule name 'a'" in error.errors[5].message


def test_a_conflict_in_defaults_is_reported_once(tmp_path: Path) -> None:
    error, _ = refused(tmp_path, """\
        defaults:
          absorb: 3s
        rules:
          - {name: a, match: "a:*", handler: "json:dumps"}
          - {name: b, match: "b:*", handler: "json:dumps", window: 1s}
          - {name: c, match: "c:*", handler: "json:dumps", window: 10s}
        """)
    assert [(e.line, e.field) for e in error.errors] == [(2, "defaults.absorb"),
                                                          (5, "rules[1].window")]


def test_one_error_is_the_error_itself(tmp_path: Path) -> None:
    error, _ = refused(tmp_path, rule_with("window: 1m"))
    assert error.errors == [error]
    assert "\n" not in str(error)


# --- negative and zero durations ------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "line", "field", "fragment"),
    [
        (rule_with("window: -5"), 5, "rules[0].window", "negative duration -5"),
        (rule_with("window: '-2s'"), 5, "rules[0].window", "negative duration '-2s'"),
        (rule_with("absorb: -10ms"), 5, "rules[0].absorb", "negative duration '-10ms'"),
        (rule_with("timeout: -0.5"), 5, "rules[0].timeout", "never below 0"),
        (rule_with("retry: {backoff: -1s}"), 5, "rules[0].retry.backoff", "negative"),
        ("defaults:\n  max_wait: -1m\nrules:\n" + RULE, 2, "defaults.max_wait", "negative"),
        ("claim_lease: -3\nrules:\n" + RULE, 1, "claim_lease", "negative duration -3"),
        ("leader_lease: 0\nrules:\n" + RULE, 1, "leader_lease", "must be longer than 0"),
        (rule_with("max_wait: 0"), 5, "rules[0].max_wait", "must be longer than 0"),
        (http_rule("url: http://h/", "timeout: -5"), 7, "rules[0].handler.http.timeout",
         "negative duration -5"),
    ],
)
def test_negative_and_zero_durations(tmp_path: Path, text: str, line: int, field: str,
                                     fragment: str) -> None:
    assert_refused(tmp_path, text, line=line, field=field, fragment=fragment)


def test_zero_is_allowed_where_it_makes_sense(tmp_path: Path) -> None:
    config = Config.from_yaml(write(tmp_path, rule_with(
        "{absorb: 0, retry: {backoff: 0, max_backoff: 0}}").replace("    {", "    <<: {")))
    rule = config.rules[0]
    assert (rule.absorb, rule.retry.backoff, rule.retry.max_backoff) == (0.0, 0.0, 0.0)


# --- warnings: rules that can never match, secrets not set ----------------------------


def rules_matching(*patterns: str) -> str:
    return "rules:\n" + "".join(f"  - name: r{i}\n    match: '{p}'\n    handler: json:dumps\n"
                                for i, p in enumerate(patterns))


@pytest.mark.parametrize(
    ("patterns", "shadowed"),
    [
        (["x:*", "x:{id}"], {1: "rules[0] 'r0' ('x:*', line 3)"}),
        (["*", "a:{b}", "c"], {1: "rules[0] 'r0'", 2: "rules[0] 'r0'"}),
        (["a:{b}", "a:{b}"], {1: "rules[0] 'r0'"}),  # the same pattern twice
        (["a:{x}", "a:{y}"], {1: "rules[0] 'r0'"}),  # the same keys, other capture names
        (["stats:*", "stats:user:{id}:daily"], {1: "rules[0] 'r0'"}),
        (["{a}:*", "{x}:{y}:{z}"], {1: "rules[0] 'r0'"}),
        (["a:{x}", "a:b"], {1: "rules[0] 'r0'"}),  # a literal segment a capture covers
        (["x:", "x:{a}", "x:*:*", "x:*"], {3: "the rules listed before it, between them"}),
        # reachable: some key reaches each of them first
        (["x:{id}", "x:*"], {}),
        (["a:{b}", "a:*"], {}),  # "a:" and "a:b:c" reach the second
        (["{a}", "*"], {}),
        (["a:{x}", "a:{x}:{y}", "*"], {}),
        (["*a*", "{x}"], {}),
        (["x:*:*", "x:*"], {}),
        (["user:{id}", "org:{id}", "*"], {}),
    ],
)
def test_a_rule_that_can_never_match_is_a_warning(tmp_path: Path, patterns: list[str],
                                                  shadowed: dict[int, str]) -> None:
    path = write(tmp_path, rules_matching(*patterns))
    config = Config.from_yaml(path)  # a warning does not refuse the file
    warnings = config.warnings({})
    assert {int(w.field[6:w.field.index("]")]) for w in warnings if w.field} == set(shadowed)
    for warning in warnings:
        index = int(str(warning.field)[6:str(warning.field).index("]")])
        assert warning.field == f"rules[{index}].match"
        assert warning.line == 3 + 3 * index
        assert shadowed[index] in warning.message
        assert f"rule 'r{index}' can never match" in warning.message
        assert str(warning).startswith(f"{path}:{warning.line}: rules[{index}].match: warning: ")


def _keys(alphabet: str, longest: int) -> Iterator[str]:
    yield ""
    for length in range(1, longest + 1):
        for combo in itertools.product(alphabet, repeat=length):
            yield "".join(combo)


def test_the_never_match_warning_is_never_wrong() -> None:
    """Every key up to 6 characters over a small alphabet: when a rule is said to be
    covered, no key reaches it; the pairs here include covered and uncovered ones."""
    parts = ["a", ":", "{p}", "*", "b"]
    patterns = sorted({"".join(c) for n in (1, 2, 3) for c in itertools.product(parts,
                                                                                   repeat=n)
                       if "{p}{p}" not in "".join(c) and "".join(c).count("{p}") <= 1})
    compiled = [KeyPattern.compile(p) for p in patterns]
    keys = list(_keys("ab:", 6))
    said_covered = 0
    for earlier, later in itertools.product(compiled, repeat=2):
        if covers([earlier], later):
            said_covered += 1
            assert all(earlier.match(k) is not None for k in keys if later.match(k) is not None), \
                (earlier.source, later.source)
        elif earlier.source == later.source:
            pytest.fail(f"{earlier.source!r} not seen to cover itself")
    assert said_covered > len(compiled)  # more than the identical pairs


def test_an_unset_webhook_secret_is_a_warning(tmp_path: Path) -> None:
    path = write(tmp_path, """\
        rules:
          - name: user
            match: "user:{id}"
            handler: json:dumps
          - name: org
            match: "org:{id}"
            handler:
              http:
                url: "http://127.0.0.1:9/{id}"
                secret_env: ORG_SECRET
        """)
    config = Config.from_yaml(path)
    (warning,) = config.warnings({"OTHER": "x"})
    assert (warning.line, warning.field) == (10, "rules[1].handler.http.secret_env")
    assert "ORG_SECRET is not set" in warning.message and "'org'" in warning.message
    assert [w.field for w in config.warnings({"ORG_SECRET": ""})] == [warning.field]
    assert config.warnings({"ORG_SECRET": "s3cret"}) == []
    (error,) = config.unset_secrets({})
    assert str(error).startswith(f"{path}:10: rules[1].handler.http.secret_env: rule 'org' "
                                 "signs its webhook with the environment variable ORG_SECRET")
    assert config.unset_secrets({"ORG_SECRET": "s3cret"}) == []


def test_check_file_gives_warnings_even_with_errors(tmp_path: Path) -> None:
    path = write(tmp_path, rules_matching("*", "a:{b}").replace("json:dumps", "json", 1))
    report = check_file(path, {})
    assert report.config is None
    assert [(e.line, e.field) for e in report.errors] == [(4, "rules[0].handler")]
    assert [(w.line, w.field) for w in report.warnings] == [(6, "rules[1].match")]
    clean = check_file(write(tmp_path, rules_matching("a:{b}", "*")), {})
    assert clean.config is not None
    assert (clean.errors, clean.warnings) == ((), ())


# --- handlers are imported only where they run ----------------------------------------


def test_handlers_can_be_left_unimported(tmp_path: Path) -> None:
    name = f"marker_{uuid.uuid4().hex}"
    marker = tmp_path / "imported"
    (tmp_path / f"{name}.py").write_text(
        f"open({str(marker)!r}, 'w').close()\ndef refresh(claim):\n    pass\n")
    path = write(tmp_path, handler_rule(f"{name}:refresh"))
    saved = list(sys.path)
    config = Config.from_yaml(path, import_handlers=False)
    assert not marker.exists() and name not in sys.modules
    assert sys.path == saved
    pending = config.rules[0].handler
    assert isinstance(pending, HandlerImport)
    assert (pending.ref, pending.line, pending.field) == (f"{name}:refresh", 4,
                                                          "rules[0].handler")
    assert config.rule_for("x:1").name == "a"  # matching needs no handler
    loaded = config.with_handlers()
    assert marker.exists()
    assert loaded.rules[0].handler is sys.modules.pop(name).refresh
    assert loaded.with_handlers() is loaded


def test_a_lazy_handler_is_still_checked_when_imported(tmp_path: Path,
                                                       signatures: str) -> None:
    path = write(tmp_path, f"""\
        rules:
          - {{name: a, match: "a:*", handler: "no_such_module_xyz:f"}}
          - {{name: b, match: "b:*", handler: "{signatures}:no_args"}}
          - {{name: c, match: "c:*", handler: "{signatures}:one"}}
        """)
    config = Config.from_yaml(path, import_handlers=False)  # loads: nothing imported
    with pytest.raises(ConfigError) as info:
        config.with_handlers()
    assert [(e.file, e.line, e.field) for e in info.value.errors] == [
        (str(path), 2, "rules[0].handler"), (str(path), 3, "rules[1].handler")]
    assert "does not import" in info.value.errors[0].message
    assert "takes 0 positional arguments" in info.value.errors[1].message


def test_a_malformed_handler_is_refused_without_importing(tmp_path: Path) -> None:
    path = write(tmp_path, handler_rule("json"))
    with pytest.raises(ConfigError) as info:
        Config.from_yaml(path, import_handlers=False)
    assert (info.value.line, info.value.field) == (4, "rules[0].handler")
    assert "must have the form 'module:function'" in info.value.message


WRITER_RULES = """\
namespace: {ns}
rules:
  - name: user
    match: "stats:user:{{id}}"
    handler: {handler}
"""


async def test_a_writer_touches_without_the_handler_module(
        tmp_path: Path, redis_url: str, namespace: str) -> None:
    """The handler's module lives only where the workers run: a writer (worker=False)
    touches and flushes all the same; a worker is refused with the file, line and field."""
    missing = f"workers_only_{uuid.uuid4().hex}"
    path = write(tmp_path, WRITER_RULES.format(ns=namespace, handler=f"{missing}.stats:refresh"))
    async with Coalescer.from_yaml(path, redis_url=redis_url, worker=False) as writer:
        writer.touch("stats:user:1")
        await writer.flush()
        assert (await writer.query.status())["rules"]["user"]["pending"] == 1
    with SyncCoalescer.from_yaml(path, redis_url=redis_url) as sync_writer:
        sync_writer.touch("stats:user:2")
        sync_writer.flush()
    assert not any(name.startswith(missing) for name in sys.modules)
    for make in (lambda: Coalescer.from_yaml(path, redis_url=redis_url),
                 lambda: Coalescer(Config.from_yaml(path, import_handlers=False),
                                   redis_url=redis_url, worker=True)):
        with pytest.raises(ConfigError) as info:
            make()
        assert (info.value.file, info.value.line, info.value.field) == (
            str(path), 5, "rules[0].handler")
        assert f"handler module '{missing}.stats' does not import" in info.value.message


async def test_a_worker_built_on_a_writers_config_imports_and_runs_handlers(
        tmp_path: Path, redis_url: str, namespace: str, module: str) -> None:
    path = write(tmp_path, WRITER_RULES.format(ns=namespace, handler=f"{module}:refresh_async")
                 + "    window: 50ms\n    absorb: 10ms\n")
    config = Config.from_yaml(path, import_handlers=False)
    async with Coalescer(config, redis_url=redis_url, worker=True) as node:
        assert node.config.rules[0].handler is sys.modules[module].refresh_async
        node.touch("stats:user:7")
        calls = sys.modules[module].CALLS
        await wait_until(lambda: calls, message="the refresh")
    ((kind, claim),) = calls
    assert (kind, claim.key, claim.params) == ("async", "stats:user:7", {"id": "7"})
