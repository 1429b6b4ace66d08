"""A real headless Chromium driven over the Chrome DevTools Protocol (CDP), for page tests.

``find_chromium()`` returns the browser's path, installing Debian's ``chromium`` with
apt when it is missing and we are root; otherwise None with the reason in
``MISSING_REASON``. ``Browser`` starts one headless Chromium with a throw-away
profile on a loopback debugging port and speaks CDP to its first tab over an aiohttp
websocket: navigate, evaluate JavaScript, poll until an expression is truthy, click,
take a screenshot.
"""

from __future__ import annotations

import asyncio
import base64
import itertools
import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from types import TracebackType
from typing import Any

import aiohttp

from tests.helpers.servers import wait_until

FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-dev-shm-usage", "--window-size=1280,900", "--remote-debugging-port=0",
         "--remote-debugging-address=127.0.0.1")
MISSING_REASON: list[str] = []


def _install() -> str | None:
    """Why chromium cannot be installed here, or None once apt installed it."""
    if os.name != "posix" or os.geteuid() != 0:
        return "chromium is not installed, and only root may install it with apt"
    if shutil.which("apt-get") is None:
        return "chromium is not installed, and apt-get is not available to install it"
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for command in (["apt-get", "update"], ["apt-get", "install", "-y", "chromium"]):
        done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            last = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
            return f"chromium is not installed and `{' '.join(command)}` failed: {last}"
    return None


def find_chromium() -> str | None:
    """The path of chromium, installed with apt first when missing (and possible)."""
    found = shutil.which("chromium")
    if found is None and not MISSING_REASON:
        reason = _install()
        if reason is not None:
            MISSING_REASON.append(reason)
        found = shutil.which("chromium")
    return found


class Browser:
    """One headless Chromium and a CDP session on its first tab."""

    def __init__(self, executable: str) -> None:
        self._executable = executable
        self._profile = Path(tempfile.mkdtemp(prefix="coalescer-chromium-"))
        self._proc: subprocess.Popen[bytes] | None = None
        self._http: aiohttp.ClientSession | None = None
        self._ws: aiohttp.ClientWebSocketResponse | None = None
        self._reader: asyncio.Task[None] | None = None
        self._ids = itertools.count(1)
        self._waiting: dict[int, asyncio.Future[dict[str, Any]]] = {}

    async def __aenter__(self) -> Browser:
        self._proc = subprocess.Popen(
            [self._executable, *FLAGS, f"--user-data-dir={self._profile}", "about:blank"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        port_file = self._profile / "DevToolsActivePort"
        await wait_until(lambda: port_file.exists() and len(port_file.read_text().split()) >= 2,
                         timeout=60, interval=0.05, message="chromium's debugging port")
        port = int(port_file.read_text().split()[0])
        self._http = aiohttp.ClientSession()
        page = await wait_until(lambda: self._first_page(port), timeout=30, interval=0.05,
                                message="chromium's first tab")
        self._ws = await self._http.ws_connect(page["webSocketDebuggerUrl"], max_msg_size=0)
        self._reader = asyncio.create_task(self._read())
        await self.send("Page.enable")
        await self.send("Runtime.enable")
        return self

    async def _first_page(self, port: int) -> dict[str, Any] | None:
        assert self._http is not None
        async with self._http.get(f"http://127.0.0.1:{port}/json/list") as answer:
            targets = await answer.json()
        return next((t for t in targets if t.get("type") == "page"), None)

    async def _read(self) -> None:
        assert self._ws is not None
        async for message in self._ws:
            if message.type != aiohttp.WSMsgType.TEXT:
                break
            data = json.loads(message.data)
            future = self._waiting.pop(data.get("id", -1), None)
            if future is not None and not future.done():
                future.set_result(data)
        for future in self._waiting.values():
            future.set_exception(ConnectionError("the browser closed its debugging socket"))

    async def send(self, method: str, **params: Any) -> dict[str, Any]:
        """Call one CDP method; its result, or RuntimeError with the browser's error."""
        assert self._ws is not None
        call_id = next(self._ids)
        future: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._waiting[call_id] = future
        await self._ws.send_str(json.dumps({"id": call_id, "method": method, "params": params}))
        answer = await asyncio.wait_for(future, 30)
        if "error" in answer:
            raise RuntimeError(f"{method} failed: {answer['error']}")
        result: dict[str, Any] = answer.get("result", {})
        return result

    async def goto(self, url: str) -> None:
        await self.send("Page.navigate", url=url)
        await self.wait_for("document.readyState === 'complete' && location.href !== "
                            "'about:blank'", message=f"{url} to load")

    async def evaluate(self, expression: str) -> Any:
        """The value of a JavaScript expression in the page (promises awaited)."""
        result = await self.send("Runtime.evaluate", expression=expression,
                                 returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in result:
            details = result["exceptionDetails"]
            raise RuntimeError(f"{expression!r} threw: "
                               f"{details.get('exception', {}).get('description', details)}")
        return result["result"].get("value")

    async def wait_for(self, expression: str, timeout: float = 20.0,
                       message: str | None = None) -> Any:
        """Evaluate ``expression`` until it is truthy; its value (True for an element)."""
        checked = f"((v) => v instanceof Node ? true : v)({expression})"
        return await wait_until(lambda: self.evaluate(checked), timeout=timeout,
                                interval=0.05, message=message or expression)

    async def screenshot(self, path: Path) -> bytes:
        """A PNG of the whole page, saved at ``path``."""
        metrics = await self.send("Page.getLayoutMetrics")
        size = metrics["cssContentSize"]
        shot = await self.send("Page.captureScreenshot", format="png", captureBeyondViewport=True,
                               clip={"x": 0, "y": 0, "width": size["width"],
                                     "height": size["height"], "scale": 1})
        data = base64.b64decode(shot["data"])
        path.write_bytes(data)
        return data

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: TracebackType | None) -> None:
        if self._ws is not None:
            await self._ws.close()
        if self._reader is not None:
            await asyncio.gather(self._reader, return_exceptions=True)
        if self._http is not None:
            await self._http.close()
        if self._proc is not None:
            self._proc.terminate()
            try:
                await asyncio.to_thread(self._proc.wait, 10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                await asyncio.to_thread(self._proc.wait)
        shutil.rmtree(self._profile, ignore_errors=True)
