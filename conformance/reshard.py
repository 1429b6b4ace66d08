"""Moving one slot between two masters of the suite's cluster, in the three phases a
client sees: MIGRATING/IMPORTING (keys still on the source), the keys moved (the
source answers ASK for them), the slot given to the target (MOVED)."""

from __future__ import annotations

from dataclasses import dataclass, field

from redis.crc import key_slot

from bench.valkey import Server

PHASES = ("begin", "keys", "end")


@dataclass
class SlotMove:
    """One slot on its way from ``source`` to ``target``."""

    slot: int
    source: Server
    target: Server
    asking_before: int = 0
    phases: list[str] = field(default_factory=list)


def slot_of(name: str) -> int:
    return int(key_slot(name.encode()))


def _owns(server: Server, slot: int) -> bool:
    with server.client() as c:
        text = c.execute_command("CLUSTER", "NODES")
    lines = text.splitlines() if isinstance(text, str) else [str(x) for x in text]
    mine = next(line for line in lines if "myself" in line.split()[2])
    for part in mine.split()[8:]:
        if part.startswith("["):
            continue
        low, _, high = part.partition("-")
        if int(low) <= slot <= int(high or low):
            return True
    return False


def _node_id(server: Server) -> str:
    with server.client() as c:
        return str(c.execute_command("CLUSTER", "MYID"))


def asking_calls(server: Server) -> int:
    """How many ASKING commands ``server`` has taken so far."""
    with server.client() as c:
        stats = c.info("commandstats")
    return int(stats.get("cmdstat_asking", {}).get("calls", 0))


def begin(masters: list[Server], slot: int) -> SlotMove:
    """Mark ``slot`` MIGRATING on its owner and IMPORTING on another master."""
    source = next(s for s in masters if _owns(s, slot))
    target = next(s for s in masters if s is not source)
    move = SlotMove(slot, source, target, asking_calls(target))
    with source.client() as src, target.client() as dst:
        dst.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", _node_id(source))
        src.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", _node_id(target))
    move.phases.append("begin")
    return move


def move_keys(move: SlotMove) -> int:
    """MIGRATE every key of the slot to the target; how many moved."""
    moved = 0
    with move.source.client() as src:
        while keys := src.execute_command("CLUSTER", "GETKEYSINSLOT", move.slot, 100):
            src.execute_command("MIGRATE", "127.0.0.1", move.target.port, "", 0, 5000,
                                "KEYS", *keys)
            moved += len(keys)
    move.phases.append("keys")
    return moved


def end(masters: list[Server], move: SlotMove) -> None:
    """Give the slot to the target on every master (clients with the old map: MOVED)."""
    move_keys(move)  # keys written to the source since
    owner = _node_id(move.target)
    for server in [move.target, move.source, *masters]:
        with server.client() as c:
            c.execute_command("CLUSTER", "SETSLOT", move.slot, "NODE", owner)
    move.phases.append("end")


def abandon(move: SlotMove) -> None:
    """A case that stopped halfway: the slot goes back to STABLE on both masters (its
    keys stay where they are), or, once its keys moved, to the target."""
    if "end" in move.phases:
        return
    owner = _node_id(move.target) if "keys" in move.phases else None
    for server in (move.source, move.target):
        with server.client() as c:
            if owner is None:
                c.execute_command("CLUSTER", "SETSLOT", move.slot, "STABLE")
            else:  # its keys are on the target now: the slot goes with them
                c.execute_command("CLUSTER", "SETSLOT", move.slot, "NODE", owner)
