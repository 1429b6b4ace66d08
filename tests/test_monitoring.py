"""The Grafana dashboard and the Prometheus alert rules in deploy/: every query names a
metric a real node serves at /metrics (read live, so new metrics count at once), the
alert rules pass a real Prometheus's `promtool check rules` and `promtool test rules`,
and a real Prometheus server scraping a real node fires an alert."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.helpers.e2e import REPO
from tests.helpers.servers import ValkeyProcess, free_port, wait_until
from tests.web.test_api import Node, NodeFactory, make_node  # noqa: F401 (make_node: a fixture)

DASHBOARD = REPO / "deploy" / "grafana" / "coalescer.json"
ALERTS = REPO / "deploy" / "prometheus" / "coalescer-alerts.yml"
ALERT_TESTS = REPO / "deploy" / "prometheus" / "coalescer-alerts.test.yml"
METRIC = re.compile(r"\bcoalescer_[a-z0-9_]+\b")
# the sample names each metric type serves (prometheus_client: a counter's family name
# comes without _total)
SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"),
            "summary": ("_sum", "_count", ""), "gauge": ("",), "unknown": ("",), "info": ("_info",)}


def promtool() -> str:
    found = shutil.which("promtool")
    if found is None:
        pytest.skip("no promtool: install Debian's prometheus package (apt-get install -y "
                    "prometheus) to check the alert rules")
    return found


async def served_names(node: Node) -> set[str]:
    """Every sample name the node's /metrics can serve, from its families' types."""
    status, text, _ = await node.request("GET", "/metrics")
    assert status == 200
    names = set()
    for family in text_string_to_metric_families(text):
        names.update(family.name + suffix for suffix in SUFFIXES[family.type])
    return names


def dashboard_queries() -> list[str]:
    board = json.loads(DASHBOARD.read_text())
    queries = [target["expr"] for panel in board["panels"]
               for target in panel.get("targets", [])]
    queries += [v["definition"] for v in board["templating"]["list"] if "definition" in v]
    return queries


def alert_exprs() -> dict[str, str]:
    groups = yaml.safe_load(ALERTS.read_text())["groups"]
    return {rule["alert"]: rule["expr"] for group in groups for rule in group["rules"]}


def unknown_names(queries: list[str], served: set[str]) -> list[str]:
    return sorted({name for query in queries for name in METRIC.findall(query)} - served)


async def test_every_dashboard_query_names_a_metric_a_node_serves(
        make_node: NodeFactory) -> None:  # noqa: F811
    node = await make_node()
    served = await served_names(node)
    queries = dashboard_queries()
    assert len(queries) >= 20
    assert all(METRIC.search(q) for q in queries), "a query without a coalescer metric"
    assert unknown_names(queries, served) == []
    # the check can fail: a name the node does not serve is caught
    assert unknown_names(["rate(coalescer_refreshs_total[5m])"], served) == [
        "coalescer_refreshs_total"]


async def test_every_alert_names_a_metric_a_node_serves(
        make_node: NodeFactory) -> None:  # noqa: F811
    node = await make_node()
    exprs = alert_exprs()
    assert {"CoalescerShardWithoutLeader", "CoalescerStartLagHigh",
            "CoalescerDeadLettersGrowing", "CoalescerUnwrittenTouchesOld",
            "CoalescerRulePausedLong", "CoalescerOutboxLagging",
            "CoalescerKafkaLagging"} <= set(exprs)
    assert unknown_names(list(exprs.values()), await served_names(node)) == []


def test_the_alert_rules_pass_promtool_check_and_their_unit_tests() -> None:
    tool = promtool()
    checked = subprocess.run([tool, "check", "rules", str(ALERTS)], capture_output=True,
                             text=True, timeout=60, check=False)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert f"SUCCESS: {len(alert_exprs())} rules found" in checked.stdout
    tested = subprocess.run([tool, "test", "rules", ALERT_TESTS.name], cwd=ALERT_TESTS.parent,
                            capture_output=True, text=True, timeout=60, check=False)
    assert tested.returncode == 0, tested.stdout + tested.stderr
    tested_alerts = set(re.findall(r"alertname: (\w+)", ALERT_TESTS.read_text()))
    assert tested_alerts == set(alert_exprs())  # every alert has a test case


async def test_a_nodes_oldest_unwritten_touch_shows_while_redis_is_down(
        make_node: NodeFactory, own_server: ValkeyProcess) -> None:  # noqa: F811
    node = await make_node(url=own_server.url, worker=False)
    gauge = "coalescer_oldest_unwritten_touch_seconds"
    assert await sample(node, gauge) == 0
    own_server.stop()
    assert (await node.touch({"keys": ["stats:user:1"]}))[0] == 202
    assert await sample(node, gauge) > 0
    own_server.start()  # back: the node writes its touch and closes cleanly
    await node.c.flush()
    assert await sample(node, gauge) == 0


async def sample(node: Node, name: str) -> float:
    _, text, _ = await node.request("GET", "/metrics")
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name:
                return float(s.value)
    raise AssertionError(f"{name} not served")


# --- a real Prometheus server -------------------------------------------------------------


@pytest.fixture
def prometheus_bin() -> str:
    promtool()
    found = shutil.which("prometheus")
    if found is None:
        pytest.skip("no prometheus server: install Debian's prometheus package")
    return found


class Prometheus:
    """A real Prometheus server on 127.0.0.1, scraping one node every 0.5 s."""

    def __init__(self, binary: str, folder: Path, target: str, rules: Path) -> None:
        self.port = free_port()
        config = {"global": {"scrape_interval": "500ms", "evaluation_interval": "500ms"},
                  "rule_files": [str(rules)],
                  "scrape_configs": [{"job_name": "coalescer",
                                      "static_configs": [{"targets": [target]}]}]}
        (folder / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.log = (folder / "prometheus.log").open("wb")
        self.proc = subprocess.Popen(
            [binary, f"--config.file={folder / 'prometheus.yml'}",
             f"--storage.tsdb.path={folder / 'data'}",
             f"--web.listen-address=127.0.0.1:{self.port}"],
            cwd=folder, stdin=subprocess.DEVNULL, stdout=self.log, stderr=subprocess.STDOUT)

    async def get(self, path: str, **params: str) -> Any:
        async with aiohttp.ClientSession() as http, http.get(
                f"http://127.0.0.1:{self.port}{path}", params=params) as answer:
            return await answer.json(content_type=None)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


@pytest.fixture
def prometheus(prometheus_bin: str, tmp_path: Path) -> Iterator[list[Prometheus]]:
    started: list[Prometheus] = []
    yield started
    for server in started:
        server.stop()


def quick_rules(folder: Path) -> Path:
    """The alert rules with CoalescerRulePausedLong's `for:` cut to one second."""
    text = yaml.safe_load(ALERTS.read_text())
    for group in text["groups"]:
        for rule in group["rules"]:
            if rule["alert"] == "CoalescerRulePausedLong":
                rule["for"] = "1s"
    path = folder / "alerts.yml"
    path.write_text(yaml.safe_dump(text))
    return path


async def firing(server: Prometheus, alert: str) -> list[dict[str, Any]]:
    answer = await server.get("/api/v1/alerts")
    return [a for a in answer["data"]["alerts"]
            if a["labels"]["alertname"] == alert and a["state"] == "firing"]


async def test_a_real_prometheus_scraping_a_node_fires_the_paused_rule_alert(
        make_node: NodeFactory, prometheus: list[Prometheus], prometheus_bin: str,  # noqa: F811
        tmp_path: Path) -> None:
    node = await make_node()
    server = Prometheus(prometheus_bin, tmp_path, f"127.0.0.1:{node.api.port}",
                        quick_rules(tmp_path))
    prometheus.append(server)

    async def scraped() -> bool:
        try:
            found = await server.get("/api/v1/query", query='coalescer_rule_paused'
                                     '{rule="user-stats"} == 0')
        except aiohttp.ClientError:
            return False
        return bool(found["data"]["result"])

    await wait_until(scraped, timeout=30, interval=0.1, message="Prometheus to scrape the node")
    assert await firing(server, "CoalescerRulePausedLong") == []
    await node.c.query.pause("user-stats")
    alerts = await wait_until(lambda: firing(server, "CoalescerRulePausedLong"), timeout=30,
                              interval=0.1, message="the paused-rule alert to fire")
    assert [a["labels"]["rule"] for a in alerts] == ["user-stats"]
    assert "coalescer resume user-stats" in alerts[0]["annotations"]["description"]
