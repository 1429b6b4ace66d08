"""``python manage.py coalescer ...`` on the example project (real processes, the suite's
Valkey), the hint of the plain command for a handler that needs Django, and
``get_coalescer()``, a Django process's own SyncCoalescer."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from django.core.management import CommandError, call_command
from django.test import override_settings

from coalescer.cli.supervisor import plan_from_args
from coalescer.integrations.django.management.cli import django_parser
from coalescer.integrations.django.process import close_coalescer, drain, get_coalescer
from coalescer.store.keys import KeySpace
from tests.helpers.django_db import configure
from tests.helpers.e2e import REPO, clean_env, coalescer_cmd
from tests.helpers.forks import LIBC_FORK, exit_code, in_child

PROJECT = REPO / "examples" / "django_project"
RULES = PROJECT / "rules.yaml"


@pytest.fixture
def env(tmp_path: Path, redis_url: str, namespace: str) -> dict[str, str]:
    env = clean_env(SHOP_DB=str(tmp_path / "shop.sqlite3"), COALESCER_REDIS_URL=redis_url,
                    COALESCER_NAMESPACE=namespace, PYTHONPATH=str(tmp_path))
    env.pop("DJANGO_SETTINGS_MODULE", None)
    return env


def manage(env: dict[str, str], *args: str, cwd: Path = PROJECT,
           settings: str | None = None) -> subprocess.CompletedProcess[str]:
    """``python manage.py ARGS`` of the example project, from ``cwd``."""
    extra = [f"--settings={settings}"] if settings else []
    return subprocess.run([sys.executable, str(PROJECT / "manage.py"), *args, *extra],
                          cwd=cwd, env=env, stdin=subprocess.DEVNULL, capture_output=True,
                          text=True, timeout=60, check=False)


def settings_module(folder: Path, lines: str) -> str:
    """A settings module in ``folder`` (on PYTHONPATH): the example's, then ``lines``."""
    (folder / "variant_settings.py").write_text(
        f"from shop_site.settings import *  # noqa: F403\n{lines}\n")
    return "variant_settings"


def test_check_imports_the_handler_that_uses_the_orm(env: dict[str, str]) -> None:
    done = manage(env, "coalescer", "check")
    assert done.returncode == 0, done.stderr
    assert f"{RULES}: OK" in done.stdout


def test_touch_status_and_explain_run_as_the_plain_command_does(env: dict[str, str],
                                                                namespace: str) -> None:
    assert manage(env, "coalescer", "touch", "stats:customer:3").returncode == 0
    explained = manage(env, "coalescer", "explain", "stats:customer:3")
    assert explained.returncode == 0, explained.stderr
    assert "rule       customer-stats" in explained.stdout
    assert "state      pending" in explained.stdout
    status = manage(env, "coalescer", "status", "--json")
    assert status.returncode == 0, status.stderr
    assert '"pending": 1' in status.stdout


def test_exit_codes_and_usage_errors_are_the_plain_commands(env: dict[str, str]) -> None:
    unknown = manage(env, "coalescer", "touch", "orders:1")
    plain = subprocess.run([*coalescer_cmd(), "touch", "orders:1", "--rules", str(RULES)],
                           env=env, capture_output=True, text=True, timeout=60, check=False)
    assert unknown.returncode == plain.returncode == 2
    assert "no rule in" in unknown.stderr
    usage = manage(env, "coalescer", "explain")
    assert usage.returncode == 2
    assert "usage: manage.py coalescer explain" in usage.stderr


def test_help_names_manage_py_and_the_rules_setting(env: dict[str, str]) -> None:
    done = manage(env, "coalescer", "run", "--help")
    assert done.returncode == 0
    assert done.stdout.startswith("usage: manage.py coalescer run")
    assert f"default {RULES}, from settings.COALESCER_RULES" in " ".join(done.stdout.split())
    listed = manage(env, "help", "coalescer")
    assert "{run,touch,check,status" in listed.stdout


@pytest.mark.parametrize(("command", "settings_module_env"),
                         [(["check"], False), (["run", "--http", "off"], True)],
                         ids=["check-settings-not-configured", "run-apps-not-loaded"])
def test_the_plain_command_says_to_use_manage_py_for_a_handler_that_needs_django(
        env: dict[str, str], command: list[str], settings_module_env: bool) -> None:
    if settings_module_env:
        env["DJANGO_SETTINGS_MODULE"] = "shop_site.settings"
    done = subprocess.run([*coalescer_cmd(), *command, "--rules", str(RULES)], env=env,
                          cwd=PROJECT, stdin=subprocess.DEVNULL, capture_output=True,
                          text=True, timeout=60, check=False)
    assert done.returncode == 1
    cause = "AppRegistryNotReady" if settings_module_env else "ImproperlyConfigured"
    assert cause in done.stderr
    assert "run the command as 'python manage.py coalescer ...'" in done.stderr


def test_a_rules_setting_that_names_no_file_is_an_error_until_rules_is_given(
        env: dict[str, str], tmp_path: Path) -> None:
    variant = settings_module(tmp_path, "COALESCER_RULES = BASE_DIR / 'missing.yaml'")
    done = manage(env, "coalescer", "status", settings=variant)
    assert done.returncode == 1
    assert (f"manage.py coalescer status: settings.COALESCER_RULES names "
            f"{PROJECT / 'missing.yaml'}, which does not exist") in done.stderr
    given = manage(env, "coalescer", "check", "--rules", str(RULES), settings=variant)
    assert given.returncode == 0, given.stderr


def test_a_rules_setting_that_is_not_a_path_is_an_error(env: dict[str, str],
                                                        tmp_path: Path) -> None:
    variant = settings_module(tmp_path, "COALESCER_RULES = ['rules.yaml']")
    done = manage(env, "coalescer", "check", settings=variant)
    assert done.returncode == 1
    assert ("settings.COALESCER_RULES must be the path of a rules file (a str or a "
            "pathlib.Path, e.g. BASE_DIR / 'rules.yaml') or rules built in code named as "
            "'module.path:attribute' (e.g. 'myapp.coalescing:rules'), not list "
            "['rules.yaml']" in done.stderr)


def test_without_the_setting_the_rules_file_is_the_working_folders(
        env: dict[str, str], tmp_path: Path) -> None:
    variant = settings_module(tmp_path, "del COALESCER_RULES")
    done = manage(env, "coalescer", "check", settings=variant, cwd=tmp_path)
    assert done.returncode == 1
    assert "./rules.yaml: rules file not found" in done.stderr
    assert manage(env, "coalescer", "check", settings=variant).returncode == 0


# -- in this process: call_command and get_coalescer() ------------------------------------

@pytest.fixture(scope="module")
def django_db(tmp_path_factory: pytest.TempPathFactory) -> None:
    configure(tmp_path_factory.mktemp("django"))


@pytest.fixture
def rules(django_db: None, tmp_path: Path, namespace: str, redis_url: str,
          monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    path = tmp_path / "rules.yaml"
    path.write_text("rules:\n  - {name: user, match: 'stats:user:{id}', handler: builtins:id}\n")
    monkeypatch.setenv("COALESCER_REDIS_URL", redis_url)
    monkeypatch.setenv("COALESCER_NAMESPACE", namespace)
    with override_settings(COALESCER_RULES=path):
        yield path
        close_coalescer()


def test_call_command_runs_the_command_and_raises_its_exit_status(
        rules: Path, capsys: pytest.CaptureFixture[str]) -> None:
    call_command("coalescer", "check")
    assert f"{rules}: OK" in capsys.readouterr().out
    with pytest.raises(CommandError) as failed:
        call_command("coalescer", "touch", "orders:1")
    assert failed.value.returncode == 2


CODED_RULES = """\
from coalescer import Rule, Rules

refreshed = []


def refresh(claim):
    refreshed.append(claim.key)


rules = Rules(rules=[Rule(name="user", match="stats:user:{id}", handler=refresh)])
"""


@pytest.fixture
def coded_rules(django_db: None, tmp_path: Path, namespace: str, redis_url: str,
                monkeypatch: pytest.MonkeyPatch) -> Path:
    """The module ``coded_rules`` (CODED_RULES), importable; this test's server and
    namespace in the environment."""
    (tmp_path / "coded_rules.py").write_text(CODED_RULES)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("COALESCER_REDIS_URL", redis_url)
    monkeypatch.setenv("COALESCER_NAMESPACE", namespace)
    return tmp_path / "coded_rules.py"


def test_the_setting_may_name_rules_built_in_code(
        coded_rules: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with override_settings(COALESCER_RULES="coded_rules:rules"):
        try:
            call_command("coalescer", "check")
            assert f"Rules(...) at {coded_rules}:10>: OK" in \
                capsys.readouterr().out
            get_coalescer().touch("stats:user:5")
            claims = drain()
        finally:
            close_coalescer()
    assert [claim.key for claim in claims] == ["stats:user:5"]
    assert sys.modules["coded_rules"].refreshed == ["stats:user:5"]


def pending(redis_url: str, namespace: str) -> list[str]:
    with redis.Redis.from_url(redis_url, decode_responses=True) as r:
        return sorted(r.zrange(KeySpace(namespace, 1).shard(0).due("user"), 0, -1))


def test_get_coalescer_is_one_per_process_and_follows_the_tests_namespace(
        rules: Path, redis_url: str, namespace: str, monkeypatch: pytest.MonkeyPatch) -> None:
    c = get_coalescer()
    assert get_coalescer() is c
    c.touch("stats:user:1")
    c.flush()
    assert pending(redis_url, namespace) == ["stats:user:1"]
    monkeypatch.setenv("COALESCER_NAMESPACE", namespace + "-next")
    nxt = get_coalescer()
    assert nxt is not c
    nxt.touch("stats:user:2")
    nxt.flush()
    assert pending(redis_url, namespace + "-next") == ["stats:user:2"]


def test_a_forked_worker_touches_through_its_own_coalescer(
        rules: Path, redis_url: str, namespace: str) -> None:
    parent = get_coalescer()  # made in the master, before the fork (gunicorn --preload)

    def worker() -> None:
        assert get_coalescer() is parent  # the same object, started again in the child
        get_coalescer().touch("stats:user:7")
        get_coalescer().flush(timeout=10)
        close_coalescer()

    assert exit_code(in_child(worker)) == 0
    assert pending(redis_url, namespace) == ["stats:user:7"]
    parent.touch("stats:user:8")  # the master's own loop and connections still work
    parent.flush()
    assert pending(redis_url, namespace) == ["stats:user:7", "stats:user:8"]


def test_run_processes_starts_its_children_through_manage_py(rules: Path) -> None:
    args = django_parser("manage.py coalescer", "manage.py").parse_args(
        ["run", "--processes", "2", "--http", "off"])
    child = plan_from_args(args, None).argv(1)
    assert child[:4] == [sys.executable, str(Path("manage.py").resolve()), "coalescer", "run"]
    assert child[child.index("--rules") + 1] == str(rules)


def test_a_worker_forked_without_pythons_fork_hooks_gets_its_own_too(
        rules: Path, redis_url: str, namespace: str) -> None:
    parent = get_coalescer()  # uwsgi's master without py-call-osafterfork forks from C

    def worker() -> None:
        get_coalescer().touch("stats:user:9")  # started again here before it buffers
        get_coalescer().flush(timeout=10)
        close_coalescer()

    assert exit_code(in_child(worker, LIBC_FORK)) == 0
    assert pending(redis_url, namespace) == ["stats:user:9"]
    parent.touch("stats:user:10")
    parent.flush()
    assert pending(redis_url, namespace) == ["stats:user:10", "stats:user:9"]
