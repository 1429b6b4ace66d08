"""A Node.js writer (the TypeScript client in clients/node) touches keys, and a Python
node of the same namespace refreshes them: one refresh per key, each after its window,
with the items the Node writer touched, scheduled times kept, cancels honoured.

Skipped, saying why, where ``node`` or ``npm`` is missing or the client cannot be built
(``npm ci && npm run build`` in clients/node, run here when its dist/ is missing).
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import Start
from tests.helpers.e2e import Recorder, recorder_rules, server_ms
from tests.helpers.node_client import CLIENT, unavailable

RULES = """\
namespace: {ns}
shards: 4
leader_lease: 1s
claim_lease: 2s
defaults:
  window: 200ms
  max_wait: 2s
  absorb: 10ms
rules:
  - name: user-stats
    match: "stats:user:{{user_id}}"
    handler: {mod}:refresh
  - name: orders
    match: "orders:{{shop}}:*"
    items: {{max: 10}}
    handler: {mod}:refresh
"""

# The Node writer: touches what the request says, flushes, answers what it did.
WRITER = """\
import {{ Coalescer }} from {client};
const req = JSON.parse(process.argv[2]);
const c = await Coalescer.connect({{ rules: req.rules, redisUrl: req.url }});
c.touchMany(req.keys);
for (const [key, item] of req.items) c.touch(key, item);
for (const key of req.keys) c.touch(key);
c.touch(req.scheduled, null, {{ delay: "1s" }});
c.touch(req.cancelled);
await c.flush();
const outcome = await c.cancel(req.cancelled);
await c.close();
process.stdout.write(JSON.stringify({{ states: outcome.states }}));
"""


@pytest.fixture(scope="module")
def node_client() -> Path:
    why = unavailable()
    if why is not None:
        pytest.skip(f"the Node client cannot run here: {why}")
    return CLIENT / "dist" / "index.js"


async def _run_writer(tmp_path: Path, client: Path, request: dict[str, Any]) -> dict[str, Any]:
    script = tmp_path / "writer.mjs"
    script.write_text(WRITER.format(client=json.dumps(client.as_uri())))
    proc = await asyncio.create_subprocess_exec(
        "node", str(script), json.dumps(request), stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0, err.decode()
    answer: dict[str, Any] = json.loads(out)
    return answer


async def _wait_for(rec: Recorder, keys: set[str], timeout: float = 15.0) -> None:
    async def seen() -> None:
        while not keys <= {c.key for c in rec.calls}:
            await asyncio.sleep(0.02)
    await asyncio.wait_for(seen(), timeout)


async def test_a_node_writer_touches_keys_that_a_python_node_refreshes(
        tmp_path: Path, namespace: str, redis_url: str, redis_client: Any, *, start: Start,
        node_client: Path) -> None:
    path, rec = recorder_rules(tmp_path, f"node_{namespace}", RULES.format(
        ns=namespace, mod="{mod}"))
    rec.clock = lambda: server_ms(redis_client)
    await start(path, redis_url=redis_url, node_id="py-node")  # a worker node
    keys = [f"stats:user:{i}" for i in range(20)]
    before = await server_ms(redis_client)

    answer = await _run_writer(tmp_path, node_client, {
        "rules": str(path), "url": redis_url, "keys": keys,
        "items": [["orders:s1:9", "row-1"], ["orders:s1:9", "row-2"]],
        "scheduled": "stats:user:later", "cancelled": "stats:user:gone"})

    assert answer["states"] == {"stats:user:gone": "pending"}
    await _wait_for(rec, {*keys, "orders:s1:9", "stats:user:later"})
    for key in keys:  # touched twice by the writer, in one burst: one refresh each
        [claim] = rec.of(key)
        assert claim.rule == "user-stats"
        assert claim.params == {"user_id": key.rsplit(":", 1)[1]}
    [order] = rec.of("orders:s1:9")
    assert sorted(order.items) == ["row-1", "row-2"]
    [later] = rec.started("stats:user:later")
    assert later >= before + 1000  # its own time, a second after the writer's touch
    assert rec.of("stats:user:gone") == []
