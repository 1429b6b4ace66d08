"""docs/protocol.md holds against the code: its version, its key table, its shard and
pattern vectors, and each script's KEYS and ARGV (against the script's header and the
arguments the Python writer really sends). A change to any of them fails here until
the document says it too."""

from __future__ import annotations

import inspect
import re
import zlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from redis.crc import key_slot

from coalescer.config.patterns import KeyPattern
from coalescer.store import keys as key_names
from coalescer.store.byte_count import ByteCount
from coalescer.store.keys import KeySpace, ShardKeys
from coalescer.store.layout import Layouts, put_bundles
from coalescer.store.protocol_version import VERSION
from coalescer.store.script_types import CancelGroup, UpsertGroup
from coalescer.store.write_scripts import WriteScripts

REPO = Path(__file__).resolve().parents[1]
DOC = (REPO / "docs" / "protocol.md").read_text(encoding="utf-8")
LUA = REPO / "coalescer" / "store" / "lua"
SHARD = ShardKeys("NS", 0)


def section(title: str) -> str:
    """The text of the section whose heading starts with ``title``, to the next heading
    of the same or a higher level."""
    found = re.search(rf"^(#+) {re.escape(title)}.*$", DOC, re.MULTILINE)
    assert found, f"docs/protocol.md has no section {title!r}"
    level = len(found.group(1))
    rest = DOC[found.end():]
    end = re.search(rf"^#{{1,{level}}} ", rest, re.MULTILINE)
    return rest[:end.start()] if end else rest


def tables(text: str) -> list[list[list[str]]]:
    """The markdown tables of ``text``: rows of cells, header and rule left out."""
    found: list[list[list[str]]] = []
    rows: list[list[str]] = []
    for line in [*text.splitlines(), ""]:
        if line.startswith("|"):
            cells = re.split(r"(?<!\\)\|", line.strip().strip("|"))
            rows.append([c.strip().replace("\\|", "|") for c in cells])
        elif rows:
            found.append([r for r in rows[2:]])
            rows = []
    return found


def code(cell: str) -> str:
    spans = re.findall(r"`([^`]*)`", cell)
    return spans[0] if spans else cell


# -- the version and the keys ---------------------------------------------------------


def test_the_version_is_the_one_the_writer_writes() -> None:
    (rows,) = tables(DOC.split("## What a client does")[0])
    assert [code(r[0]) for r in rows] == [VERSION]


def built_keys() -> set[str]:
    """Every key name keys.py builds, with NS, N, RULE, KEY, NODE for its parts; a
    prefix property (the start of a per-key name) left out."""
    shard = ShardKeys("NS", "N")  # type: ignore[arg-type]  # a placeholder shard number
    out: set[str] = set()
    for name, member in inspect.getmembers(ShardKeys):
        if name.startswith("_"):
            continue
        if isinstance(member, property) and not name.endswith("prefix"):
            out.add(getattr(shard, name))
        elif inspect.isfunction(member):
            params = list(inspect.signature(member).parameters)[1:]
            out.add(member(shard, *[p.upper() for p in params]))
    for _, fn in inspect.getmembers(key_names, inspect.isfunction):
        params = list(inspect.signature(fn).parameters)
        if fn.__module__ == key_names.__name__ and params[:1] == ["namespace"]:
            out.add(fn("NS", *[p.upper() for p in params[1:]]))
    return {k for k in out if isinstance(k, str)}


def test_the_key_table_names_every_key_the_code_builds_and_no_other() -> None:
    (rows,) = tables(section("Keys and hash tags"))
    documented = [code(r[0]) for r in rows]
    assert len(documented) == len(set(documented)), "a key documented twice"
    missing = built_keys() - set(documented)
    extra = set(documented) - built_keys()
    assert not missing, f"keys.py builds keys docs/protocol.md does not list: {missing}"
    assert not extra, f"docs/protocol.md lists keys keys.py does not build: {extra}"


# -- vectors --------------------------------------------------------------------------


def test_the_shard_vectors_hold() -> None:
    (rows,) = tables(section("The shard function"))
    assert len(rows) >= 5
    for key_cell, crc, *shards in rows:
        key = code(key_cell)
        assert zlib.crc32(key.encode()) == key_names.key_hash(key) == int(crc), key
        counts = (1, 4, 16, 256)
        assert [KeySpace("NS", n).shard_of(key) for n in counts] == [int(s) for s in shards]


def test_the_slot_vectors_hold() -> None:
    text = section("The shard function")
    pairs = re.findall(r"shard (\d+)(?: \(`shop:\d+`\))? (?:is )?slot (\d+)", text)
    assert len(pairs) == 4
    for shard, slot in pairs:
        assert key_slot(ShardKeys("shop", int(shard)).meta.encode()) == int(slot)
    nodes = re.search(r"`shop:nodes` slot (\d+)", text)
    assert nodes and key_slot(key_names.protocol_version("shop").encode()) == int(nodes[1])


def test_the_pattern_vectors_hold() -> None:
    rows = tables(section("Rules: which rule a key follows"))[0]
    assert len(rows) >= 10
    for pattern, key, matches, captures in rows:
        found = KeyPattern.compile(code(pattern)).match(code(key))
        assert (found is not None) == (matches == "yes"), (pattern, key)
        expected = dict(re.findall(r"`(\w+)=([^`]*)`", captures))
        assert (found or {}) == expected, (pattern, key)


# -- the scripts ------------------------------------------------------------------------


def header(script: str) -> str:
    """The opening comment of a Lua file (its KEYS, ARGV and reply)."""
    lines = []
    for line in (LUA / f"{script}.lua").read_text().splitlines():
        if line.startswith("#!"):
            continue
        if not line.startswith("--"):
            break
        lines.append(line)
    return "\n".join(lines)


def numbered(text: str, what: str) -> set[int]:
    """The fixed positions ``what[N]`` that ``text`` names."""
    return {int(n) for n in re.findall(rf"{what}\[(\d+)\]", text)}


def script_tables(script: str) -> tuple[list[list[str]], list[list[str]]]:
    keys, args = tables(section(f"{script}.lua"))[:2]
    return keys, args


def resolve(template: str, rule: str = "stats") -> str:
    return template.replace("NS:{NS:N}", SHARD.prefix).replace("RULE", rule)


def positions(rows: list[list[str]], what: str) -> dict[str, str]:
    return {code(r[0]).removeprefix(f"{what}[").removesuffix("]"): r[1] for r in rows}


@pytest.mark.parametrize("script", ["layout", "upsert", "cancel", "limits", "pending_bytes",
                                    "reshard_put"])
def test_each_script_documents_the_fixed_keys_and_argv_its_header_names(script: str) -> None:
    keys, args = script_tables(script)
    for what, rows in (("KEYS", keys), ("ARGV", args)):
        documented = {int(p) for p in positions(rows, what) if p.isdigit()}
        assert documented == numbered(header(script), what), (
            f"{script}.lua names {what} {sorted(numbered(header(script), what))}, "
            f"docs/protocol.md {sorted(documented)}")


class Capture(WriteScripts):
    """The real wrappers, with each call's KEYS and ARGV kept instead of sent."""

    def __init__(self, reply: Any) -> None:  # no client: nothing is sent
        self.calls: list[tuple[str, list[str], list[Any]]] = []
        self.reply = reply

    async def _run(self, name: str, keys: Sequence[str], args: Sequence[Any]) -> Any:
        self.calls.append((name, list(keys), list(args)))
        return self.reply


def documented_keys(script: str, groups: int, rules: Sequence[str]) -> list[str]:
    """The KEYS the document gives ``script`` for ``groups`` groups (rule per group)."""
    rows = positions(script_tables(script)[0], "KEYS")
    out = [resolve(code(rows[p])) for p in sorted((p for p in rows if p.isdigit()), key=int)]
    per_group = [p for p in rows if "g" in p or "r" in p]
    for g in range(groups):
        out += [resolve(code(rows[p]), rules[g]) for p in per_group]
    return out


def counts(script: str) -> tuple[int, int, int]:
    """ARGV: fixed, per group, and after the groups (optional sections), each run of
    positions checked to follow on from the one before."""
    rows = list(positions(script_tables(script)[1], "ARGV"))
    fixed = [int(p) for p in rows if p.isdigit()]
    assert fixed == list(range(1, len(fixed) + 1)), f"{script}: ARGV {fixed}"
    groups = [re.fullmatch(r"(\d+)\+(\d+)g", p) for p in rows if p.endswith("g")]
    starts = [int(m[1]) for m in groups if m]
    assert len(starts) == len(groups), f"{script}: per-group ARGV {rows}"
    assert starts == list(range(len(fixed) + 1, len(fixed) + 1 + len(starts))), rows
    assert all(m and int(m[2]) == len(starts) for m in groups), rows
    after = [re.match(r"(\d+)\+(\d+)G", p) for p in rows if "G" in p]
    assert all(m and int(m[1]) == len(fixed) + 1 + n and int(m[2]) == len(starts)
               for n, m in enumerate(after)), rows
    return len(fixed), len(starts), len(after)


async def test_upsert_is_called_as_documented() -> None:
    calls = Capture([1, 1, 0, [], [], 0, []])
    plain = UpsertGroup("stats", 10_000, 60_000, ["stats:1", "stats:2"])
    other = UpsertGroup("orders", 5_000, 30_000, ["orders:1"])
    with_items = UpsertGroup("orders", 5_000, 30_000, ["orders:1"],
                             items={"orders:1": ["a"]}, items_max=3)
    await calls.upsert_keys(SHARD, [plain], gen=3)
    await calls.upsert_keys(SHARD, [plain, other], gen=3)
    await calls.upsert_keys(SHARD, [plain, with_items], gen=3)
    fixed, per_group, after = counts("upsert")
    (_, keys1, args1), (_, keys2, args2), (_, _, args3) = calls.calls
    assert keys1 == documented_keys("upsert", 1, ["stats"])
    assert keys2 == documented_keys("upsert", 2, ["stats", "orders"])
    assert len(args1) == fixed + per_group, args1
    assert len(args2) == fixed + 2 * per_group, args2
    assert len(args3) == fixed + 2 * per_group + after, args3  # items: prefix, max, fields
    assert args1[:3] == [SHARD.wake_channel, 3, 0]
    assert args1[fixed:fixed + per_group] == [10_000, 60_000, 2, "stats:1\0stats:2", 0, ""]
    assert args3[fixed + 2 * per_group:] == [SHARD.items_prefix, 3, "orders:1\x001\x00a"]


async def test_cancel_is_called_as_documented() -> None:
    calls = Capture([0, ["idle", "idle"], 0, []])
    await calls.cancel(SHARD, [CancelGroup("stats", ["stats:1"]),
                               CancelGroup("orders", ["orders:1"])])
    ((_, keys, args),) = calls.calls
    fixed, per_group, after = counts("cancel")
    assert keys == documented_keys("cancel", 2, ["stats", "orders"])
    assert len(args) == fixed + 2 * per_group + after
    assert args[2:5] == [SHARD.items_prefix, SHARD.claimed_prefix, SHARD.traces_prefix]
    assert args[fixed:fixed + per_group] == ["stats", 1, "stats:1"]


async def test_limits_is_called_as_documented() -> None:
    calls = Capture([0, 0, 0, 0])
    await calls.limits(SHARD, ["stats", "orders"], keep_dead=5, dead_ttl_ms=9, budget=0)
    ((_, keys, args),) = calls.calls
    assert keys == [SHARD.meta, SHARD.due("stats"), SHARD.due("orders"),
                    SHARD.dead("stats"), SHARD.dead("orders")]
    fixed, _, _ = counts("limits")
    assert len(args) == fixed and args[0] == 2
    assert args[1:3] == [SHARD.items_prefix, SHARD.claimed_prefix]
    assert args[6] == SHARD.traces_prefix


async def test_layout_and_pending_bytes_are_called_as_documented() -> None:
    sent: list[tuple[list[str], list[Any]]] = []

    class Client:
        def register_script(self, _source: str) -> Any:
            async def run(*, keys: list[str], args: list[Any]) -> Any:
                sent.append((keys, args))
                return [0, 0]
            return run

    await ByteCount(Client(), items=True).count(SHARD)
    await ByteCount(Client(), items=True, leading=True).count(SHARD)
    (keys, args), (_, leading) = sent
    assert keys == documented_keys("pending_bytes", 0, [])
    optional = [code(r[0]) for r in script_tables("pending_bytes")[1] if "OPTIONAL" in r[1]]
    fixed, _, _ = counts("pending_bytes")
    assert (len(args), len(leading)) == (fixed - len(optional), fixed)
    assert leading[-1] == SHARD.quiet_prefix
    layout = Layouts(Capture([1, 4, 0, 0, 0, 0, "", [], 0]), "NS", 4)  # type: ignore[arg-type]
    assert layout._keys() == [key_names.layout("NS"), key_names.drained("NS")]
    assert [code(r[1]) for r in script_tables("layout")[0]] == [
        "NS:{NS:nodes}:layout", "NS:{NS:nodes}:drained"]


async def test_reshard_put_is_called_as_documented() -> None:
    sent: list[tuple[str, list[str], list[Any]]] = []

    class Scripts:
        async def call(self, name: str, keys: list[str], args: list[Any], *,
                       durable: bool = False) -> Any:
            sent.append((name, keys, args))
            return 2

    bundles = ['{"d":0,"k":"stats:1"}', '{"d":0,"k":"stats:2"}']
    assert await put_bundles(Scripts(), SHARD, 7, bundles) == 2  # type: ignore[arg-type]
    ((name, keys, args),) = sent
    assert name == "reshard_put"
    assert keys == documented_keys("reshard_put", 0, [])
    documented = positions(script_tables("reshard_put")[1], "ARGV")
    assert [resolve(code(documented[p])) for p in ("1", "2")] == [SHARD.wake_channel,
                                                                  SHARD.prefix]
    assert args == [SHARD.wake_channel, SHARD.prefix, 7, *bundles]


# -- refusals as the conformance adapters name them -------------------------------------


def test_every_refusal_code_is_one_the_adapter_protocol_defines() -> None:
    readme = (REPO / "conformance" / "README.md").read_text(encoding="utf-8")
    adapter_codes = set(re.findall(r"^\| `([A-Z_]+)`", readme, re.MULTILINE))
    adapter_codes |= {"MISCONF", "NOREPLICAS", "OOM", "READONLY"}
    (rows,) = tables(section("Refusals a client sees"))
    documented = {c for r in rows for c in re.findall(r"`([A-Z_]+)`", r[-1])}
    assert documented == {"QUOTA", "EVICTION_POLICY", "VERSION"}
    assert documented <= adapter_codes, documented - adapter_codes
