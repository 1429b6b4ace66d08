"""Rules named by a string (the commands' ``--rules``, Django's
``settings.COALESCER_RULES``): a rules file, or, as ``module.path:attribute``, a
``Rules(...)`` (or a ``Config``) built in code, imported as docs/cli.md's "Rules built
in code" says (from ``sys.path``; the working folder last, and only when no other user
could have planted the module there). Every command loads its rules here:
``load_rules`` for those that use them, ``check_rules`` for ``coalescer check``, which
reports the same errors and warnings either way.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import os
import re
import reprlib
import stat
import sys
import sysconfig
import traceback
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from coalescer.config.code_rules import Rules
from coalescer.config.lint import ConfigWarning
from coalescer.config.rules import CheckReport, Config, check_config, check_file
from coalescer.errors import ConfigError

_IDENTIFIERS = r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*"
MODULE_REF = re.compile(rf"({_IDENTIFIERS}):({_IDENTIFIERS})", re.ASCII)

NOT_FOUND = ("rules file not found (give another with --rules PATH, or name rules built "
             "in code with --rules module.path:attribute)")


def is_module_ref(value: str) -> bool:
    """Whether ``--rules value`` names rules in code: no such file, and the form
    ``dotted.module:attribute``."""
    return MODULE_REF.fullmatch(value) is not None and not Path(value).is_file()


def load_rules(value: str, *, import_handlers: bool = True) -> Config:
    """The ``Config`` that ``--rules value`` names; handler modules are imported only
    with ``import_handlers`` (a process that runs handlers). One ConfigError saying
    what was wrong otherwise."""
    if is_module_ref(value):
        config = _code_rules(value).config
        return config.with_handlers() if import_handlers else config
    if not os.path.lexists(value):
        raise ConfigError(NOT_FOUND, file=value)
    return Config.from_yaml(value, import_handlers=import_handlers)


def check_rules(value: str, environ: Mapping[str, str], *,
                import_handlers: bool = True) -> CheckReport:
    """What ``coalescer check`` reports of ``--rules value``: every error and warning,
    each naming the rules file's line or the ``Rules(...)``/``Rule(...)`` call's."""
    if not is_module_ref(value):
        if not os.path.lexists(value):
            return CheckReport(config=None, errors=(ConfigError(NOT_FOUND, file=value),),
                               warnings=())
        return check_file(value, environ, import_handlers=import_handlers)
    try:
        found = _code_rules(value)
    except ConfigError as exc:
        return CheckReport(config=None, errors=tuple(exc.errors), warnings=())
    report = check_config(found.config, environ, import_handlers=import_handlers)
    if found.file is None:
        return report
    return dataclasses.replace(report, warnings=tuple(
        _in_file(warning, found.config.source, found.file) for warning in report.warnings))


@dataclasses.dataclass(frozen=True)
class _Found:
    config: Config
    file: str | None  # the file of the Rules(...) call; None for a Config


def _code_rules(value: str) -> _Found:
    """The rules ``module:attribute`` names, imported; a ConfigError naming what was
    wrong (the module, the attribute, its type) or the ``Rule(...)`` call at fault."""
    module_name, attribute = value.split(":")
    module = _import(value, module_name)
    found: Any = module
    for part in attribute.split("."):
        if not hasattr(found, part):
            raise ConfigError(_missing(module, attribute), file=value)
        found = getattr(found, part)
    if isinstance(found, Rules):
        return _Found(found.config, found.file)
    if isinstance(found, Config):
        return _Found(found, None)
    raise ConfigError(f"{attribute} is {_what(found)}, not a Rules(...) or a Config: name "
                      "the Rules(...) object itself", file=value)


def _import(value: str, module_name: str) -> Any:
    """The module, imported from ``sys.path``, else from a trusted working folder."""
    looked = _allow_working_folder(module_name.partition(".")[0])
    try:
        return importlib.import_module(module_name)
    except ConfigError:
        raise  # its Rules(...) failed its checks: the error names the call's file and line
    except ImportError as exc:
        raise ConfigError(f"cannot import module {module_name}: {exc} (looked for on "
                          f"sys.path, then {looked})", file=value) from None
    except Exception as exc:  # the module's own code failed: say what and where
        raise ConfigError(f"importing module {module_name} raised {type(exc).__name__}: "
                          f"{exc}{_where(exc)}", file=value) from None


def _allow_working_folder(package: str) -> str:
    """Put the working folder last on ``sys.path`` when ``package`` is not importable
    without it and no other user could have put it there; say where it was looked for."""
    cwd = os.getcwd()
    if cwd in sys.path or _findable(package):
        return f"the working folder, {cwd}"
    distrust = _distrust(cwd)
    if distrust is not None:
        return (f"not the working folder, {cwd}: it {distrust} (install the package, or "
                "name its folder in $PYTHONPATH)")
    sys.path.append(cwd)
    importlib.invalidate_caches()
    return f"the working folder, {cwd}"


def _findable(package: str) -> bool:
    try:
        return importlib.util.find_spec(package) is not None
    except (ImportError, ValueError):
        return False


def _distrust(folder: str) -> str | None:
    """Why another user may have put a module in ``folder``, or None."""
    try:
        found = os.stat(folder)
    except OSError as exc:
        return f"cannot be read ({exc.strerror})"
    if found.st_uid not in (os.geteuid(), 0):
        return f"belongs to another user (uid {found.st_uid})"
    if found.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return "may be written by other users"
    return None


def _where(exc: BaseException) -> str:
    """" (at FILE:LINE)": the innermost frame of ``exc``'s traceback outside Python's
    own library (the app's line that called into it)."""
    stdlib = sysconfig.get_paths()["stdlib"]
    frames = [frame for frame in traceback.extract_tb(exc.__traceback__)
              if not frame.filename.startswith((stdlib, "<frozen "))]
    return f" (at {frames[-1].filename}:{frames[-1].lineno})" if frames else ""


def _missing(module: Any, attribute: str) -> str:
    """The error for an attribute the module does not have, naming the rules it has."""
    held = sorted(name for name, value in vars(module).items()
                  if isinstance(value, Rules | Config))
    where = getattr(module, "__file__", None) or module.__name__
    text = f"module {module.__name__} ({where}) has no attribute {attribute}"
    return text + (f"; its rules: {', '.join(held)}" if held else "")


def _what(value: object) -> str:
    """``value``'s type and what it is: "a dict ({'a': 1})", "a function (app.rules.make)"."""
    name = type(value).__name__
    article = "an" if name[:1].lower() in "aeiou" else "a"
    qualname = getattr(value, "__qualname__", None)
    shown = (f"{getattr(value, '__module__', '?')}.{qualname}" if isinstance(qualname, str)
             else reprlib.repr(value))
    return f"{article} {name} ({shown})"


def _in_file(warning: ConfigWarning, source: str, file: str) -> ConfigWarning:
    """A warning of rules in code named by the file of their ``Rules(...)`` call rather
    than the config's source text."""
    return dataclasses.replace(warning, file=file) if warning.file == source else warning
