"""What a batch handler's answer means: which keys of the batch failed.

A batch handler (a rule with ``batch:``) gets the list of its claims and answers:

* ``None`` (or nothing): every key succeeded;
* an iterable of failed claims or keys (``[claim, "stats:customer:7"]``): those are
  retried (or dead-lettered), the rest succeeded;
* a mapping from a key to an exception or a message (``{claim.key: "no such row"}``): as
  above, each failed key recorded with its own error;
* raising: every key of the batch failed with that error.

Anything else (a number, a key that is not in the batch) is the handler's bug: every
key of the batch is failed with an error saying what was wrong, so nothing is lost.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from coalescer.claim import Claim

MAX_SHOWN = 80  # characters of a bad answer quoted in the error


class KeyFailed(Exception):
    """A key a batch handler reported as failed (the message is the handler's)."""


class BatchAnswerError(TypeError):
    """A batch handler answered something that does not say which keys failed."""


def _shown(value: object) -> str:
    text = repr(value)
    return text if len(text) <= MAX_SHOWN else text[:MAX_SHOWN - 3] + "..."


def _key_of(item: object, batch: set[str]) -> str:
    key = item.key if isinstance(item, Claim) else item
    if not isinstance(key, str):
        raise BatchAnswerError(f"batch handler returned {_shown(item)} among its failed keys; "
                               "expected a Claim or a key (str)")
    if key not in batch:
        raise BatchAnswerError(f"batch handler returned {_shown(key)} as failed, which is not "
                               "a key of this batch")
    return key


def _error_of(key: str, value: object) -> Exception:
    if isinstance(value, Exception):
        return value
    if value is None:
        return KeyFailed("reported failed by the batch handler")
    if isinstance(value, str):
        return KeyFailed(value or "reported failed by the batch handler")
    raise BatchAnswerError(f"batch handler returned {_shown(value)} as the error of {key!r}; "
                           "expected an exception or a message (str)")


def failed_keys(answer: object, claims: Sequence[Claim]) -> dict[str, Exception]:
    """The failed keys of a batch, each with its error; BatchAnswerError when ``answer``
    is none of the shapes described in this module."""
    if answer is None:
        return {}
    batch = {claim.key for claim in claims}
    if isinstance(answer, Mapping):
        out: dict[str, Exception] = {}
        for item, value in answer.items():
            key = _key_of(item, batch)
            out[key] = _error_of(key, value)
        return out
    if isinstance(answer, str | bytes) or not isinstance(answer, Iterable):
        raise BatchAnswerError(f"batch handler returned {_shown(answer)}; expected None (all "
                               "succeeded), a list of the failed claims or keys, or a mapping "
                               "of failed key to error")
    reported = KeyFailed("reported failed by the batch handler")
    return {_key_of(item, batch): reported for item in answer}
