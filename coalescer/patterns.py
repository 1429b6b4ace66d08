"""Key patterns of rules: ``{name}`` captures one ':'-free segment, ``*`` matches anything."""

from __future__ import annotations

import re
from dataclasses import dataclass

_TOKEN_RE = re.compile(r"\{[^{}]*\}|[{}]|\*+|[^{}*]+")
# No key may hold a NUL: it separates keys in the upsert script's argument, so
# neither a capture nor a wildcard matches one (such a key matches no rule).
_CAPTURE = "([^:\x00]+)"
_ANYTHING = "[^\x00]*"
ALLOWED = (
    "a pattern is literal text with {name} captures (one non-empty segment without ':', "
    "name an identifier, each name once) and * wildcards (anything, ':' included); "
    "no key may contain a NUL character"
)


@dataclass(frozen=True, slots=True)
class KeyPattern:
    """A compiled key pattern; the whole key must match."""

    source: str
    regex: re.Pattern[str]
    names: tuple[str, ...]

    @classmethod
    def compile(cls, source: str) -> KeyPattern:
        """Compile ``source``; ValueError says what is wrong and what is allowed."""
        if not isinstance(source, str) or not source:
            raise ValueError(f"empty pattern {source!r}: {ALLOWED}")
        parts: list[str] = []
        names: list[str] = []
        for token in _TOKEN_RE.findall(source):
            parts.append(_translate(token, names, source))
        return cls(source=source, regex=re.compile("".join(parts), re.DOTALL),
                   names=tuple(names))

    def match(self, key: str) -> dict[str, str] | None:
        """The captured segments when ``key`` matches the whole pattern, else None."""
        found = self.regex.fullmatch(key)
        if found is None:
            return None
        return dict(zip(self.names, found.groups(), strict=True))

    def __str__(self) -> str:
        return self.source


def _translate(token: str, names: list[str], source: str) -> str:
    if token in ("{", "}"):
        raise ValueError(f"unbalanced {token!r} in pattern {source!r}: {ALLOWED}")
    if token.startswith("*"):
        return _ANYTHING
    if not token.startswith("{"):
        return re.escape(token)
    name = token[1:-1]
    if not name:
        raise ValueError(f"empty braces {{}} in pattern {source!r}: {ALLOWED}")
    if not name.isidentifier():
        raise ValueError(f"capture name {name!r} in pattern {source!r} is not an identifier: "
                         f"{ALLOWED}")
    if name in names:
        raise ValueError(f"capture name {name!r} appears twice in pattern {source!r}: "
                         f"{ALLOWED}")
    names.append(name)
    return _CAPTURE
