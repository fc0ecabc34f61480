"""The worker's Prometheus metrics and the Grafana dashboard that reads them."""

from __future__ import annotations

import json
import re

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from pipeline.worker.metrics import Metrics
from pipeline.worker.procs import ROOT

DASHBOARD = ROOT / "deploy" / "grafana" / "fleetmedic.json"


def _exported() -> set[str]:
    m = Metrics()
    m.records.labels("t", "ok").inc()
    m.anomalies.labels("k").inc()
    m.verdicts.labels("node", "gpu_hardware").inc()
    m.actions.labels("isolate", "applied").inc()
    m.detect_seconds.labels("GPU").observe(0.01)
    m.batch_size.labels("GPU").observe(100)
    m.lag.labels("t").set(0.5)
    names = set()
    for fam in text_string_to_metric_families(generate_latest(m.registry).decode()):
        names.update(s.name for s in fam.samples)
    return names


def test_the_worker_exports_the_documented_families() -> None:
    names = _exported()
    for n in ("fleetmedic_records_total", "fleetmedic_anomalies_total", "fleetmedic_verdicts_total",
              "fleetmedic_actions_total", "fleetmedic_breaker_isolations", "fleetmedic_breaker_budget",
              "fleetmedic_detect_seconds_bucket", "fleetmedic_detect_batch_records_count", "fleetmedic_event_lag_seconds"):
        assert n in names, n


def test_every_dashboard_query_reads_a_metric_the_worker_exports() -> None:
    dash = json.loads(DASHBOARD.read_text())
    exported = _exported()
    queries = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    assert len(queries) >= 8
    for q in queries:
        used = set(re.findall(r"\bfleetmedic_[a-z_]+", q))
        assert used, q
        assert used <= exported, f"{q}: {used - exported} not exported"
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    assert dash["uid"] == "fleetmedic" and dash["templating"]["list"][0]["type"] == "datasource"
