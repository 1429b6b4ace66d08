"""``$COALESCER_NAMESPACE``: a namespace that replaces the rules' own wherever rules are
loaded (a rules file, YAML text, rules built in Python), so that one rules file can serve
several isolated deployments, and a test's coalescer never shares keys with a running one.

The pytest plugin (``coalescer.testing``) sets it for each test to the test's namespace.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from coalescer.config.yaml_reader import NAME_RE, shown
from coalescer.errors import ConfigError

ENV_NAMESPACE = "COALESCER_NAMESPACE"


def namespace_override(source: str, environ: Mapping[str, str] | None = None) -> str | None:
    """The namespace ``$COALESCER_NAMESPACE`` sets (None when it is unset or empty).

    A value that is not a valid namespace is a ConfigError on the ``namespace`` field of
    ``source`` (the rules' file) naming the variable and the value.
    """
    value = (os.environ if environ is None else environ).get(ENV_NAMESPACE, "")
    if not value:
        return None
    if NAME_RE.fullmatch(value) is None:
        raise ConfigError(f"${ENV_NAMESPACE} is {shown(value)}, which is not a namespace: "
                          "it may only use letters, digits, '_', '.' and '-' (it becomes "
                          f"part of Redis keys); fix or unset ${ENV_NAMESPACE}",
                          file=source, field="namespace")
    return value


def namespace_origin(namespace: str, environ: Mapping[str, str] | None = None) -> str | None:
    """A note saying that ``namespace`` (a loaded config's) came from the variable, e.g.
    "(from $COALESCER_NAMESPACE)"; None when the variable did not set it."""
    value = (os.environ if environ is None else environ).get(ENV_NAMESPACE, "")
    return f"(from ${ENV_NAMESPACE})" if value and value == namespace else None
