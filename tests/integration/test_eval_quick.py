"""`make eval` cannot rot: its quick mode runs both parts end to end on the real broker.

The quick quality run is small (64 nodes, one fault of each kind), so only what must hold
on any run is asserted: every kind was injected and judged with the right class, no
healthy node was isolated and no user error was blamed on hardware; the report has every
key the full run reports, and its plots are written.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from pipeline.sim.cluster import KIND_CLASS

from .harness import ROOT

pytestmark = pytest.mark.integration


def test_quick_eval_runs_both_parts_through_the_real_pipeline(kafka_bootstrap, tmp_path):
    out = tmp_path / "eval.json"
    res = subprocess.run([sys.executable, "-m", "pipeline", "--bootstrap", kafka_bootstrap, "eval", "--quick",
                          "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=900,
                         stdin=subprocess.DEVNULL, env={**os.environ, "FLEETMEDIC_STATE": str(tmp_path / "state")})
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    ev = json.loads(out.read_text())
    q = ev["quality"]
    assert q["path"] == "kafka+faust"
    assert set(q["by_kind"]) == set(KIND_CLASS), q["by_kind"]  # every kind was injected
    # a crash prints real output (the corpus's tune split): its class is what that output
    # supports; what must hold is that it is run again, never stopped, no node isolated
    crashes = ("transient_crash", "nccl_timeout")
    wrong = {k: v for k, v in q["by_kind"].items() if v["right"] != v["faults"] and k not in crashes}
    assert not wrong, (wrong, q["missed"], q["wrong_class"])
    assert not [w for w in q["wrong_class"] if w.split("@")[0] in crashes and "(stop)" in w], q["wrong_class"]
    assert q["transient_faults_kept_every_node"] == q["transient_faults"] > 0
    assert ev["false_isolations"] == 0, q["false_isolation_detail"]
    assert ev["user_errors_blamed_on_hardware"] == 0 and q["user_errors_stopped"] == q["user_errors"] > 0
    assert ev["switch_faults_blamed_on_nodes"] == 0
    assert ev["hw_recall"] == 1.0 and ev["hw_precision"] == 1.0
    assert 0.0 < ev["degrading_isolated_before_failure"] <= 1.0
    for p in ("fleetmedic", "manual", "naive_cordon", "retry_only"):
        assert 0.0 < ev["policies"][p]["ettr"] <= 1.0
    assert ev["policies"]["fleetmedic"]["healthy_nodes_isolated"] == 0
    for png in ("eval_delays.png", "eval_lead_times.png", "eval_policies.png"):
        assert (tmp_path / png).stat().st_size > 10_000
    assert "eval 1/2" in res.stderr and "eval 2/2" in res.stderr
    # the run is recorded; scoring the record again gives the same result
    records = tmp_path / "state" / "quality_records_quick.json"
    again = tmp_path / "rescored.json"
    res = subprocess.run([sys.executable, "-m", "pipeline.eval.quality", "--rescore", str(records), "--out", str(again)],
                         cwd=ROOT, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert res.returncode == 0, res.stderr[-3000:]
    r = json.loads(again.read_text())
    for key in ("by_kind", "by_class", "hw_recall", "hw_precision", "false_isolations", "missed", "wrong_class",
                "confounded", "lead_s", "verdict_lag_wall_s"):
        assert r[key] == q[key], key
