"""The evaluation's scorer on hand-made runs: what counts as right, wrong or confounded."""

from __future__ import annotations

from pipeline.eval.metrics import score
from pipeline.sim.cluster import Cluster, Fault, SimConfig

T0 = 1_800_000_000.0


def _cluster(faults: list[Fault]) -> Cluster:
    c = Cluster(SimConfig(nodes=32, faults="none", seed=3), t0=T0)
    for f in faults:
        f.applied_ts = T0 + f.at
    c.faults = faults
    return c


def _job_verdict(job: str, t: float, fc: str, action: str, *, exclude=(), evidence=None) -> dict:
    return {"id": f"v-{job}-{t}", "ts": T0 + t, "scope": "job", "subject": job, "fault_class": fc, "job": job,
            "nodes": ["node-0001", "node-0002"], "evidence": evidence or {},
            "actions": [{"action": action, "target": job, "params": {"exclude": list(exclude)}}]}


def _node_verdict(node: str, t: float, fc: str) -> dict:
    return {"id": f"v-{node}-{t}", "ts": T0 + t, "scope": "node", "subject": node, "fault_class": fc,
            "evidence": {}, "actions": [{"action": "isolate", "target": node, "params": {}}]}


def test_a_transient_crash_retried_is_right() -> None:
    c = _cluster([Fault(kind="nccl_timeout", at=100.0, job="job-1")])
    r = score(c, [_job_verdict("job-1", 110.0, "transient_software", "retry")], [])
    assert r["by_kind"]["nccl_timeout"]["right"] == 1 and r["wrong_class"] == [] and r["confounded"] == []


def test_a_transient_crash_blamed_on_a_healthy_node_is_wrong() -> None:
    c = _cluster([Fault(kind="nccl_timeout", at=100.0, job="job-1")])
    v = _job_verdict("job-1", 110.0, "node_degrading", "requeue", exclude=["node-0002"])
    r = score(c, [v], [])
    assert r["by_kind"]["nccl_timeout"]["right"] == 0
    assert r["wrong_class"] == ["nccl_timeout@job-1: node_degrading (requeue)"]


def test_a_crash_during_a_real_degradation_of_the_jobs_node_is_confounded_not_wrong() -> None:
    deg = Fault(kind="sbe_rise", at=50.0, node="node-0002", job="job-1", fail_at=2000.0)
    c = _cluster([deg, Fault(kind="nccl_timeout", at=100.0, job="job-1")])
    vs = [_job_verdict("job-1", 110.0, "node_degrading", "requeue", exclude=["node-0002"]),
          _node_verdict("node-0002", 112.0, "node_degrading")]
    r = score(c, vs, [])
    assert r["by_kind"]["nccl_timeout"]["right"] == 1
    assert r["wrong_class"] == []
    assert r["confounded"] == ["nccl_timeout@job-1: node_degrading (sbe_rise@node-0002)"]


def test_blaming_the_degrading_node_before_its_fault_began_is_still_wrong() -> None:
    deg = Fault(kind="sbe_rise", at=500.0, node="node-0002", job="job-1", fail_at=2000.0)
    c = _cluster([deg, Fault(kind="nccl_timeout", at=100.0, job="job-1")])
    r = score(c, [_job_verdict("job-1", 110.0, "node_degrading", "requeue", exclude=["node-0002"])], [])
    assert r["by_kind"]["nccl_timeout"]["right"] == 0 and r["confounded"] == []


def test_a_crash_during_its_leaf_switch_fault_blamed_on_the_switch_is_confounded() -> None:
    c = _cluster([])
    node = "node-0003"
    leaf_fault = Fault(kind="leaf", at=80.0, leaf=c.nodes[node].leaf, end_at=680.0)
    c.faults = [leaf_fault, Fault(kind="nccl_timeout", at=100.0, job="job-1")]
    for f in c.faults:
        f.applied_ts = T0 + f.at
    v = _job_verdict("job-1", 120.0, "fabric_switch", "requeue",
                     evidence={"node_faults": {node: {"kind": "fabric", "fault_class": "fabric_switch"}}})
    r = score(c, [v], [])
    assert r["by_kind"]["nccl_timeout"]["right"] == 1
    assert r["confounded"] == [f"nccl_timeout@job-1: fabric_switch (leaf@{c.nodes[node].leaf})"]
    # the same verdict on a node under another, healthy leaf is wrong
    other = next(n for n, x in c.nodes.items() if x.leaf != c.nodes[node].leaf)
    v2 = _job_verdict("job-1", 120.0, "fabric_switch", "requeue",
                      evidence={"node_faults": {other: {"kind": "fabric", "fault_class": "fabric_switch"}}})
    r2 = score(c, [v2], [])
    assert r2["by_kind"]["nccl_timeout"]["right"] == 0 and r2["wrong_class"]


def test_a_user_bug_on_a_job_with_a_real_node_fault_is_not_blamed_on_hardware() -> None:
    hw = Fault(kind="xid79", at=90.0, node="node-0001", job="job-1")
    c = _cluster([hw, Fault(kind="user_bug", at=100.0, job="job-1")])
    vs = [_job_verdict("job-1", 101.0, "gpu_hardware", "requeue", exclude=["node-0001"]),
          _job_verdict("job-1", 400.0, "user_error", "stop")]
    r = score(c, vs, [])
    assert r["user_errors_blamed_on_hardware"] == 0 and r["user_errors_stopped"] == 1
    # blaming a node that had no fault is counted
    c2 = _cluster([Fault(kind="user_bug", at=100.0, job="job-1")])
    r2 = score(c2, [_job_verdict("job-1", 101.0, "gpu_hardware", "requeue", exclude=["node-0001"]),
                    _job_verdict("job-1", 400.0, "user_error", "stop")], [])
    assert r2["user_errors_blamed_on_hardware"] == 1


def test_a_crash_while_a_user_bug_is_being_retried_is_confounded_and_the_bug_still_scored() -> None:
    bug, crash = Fault(kind="user_bug", at=100.0, job="job-1"), Fault(kind="nccl_timeout", at=150.0, job="job-1")
    c = _cluster([bug, crash])
    vs = [_job_verdict("job-1", 121.0, "transient_software", "retry"),  # the traceback's first failure
          _job_verdict("job-1", 160.0, "transient_software", "retry"),  # the crash
          _job_verdict("job-1", 400.0, "user_error", "stop")]           # the bug again: stopped
    r = score(c, vs, [])
    assert r["by_kind"]["user_bug"]["right"] == 1  # its window runs past the crash to the stop
    assert r["by_kind"]["nccl_timeout"]["right"] == 1
    assert r["confounded"] == ["nccl_timeout@job-1: user_error (user_bug@job-1 since 100 s)"]
    assert r["user_errors_stopped"] == 1 and r["wrong_class"] == []


def test_a_crash_after_the_user_bug_was_stopped_is_not_confounded() -> None:
    bug, crash = Fault(kind="user_bug", at=100.0, job="job-1"), Fault(kind="nccl_timeout", at=500.0, job="job-1")
    c = _cluster([bug, crash])
    vs = [_job_verdict("job-1", 121.0, "user_error", "retry"), _job_verdict("job-1", 300.0, "user_error", "stop"),
          _job_verdict("job-1", 510.0, "user_error", "stop")]
    r = score(c, vs, [])
    assert r["by_kind"]["nccl_timeout"]["right"] == 0
    assert r["wrong_class"] == ["nccl_timeout@job-1: user_error (stop)"]


def test_rescoring_a_file_that_is_not_a_record_names_it(tmp_path) -> None:
    import pytest

    from pipeline.eval.quality import rescore

    bad = tmp_path / "verdicts.json"
    bad.write_text('{"verdicts": []}')
    with pytest.raises(ValueError, match="verdicts.json: not a records file"):
        rescore(bad, say=lambda *a: None)


def test_a_recorded_in_process_run_rescored_gives_the_same_result(tmp_path) -> None:
    from pipeline.eval.quality import rescore, run

    rec = tmp_path / "records.json"
    first = run(quick=True, inprocess=True, records=rec, say=lambda *a: None)
    again = rescore(rec, say=lambda *a: None)
    assert again.pop("rescored_from") == str(rec)
    assert again == first and first["faults"] > 0


def test_scoring_leaves_the_verdicts_as_they_were_recorded() -> None:
    c = _cluster([Fault(kind="nccl_timeout", at=100.0, job="job-1")])
    vs = [_job_verdict("job-1", 110.0, "transient_software", "retry")]
    before = [dict(v) for v in vs]
    score(c, vs, [])
    assert vs == before
