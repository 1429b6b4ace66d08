"""$COALESCER_NAMESPACE replaces the rules' namespace wherever rules are loaded; `check`
and `status` say so; a bad value is an error naming the variable and the value."""

from __future__ import annotations

from pathlib import Path

import pytest

from coalescer import Coalescer, Config, ConfigError
from coalescer.cli.main import main
from coalescer.config.rules import check_file

RULES = """\
namespace: {ns}
rules:
  - name: item
    match: "item:{{id}}"
    handler: builtins:id
"""


@pytest.fixture
def rules(tmp_path: Path, namespace: str) -> Path:
    path = tmp_path / "rules.yaml"
    path.write_text(RULES.format(ns=namespace))
    return path


def test_the_variable_replaces_the_namespace_of_a_file_and_of_text(
        rules: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COALESCER_NAMESPACE", "dev-ann")
    assert Config.from_yaml(rules).namespace == "dev-ann"
    assert Config.from_string(RULES.format(ns="shop")).namespace == "dev-ann"
    assert check_file(rules, {}).config.namespace == "dev-ann"  # type: ignore[union-attr]


@pytest.mark.parametrize("value", [None, ""])
def test_unset_or_empty_leaves_the_files_namespace(
        rules: Path, namespace: str, value: str | None,
        monkeypatch: pytest.MonkeyPatch) -> None:
    if value is None:
        monkeypatch.delenv("COALESCER_NAMESPACE", raising=False)
    else:
        monkeypatch.setenv("COALESCER_NAMESPACE", value)
    assert Config.from_yaml(rules).namespace == namespace


@pytest.mark.parametrize("value", ["a b", "shop:1", "ns\n"])
def test_a_bad_value_is_an_error_naming_the_variable_and_the_value(
        rules: Path, value: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COALESCER_NAMESPACE", value)
    with pytest.raises(ConfigError) as caught:
        Config.from_yaml(rules)
    assert str(caught.value) == (
        f"{rules}: namespace: $COALESCER_NAMESPACE is {value!r}, which is not a namespace: "
        "it may only use letters, digits, '_', '.' and '-' (it becomes part of Redis keys); "
        "fix or unset $COALESCER_NAMESPACE")
    report = check_file(rules, {})
    assert report.config is None
    assert [e.field for e in report.errors] == ["namespace"]


async def test_touches_go_to_the_variables_namespace(
        rules: Path, namespace: str, redis_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COALESCER_NAMESPACE", f"{namespace}-other")
    async with Coalescer.from_yaml(rules, redis_url=redis_url, worker=False) as c:
        c.touch("item:1")
        await c.flush()
        assert (await c.query.status())["rules"]["item"]["pending"] == 1
    monkeypatch.delenv("COALESCER_NAMESPACE")
    async with Coalescer.from_yaml(rules, redis_url=redis_url, worker=False) as c:
        assert c.config.namespace == namespace
        assert (await c.query.status())["rules"]["item"]["pending"] == 0


def test_check_says_where_the_namespace_came_from(
        rules: Path, namespace: str, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", str(rules)]) == 0
    assert f"namespace: {namespace}  shards: 1" in capsys.readouterr().out
    monkeypatch.setenv("COALESCER_NAMESPACE", "dev-ann")
    assert main(["check", str(rules)]) == 0
    assert "namespace: dev-ann (from $COALESCER_NAMESPACE)  shards: 1" in (
        capsys.readouterr().out)


def test_check_fails_on_a_bad_value(rules: Path, monkeypatch: pytest.MonkeyPatch,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("COALESCER_NAMESPACE", "a b")
    assert main(["check", str(rules)]) == 1
    err = capsys.readouterr().err
    assert "namespace: $COALESCER_NAMESPACE is 'a b', which is not a namespace" in err
    assert f"1 error in {rules}" in err


def test_status_says_where_the_namespace_came_from(
        rules: Path, namespace: str, redis_url: str, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("COALESCER_NAMESPACE", f"{namespace}-dev")
    assert main(["status", "--rules", str(rules), "--redis", redis_url]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first == f"namespace {namespace}-dev (from $COALESCER_NAMESPACE)"
