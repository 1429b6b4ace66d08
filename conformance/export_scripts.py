"""python -m conformance.export_scripts DIR: write the text of every script a client
calls to touch (docs/protocol.md: Scripts), exactly as it is sent to Redis, to
DIR/NAME.lua, and DIR/manifest.json with each one's SHA-1 (what EVALSHA takes) and the
protocol version. A client in another language ships these files; its tests compare them
with a fresh export, so a script changed here is noticed there."""

from __future__ import annotations

import hashlib
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from coalescer.store.protocol_version import VERSION
from coalescer.store.script_calls import script_source

CLIENT_SCRIPTS = ("layout", "upsert", "cancel", "limits", "pending_bytes", "reshard_put")


def export(folder: Path) -> dict[str, object]:
    """Write the scripts and the manifest to ``folder``; returns the manifest."""
    folder.mkdir(parents=True, exist_ok=True)
    shas: dict[str, str] = {}
    for name in CLIENT_SCRIPTS:
        text = script_source(name)
        (folder / f"{name}.lua").write_text(text, encoding="utf-8", newline="")
        shas[name] = hashlib.sha1(text.encode("utf-8"), usedforsecurity=False).hexdigest()
    manifest: dict[str, object] = {"protocol": VERSION, "scripts": shas}
    (folder / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n",
                                          encoding="utf-8")
    return manifest


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 1 or args[0].startswith("-"):
        print("usage: python -m conformance.export_scripts DIR", file=sys.stderr)
        return 2
    manifest = export(Path(args[0]))
    print(f"wrote {len(CLIENT_SCRIPTS)} scripts and manifest.json (protocol "
          f"{manifest['protocol']}) to {args[0]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
