"""A pytest plugin for testing code that touches keys: installed with coalescer.

pytest loads it by itself (entry point ``pytest11``; ``-p no:coalescer`` turns it
off). Its fixtures: ``coalescer_url`` (a real valkey-server for the session, or
``$COALESCER_TEST_REDIS_URL``), ``coalescer_namespace`` (the test's own),
``coalescer_factory(rules, **options)`` (a started ``Coalescer`` there, ``worker``
False by default) and ``coalescer_isolated_env`` (autouse: ``$COALESCER_NAMESPACE`` and
``$COALESCER_REDIS_URL`` point the application's own coalescers at them; the ini option
``coalescer_isolate_env = false`` turns it off). Helpers: ``assert_refreshed(claims,
keys)`` and ``refreshed_keys(claims)``. What each does, in full: docs/testing.md.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import uuid
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from pathlib import Path
from typing import Any

import pytest

from coalescer.claim import Claim
from coalescer.coalescer import Coalescer
from coalescer.config.code_rules import Rules, rules_config
from coalescer.config.namespace_env import ENV_NAMESPACE
from coalescer.config.rules import NAME_RE, Config
from coalescer.errors import ConfigError
from coalescer.facade.core import default_node_id
from coalescer.store.embedded import ENV_REDIS_URL, ROOT_NAME, EmbeddedServer

Factory = Callable[..., AbstractAsyncContextManager[Coalescer]]

ISOLATE_ENV = "coalescer_isolate_env"  # the ini option
ENV_TEST_REDIS_URL = "COALESCER_TEST_REDIS_URL"
_SESSION_ENV = pytest.StashKey[pytest.MonkeyPatch]()

__all__ = ["Factory", "assert_refreshed", "load_rules", "refreshed_keys"]


def refreshed_keys(claims: Iterable[Claim]) -> list[str]:
    """The keys of ``claims``, each once, in the order they first ran."""
    return list(dict.fromkeys(claim.key for claim in claims))


def assert_refreshed(claims: Sequence[Claim], keys: Iterable[str], *,
                     exactly_once: bool = False) -> None:
    """Assert that ``claims`` refreshed every key of ``keys`` and no other key.

    With ``exactly_once``, also that none of them ran more than once (a coalesced
    burst, no retry). The AssertionError lists what was missing, unexpected, or
    repeated.
    """
    ran = [claim.key for claim in claims]
    expected = list(dict.fromkeys(keys))
    missing = [k for k in expected if k not in ran]
    unexpected = [k for k in refreshed_keys(claims) if k not in expected]
    repeated = [k for k in refreshed_keys(claims) if ran.count(k) > 1] if exactly_once else []
    if missing or unexpected or repeated:
        problems = [f"{what}: {found!r}" for what, found in (
            ("not refreshed", missing), ("refreshed but not expected", unexpected),
            ("refreshed more than once", repeated)) if found]
        raise AssertionError(f"refreshes were {ran!r}; " + "; ".join(problems))


def load_rules(rules: str | os.PathLike[str] | Rules | Config, *,
               rootdir: Path | None = None) -> Config:
    """A rules file's path, rules as YAML text (any string holding a line break), or
    rules built in code (``Rules(...)``) or loaded already (a ``Config``).

    With ``rootdir``, a relative path is looked up there first, then in the working
    folder; a ConfigError names both when it is in neither.
    """
    if isinstance(rules, Rules | Config):
        return rules_config(rules)
    if isinstance(rules, str) and "\n" in rules:
        return Config.from_string(rules, source="<rules text>")
    return Config.from_yaml(rules if rootdir is None else rules_path(rules, rootdir))


def rules_path(rules: str | os.PathLike[str], rootdir: Path) -> Path:
    """Where a relative ``rules`` path is: in ``rootdir`` (the pytest rootdir) if it is
    there, else in the working folder; an absolute path as it is."""
    path = Path(rules)
    if path.is_absolute():
        return path
    for folder in (rootdir, Path.cwd()):
        if (folder / path).exists():
            return folder / path
    raise ConfigError(f"rules file not found in the pytest rootdir ({rootdir}) or the "
                      f"working folder ({Path.cwd()})", file=os.fspath(rules))


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addini(ISOLATE_ENV, type="bool", default=True,
                  help="coalescer: set $COALESCER_NAMESPACE and $COALESCER_REDIS_URL to the "
                       "test's namespace and server for each test (default: true)")


def pytest_configure(config: pytest.Config) -> None:
    """For the session: a namespace of its own, for coalescers built at import."""
    if config.getini(ISOLATE_ENV):
        patch = config.stash[_SESSION_ENV] = pytest.MonkeyPatch()
        patch.setenv(ENV_NAMESPACE, "test-session-" + uuid.uuid4().hex[:12])


def pytest_unconfigure(config: pytest.Config) -> None:
    patch = config.stash.get(_SESSION_ENV, None)
    if patch is not None:
        patch.undo()


@pytest.fixture(autouse=True)
def coalescer_isolated_env(request: pytest.FixtureRequest,
                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test's $COALESCER_NAMESPACE and $COALESCER_REDIS_URL: its namespace and the
    session's server (unless the ini option ``coalescer_isolate_env`` is false)."""
    if request.config.getini(ISOLATE_ENV):
        monkeypatch.setenv(ENV_NAMESPACE, request.getfixturevalue("coalescer_namespace"))
        monkeypatch.setenv(ENV_REDIS_URL, request.getfixturevalue("coalescer_url"))


@pytest.fixture(scope="session")
def coalescer_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real valkey-server for the test session (or $COALESCER_TEST_REDIS_URL's); its URL."""
    given = os.environ.get(ENV_TEST_REDIS_URL)
    if given:
        yield given
        return
    server = EmbeddedServer(tmp_path_factory.mktemp("coalescer-server") / ROOT_NAME)
    url = server.acquire()
    try:
        yield url
    finally:
        server.release()


@pytest.fixture
def coalescer_namespace() -> str:
    """A namespace of this test's own."""
    return "test-" + uuid.uuid4().hex[:12]


@pytest.fixture
def coalescer_factory(coalescer_url: str, coalescer_namespace: str,
                      request: pytest.FixtureRequest) -> Factory:
    """``coalescer_factory(rules, **options)``: ``async with`` it for a started Coalescer.

    ``rules`` is YAML text, a rules file's path or ``Rules(...)``; a relative path is
    looked up in the pytest rootdir (``request.config.rootpath``) first, then in the
    working folder.
    """
    rootdir = request.config.rootpath
    numbers = itertools.count(1)

    @asynccontextmanager
    async def make(rules: str | os.PathLike[str] | Rules | Config,
                   **options: Any) -> AsyncIterator[Coalescer]:
        namespace = options.pop("namespace", coalescer_namespace)
        if not isinstance(namespace, str) or NAME_RE.fullmatch(namespace) is None:
            raise ConfigError(f"namespace {namespace!r} may only use letters, digits, '_', "
                              "'.' and '-'", file="coalescer_factory", field="namespace")
        config = dataclasses.replace(load_rules(rules, rootdir=rootdir), namespace=namespace)
        options.setdefault("redis_url", coalescer_url)
        options.setdefault("worker", False)
        options.setdefault("grace", 5.0)
        options.setdefault("node_id", f"{default_node_id()}-{next(numbers)}")
        async with Coalescer(config, **options) as c:
            yield c

    return make
