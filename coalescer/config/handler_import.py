"""Importing a rule's ``module:function`` handler, with the rules file's folder first on
``sys.path``, and checking that it can be called with the claim.

Only processes that run handlers (worker nodes, ``coalescer check``) import them; a
write-path process keeps each one as a ``HandlerImport`` and never imports its module.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from coalescer.errors import ConfigError


@dataclass(frozen=True, kw_only=True, slots=True)
class HandlerImport:
    """A ``module:function`` handler not imported yet, with where the rules file names it."""

    ref: str
    file: str
    line: int
    field: str
    base_dir: Path | None = None

    def error(self, message: str) -> ConfigError:
        return ConfigError(message, file=self.file, line=self.line, field=self.field)

    def __str__(self) -> str:
        return self.ref


def split_ref(ref: str) -> tuple[str, str]:
    """('module', 'attr.path') from 'module:attr.path', or ('', '') when malformed."""
    module_name, sep, attr_path = ref.partition(":")
    parts = [*module_name.split("."), *attr_path.split(".")]
    if not sep or not all(part.isidentifier() for part in parts):
        return "", ""
    return module_name, attr_path


def resolve(spec: HandlerImport) -> Callable[..., object]:
    """The handler ``spec`` names, imported and checked; ConfigError (with the file, line
    and field) when it does not import, is missing, or cannot take the claim."""
    module_name, attr_path = split_ref(spec.ref)
    with on_path(spec.base_dir, fresh=module_name not in sys.modules):
        try:
            target: object = importlib.import_module(module_name)
        except Exception as exc:
            where = repr(str(spec.base_dir)) if spec.base_dir is not None else "nothing extra"
            raise spec.error(f"handler module {module_name!r} does not import "
                             f"({type(exc).__name__}: {exc}); it is looked up with "
                             f"{where} first on sys.path{setup_hint(exc)}") from None
    for part in attr_path.split("."):
        if not hasattr(target, part):
            raise spec.error(f"module {module_name!r} has no attribute {attr_path!r}")
        target = getattr(target, part)
    if not callable(target):
        raise spec.error(f"handler {spec.ref!r} is {type(target).__name__}, not a function; "
                         "it must be an async or plain function")
    problem = signature_problem(target)
    if problem is not None:
        raise spec.error(f"{spec.ref} {problem}")
    return target


# what Django raises when a module uses the ORM in a process that did not set Django up
DJANGO_NOT_SET_UP = frozenset({"django.core.exceptions.ImproperlyConfigured",
                               "django.core.exceptions.AppRegistryNotReady"})


def setup_hint(exc: BaseException) -> str:
    """What to do when a handler module needs a framework this process has not set up."""
    kind = type(exc)
    if f"{kind.__module__}.{kind.__qualname__}" not in DJANGO_NOT_SET_UP:
        return ""
    return ("; a handler that uses Django needs Django set up first: run the command as "
            "'python manage.py coalescer ...' (with 'coalescer.integrations.django' in "
            "INSTALLED_APPS)")


@contextmanager
def on_path(base_dir: Path | None, *, fresh: bool = True) -> Iterator[None]:
    """Import with ``base_dir`` first on sys.path (it stays there); ``fresh``: the module
    is not imported yet, so the finders' caches are dropped (files may be new)."""
    if base_dir is not None:
        folder = str(base_dir)
        if sys.path[:1] != [folder]:
            while folder in sys.path:
                sys.path.remove(folder)
            sys.path.insert(0, folder)
    if fresh:
        importlib.invalidate_caches()
    yield


def is_async(fn: Callable[..., object]) -> bool:
    """Whether calling ``fn`` gives a coroutine (an ``async def`` function, a partial of
    one, or an object whose ``__call__`` is one)."""
    target = fn.func if isinstance(fn, functools.partial) else fn
    method = type(target).__call__ if not inspect.isroutine(target) else None
    return inspect.iscoroutinefunction(target) or inspect.iscoroutinefunction(method)


def signature_problem(fn: Callable[..., object]) -> str | None:
    """Why ``fn`` cannot be called as ``fn(claim)``, or None when it can (or when its
    signature cannot be read, as for some builtins). Read once a function: many rules
    often share one handler."""
    try:
        return _signature_problem(fn)
    except TypeError:  # not hashable: read it every time
        return _signature_problem.__wrapped__(fn)


@cache
def _signature_problem(fn: Callable[..., object]) -> str | None:
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return None
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    required = [p for p in positional if p.default is p.empty]
    keyword_only = [p.name for p in params if p.kind == p.KEYWORD_ONLY and p.default is p.empty]
    takes_more = any(p.kind == p.VAR_POSITIONAL for p in params)
    if keyword_only:
        names = ", ".join(repr(name) for name in keyword_only)
        return (f"has required keyword-only arguments ({names}); "
                "a handler takes one positional argument (the claim)")
    if len(required) > 1 or not (positional or takes_more):
        verb = "takes" if len(required) == len(positional) else "requires"
        count = len(required) if required else len(positional)
        return f"{verb} {count} positional arguments; a handler takes one (the claim)"
    return None
