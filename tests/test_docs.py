"""The documentation's relative links resolve: files exist, #anchors name a heading.

Covers README.md, docs/*.md, examples/*/README.md and bench/README.md. Anchors follow
GitHub's slugs: the heading's text lowercased, punctuation other than '-' and '_'
dropped, spaces turned into '-', and '-1', '-2', ... added to repeats. External links
(http:, https:, mailto:) are not checked.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

DOCS = sorted([REPO / "README.md", *(REPO / "docs").glob("*.md"),
               *(REPO / "examples").glob("*/README.md"), REPO / "bench" / "README.md"])

FENCE = re.compile(r"^(```|~~~)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
# [text](target) or ![alt](target); the target ends at whitespace or ')'.
LINK = re.compile(r"!?\[(?:[^\]\[]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
EXTERNAL = re.compile(r"^[a-z][a-z0-9+.-]*:", re.I)


def prose_lines(text: str) -> list[str]:
    """The lines outside fenced code blocks."""
    out, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line.lstrip()):
            fenced = not fenced
            continue
        if not fenced:
            out.append(line)
    return out


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's text."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text only
    text = re.sub(r"<[^>]+>", "", text).strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)  # \w keeps letters, digits and '_'
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    found: set[str] = set()
    seen: dict[str, int] = {}
    for line in prose_lines(path.read_text(encoding="utf-8")):
        m = HEADING.match(line)
        if m is None:
            continue
        base = slug(m.group(2))
        n = seen.get(base, 0)
        seen[base] = n + 1
        found.add(base if n == 0 else f"{base}-{n}")
    return found


def links(path: Path) -> list[str]:
    out = []
    for line in prose_lines(path.read_text(encoding="utf-8")):
        code_free = re.sub(r"`[^`]*`", "", line)
        out += [m.group(1) for m in LINK.finditer(code_free)]
    return out


def test_slugs_follow_github() -> None:
    assert slug("Set-up: two commands") == "set-up-two-commands"
    assert slug("Forking servers (gunicorn, uwsgi, Celery prefork)") == \
        "forking-servers-gunicorn-uwsgi-celery-prefork"
    assert slug("`await coalescer.drain(timeout=30.0)`") == "await-coalescerdraintimeout300"
    assert slug("Every core: `run --processes N`") == "every-core-run---processes-n"
    assert slug("Changing `shards`: drain first") == "changing-shards-drain-first"


def test_every_page_is_covered() -> None:
    names = {p.relative_to(REPO).as_posix() for p in DOCS}
    assert {"README.md", "docs/architecture.md", "bench/README.md",
            "examples/webhook/README.md"} <= names


@pytest.mark.parametrize("page", DOCS, ids=lambda p: p.relative_to(REPO).as_posix())
def test_relative_links_resolve(page: Path) -> None:
    broken = []
    for target in links(page):
        if EXTERNAL.match(target):
            continue
        file_part, _, anchor = target.partition("#")
        dest = (page.parent / file_part).resolve() if file_part else page
        if not dest.exists():
            shown = dest.relative_to(REPO) if dest.is_relative_to(REPO) else dest
            broken.append(f"{target}: no file {shown}")
            continue
        if anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading with the anchor #{anchor} in "
                          f"{dest.relative_to(REPO)}")
    assert not broken, f"{page.relative_to(REPO)}: " + "; ".join(broken)


def test_the_kits_sample_test_is_in_the_testing_page() -> None:
    """tests/test_testing_kit.py runs the sample test of docs/testing.md word for word."""
    from tests.test_testing_kit import SAMPLE_TEST

    assert SAMPLE_TEST in (REPO / "docs" / "testing.md").read_text(encoding="utf-8")


def test_readme_stays_the_front_door() -> None:
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    assert len(readme.splitlines()) <= 350
    assert ("python3 -m venv .venv && .venv/bin/pip install -e '.[dev]' && "
            ".venv/bin/coalescer demo") in readme
    assert ".venv/bin/pytest -q" in readme


FENCE_LINE = re.compile(r"^\s*(`{3,}|~{3,})(.*)$")


def unclosed_fence(text: str) -> int | None:
    """The line number of a code fence that is never closed, or None. As Markdown reads
    them: a fence closes with the same character, at least as many times, and nothing
    after it (so "``` Metrics:" opens a block instead of closing one)."""
    opened: tuple[int, str] | None = None
    for number, line in enumerate(text.splitlines(), 1):
        m = FENCE_LINE.match(line)
        if m is None:
            continue
        fence, rest = m.groups()
        if opened is None:
            opened = (number, fence)
        elif fence[0] == opened[1][0] and len(fence) >= len(opened[1]) and not rest.strip():
            opened = None
    return opened[0] if opened else None


def test_the_fence_check_finds_a_fence_left_open() -> None:
    assert unclosed_fence("```sh\nls\n```\n") is None
    assert unclosed_fence("```sh\nls\n``` Then:\nmore\n") == 1
    assert unclosed_fence("  ```yaml\n  a: 1\n  ```\n````\n```\n````\n") is None


@pytest.mark.parametrize("page", [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))],
                         ids=lambda p: p.relative_to(REPO).as_posix())
def test_every_code_fence_is_closed(page: Path) -> None:
    line = unclosed_fence(page.read_text(encoding="utf-8"))
    assert line is None, (f"{page.relative_to(REPO)}:{line}: this code fence is never "
                          "closed (a closing ``` stands alone on its line)")
