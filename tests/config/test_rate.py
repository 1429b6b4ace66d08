"""A rule's ``rate:``: how it is written, and every way it is refused."""

from __future__ import annotations

from pathlib import Path
from textwrap import dedent

import pytest

from coalescer.config.model import RateLimit
from coalescer.config.rules import Config
from coalescer.errors import ConfigError
from coalescer.worker.registry import fingerprint


def _rules(tmp_path: Path, rate: str) -> Path:
    path = tmp_path / "rules.yaml"
    path.write_text(dedent(f"""\
        rules:
          - name: plain
            match: "plain:*"
            handler: json:dumps
          - name: paced
            match: "paced:*"
            handler: json:dumps
            rate: {rate}
        """))
    return path


@pytest.mark.parametrize(("text", "count", "per", "burst"), [
    ("100/s", 100, 1.0, 10),
    ("30/m", 30, 60.0, 1),
    ("500/h", 500, 3600.0, 1),
    ('" 200 / s "', 200, 1.0, 20),
    ("1/s", 1, 1.0, 1),
])
def test_rate_is_starts_per_second_minute_or_hour(tmp_path: Path, text: str, count: int,
                                                  per: float, burst: int) -> None:
    config = Config.from_yaml(_rules(tmp_path, text))
    assert config.rule("plain").rate is None
    rate = config.rule("paced").rate
    assert rate == RateLimit(count=count, per=per)
    assert rate.burst == burst
    assert f"rate: {rate}" in config.describe()


@pytest.mark.parametrize(("text", "fragment"), [
    ("100", "written like 100/s, 30/m or 500/h, got 100"),
    ("100/d", "got '100/d'"),
    ("fast", "got 'fast'"),
    ("1.5/s", "got '1.5/s'"),
    ("-5/s", "got '-5/s'"),
    ("0/s", "from 1 to 1000000 starts per period, got 0"),
    ("2000000/s", "got 2000000"),
    ("{n: 5}", "got {'n': 5}"),
])
def test_a_bad_rate_is_refused_with_file_line_and_field(tmp_path: Path, text: str,
                                                        fragment: str) -> None:
    path = _rules(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        Config.from_yaml(path)
    error = info.value
    assert (error.file, error.line, error.field) == (str(path), 8, "rules[1].rate")
    assert fragment in error.message, error.message


def test_rate_is_a_rule_setting_not_a_default(tmp_path: Path) -> None:
    path = tmp_path / "rules.yaml"
    path.write_text(dedent("""\
        defaults:
          rate: 10/s
        rules:
          - {name: all, match: "*", handler: json:dumps}
        """))
    with pytest.raises(ConfigError) as info:
        Config.from_yaml(path)
    assert (info.value.line, info.value.field) == (2, "defaults.rate")


def test_a_rate_is_part_of_the_rule_fingerprint(tmp_path: Path) -> None:
    paced = Config.from_yaml(_rules(tmp_path, "10/s")).rule("paced")
    faster = Config.from_yaml(_rules(tmp_path, "20/s")).rule("paced")
    unpaced = Config.from_string(dedent("""\
        rules:
          - {name: paced, match: "paced:*", handler: json:dumps}
        """)).rule("paced")
    assert len({fingerprint(paced), fingerprint(faster), fingerprint(unpaced)}) == 3
