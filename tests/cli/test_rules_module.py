"""`--rules module.path:attribute`: the commands on rules built in code, run as real
child processes in a project folder holding a package ``app``."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.helpers.e2e import REPO, clean_env, coalescer_cmd
from tests.helpers.servers import poll_until

CODE = '''\
from pathlib import Path

from coalescer import Rule, Rules

DONE = Path(__file__).resolve().parent.parent / "refreshed.txt"


def refresh(claim):
    with DONE.open("a") as out:
        out.write(claim.key + "\\n")


def fail(claim):
    raise RuntimeError("db down")


RULES = Rules(namespace="{ns}", leader_lease="1s", claim_lease="1s",
              defaults={{"window": "50ms", "max_wait": "1s", "absorb": "10ms"}}, rules=[
    Rule(name="item", match="item:{{id}}", handler=refresh),
    Rule(name="fail", match="fail:{{id}}", handler=fail, retry={{"attempts": 1}}),
])
NEVER = Rules(namespace="{ns}", rules=[
    Rule(name="item", match="item:{{id}}", handler=refresh),
    Rule(name="shadowed", match="item:{{x}}", handler="app.coalescing:refresh"),
])
NOT_RULES = {{"item": "item:{{id}}"}}
GONE = Rules(namespace="{ns}", rules=[
    Rule(name="gone", match="gone:{{id}}", handler="app.gone:refresh"),
])
'''

BROKEN = '''\
from coalescer import Rule, Rules


def refresh(claim):
    pass


RULES = Rules(rules=[
    Rule(name="item", match="item:{id}", handler=refresh, window="soon"),
])
'''


@pytest.fixture
def project(tmp_path: Path, namespace: str) -> Path:
    """A project folder: ``app/coalescing.py`` holds RULES (and more), ``app/broken.py``
    a Rules(...) that fails its checks, ``app/raising.py`` a module that raises."""
    app = tmp_path / "app"
    app.mkdir()
    (app / "__init__.py").write_text("")
    (app / "coalescing.py").write_text(CODE.format(ns=namespace))
    (app / "broken.py").write_text(BROKEN)
    (app / "raising.py").write_text("import json\n\njson.loads('{')\n")
    return tmp_path


def cli(project: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*coalescer_cmd(), *args], cwd=project, env=clean_env(),
                          capture_output=True, text=True, timeout=60, check=False)


def test_check_reads_rules_built_in_code(project: Path, namespace: str) -> None:
    done = cli(project, "check", "--rules", "app.coalescing:RULES")
    assert done.returncode == 0, done.stderr
    assert f"<Rules(...) at {project / 'app' / 'coalescing.py'}:17>: OK" in done.stdout
    assert f"namespace: {namespace}" in done.stdout
    assert "match:    item:{id}" in done.stdout


def test_check_warns_of_rules_in_code_as_of_a_file(project: Path) -> None:
    done = cli(project, "check", "app.coalescing:NEVER")
    assert done.returncode == 0, done.stderr
    assert done.stderr.startswith(
        f"{project / 'app' / 'coalescing.py'}:24: rules[1].match: warning: rule 'shadowed' "
        "can never match")
    assert "OK (1 warning)" in done.stdout


ERRORS = {
    "module missing": ("app.nowhere:RULES", "app.nowhere:RULES: cannot import module "
                       "app.nowhere: No module named 'app.nowhere' (looked for on "
                       "sys.path, then the working folder, {project})"),
    "attribute missing": ("app.coalescing:RULEZ", "app.coalescing:RULEZ: module "
                          "app.coalescing ({project}/app/coalescing.py) has no attribute "
                          "RULEZ; its rules: GONE, NEVER, RULES"),
    "wrong type": ("app.coalescing:NOT_RULES", "app.coalescing:NOT_RULES: NOT_RULES is a "
                   "dict ({{'item': 'item:{{id}}'}}), not a Rules(...) or a Config"),
    "a function": ("app.coalescing:refresh", "app.coalescing:refresh: refresh is a "
                   "function (app.coalescing.refresh), not a Rules(...) or a Config"),
    "checks fail": ("app.broken:RULES", "{project}/app/broken.py:9: rules[0].window: "),
    "module raises": ("app.raising:RULES", "app.raising:RULES: importing module app.raising "
                      "raised JSONDecodeError: Expecting property name enclosed in double "
                      "quotes: line 1 column 2 (char 1) (at {project}/app/raising.py:3)"),
    "a handler path that does not import": (
        "app.coalescing:GONE", "{project}/app/coalescing.py:28: rules[0].handler: handler "
                               "module 'app.gone' does not import"),
    "neither": ("app/coalescing.py:RULES", "app/coalescing.py:RULES: rules file not found "
                "(give another with --rules PATH, or name rules built in code with --rules "
                "module.path:attribute)"),
}


@pytest.mark.parametrize("value, expected", ERRORS.values(), ids=ERRORS.keys())
def test_check_names_what_is_wrong_with_rules_in_code(project: Path, value: str,
                                                      expected: str) -> None:
    done = cli(project, "check", "--rules", value)
    assert done.returncode == 1
    assert done.stdout == ""
    first, summary = done.stderr.splitlines()
    assert first.startswith(expected.format(project=project))
    assert summary == f"1 error in {value}"


def test_check_no_import_imports_the_rules_but_no_handler_path(project: Path) -> None:
    done = cli(project, "check", "--no-import", "--rules", "app.coalescing:GONE")
    assert done.returncode == 0, done.stderr
    assert "handler:  app.gone:refresh" in done.stdout


@pytest.mark.parametrize("command", [["run", "--http", "off"], ["touch", "item:1"],
                                     ["status"]])
def test_every_command_names_what_is_wrong(project: Path, command: list[str]) -> None:
    done = cli(project, command[0], "--rules", "app.coalescing:NOT_RULES", *command[1:])
    assert done.returncode == 1
    assert done.stderr.startswith(f"coalescer {command[0]}: app.coalescing:NOT_RULES: "
                                  "NOT_RULES is a dict")


def test_an_existing_file_of_that_name_wins(project: Path) -> None:
    (project / "app.coalescing:RULES").write_text(textwrap.dedent("""\
        namespace: from-the-file
        rules:
          - name: other
            match: "other:{id}"
            handler: {http: {url: "http://127.0.0.1:9/refresh"}}
        """))
    done = cli(project, "check", "--rules", "app.coalescing:RULES")
    assert done.returncode == 0, done.stderr
    assert "namespace: from-the-file" in done.stdout


def test_run_processes_refresh_keys_with_rules_in_code(project: Path, redis_url: str) -> None:
    """`run --processes 2` gives its children the same --rules; a touch by `touch` on
    the same rules is refreshed by the handler defined in code; the commands printed
    as hints name the same rules."""
    rules = ("--rules", "app.coalescing:RULES", "--redis", redis_url)
    out = project / "node.out"
    with out.open("wb") as sink:
        node = subprocess.Popen([*coalescer_cmd(), "run", "--http", "off", "--processes", "2",
                                 *rules], cwd=project, env=clean_env(),
                                stdin=subprocess.DEVNULL, stdout=sink, stderr=subprocess.STDOUT)
    try:
        poll_until(lambda: out.read_text().count(" running, using ") == 2, timeout=30,
                   message="both children running")
        done = cli(project, "touch", *rules, "item:1", "item:2", "fail:1")
        assert done.returncode == 0, done.stderr
        refreshed = project / "refreshed.txt"
        poll_until(lambda: refreshed.exists() and
                   sorted(refreshed.read_text().split()) == ["item:1", "item:2"],
                   timeout=20, message=f"both keys refreshed; the node's output:\n"
                                       f"{out.read_text()}")
        hint = f"`coalescer dead retry --rules app.coalescing:RULES --redis {redis_url}"
        poll_until(lambda: f"{hint} fail:1`" in out.read_text(), timeout=20,
                   message=f"fail:1 dead-lettered; the node's output:\n{out.read_text()}")
        status = cli(project, "status", *rules)
        assert f"re-queue with {hint} KEY` or `--all`" in status.stdout, status.stderr
    finally:
        node.send_signal(signal.SIGTERM)
        assert node.wait(timeout=30) == 0, out.read_text()


def test_manage_py_coalescer_takes_rules_in_code_whose_handler_uses_the_orm(
        tmp_path: Path, redis_url: str, namespace: str) -> None:
    """Django is set up before the rules module is imported: its handler's module
    imports models at its top."""
    (tmp_path / "shop_rules.py").write_text(textwrap.dedent("""\
        from coalescer import Rule, Rules
        from shop.handlers import refresh_customer_stats

        RULES = Rules(namespace="shop", rules=[
            Rule(name="stats", match="stats:customer:{id}", handler=refresh_customer_stats),
        ])
        """))
    project = REPO / "examples" / "django_project"
    env = clean_env(SHOP_DB=str(tmp_path / "shop.sqlite3"), COALESCER_REDIS_URL=redis_url,
                    COALESCER_NAMESPACE=namespace, PYTHONPATH=str(tmp_path))
    env.pop("DJANGO_SETTINGS_MODULE", None)
    done = subprocess.run([sys.executable, str(project / "manage.py"), "coalescer", "check",
                           "-v", "--rules", "shop_rules:RULES"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    assert f"<Rules(...) at {tmp_path / 'shop_rules.py'}:4>: OK" in done.stdout
    assert f"defined in {project / 'shop' / 'handlers.py'}" in done.stdout
