"""Commands printed as hints (a dead letter's `coalescer dead retry KEY` in the node log,
in `coalescer status` and `coalescer explain`), written so that pasting one reaches the
rules file and the server of the process that printed it: ``--rules PATH`` and
``--redis URL`` as docs/cli.md says (a password never printed); neither for the embedded
server, which the rules file's folder leads to, nor ``--rules`` for rules that did not
come from a file.
"""

from __future__ import annotations

import dataclasses
import os
import shlex
from collections.abc import Mapping
from pathlib import Path

from coalescer.common.redact import redact
from coalescer.store.embedded import ENV_REDIS_URL

DEFAULT_RULES = "rules.yaml"


@dataclasses.dataclass(frozen=True, kw_only=True)
class CommandHints:
    """The options a printed command needs; the default adds none."""

    rules: str | None = None  # --rules PATH
    redis: str | None = None  # --redis URL
    redis_env: bool = False  # the URL must come from $COALESCER_REDIS_URL

    @classmethod
    def of(cls, rules_source: str | None, redis_url: str | None, *,
           environ: Mapping[str, str] = os.environ) -> CommandHints:
        """The hints of a process on the rules file ``rules_source`` (a config's source)
        and the URL it was given (None: $COALESCER_REDIS_URL, else the embedded server)."""
        redis_env = bool(redis_url and _has_password(redis_url)) or (
            not redis_url and bool(environ.get(ENV_REDIS_URL)))
        return cls(rules=_rules_option(rules_source),
                   redis=redis_url if redis_url and not redis_env else None,
                   redis_env=redis_env)

    def command(self, action: str, *keys: str) -> str:
        """```coalescer ACTION [--rules PATH] [--redis URL] KEY...``` in backquotes; a key
        starting with "-" comes after ``--``."""
        words = ["coalescer", action]
        if self.rules is not None:
            words += ["--rules", shlex.quote(self.rules)]
        if self.redis is not None:
            words += ["--redis", shlex.quote(self.redis)]
        if any(key.startswith("-") for key in keys):
            words.append("--")
        words += [shlex.quote(key) for key in keys]
        return f"`{' '.join(words)}`"

    @property
    def note(self) -> str:
        """What the commands need besides their words: " (with $COALESCER_REDIS_URL set)"
        or nothing."""
        return f" (with ${ENV_REDIS_URL} set)" if self.redis_env else ""


def _has_password(url: str) -> bool:
    """True when showing ``url`` would hide a password (in it, or as ?password=)."""
    return redact(url) != url


def _rules_option(source: str | None) -> str | None:
    if source is None or not Path(source).is_file():
        return None
    path = Path(os.path.abspath(source))
    try:
        if path.samefile(Path.cwd() / DEFAULT_RULES):
            return None
    except OSError:
        pass
    return str(path)
