"""The pytest plugin ``coalescer.testing``, run as a user's suite runs it (pytester)."""

from __future__ import annotations

import os
import textwrap
from pathlib import Path

import pytest

from coalescer import Claim, ConfigError
from coalescer.testing import Factory, assert_refreshed, refreshed_keys

pytest_plugins = ["pytester"]

# The sample test of docs/testing.md, word for word (tests/test_docs.py checks that it is there).
SAMPLE_TEST = '''\
import pytest

from coalescer.testing import assert_refreshed
from myapp import orders, stats


@pytest.mark.asyncio
async def test_orders_refresh_the_user_stats_once(coalescer_factory):
    async with coalescer_factory("rules.yaml") as c:
        for amount in (10, 20, 12):
            orders.place(c, user_id=42, amount=amount)  # touches "stats:user:42"
        claims = await c.drain()  # runs what is pending now, windows skipped
    assert_refreshed(claims, ["stats:user:42"], exactly_once=True)
    assert stats.totals[42] == 42
'''

RULES_YAML = """\
rules:
  - name: user-stats
    match: "stats:user:{user_id}"
    handler: myapp.stats:refresh_user
"""

ORDERS_PY = """\
ORDERS = []


def place(coalescer, *, user_id, amount):
    ORDERS.append((user_id, amount))
    coalescer.touch(f"stats:user:{user_id}")
"""

STATS_PY = """\
from myapp import orders

totals = {}


def refresh_user(claim):
    user_id = int(claim.params["user_id"])
    totals[user_id] = sum(a for u, a in orders.ORDERS if u == user_id)
"""

# A second test file of the same suite, run after the sample: its namespace is fresh,
# so it sees nothing of the sample's: no pending key, no refresh in the history of the
# same key the sample refreshed.
ISOLATION_TEST = '''\
import pytest


@pytest.mark.asyncio
async def test_a_fresh_namespace(coalescer_factory, coalescer_namespace):
    async with coalescer_factory("rules.yaml") as c:
        assert c.config.namespace == coalescer_namespace
        assert await c.drain() == []
        assert await c.query.history() == []
        c.touch("stats:user:42")
        (claim,) = await c.drain()
    assert claim.attempt == 1
'''


def user_project(pytester: pytest.Pytester, orders_py: str = ORDERS_PY) -> None:
    pytester.makefile(".yaml", rules=RULES_YAML)
    pkg = pytester.mkpydir("myapp")
    (pkg / "orders.py").write_text(orders_py)
    (pkg / "stats.py").write_text(STATS_PY)


def test_the_sample_test_passes_in_a_users_suite(pytester: pytest.Pytester) -> None:
    user_project(pytester)
    pytester.makepyfile(test_stats=SAMPLE_TEST, test_then_isolated=ISOLATION_TEST)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-W", "ignore")
    result.assert_outcomes(passed=2)


def test_the_sample_test_fails_when_the_write_path_forgets_to_touch(
        pytester: pytest.Pytester) -> None:
    forgetful = ORDERS_PY.replace('    coalescer.touch(f"stats:user:{user_id}")\n', "")
    user_project(pytester, forgetful)
    pytester.makepyfile(test_stats=SAMPLE_TEST)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-W", "ignore")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*refreshes were []; not refreshed: ['stats:user:42']*"])


def test_the_sample_test_finds_the_rules_when_pytest_runs_from_a_subfolder(
        pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    user_project(pytester)
    pytester.makeini("[pytest]\npythonpath = .\n")  # the project's root: the rootdir
    tests = pytester.mkdir("tests")
    (tests / "test_stats.py").write_text(SAMPLE_TEST)
    monkeypatch.chdir(tests)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-W", "ignore")
    result.assert_outcomes(passed=1)


FOUND_IN_CWD_TEST = '''\
import pytest


@pytest.mark.asyncio
async def test_rules_of_the_working_folder(coalescer_factory):
    async with coalescer_factory("local.yaml") as c:
        assert [r.name for r in c.config.rules] == ["local"]
'''


def test_rules_missing_from_the_rootdir_are_looked_up_in_the_working_folder(
        pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    pytester.makeini("[pytest]\n")
    here = pytester.mkdir("here")
    (here / "local.yaml").write_text(
        "rules:\n  - name: local\n    match: '*'\n    handler: builtins:id\n")
    pytester.makepyfile(test_local=FOUND_IN_CWD_TEST)
    monkeypatch.chdir(here)
    result = pytester.runpytest_subprocess(str(pytester.path), "-p", "no:cacheprovider",
                                           "-W", "ignore")
    result.assert_outcomes(passed=1)


def test_the_plugin_can_be_turned_off(pytester: pytest.Pytester) -> None:
    pytester.makepyfile("def test_x(coalescer_url):\n    pass\n")
    result = pytester.runpytest_subprocess("-p", "no:coalescer", "-p", "no:cacheprovider")
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(["*fixture 'coalescer_url' not found*"])


# -- the fixtures and helpers, in this suite (the plugin is installed with coalescer) --


async def test_factory_takes_yaml_text_and_puts_it_in_the_test_namespace(
        coalescer_factory: Factory, coalescer_namespace: str, coalescer_url: str) -> None:
    text = textwrap.dedent("""\
        namespace: ignored
        shards: 3
        rules:
          - name: other
            match: "*"
            handler: builtins:id
        """)
    async with coalescer_factory(text) as c:
        assert c.config.namespace == coalescer_namespace
        assert c.config.shards == 3
        assert c.redis_url == coalescer_url
        assert not c.worker  # handlers run when the test drains
        c.touch("anything:at:all")
        await c.flush()
        assert (await c.query.status())["rules"]["other"]["pending"] == 1
        keys = [k async for k in c.redis.scan_iter(match="ignored*")]
        assert keys == []


async def test_factory_coalescers_of_one_test_share_its_namespace(
        coalescer_factory: Factory, tmp_path: Path) -> None:
    path = tmp_path / "rules.yaml"
    path.write_text("rules:\n  - name: all\n    match: '*'\n    handler: builtins:id\n")
    async with coalescer_factory(path) as writer, \
            coalescer_factory(str(path), worker=True) as worker:
        assert writer.node_id != worker.node_id
        writer.touch("k")
        await writer.flush()
        assert refreshed_keys(await worker.drain()) == ["k"]


async def test_a_relative_rules_path_is_the_rootdirs_before_the_working_folders(
        coalescer_factory: Factory, request: pytest.FixtureRequest, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "rules.yaml").write_text(
        "rules:\n  - name: elsewhere\n    match: '*'\n    handler: builtins:id\n")
    monkeypatch.chdir(tmp_path)
    async with coalescer_factory("rules.yaml") as c:  # this repository's rules.yaml
        assert c.config.source == str(request.config.rootpath / "rules.yaml")
        assert [r.name for r in c.config.rules] == ["user-stats", "org-stats"]
    async with coalescer_factory(tmp_path / "rules.yaml") as c:  # absolute: as it is
        assert [r.name for r in c.config.rules] == ["elsewhere"]


async def test_a_rules_file_in_neither_folder_is_an_error_naming_both(
        coalescer_factory: Factory, request: pytest.FixtureRequest) -> None:
    with pytest.raises(ConfigError) as caught:
        async with coalescer_factory("no-such-rules.yaml"):
            pass
    assert str(caught.value) == (
        f"no-such-rules.yaml: rules file not found in the pytest rootdir "
        f"({request.config.rootpath}) or the working folder ({Path.cwd()})")


async def test_factory_refuses_a_bad_namespace_naming_it(coalescer_factory: Factory) -> None:
    with pytest.raises(ConfigError, match=r"coalescer_factory: namespace: namespace 'a b'"):
        async with coalescer_factory(RULES_YAML, namespace="a b"):
            pass


def claims(*keys: str) -> list[Claim]:
    return [Claim(key=k, rule="r") for k in keys]


@pytest.mark.parametrize(("ran", "expected", "once", "message"), [
    (["a"], ["a", "b"], False, "refreshes were ['a']; not refreshed: ['b']"),
    (["a", "c"], ["a"], False, "refreshes were ['a', 'c']; refreshed but not expected: ['c']"),
    (["a", "a"], ["a"], True, "refreshes were ['a', 'a']; refreshed more than once: ['a']"),
    ([], ["\x00|\n"], False, r"refreshes were []; not refreshed: ['\x00|\n']"),
])
def test_assert_refreshed_says_what_is_wrong(ran: list[str], expected: list[str], once: bool,
                                             message: str) -> None:
    with pytest.raises(AssertionError) as caught:
        assert_refreshed(claims(*ran), expected, exactly_once=once)
    assert str(caught.value) == message


def test_assert_refreshed_passes_on_a_match() -> None:
    assert_refreshed(claims("b", "a", "a"), ["a", "b"])
    assert_refreshed(claims("b", "a"), iter(["a", "b"]), exactly_once=True)
    assert refreshed_keys(claims("b", "a", "b")) == ["b", "a"]


# -- the environment of the code under test: $COALESCER_NAMESPACE and $COALESCER_REDIS_URL --

ENV_TESTS = '''\
import os

import pytest

AT_IMPORT = os.environ.get("COALESCER_NAMESPACE")
SEEN = []


def test_a_module_is_imported_in_the_sessions_namespace():
    assert AT_IMPORT.startswith("test-session-")


@pytest.mark.parametrize("run", [1, 2])
def test_each_test_has_its_namespace_and_the_sessions_server(
        run, coalescer_namespace, coalescer_url):
    assert os.environ["COALESCER_NAMESPACE"] == coalescer_namespace
    assert os.environ["COALESCER_REDIS_URL"] == coalescer_url
    SEEN.append(coalescer_namespace)
    assert len(set(SEEN)) == run
'''


def test_the_plugin_gives_each_test_its_namespace_and_server_in_the_environment(
        pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COALESCER_NAMESPACE", "production")
    monkeypatch.setenv("COALESCER_REDIS_URL", "redis://127.0.0.1:1/0")
    pytester.makepyfile(test_env=ENV_TESTS)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=3)


OFF_TEST = '''\
import os


def test_the_environment_is_left_alone(coalescer_url):
    assert os.environ["COALESCER_NAMESPACE"] == "production"
    assert "COALESCER_REDIS_URL" not in os.environ
    assert coalescer_url == "{url}"
'''


def test_the_ini_option_leaves_the_environment_alone_and_a_given_server_is_used(
        pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, redis_url: str) -> None:
    monkeypatch.setenv("COALESCER_NAMESPACE", "production")
    monkeypatch.delenv("COALESCER_REDIS_URL", raising=False)
    monkeypatch.setenv("COALESCER_TEST_REDIS_URL", redis_url)
    pytester.makeini("[pytest]\ncoalescer_isolate_env = false\n")
    pytester.makepyfile(test_off=OFF_TEST.format(url=redis_url))
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1)


def test_the_environment_is_restored_after_the_session(
        pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, redis_url: str) -> None:
    monkeypatch.delenv("COALESCER_NAMESPACE", raising=False)
    monkeypatch.setenv("COALESCER_REDIS_URL", "redis://127.0.0.1:1/0")
    monkeypatch.setenv("COALESCER_TEST_REDIS_URL", redis_url)  # no server started in-process
    pytester.makeini("[pytest]\nasyncio_default_fixture_loop_scope = function\n")
    pytester.makepyfile(test_env=ENV_TESTS)
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=3)
    assert "COALESCER_NAMESPACE" not in os.environ
    assert os.environ["COALESCER_REDIS_URL"] == "redis://127.0.0.1:1/0"
