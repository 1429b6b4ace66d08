"""A rule's ``isolation`` field: ``thread`` (the default) or ``process``, which only a
plain-function Python handler can have; every refusal names the file, line and field."""

from __future__ import annotations

import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from textwrap import dedent

import pytest

from coalescer.config.rules import Config
from coalescer.errors import ConfigError

HANDLERS = """\
async def refresh_async(claim):
    pass

def refresh_sync(claim):
    pass
"""

RULE = """\
rules:
  - name: stats
    match: "stats:{{id}}"
    handler: {handler}
    isolation: {isolation}
"""


@pytest.fixture
def module(tmp_path: Path) -> Iterator[str]:
    """A handler module in tmp_path under a name no other test uses."""
    name = f"iso_handlers_{uuid.uuid4().hex}"
    (tmp_path / f"{name}.py").write_text(HANDLERS)
    saved = list(sys.path)
    yield name
    sys.modules.pop(name, None)
    sys.path[:] = saved


def _rules(tmp_path: Path, handler: str, isolation: str) -> Path:
    path = tmp_path / "rules.yaml"
    path.write_text(dedent(RULE.format(handler=handler, isolation=isolation)))
    return path


def _refused(path: Path, *, import_handlers: bool = True) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        Config.from_yaml(path, import_handlers=import_handlers).with_handlers()
    error = info.value
    assert (error.file, error.line, error.field) == (str(path), 5, "rules[0].isolation")
    return error


def test_process_isolation_of_a_plain_function_imports_from_the_rules_folder(
        tmp_path: Path, module: str) -> None:
    rule = Config.from_yaml(_rules(tmp_path, f"{module}:refresh_sync", "process")).rules[0]
    assert rule.isolation is not None
    assert rule.isolation.base_dir == tmp_path.resolve()
    assert "isolation: process" in rule.describe()


def test_thread_isolation_is_the_default(tmp_path: Path, module: str) -> None:
    rule = Config.from_yaml(_rules(tmp_path, f"{module}:refresh_sync", "thread")).rules[0]
    assert rule.isolation is None


def test_an_unknown_isolation_is_refused(tmp_path: Path, module: str) -> None:
    error = _refused(_rules(tmp_path, f"{module}:refresh_sync", "fork"))
    assert "isolation must be thread or process, got 'fork'" in error.message


def test_process_isolation_of_an_async_handler_is_refused(tmp_path: Path,
                                                           module: str) -> None:
    error = _refused(_rules(tmp_path, f"{module}:refresh_async", "process"))
    assert "async def" in error.message


def test_process_isolation_of_an_async_handler_is_refused_when_imported_later(
        tmp_path: Path, module: str) -> None:
    error = _refused(_rules(tmp_path, f"{module}:refresh_async", "process"),
                     import_handlers=False)
    assert "async def" in error.message


def test_process_isolation_of_a_webhook_is_refused(tmp_path: Path) -> None:
    error = _refused(_rules(tmp_path, "{http: {url: 'http://127.0.0.1:9/x'}}", "process"))
    assert "an http handler has nothing to isolate" in error.message
