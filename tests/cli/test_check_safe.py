"""`coalescer check` on a file from someone else: --no-import runs none of the handlers'
code, and a webhook URL can only be filled in within its path."""

from __future__ import annotations

from pathlib import Path

from tests.cli.test_main import cli

RULES = """\
namespace: safe
rules:
  - name: a
    match: "a:{id}"
    handler: planted:refresh
  - name: b
    match: "b:{id}"
    handler: not-a-ref
"""

PLANTED = """\
from pathlib import Path
Path(__file__).with_name("ran").write_text("the handler module's code ran")

def refresh(claim):
    pass
"""


def test_check_no_import_runs_no_handler_code_and_still_checks_the_names(
        tmp_path: Path) -> None:
    (tmp_path / "planted.py").write_text(PLANTED)
    rules = tmp_path / "rules.yaml"
    rules.write_text(RULES)
    done = cli("check", str(rules), "--no-import", cwd=tmp_path)
    assert not (tmp_path / "ran").exists()
    assert done.returncode == 1
    assert "rules[1].handler: handler 'not-a-ref' must have the form" in done.stderr
    assert "1 error in" in done.stderr

    rules.write_text(RULES.replace("not-a-ref", "planted:refresh"))
    done = cli("check", str(rules), "--no-import", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert not (tmp_path / "ran").exists()
    assert "handler:  planted:refresh" in done.stdout

    done = cli("check", str(rules), cwd=tmp_path)  # without it, the module is imported
    assert done.returncode == 0 and (tmp_path / "ran").exists()


HOSTILE_URL = """\
namespace: safe
rules:
  - name: a
    match: "a:{tenant}"
    handler:
      http:
        url: "https://{tenant}.hooks.example/refresh"
  - name: b
    match: "b:{id}"
    handler:
      http:
        url: "https://hooks.example/refresh?id={id}"
  - name: c
    match: "c:{id}"
    handler:
      http:
        url: "https://hooks.example/refresh/{id}"
"""


def test_a_capture_outside_a_webhook_urls_path_is_refused_with_file_line_and_field(
        tmp_path: Path) -> None:
    # a key "a:attacker.example#" would have sent the signed request to another server
    rules = tmp_path / "rules.yaml"
    rules.write_text(HOSTILE_URL)
    done = cli("check", str(rules), "--no-import", cwd=tmp_path)
    assert done.returncode == 1
    lines = done.stderr.splitlines()
    assert lines[0].startswith(f"{rules}:7: rules[0].handler.http.url: url "
                               "'https://{tenant}.hooks.example/refresh' uses {tenant} in "
                               "its host: a capture may only fill in the path")
    assert lines[1].startswith(f"{rules}:12: rules[1].handler.http.url: url "
                               "'https://hooks.example/refresh?id={id}' uses {id} in its query")
    assert lines[2] == f"2 errors in {rules}"
