"""Scripts changed for a measurement: the clients made inside ``edited_scripts(edit)``
register each script as ``edit(name, text)`` returns it (a script's text is read as a
client registers it), and every client made after the block the scripts as they are."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

from coalescer.store import script_calls

Edit = Callable[[str, str], str]  # (script name, its text) -> the text to run


def install(edit: Edit) -> Callable[[str], str]:
    """From now on, this process's scripts are edited; returns what read them before."""
    original = script_calls.script_source
    script_calls.script_source = lambda name: edit(name, original(name))
    return original


@contextlib.contextmanager
def edited_scripts(edit: Edit) -> Iterator[None]:
    """The scripts edited for the clients made inside the block."""
    original = install(edit)
    try:
        yield
    finally:
        script_calls.script_source = original  # type: ignore[assignment]
