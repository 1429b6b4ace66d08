"""The scripts a client in another language ships are exactly the ones the Python writer
sends: the same text, and the SHA-1 Redis knows them by."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import redis

from conformance.export_scripts import CLIENT_SCRIPTS

REPO = Path(__file__).resolve().parents[2]


def test_the_exported_scripts_are_the_ones_redis_runs(tmp_path: Path, redis_url: str) -> None:
    done = subprocess.run([sys.executable, "-m", "conformance.export_scripts", str(tmp_path)],
                          capture_output=True, text=True, cwd=REPO, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert manifest["protocol"] == "1.0"
    assert sorted(manifest["scripts"]) == sorted(CLIENT_SCRIPTS)
    with redis.Redis.from_url(redis_url) as r:
        for name, sha in manifest["scripts"].items():
            text = (tmp_path / f"{name}.lua").read_bytes()
            assert r.script_load(text) == sha, name


def test_without_a_folder_it_says_how_to_call_it() -> None:
    done = subprocess.run([sys.executable, "-m", "conformance.export_scripts"],
                          capture_output=True, text=True, cwd=REPO, timeout=60, check=False)
    assert done.returncode == 2
    assert "usage: python -m conformance.export_scripts DIR" in done.stderr
