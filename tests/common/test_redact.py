"""Passwords in URLs are hidden wherever a URL is shown."""

from __future__ import annotations

import pytest

from coalescer import Coalescer
from coalescer.common.redact import redact, redact_url, redact_with
from coalescer.config.rules import Config
from coalescer.store.connection import Connection


@pytest.mark.parametrize(("url", "shown"), [
    ("redis://:s3cret@127.0.0.1:6379/0", "redis://:***@127.0.0.1:6379/0"),
    ("redis://default:s3cret@127.0.0.1:6379", "redis://default:***@127.0.0.1:6379"),
    ("rediss://user:s3cret@cache.example:6380/2", "rediss://user:***@cache.example:6380/2"),
    ("redis://:p%40ss@h/0", "redis://:***@h/0"),
    ("redis://:p@ss@h/0", "redis://:***@h/0"),  # an unquoted @ in the password
    ("redis://:pa/ss@h:1/0", "redis://:***@h:1/0"),  # an unencoded / in the password
    ("redis://:pa#ss@h:1/0", "redis://:***@h:1/0"),
    ("redis://:pa?ss@h:1/0", "redis://:***@h:1/0"),
    ("redis://u:p/a?s#s@h/0?db=1", "redis://u:***@h/0?db=1"),
    ("unix:///run/redis.sock?db=0&password=s3cret", "unix:///run/redis.sock?db=0&password=***"),
    ("redis://h:1/0?PASSWORD=s3cret&x=1#f", "redis://h:1/0?PASSWORD=***&x=1#f"),
    ("http://user:s3cret@127.0.0.1:9/hook/{id}", "http://user:***@127.0.0.1:9/hook/{id}"),
    ("unix://:pa/ss/tail@/run/r.sock?db=0", "unix://:***@/run/r.sock?db=0"),
    ("unix:///run/r.sock?password=pa#ss/tail", "unix:///run/r.sock?password=***"),
    ("unix:///run/r.sock?password=pa@ss/tail", "unix:///run/r.sock?password=***"),
    ("redis://127.0.0.1:6379/0", "redis://127.0.0.1:6379/0"),
    ("redis://user@127.0.0.1", "redis://user@127.0.0.1"),
    ("", ""),
])
def test_redact_hides_the_password(url: str, shown: str) -> None:
    assert redact(url) == shown


@pytest.mark.parametrize("password", ["pa ss", "pa'ss", 'pa"ss', "pa<ss"])
def test_redact_url_hides_a_password_with_a_space_or_a_quote(password: str) -> None:
    assert redact_url(f"redis://:{password}@h:1/0") == "redis://:***@h:1/0"


def test_redact_finds_every_url_in_a_message() -> None:
    message = ("failed on redis://:one@a:1/0, then 'rediss://u:two@b:2' and "
               "unix:///s.sock?password=three) ok")
    assert redact(message) == ("failed on redis://:***@a:1/0, then 'rediss://u:***@b:2' and "
                               "unix:///s.sock?password=*** ok")


def test_reprs_hide_the_password() -> None:
    config = Config.from_string('rules: [{name: a, match: "*", handler: "json:dumps"}]')
    c = Coalescer(config, redis_url="redis://:s3cret@127.0.0.1:6379/0", worker=False)
    assert "s3cret" not in repr(c)
    assert "redis://:***@127.0.0.1:6379/0" in repr(c)
    conn = Connection("redis://:s3cret@127.0.0.1:6379/0", None, None,  # type: ignore[arg-type]
                      cluster=False)
    assert repr(conn) == "Connection(url='redis://:***@127.0.0.1:6379/0', cluster=False)"


def test_redact_with_hides_the_tail_a_url_parser_cut_off_the_password() -> None:
    url = "unix://:pa/ss/tail@/run/r.sock"
    # redis-py reads the socket path as /ss/tail@/run/r.sock and names it in its error
    message = "Error 2 connecting to /ss/tail@/run/r.sock. No such file or directory."
    assert redact_with(message, url) == (
        "Error 2 connecting to ***@/run/r.sock. No such file or directory.")
    assert redact_with(message, "unix:///run/r.sock") == message
