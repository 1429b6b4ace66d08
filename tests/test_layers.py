"""The package's layers: each subpackage imports only from the layers below it, and no
two modules import each other, directly or through others."""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "coalescer"

# Lowest first. Modules of one rank may import each other's rank only where they
# share a subpackage (worker and sources are peers that never import each other).
RANKS = {
    "errors": 0, "common": 1, "config": 2, "store": 3, "tracing": 3, "write": 4, "claim": 4,
    "worker": 5, "sources": 5, "query": 6,
    "facade": 7, "integrations": 7,
    "web": 8, "cli": 9,
}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__" and len(parts) > 1:
        parts.pop()
    return ".".join(parts)


FACADE = {"__init__", "coalescer", "sync", "testing"}


# Of one rank, but one builds on the other: the integrations make coalescers for an app
# (the façade's SyncCoalescer), the façade never imports an integration.
BESIDE = {("integrations", "facade")}

# A Django app's management commands are command-line entry points: the cli layer.
DJANGO_COMMANDS = "coalescer.integrations.django.management"


def layer(module: str) -> str:
    """The subpackage of ``module``; the top-level modules a user imports are the façade."""
    if module == DJANGO_COMMANDS or module.startswith(DJANGO_COMMANDS + "."):
        return "cli"
    parts = module.split(".")
    name = parts[1] if len(parts) > 1 else "__init__"
    return "facade" if name in FACADE else name


@functools.cache
def imported(path: Path, *, typing: bool = False) -> frozenset[str]:
    """The coalescer modules ``path`` imports, lazy imports inside functions included,
    imports made only for type checking left out unless ``typing``; ``from coalescer.x
    import y`` counts as importing the module ``coalescer.x.y`` where there is one."""
    tree = ast.parse(path.read_text())
    typing_only = set() if typing else {
        id(n) for top in ast.walk(tree) if isinstance(top, ast.If)
        and "TYPE_CHECKING" in ast.unparse(top.test) for n in ast.walk(top)}
    found: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.update(f"{node.module}.{alias.name}" if f"{node.module}.{alias.name}"
                         in MODULES else node.module for alias in node.names)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return frozenset(m for m in found if m.split(".")[0] == "coalescer")


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def tiers(package: str, *lines: str) -> dict[str, int]:
    """The tier of each module named on ``lines``, lowest first; the names are below
    ``coalescer.package`` (``__init__`` is the package itself)."""
    prefix = f"coalescer.{package}." if package else "coalescer."
    return {(prefix + name).removesuffix(".__init__"): tier
            for tier, line in enumerate(lines) for name in line.split()}


# Within a layer too, an order: a module imports only modules of lower tiers of its own
# layer, never one of its tier or above. A module not listed here takes the tier above
# the highest of the modules of its layer it imports; list it to say where it belongs.
WITHIN: dict[str, dict[str, int]] = {
    "errors": tiers("", "errors"),
    "claim": tiers("", "claim"),
    "common": tiers(
        "common",
        "__init__ forksafe json_depth key_limits log_once metrics plural printable redact"
        " traceparent",
        "audit_log retrying"),
    "config": tiers(
        "config",
        "__init__ durability durations handler_import limits matcher sizes",
        "patterns schedule yaml_reader",
        "fair",
        "lint model namespace_env rule_index templates",
        "sources",
        "kafka_source",
        "schema",
        "rules",
        "code_rules",
        "rules_source"),
    "tracing": tiers("tracing", "bounds", "touches", "refreshes", "__init__"),
    "store": tiers(
        "store",
        # what the scripts stand on: key names, states, how calls are batched
        "__init__ batching embedded_procs eviction key_states keycheck keys replicas sentinel",
        "connection embedded fair_args paused_copies protocol_version redis_failures"
        " script_calls"
        " script_types",
        # one family of scripts each
        "byte_count claim_scripts embedded_watch hints lease_scripts operator_scripts"
        " write_scripts audit_stream search_scripts",
        "scripts",  # joins the families
        "layout"),
    "write": tiers(
        "write",
        "__init__ buffer cancel cancel_scheduled failures quota recent_writes routing",
        "backpressure refusals",
        "batches",
        "absorber",
        "flusher room"),
    "worker": tiers(
        "worker",
        # knowing nothing of a node
        "__init__ batches coalescing failure_log failure_window jobs lead_log lease_clock"
        " loop_lag node_death resharding summary threads wakeups webhooks",
        "child claims fork_preload invoke lapsed paused",
        # what the parts share, importing none of them; calling a handler in a child
        "context isolation",
        # the parts
        "claim_leases handlers mover node_lease registry run_log throttle",
        "claim_runs health results",
        "runner",
        "adopter drain poller",
        "leadership",
        "node"),  # wires the parts
    "sources": tiers(
        "sources",
        "kafka_commit kafka_status outbox_sql stream_old_group times",
        "base kafka_values kafka_watch outbox_db",
        "kafka outbox streams",
        "__init__"),  # the registry of types
    "query": tiers(
        "query",
        "__init__ layout_read rate_status rule_counts source_status"
        " timeline_events trace_links",
        "controls dead_letters due history registry_status scheduled_keys key_search",
        "workers bulk",
        "explain status timeline_text",
        "timeline",
        "reader"),
    "facade": tiers(
        "",
        "facade.__init__ facade.run",
        "facade.core",  # what the parts share
        "facade.cancelling facade.draining facade.lifecycle facade.touching",
        "coalescer",  # hands each call to its part
        "sync testing",
        "__init__"),
    "integrations": tiers(
        "integrations",
        "__init__ asgi django.apps django.conf django.migrations"
        " django.migrations.0001_initial django.models outbox_rows",
        "django.process outbox_sqlalchemy",
        "django.__init__ sqlalchemy"),
    "web": tiers(
        "web",
        "__init__ listener requests",
        "connections guards page scheduled_api roles operator_api timeline_api",
        "api"),
    "cli": tiers(
        "",
        "cli.operator_parser cli.operator_cmds cli.timeline_cmd",
        "cli.check_details cli.closed_stdout cli.demo cli.demo_app.__init__"
        " cli.demo_app.handlers cli.errors cli.parser cli.refresh_lines cli.scheduled_cmds"
        " cli.stopping integrations.django.management.__init__"
        " integrations.django.management.commands.__init__"
        " integrations.django.management.forkserver_setup",
        "cli.supervisor",
        "cli.commands",
        "cli.main",
        "cli.__init__ cli.__main__ integrations.django.management.cli",
        "integrations.django.management.commands.coalescer"),
}


@pytest.mark.parametrize("module", sorted(MODULES))
def test_a_module_imports_only_from_its_own_layer_or_below(module: str) -> None:
    mine = layer(module)
    wrong = []
    for target in imported(MODULES[module]):
        theirs = layer(target)
        if theirs == mine or (mine, theirs) in BESIDE:
            continue
        if RANKS[theirs] >= RANKS[mine]:
            wrong.append(target)
    assert not wrong, f"{module} ({mine}) imports from layers at or above its own: {wrong}"


def test_every_subpackage_says_what_it_holds_and_may_import() -> None:
    for init in sorted(PACKAGE.glob("*/__init__.py")):
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        assert "import" in doc, f"{init.parent.name}/__init__.py does not say what it may import"
        assert layer(module_name(init)) in RANKS, f"{init.parent.name} has no rank"


def test_no_two_modules_import_each_other() -> None:
    """Imports made only for type checking count too: a part that names the node's type
    cannot be read without the node."""
    graph = {m: {t for t in imported(p, typing=True) if t in MODULES and t != m}
             for m, p in MODULES.items()}
    cycles = {" -> ".join(path) for start in graph if (path := cycle_from(start, graph))}
    assert not cycles, "import cycles:\n" + "\n".join(sorted(cycles))


def cycle_from(start: str, graph: dict[str, set[str]]) -> list[str]:
    """A path of imports from ``start`` back to it, or none."""
    came_from: dict[str, str] = {}
    stack = [start]
    while stack:
        node = stack.pop()
        for target in sorted(graph[node]):
            if target == start:
                path = [node]
                while path[-1] != start:
                    path.append(came_from[path[-1]])
                return [start, *reversed(path[:-1]), start]
            if target not in came_from:
                came_from[target] = node
                stack.append(target)
    return []


def test_every_module_listed_in_a_tier_exists() -> None:
    gone = sorted(m for tiers_ in WITHIN.values() for m in tiers_ if m not in MODULES)
    assert not gone, f"WITHIN in tests/test_layers.py names modules that are no more: {gone}"


def tier(module: str, seen: frozenset[str] = frozenset()) -> int:
    """``module``'s tier in its layer: the listed one, else the one above the highest
    of the modules of its layer it imports (a cycle is test_no_two_modules_...'s)."""
    own = WITHIN.get(layer(module), {})
    if module in own:
        return own[module]
    below = [tier(t, seen | {module}) for t in imported(MODULES[module], typing=True)
             if t in MODULES and layer(t) == layer(module) and t not in seen | {module}]
    return 1 + max(below, default=-1)


@pytest.mark.parametrize("module", sorted(MODULES))
def test_a_module_imports_only_lower_tiers_of_its_own_layer(module: str) -> None:
    """Imports made only for type checking count too."""
    mine = tier(module)
    up = [f"{module} (tier {mine}) imports {t} (tier {tier(t)})"
          for t in sorted(imported(MODULES[module], typing=True))
          if t in MODULES and t != module and layer(t) == layer(module) and tier(t) >= mine]
    assert not up, ("imports at or above the importer's own tier (WITHIN in "
                    "tests/test_layers.py):\n" + "\n".join(up))
