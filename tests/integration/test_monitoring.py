"""Prometheus and Alertmanager, real, built from the Go module proxy by
``deploy/monitoring.sh`` and started by it with fleetmedic's configuration
(``deploy/prometheus/``).

- promtool checks and unit-tests the alerting rules; amtool checks the routes.
- A live worker posts its verdicts to Alertmanager's API (a receiver of format
  ``alertmanager-api``). Two nodes lose a GPU at once: Alertmanager holds one firing
  alert per node and delivers them, grouped, in one notification to its webhook receiver
  (an HTTP server of the test). An operator returns one node: its alert resolves, and
  Alertmanager says so.
- Prometheus scrapes the same worker: its series are there, every rule evaluates
  without error on them, and every query of the Grafana dashboard
  (``deploy/grafana/fleetmedic.json``) runs and names only series that exist.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from .harness import BackgroundLoop, ClusterAPI, Worker, api_call, lose_gpus, serve, wait_for

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "deploy" / "monitoring.sh"
CONF = REPO / "deploy" / "prometheus"


def _script(*args: str, env: dict[str, str] | None = None, timeout: float = 3600) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", str(SCRIPT), *args], env=env or dict(os.environ), capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL, check=False)


def _get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=15) as r:
        return json.loads(r.read())


class Notifications:
    """Alertmanager's webhook receiver: every notification it delivers, in order."""

    def __init__(self, bg: BackgroundLoop) -> None:
        self.bg = bg
        self.got: list[dict[str, Any]] = []

        async def hook(request: web.Request) -> web.Response:
            self.got.append(json.loads(await request.read()))
            return web.Response(text="ok")

        self.runner, self.port = serve(bg, [("POST", "/alerts", hook)])

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/alerts"

    def alerts(self, node: str) -> list[tuple[str, dict[str, Any]]]:
        """(notification status, alert) for each time ``node``'s alert was delivered."""
        return [(n["status"], a) for n in self.got for a in n["alerts"] if a["labels"].get("node") == node]

    def close(self) -> None:
        self.bg.run(self.runner.cleanup())


def test_promtool_and_amtool_check_the_shipped_configuration() -> None:
    rules = _script("promtool", "check", "rules", str(CONF / "rules.yml"))
    assert rules.returncode == 0 and "SUCCESS: 7 rules found" in rules.stdout, rules.stdout + rules.stderr
    tested = _script("promtool", "test", "rules", str(CONF / "rules_test.yml"))
    assert tested.returncode == 0 and "SUCCESS" in tested.stdout, tested.stdout + tested.stderr
    config = _script("promtool", "check", "config", str(CONF / "prometheus.yml"))
    assert config.returncode == 0 and "WARNING" not in config.stdout + config.stderr, config.stdout + config.stderr
    routes = _script("amtool", "check-config", str(CONF / "alertmanager.yml"))
    assert routes.returncode == 0 and "SUCCESS" in routes.stdout, routes.stdout + routes.stderr


def test_a_rule_test_that_should_fail_does(tmp_path: Path) -> None:
    """promtool's verdict is not a formality: a rule test that expects the worker-down
    alert a minute too early fails."""
    text = (CONF / "rules_test.yml").read_text().replace("rule_files:\n  - rules.yml",
                                                         f"rule_files:\n  - {CONF / 'rules.yml'}")
    broken = text.replace("      - eval_time: 3m\n        alertname: FleetmedicWorkerDown\n        exp_alerts: []",
                          "      - eval_time: 3m\n        alertname: FleetmedicWorkerDown\n        exp_alerts:\n"
                          "          - exp_labels: {severity: critical, job: fleetmedic, instance: \"10.0.0.5:6066\"}")
    assert broken != text
    (tmp_path / "broken_test.yml").write_text(broken)
    res = _script("promtool", "test", "rules", str(tmp_path / "broken_test.yml"))
    assert res.returncode != 0 and "FleetmedicWorkerDown" in res.stdout + res.stderr


@pytest.fixture(scope="module")
def stack(kafka_bootstrap: str, tmp_path_factory: pytest.TempPathFactory):
    from pipeline.config import load_settings

    bg = BackgroundLoop()
    hook = Notifications(bg)
    env = {**os.environ, "FLEETMEDIC_STATE": str(tmp_path_factory.mktemp("monitoring")),
           "FLEETMEDIC_AM_WEBHOOK": hook.url, "FLEETMEDIC_MON_INTERVAL": "1s",
           "FLEETMEDIC_MON_GROUP_WAIT": "2s", "FLEETMEDIC_MON_GROUP_INTERVAL": "2s"}
    started = _script("start", env=env)
    assert started.returncode == 0, started.stdout + started.stderr
    urls = dict(part.split("=", 1) for part in started.stdout.strip().splitlines()[-1].split())
    prom, am = urls["PROMETHEUS"], urls["ALERTMANAGER"]
    cfg = tmp_path_factory.mktemp("alerts-am") / "fleetmedic.toml"
    cfg.write_text(f"""
[alerts]
max_attempts = 20
base_delay_s = 0.2
max_delay_s = 1.0

[[alerts.webhooks]]
name = "alertmanager"
url = "{am}"
format = "alertmanager-api"
""")
    api = ClusterAPI(load_settings(environ={}))
    worker = Worker(kafka_bootstrap, sim_url=api.url,
                    env={"FLEETMEDIC_CONFIG": str(cfg), "FLEETMEDIC_SAFETY__FLEET_SIZE": "40"})
    worker.start()
    port = worker.env["FLEETMEDIC_WORKER__WEB_PORT"]
    targets = _script("targets", f"127.0.0.1:{port}", env=env)
    assert targets.returncode == 0, targets.stderr
    try:
        yield {"prom": prom, "am": am, "worker": worker, "api": api, "hook": hook, "bootstrap": kafka_bootstrap,
               "instance": f"127.0.0.1:{port}"}
    finally:
        worker.stop()
        api.close()
        _script("stop", env=env, timeout=120)
        hook.close()
        bg.stop()


def test_a_verdict_fires_in_alertmanager_and_a_return_resolves_it(stack) -> None:
    worker, api, hook, am = stack["worker"], stack["api"], stack["hook"], stack["am"]
    nodes = ["amx-0", "amx-1"]
    api.add_nodes(nodes)
    lose_gpus(stack["bootstrap"], worker, nodes)

    def active(node: str) -> list[dict[str, Any]]:
        q = urllib.parse.urlencode({"filter": f'node="{node}"', "active": "true", "silenced": "false"})
        return _get(f"{am}/api/v2/alerts?{q}")

    assert wait_for(lambda: all(active(n) for n in nodes), 60), f"no alerts in Alertmanager\n{worker.log_tail()}"
    alert = active("amx-0")[0]
    assert alert["labels"]["alertname"] == "FleetmedicNodeOutOfService" and alert["labels"]["severity"] == "critical"
    assert alert["annotations"]["fault_class"] in ("gpu_hardware", "gpu_memory")
    assert alert["status"]["state"] == "active"
    # Alertmanager's own webhook: both nodes in one notification, firing
    assert wait_for(lambda: any({a["labels"]["node"] for a in n["alerts"]} >= set(nodes) for n in hook.got), 30), \
        hook.got
    first = next(n for n in hook.got if {a["labels"]["node"] for a in n["alerts"]} >= set(nodes))
    assert first["status"] == "firing" and first["groupLabels"] == {"alertname": "FleetmedicNodeOutOfService"}
    assert first["version"] == "4" and first["receiver"] == "fleetmedic-webhook"
    # an operator returns one node: its alert resolves in Alertmanager and in a notification
    status, body = api_call(worker, "POST", "/api/v1/nodes/amx-0/return")
    assert status == 202, body
    assert wait_for(lambda: not active("amx-0"), 60), active("amx-0")
    assert active("amx-1"), "the other node's alert must still fire"
    assert wait_for(lambda: any(a["status"] == "resolved" for _, a in hook.alerts("amx-0")), 30), hook.got
    resolved = [a for _, a in hook.alerts("amx-0") if a["status"] == "resolved"][-1]
    assert resolved["endsAt"] > resolved["startsAt"]
    assert all(a["status"] == "firing" for _, a in hook.alerts("amx-1"))


def test_prometheus_scrapes_the_worker_and_the_dashboard_asks_for_real_series(stack) -> None:
    prom = stack["prom"]

    def query(expr: str) -> dict[str, Any]:
        return _get(f"{prom}/api/v1/query?" + urllib.parse.urlencode({"query": expr}))

    up = wait_for(lambda: [r for r in query('up{job="fleetmedic"}')["data"]["result"]
                           if r["metric"]["instance"] == stack["instance"] and r["value"][1] == "1"], 30)
    assert up, query('up{job="fleetmedic"}')
    # the series the worker has produced by now (after the alert test's verdicts)
    names = set(wait_for(lambda: [n for n in _get(f"{prom}/api/v1/label/__name__/values")["data"]
                                  if n.startswith("fleetmedic_actions_total")] and
                         _get(f"{prom}/api/v1/label/__name__/values")["data"], 30))
    assert {"fleetmedic_records_total", "fleetmedic_verdicts_total", "fleetmedic_breaker_budget"} <= names, names
    dashboard = json.loads((REPO / "deploy" / "grafana" / "fleetmedic.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    assert len(exprs) >= 10
    for expr in exprs:
        used = set(re.findall(r"\b(fleetmedic_[a-z_]+)\b", expr))
        assert used and used <= names, f"{expr!r} asks for {sorted(used - names)}, which the worker does not export"
        res = query(expr)
        assert res["status"] == "success", (expr, res)
    assert query("sum(fleetmedic_records_total)")["data"]["result"], "no records counted"
    # the alerting rules are loaded and evaluate without error on the real series
    groups = wait_for(lambda: [g for g in _get(f"{prom}/api/v1/rules")["data"]["groups"]
                               if all(r.get("lastEvaluation", "").startswith("2") and
                                      not r["lastEvaluation"].startswith("0001") for r in g["rules"])], 30)
    rules = [r for g in groups for r in g["rules"]]
    assert len(rules) == 7 and all(r["health"] == "ok" for r in rules), rules
