"""`make bench` cannot rot: its quick mode runs end to end on the real broker.

Only the shape and sanity of the results are checked; speed is for `make bench` to
report, never for a test to assert.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from .harness import ROOT

pytestmark = pytest.mark.integration

KEYS = ("baseline_samples_per_s", "pipeline_samples_per_s", "ratio", "latency_p50_s", "latency_p99_s",
        "two_worker_speedup", "mem_mb_per_1k_nodes", "machine")


def test_quick_bench_measures_every_figure(kafka_bootstrap, tmp_path):
    out = tmp_path / "throughput.json"
    res = subprocess.run([sys.executable, "-m", "pipeline", "--bootstrap", kafka_bootstrap, "bench", "--quick",
                          "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=600,
                         stdin=subprocess.DEVNULL, env={**__import__("os").environ,
                                                        "FLEETMEDIC_STATE": str(tmp_path / "state")})
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    r = json.loads(out.read_text())
    for k in KEYS:
        assert r.get(k) is not None, k
    assert r["one_worker"]["complete"] and r["two_workers"]["complete"]
    assert r["one_worker"]["records"] >= r["messages"]
    assert r["latency"]["actions_seen"] == r["latency"]["applied"] == r["latency"]["faults"] > 0
    # every fault passed every stage, and its isolation was applied (by the backend's own
    # log) before the pipeline's record of it was read
    for f in r["latency"]["per_fault_s"]:
        assert min(f.values()) > 0 and f["action"] <= f["reported"], f
    for k in ("latency_p99_s", "two_worker_speedup", "mem_per_worker_ratio_two_vs_one", "mem_above_idle_ratio_two_vs_one"):
        assert r[f"{k}_min"] <= r[k] <= r[f"{k}_max"], k
    assert r["machine"]["cores"] >= 1
    assert "fleetmedic, 1 worker" in res.stdout and "ratio to baseline" in res.stdout
    # the dashboard's frame times, beside it: the whole quick fleet drawn and updated in Chromium
    d = json.loads((tmp_path / "dashboard.json").read_text())
    assert d["nodes"] == r["nodes"] and d["runs"] == 1
    for k in ("load_ms", "frame_p95_ms", "idle_frame_p95_ms", "stall_ratio"):
        assert d[k] is not None and d[f"{k}_min"] <= d[k] <= d[f"{k}_max"], k
    assert "stall ratio" in res.stderr


def test_quick_burst_bench_isolates_every_node_on_the_real_api_server(tmp_path):
    """``make bench-burst`` in small: its own control plane, Slurm controller and broker,
    600 nodes, bursts of 20 and 50, three runs each; every node of every burst is seen
    isolated by the watch on Kubernetes and drained on Slurm."""
    out = tmp_path / "burst.json"
    res = subprocess.run([sys.executable, "-m", "pipeline", "bench-burst", "--quick", "--out", str(out)], cwd=ROOT,
                         capture_output=True, text=True, timeout=1200, stdin=subprocess.DEVNULL,
                         env={**__import__("os").environ, "FLEETMEDIC_STATE": str(tmp_path / "state")})
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    r = json.loads(out.read_text())
    assert set(r["bursts"]) == {"20", "50"}
    for size, b in r["bursts"].items():
        assert len(b["runs"]) == 3
        for run in b["runs"]:
            assert run["verdicts_seen"] == int(size)  # every node's verdict, each node seen done
            assert 0 < run["seconds"] and 0 < run["raw_seconds"] and 0 < run["raw_same_calls_seconds"]
            assert run["worker_cpu_s"] > 0  # the worker under measurement did the work
            # the parties were found, and the machine's busy time covers each of them
            for side in ("fm", "raw"):
                assert run[f"{side}_cpu_apiserver_s"] > 0 and run[f"{side}_cpu_etcd_s"] >= 0, (side, run)
                parts = sum(run[f"{side}_cpu_{p}_s"] for p in ("apiserver", "etcd", "broker", "worker", "bench"))
                assert parts <= run[f"{side}_cpu_machine_s"] * 1.05 + 0.1, (side, run)
            assert run["fm_cpu_broker_s"] > 0 and run["raw_cpu_worker_s"] < run["fm_cpu_worker_s"]
            # a tenth, half, nine tenths and all of the verdicts and of the nodes done, in order,
            # and the last node done is the burst's seconds
            verdicts, done = run["timeline_s"]["verdicts"], run["timeline_s"]["cordon"]
            assert verdicts == sorted(verdicts) and done == sorted(done) and len(done) == 4
            assert abs(done[-1] - run["seconds"]) < 0.01 and verdicts[0] < done[-1]
        for key in ("seconds", "nodes_per_s", "raw_limit_nodes_per_s", "ratio", "raw_same_calls_nodes_per_s",
                    "ratio_same_calls"):
            assert b[f"{key}_min"] <= b[key] <= b[f"{key}_max"], (size, key)
        assert 0 < b["p50_s"] <= b["p99_s"], size
    assert r["nodes_registered"] == 600 and r["nvsentinel_published"]["burst"] == 1000
    assert "| burst |" in res.stderr
    # the same bursts drained on a Slurm controller of its own
    sl = r["slurm"]
    assert set(sl["bursts"]) == {"20", "50"} and sl["bench_nodes"] == 2 * 3 * (20 + 50)
    for size, b in sl["bursts"].items():
        assert len(b["runs"]) == 3
        for run in b["runs"]:
            assert run["verdicts_seen"] == int(size)
            assert min(run[k] for k in ("raw_limit_nodes_per_s", "raw_hostlist_nodes_per_s",
                                        "raw_per_node_nodes_per_s")) > 0
        for key in ("seconds", "nodes_per_s", "raw_limit_nodes_per_s", "ratio"):
            assert b[f"{key}_min"] <= b[key] <= b[f"{key}_max"], (size, key)
        assert 0 < b["p50_s"] <= b["p99_s"], size
    assert "| Slurm burst |" in res.stderr
