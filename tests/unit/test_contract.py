"""docs/contract.md says what the code does.

The document is generated from the registries and tables of :mod:`pipeline.cli.contract`
and from the code it reads (metrics, triage rules, settings, the breaker).  These tests
fail when the document is stale, and when real input run through the pipeline makes it
emit an action param, an evidence key, a finding kind, a rule or a metric that the
document does not name, or act otherwise than it says.
"""

from __future__ import annotations

import json
import time
from collections import defaultdict
from pathlib import Path

import pytest

from pipeline.cli import contract
from pipeline.config import DetectorSettings, Settings, load_settings
from pipeline.detect.glue import GpuDetection, NetworkDetection
from pipeline.eval import failures as corpus
from pipeline.eval.inproc import InProcessLoop
from pipeline.sim.cluster import Cluster, Fault, SimConfig
from pipeline.correlate.triage import triage
from schemas import GpuSample, NetworkSample
from schemas.codec import decode

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
#: every fault the simulator can inject on a node, each striking a running job
KINDS = ("xid79", "ecc_dbe", "sbe_rise", "nvlink", "thermal", "xid_gsp", "xid_sram", "nic", "transient_crash",
         "nccl_timeout", "user_bug")


@pytest.fixture(scope="module")
def scenario() -> tuple[list, list]:
    """Verdicts and anomalies of a simulated incident of every kind, through the
    pipeline's own decisions (the in-process loop)."""
    t0 = time.time() - 20000
    cfg = SimConfig(nodes=32, speed=1.0, duration=1e9, seed=5, faults="none", gpu_every=10, network_every=10)
    cluster = Cluster(cfg, t0=t0)
    plan = [Fault(kind=k, at=1200.0 + 400 * i) for i, k in enumerate(KINDS)]
    cluster.faults, cluster.pending_faults = plan, list(plan)
    loop = InProcessLoop(load_settings(environ={}), cluster)
    try:
        loop.step(int(1200 + 400 * len(KINDS) + 1800))
        loop.finish()
    finally:
        loop.close()
    return loop.verdict_dicts(), loop.pipe.anomalies


def fixture_anomalies() -> list:
    """Findings from the upstream fixtures: node_exporter's and procfs's InfiniBand trees
    (a rated speed set, so a slow link is found) and dcgm-exporter's records with an Xid
    and an NVSwitch SXid added."""
    net = NetworkDetection(DetectorSettings())
    net.net = net.net.model_copy(update={"rated_gbps": {"mlx5_0": 100.0, "mlx4_0": 100.0}})
    out = []
    for d in ("node_exporter", "procfs"):
        rec = json.loads((FIXTURES / d / "infiniband.expected.json").read_text())
        out += net.process([decode(NetworkSample, json.dumps(rec))])
    gpu = json.loads((FIXTURES / "dcgm-exporter" / "upstream" / "hostname-lowercase.expected.json").read_text())
    gpu = (gpu if isinstance(gpu, list) else gpu.get("records", [gpu]))[0]
    gpu["xids"] = [{"gpu": 0, "code": 79, "detail": "GPU has fallen off the bus."}, {"gpu": 1, "code": 13, "count": 3}]
    gpu["sxids"] = [{"code": 12028, "fatal": True, "switch_pci_bus_id": "0000:05:00", "detail": "egress error"}]
    out += GpuDetection(DetectorSettings()).process([decode(GpuSample, json.dumps(gpu))])
    return out


def test_the_document_is_what_the_code_generates() -> None:
    assert contract.DOC.read_text() == contract.render(), "docs/contract.md is stale: run `fleetmedic contract`"


def test_every_metric_the_worker_exports_is_documented_with_its_type_and_labels() -> None:
    text = contract.DOC.read_text()
    found = contract.metrics()
    assert len(found) >= 9
    for name, typ, _, labels in found:
        row = next((ln for ln in text.splitlines() if ln.startswith(f"| `{name}` |")), None)
        assert row is not None, f"{name} missing from docs/contract.md"
        assert f"| {typ} |" in row and all(f"`{x}`" in row for x in labels), row
    for result in ("ok", "deadletter", "duplicate", "late"):
        assert f"`{result}`" in text


def test_every_action_param_the_pipeline_emits_is_documented(scenario) -> None:
    verdicts, _ = scenario
    seen: dict[str, set[str]] = defaultdict(set)
    for v in verdicts:
        for a in v["actions"]:
            seen[a["action"]] |= set(a["params"])
    for case in corpus.load("tune")[:60]:
        result = corpus.replay(case, "plain")
        for step in result["steps"]:
            seen[step["action"]] |= {"attempt", "scheduler"}
    assert {"isolate", "drain", "diagnose", "requeue", "retry", "escalate"} <= set(seen), dict(seen)
    for action, params in seen.items():
        missing = params - set(contract.ACTION_PARAMS[action])
        assert not missing, f"{action}: {sorted(missing)} not in contract.ACTION_PARAMS"


def test_every_finding_kind_and_evidence_key_emitted_is_documented(scenario) -> None:
    _, anomalies = scenario
    anomalies = anomalies + fixture_anomalies()
    kinds = {a.kind for a in anomalies}
    assert {"xid", "sxid", "gpu_lost", "ecc_dbe", "ecc_sbe_rate", "thermal_throttle", "link_degraded"} <= kinds, kinds
    for a in anomalies:
        assert a.kind in contract.EVIDENCE, f"finding {a.kind} not in contract.EVIDENCE"
        missing = set(a.evidence) - set(contract.EVIDENCE[a.kind])
        assert not missing, f"{a.kind}: evidence {sorted(missing)} not in contract.EVIDENCE"


def test_every_rule_that_decides_is_documented_and_each_kind_acts_as_documented() -> None:
    rules = {r["rule"] for r in contract.triage_rules()}
    assert {"xid_in_log", "python_exception", "nccl_watchdog_timeout", "preempted", "no_evidence"} <= rules
    documented = rules | set(contract.JOB_RULES)
    first: dict[str, set[str]] = defaultdict(set)
    for split in ("tune", "eval"):
        for case in corpus.load(split):
            result = corpus.replay(case, "plain")
            assert result["first_rule"] in documented, f"{case.id}: rule {result['first_rule']} not documented"
            f = case.failed_fields()
            _, t = triage(f.get("exit_code"), f.get("reason"), f.get("log_tail"))
            if result["first_rule"] == t.rule:
                first[t.kind].add(result["first_action"])
    assert len(first) >= 6, dict(first)
    for kind, actions in first.items():
        assert actions == {contract.KIND_ACTIONS[kind][0]}, (kind, actions)


def test_every_time_setting_has_its_clock_and_the_breaker_table_is_the_breakers() -> None:
    timed = {f"{sec}.{k}" for sec in ("detectors", "policy", "network", "safety", "actuators")
             for k in type(getattr(Settings(), sec)).model_fields if k.endswith("_s")}
    listed = {k for _, _, keys, _ in contract.CLOCKS for k in keys}
    assert timed <= listed, f"time settings without a clock in contract.CLOCKS: {sorted(timed - listed)}"
    assert all(clock in ("event", "wall") for _, clock, _, _ in contract.CLOCKS)
    table = dict(contract.breaker_table((8, 40, 10000)))
    assert table == {8: 1, 40: 4, 10000: 50}
