"""The node track: anomalies and notices about one node become node verdicts."""

from __future__ import annotations

import pytest

from pipeline.config import PolicySettings
from pipeline.correlate.policy import node_on_anomaly, node_on_notice
from pipeline.correlate.state import NODE_VERSION, NodeState, load_node, new_node
from schemas import ActionName, FaultClass, Severity

from .builders import T0, anomaly, critical_gpu_lost, node_notice

HEALTHY, SUSPECT, ISOLATED, DIAGNOSING, FAILED = (NodeState.healthy, NodeState.suspect, NodeState.isolated,
                                                  NodeState.diagnosing, NodeState.failed)
NODE = "node-0001"
JOB = "train-0001"


@pytest.fixture
def cfg() -> PolicySettings:
    return PolicySettings(degrade_confirmations=3, degrade_window_s=600.0, repeat_failure_jobs=3,
                          lemon_returns=3, lemon_window_s=86400.0)


def _placed(cfg: PolicySettings, job: str = JOB) -> dict:
    h = new_node()
    node_on_notice(h, node_notice(NODE, "placed", job), cfg)
    return h


def _actions(v) -> list[ActionName]:
    return [a.action for a in v.actions]


def _warning(ts: float, kind: str = "ecc_sbe_rate"):
    return anomaly(NODE, ts, kind=kind, fault_class=FaultClass.node_degrading, severity=Severity.warning)


def test_a_critical_gpu_hardware_anomaly_isolates_drains_diagnoses_and_tells_the_job(cfg) -> None:
    h = _placed(cfg)
    d = node_on_anomaly(h, critical_gpu_lost(NODE, T0), cfg)
    [v] = d.verdicts
    assert _actions(v) == [ActionName.isolate, ActionName.drain, ActionName.diagnose]
    assert all(a.target == NODE for a in v.actions)
    assert (v.scope, v.subject, v.fault_class) == ("node", NODE, FaultClass.gpu_hardware)
    [notice] = d.job_notices
    assert (notice.job, notice.node, notice.kind) == (JOB, NODE, "node_fault")
    assert notice.incident == v.incident
    assert h["state"] == ISOLATED


def test_a_critical_fault_on_an_idle_node_isolates_without_a_job_notice(cfg) -> None:
    h = new_node()
    d = node_on_anomaly(h, critical_gpu_lost(NODE, T0), cfg)
    assert _actions(d.verdicts[0]) == [ActionName.isolate, ActionName.drain, ActionName.diagnose]
    assert d.job_notices == []


def test_a_single_degradation_warning_makes_the_node_suspect_but_does_not_isolate(cfg) -> None:
    h = _placed(cfg)
    d = node_on_anomaly(h, _warning(T0), cfg)
    assert d.verdicts == [] and d.job_notices == []
    assert h["state"] == SUSPECT


def test_confirmed_degradation_under_a_running_job_isolates_without_drain_and_warns_the_job(cfg) -> None:
    h = _placed(cfg)
    decisions = [node_on_anomaly(h, _warning(T0 + 60 * i), cfg) for i in range(3)]
    assert [len(d.verdicts) for d in decisions] == [0, 0, 1]
    v = decisions[-1].verdicts[0]
    assert _actions(v) == [ActionName.isolate, ActionName.diagnose]
    assert v.fault_class is FaultClass.node_degrading
    assert v.evidence["confirmations"] == 3
    [notice] = decisions[-1].job_notices
    assert (notice.job, notice.kind, notice.incident) == (JOB, "node_degrading", v.incident)
    assert h["state"] == ISOLATED


def test_confirmed_degradation_on_an_idle_node_also_drains(cfg) -> None:
    h = new_node()
    for i in range(3):
        d = node_on_anomaly(h, _warning(T0 + 60 * i), cfg)
    assert _actions(d.verdicts[0]) == [ActionName.isolate, ActionName.drain, ActionName.diagnose]
    assert d.job_notices == []


def test_degradation_warnings_outside_the_window_do_not_count(cfg) -> None:
    h = _placed(cfg)
    spacing = cfg.degrade_window_s / 2 + 1  # any two consecutive fit the window, never three
    decisions = [node_on_anomaly(h, _warning(T0 + spacing * i), cfg) for i in range(5)]
    assert all(d.verdicts == [] for d in decisions)
    assert h["state"] == SUSPECT


def test_info_findings_are_not_degradation_evidence(cfg) -> None:
    h = _placed(cfg)
    for i in range(5):
        d = node_on_anomaly(h, anomaly(NODE, T0 + i, severity=Severity.info), cfg)
        assert d.verdicts == []
    assert h["state"] == HEALTHY


def test_anomalies_on_an_isolated_node_produce_no_new_verdict(cfg) -> None:
    h = _placed(cfg)
    node_on_anomaly(h, critical_gpu_lost(NODE, T0), cfg)
    later = [critical_gpu_lost(NODE, T0 + 1), *(_warning(T0 + 2 + i) for i in range(3))]
    for a in later:
        d = node_on_anomaly(h, a, cfg)
        assert d.verdicts == [] and d.job_notices == []
    assert h["state"] == ISOLATED


def test_failures_of_enough_distinct_jobs_isolate_the_node(cfg) -> None:
    h = new_node()
    first = node_on_notice(h, node_notice(NODE, "job_failed", "job-a", T0), cfg)
    again = node_on_notice(h, node_notice(NODE, "job_failed", "job-a", T0 + 10), cfg)
    second = node_on_notice(h, node_notice(NODE, "job_failed", "job-b", T0 + 20), cfg)
    assert first.verdicts == again.verdicts == second.verdicts == []
    third = node_on_notice(h, node_notice(NODE, "job_failed", "job-c", T0 + 30), cfg)
    [v] = third.verdicts
    assert ActionName.isolate in _actions(v)
    assert v.evidence["failed_jobs"] == ["job-a", "job-b", "job-c"]
    assert h["state"] == ISOLATED


def test_failures_of_big_jobs_share_their_blame_and_do_not_isolate_a_node(cfg) -> None:
    # three failed 512-node jobs: every node of them was there; none carries the blame
    h = new_node()
    for i, job in enumerate(["job-a", "job-b", "job-c", "job-d"]):
        d = node_on_notice(h, node_notice(NODE, "job_failed", job, T0 + 10 * i, job_nodes=512), cfg)
        assert d.verdicts == []
    assert h["state"] != ISOLATED


def test_failures_of_small_jobs_carry_enough_blame_to_isolate(cfg) -> None:
    h = new_node()
    sizes = {"job-a": 2, "job-b": 4, "job-c": 2}
    ds = [node_on_notice(h, node_notice(NODE, "job_failed", j, T0 + 10 * i, job_nodes=k), cfg)
          for i, (j, k) in enumerate(sizes.items())]
    assert ds[0].verdicts == ds[1].verdicts == []
    [v] = ds[2].verdicts
    assert ActionName.isolate in _actions(v) and v.evidence["blame"] == 1.25


def test_failures_of_different_jobs_that_keep_beginning_on_one_node_isolate_it_whatever_the_job_size(cfg) -> None:
    # three 512-node jobs each fail first on this node
    h = new_node()
    ds = [node_on_notice(h, node_notice(NODE, "job_failed", f"job-{c}", T0 + 3600 * i, job_nodes=512, origin=True,
                                        attempt=1), cfg) for i, c in enumerate("abc")]
    assert ds[0].verdicts == ds[1].verdicts == []
    [v] = ds[2].verdicts
    assert ActionName.isolate in _actions(v) and ActionName.diagnose in _actions(v)
    assert v.fault_class is FaultClass.unknown
    assert v.evidence["failed_jobs"] == ["job-a", "job-b", "job-c"]
    assert v.evidence["failures_began_here"] == [["job-a", 1], ["job-b", 1], ["job-c", 1]]
    assert h["state"] == ISOLATED


def test_one_jobs_retries_beginning_on_its_rank0_node_never_make_that_node_suspect(cfg) -> None:
    # a user's bug retried in place: Kubernetes reports the rank-0 pod first every time
    h = new_node()
    for i in range(6):
        d = node_on_notice(h, node_notice(NODE, "job_failed", "job-a", T0 + 600 * i, job_nodes=4, origin=True,
                                          attempt=i + 1), cfg)
        assert d.verdicts == []
    assert h["state"] == HEALTHY
    # a second and a third job beginning here are what counts
    node_on_notice(h, node_notice(NODE, "job_failed", "job-b", T0 + 7000, job_nodes=512, origin=True), cfg)
    d = node_on_notice(h, node_notice(NODE, "job_failed", "job-c", T0 + 7100, job_nodes=512, origin=True), cfg)
    [v] = d.verdicts
    assert v.evidence["failed_jobs"] == ["job-a", "job-b", "job-c"]


def test_a_replayed_failure_or_one_begun_elsewhere_does_not_count_as_beginning_here(cfg) -> None:
    h = new_node()
    notices = [node_notice(NODE, "job_failed", "job-a", T0, job_nodes=512, origin=True, attempt=1),
               node_notice(NODE, "job_failed", "job-a", T0 + 5, job_nodes=512, origin=True, attempt=1),  # replayed
               node_notice(NODE, "job_failed", "job-a", T0 + 3600, job_nodes=512, origin=False, attempt=2),
               node_notice(NODE, "job_failed", "job-a", T0 + 7200, job_nodes=512, origin=True, attempt=3)]
    assert all(node_on_notice(h, n, cfg).verdicts == [] for n in notices)
    assert h["state"] != ISOLATED


def test_failures_that_began_here_longer_ago_than_the_origin_window_do_not_count(cfg) -> None:
    h = new_node()
    step = cfg.repeat_origin_window_s / 2 + 1
    for i in range(4):
        d = node_on_notice(h, node_notice(NODE, "job_failed", f"job-{i}", T0 + step * i, job_nodes=512, origin=True,
                                          attempt=1), cfg)
        assert d.verdicts == []


def test_job_failures_older_than_the_repeat_window_do_not_count(cfg) -> None:
    h = new_node()
    step = cfg.repeat_failure_window_s / 2 + 1
    for i, job in enumerate(["job-a", "job-b", "job-c", "job-d"]):
        d = node_on_notice(h, node_notice(NODE, "job_failed", job, T0 + step * i), cfg)
        assert d.verdicts == []


def _isolate(h: dict, cfg: PolicySettings, ts: float):
    return node_on_anomaly(h, critical_gpu_lost(NODE, ts), cfg).verdicts[0]


def test_passed_diagnostics_return_the_node_and_reset_its_state(cfg) -> None:
    h = new_node()
    node_on_anomaly(h, _warning(T0), cfg)
    isolation = _isolate(h, cfg, T0 + 1)
    node_on_notice(h, node_notice(NODE, "diag_started", "diag-1", T0 + 2), cfg)
    assert h["state"] == DIAGNOSING
    d = node_on_notice(h, node_notice(NODE, "diag_passed", "diag-1", T0 + 62), cfg)
    [v] = d.verdicts
    assert _actions(v) == [ActionName.return_]
    assert v.incident == isolation.incident
    assert h["state"] == HEALTHY and h["anomalies"] == [] and h["incident"] is None
    # a fresh single warning after the return does not isolate on old evidence
    assert node_on_anomaly(h, _warning(T0 + 100), cfg).verdicts == []


def test_failed_diagnostics_escalate_and_keep_the_node_out(cfg) -> None:
    h = new_node()
    isolation = _isolate(h, cfg, T0)
    d = node_on_notice(h, node_notice(NODE, "diag_failed", "diag-1", T0 + 60, reason="dcgmi: fail"), cfg)
    [v] = d.verdicts
    assert _actions(v) == [ActionName.escalate]
    assert v.incident == isolation.incident
    assert h["state"] == FAILED
    assert node_on_anomaly(h, critical_gpu_lost(NODE, T0 + 100), cfg).verdicts == []


def test_diagnostics_results_for_a_node_in_service_change_nothing(cfg) -> None:
    h = new_node()
    d = node_on_notice(h, node_notice(NODE, "diag_passed", "diag-1", T0), cfg)
    assert d.verdicts == [] and h["state"] == HEALTHY


def test_only_the_diagnostics_of_this_isolation_decide_it(cfg) -> None:
    """A diagnostics outcome from before the isolation (an earlier isolation's run, or a
    watcher that re-reports a finished job after a restart) neither returns a node just
    taken out nor fails it; once this isolation's run has started, only its own outcome
    counts."""
    h = new_node()
    isolation = _isolate(h, cfg, T0 + 100)
    # diag-0 belongs to an earlier isolation: it started and passed before this one
    for kind, ts in (("diag_started", T0 + 10), ("diag_passed", T0 + 60), ("diag_failed", T0 + 99)):
        assert node_on_notice(h, node_notice(NODE, kind, "diag-0", ts), cfg).verdicts == []
        assert h["state"] == ISOLATED
    node_on_notice(h, node_notice(NODE, "diag_started", "diag-1", T0 + 102), cfg)
    assert h["state"] == DIAGNOSING
    # an older run's outcome arriving late, even after this run started, is not this run's
    assert node_on_notice(h, node_notice(NODE, "diag_passed", "diag-0", T0 + 150), cfg).verdicts == []
    assert h["state"] == DIAGNOSING
    [v] = node_on_notice(h, node_notice(NODE, "diag_failed", "diag-1", T0 + 160), cfg).verdicts
    assert _actions(v) == [ActionName.escalate] and v.incident == isolation.incident and h["state"] == FAILED


def test_a_node_that_keeps_coming_back_is_escalated_as_a_lemon(cfg) -> None:
    h = new_node()
    outcomes = []
    for i in range(cfg.lemon_returns):
        t = T0 + 1000 * i
        _isolate(h, cfg, t)
        [v] = node_on_notice(h, node_notice(NODE, "diag_passed", f"diag-{i}", t + 60), cfg).verdicts
        outcomes.append(_actions(v))
    assert outcomes[:-1] == [[ActionName.return_]] * (cfg.lemon_returns - 1)
    assert outcomes[-1] == [ActionName.escalate]
    assert h["state"] == FAILED


def test_returns_older_than_the_lemon_window_are_forgiven(cfg) -> None:
    h = new_node()
    for i in range(cfg.lemon_returns + 2):
        t = T0 + (cfg.lemon_window_s + 1) * i
        _isolate(h, cfg, t)
        [v] = node_on_notice(h, node_notice(NODE, "diag_passed", f"diag-{i}", t + 60), cfg).verdicts
        assert _actions(v) == [ActionName.return_]


def test_failures_kept_in_the_older_shape_still_count_their_blame_and_never_as_begun_here(cfg) -> None:
    # a node state written before the origin and attempt fields: [ts, job, signature, share]
    h = new_node()
    h["failed_jobs"] = [[T0, "job-a", "sig", 0.5], [T0 + 10, "job-b", "sig", 0.5]]
    d = node_on_notice(h, node_notice(NODE, "job_failed", "job-c", T0 + 20, job_nodes=4), cfg)
    [v] = d.verdicts  # 0.5 + 0.5 + 0.25 of blame over three jobs
    assert v.evidence["failed_jobs"] == ["job-a", "job-b", "job-c"] and "failures_began_here" not in v.evidence
    h = new_node()
    h["failed_jobs"] = [[T0, "job-a", "sig", 0.01], [T0 + 10, "job-a", "sig", 0.01]]
    d = node_on_notice(h, node_notice(NODE, "job_failed", "job-a", T0 + 20, job_nodes=100, origin=True), cfg)
    assert d.verdicts == []  # one failure begun here, the older two not


def test_a_fault_is_told_to_the_job_it_struck_whether_the_release_came_first_or_not(cfg) -> None:
    # the job ran here from T0 to T0 + 100; a GPU fell off the bus at T0 + 99.  The release
    # (job topic) and the finding (telemetry) reach the node track in either order.
    def told(release_first: bool) -> list[tuple]:
        h = new_node()
        node_on_notice(h, node_notice(NODE, "placed", JOB, ts=T0), cfg)
        release = node_notice(NODE, "released", JOB, ts=T0 + 100)
        if release_first:
            node_on_notice(h, release, cfg)
        d = node_on_anomaly(h, critical_gpu_lost(NODE, T0 + 99), cfg)
        if not release_first:
            node_on_notice(h, release, cfg)
        return [(n.job, n.kind, n.ts) for n in d.job_notices] + [(v.job, v.incident) for v in d.verdicts]

    assert told(True) == told(False)
    assert told(True)[0] == (JOB, "node_fault", T0 + 99)
    # a fault after the job left is not its
    h = new_node()
    node_on_notice(h, node_notice(NODE, "placed", JOB, ts=T0), cfg)
    node_on_notice(h, node_notice(NODE, "released", JOB, ts=T0 + 100), cfg)
    assert node_on_anomaly(h, critical_gpu_lost(NODE, T0 + 101), cfg).job_notices == []


def test_every_job_running_on_a_node_is_told_of_its_fault(cfg) -> None:
    # two single-GPU jobs share the node; a third left before the fault, a fourth comes after
    h = new_node()
    node_on_notice(h, node_notice(NODE, "placed", "job-a", ts=T0), cfg)
    node_on_notice(h, node_notice(NODE, "placed", "job-b", ts=T0 + 5), cfg)
    node_on_notice(h, node_notice(NODE, "placed", "job-c", ts=T0 + 1), cfg)
    node_on_notice(h, node_notice(NODE, "released", "job-c", ts=T0 + 10), cfg)
    d = node_on_anomaly(h, critical_gpu_lost(NODE, T0 + 20), cfg)
    assert sorted((n.job, n.kind) for n in d.job_notices) == [("job-a", "node_fault"), ("job-b", "node_fault")]
    [v] = d.verdicts
    assert v.evidence["jobs"] == ["job-a", "job-b"]
    # a job placed on the node after it was isolated is told at once
    d = node_on_notice(h, node_notice(NODE, "placed", "job-d", ts=T0 + 30), cfg)
    assert [(n.job, n.kind) for n in d.job_notices] == [("job-d", "node_fault")]


def test_a_degrading_node_warns_every_job_on_it(cfg) -> None:
    h = new_node()
    for j in ("job-a", "job-b"):
        node_on_notice(h, node_notice(NODE, "placed", j, ts=T0), cfg)
    d = None
    for i in range(3):
        d = node_on_anomaly(h, _warning(T0 + 10 + i), cfg)
    assert sorted((n.job, n.kind) for n in d.job_notices) == [("job-a", "node_degrading"), ("job-b", "node_degrading")]


def test_a_node_state_kept_in_the_older_one_job_shape_is_read_as_today(cfg) -> None:
    old = {"state": HEALTHY, "since": 0.0, "job": JOB, "job_since": T0, "left": ["job-z", T0 - 100, T0 - 1],
           "anomalies": [], "failed_jobs": [], "returns": [], "incident": None, "fault_class": None}
    d = node_on_anomaly(load_node(old), critical_gpu_lost(NODE, T0 + 5), cfg)
    assert [n.job for n in d.job_notices] == [JOB]
    assert old["v"] == NODE_VERSION
    assert old["jobs"] == {JOB: T0} and old["left"] == [["job-z", T0 - 100, T0 - 1]]
    assert "job" not in old and "job_since" not in old
    # a fault within the job that left: told to it
    old2 = {"state": HEALTHY, "since": 0.0, "job": None, "left": ["job-z", T0 - 100, T0 - 1], "anomalies": [],
            "failed_jobs": [], "returns": [], "incident": None, "fault_class": None}
    assert [n.job for n in node_on_anomaly(load_node(old2), critical_gpu_lost(NODE, T0 - 50), cfg).job_notices] == \
        ["job-z"]


def test_a_degrading_node_is_drained_once_every_job_on_it_moved_off_at_its_checkpoint(cfg) -> None:
    h = new_node()
    for j in ("job-a", "job-b"):
        node_on_notice(h, node_notice(NODE, "placed", j, ts=T0), cfg)
    for i in range(3):
        d = node_on_anomaly(h, _warning(T0 + 10 + i), cfg)
    [v] = d.verdicts
    assert ActionName.drain not in _actions(v)  # the jobs first save their state
    incident = v.incident
    first = node_on_notice(h, node_notice(NODE, "job_moved", "job-a", ts=T0 + 40, reason="checkpoint reached",
                                          signature=incident), cfg)
    assert first.verdicts == []  # job-b is still saving: no drain under it
    last = node_on_notice(h, node_notice(NODE, "job_moved", "job-b", ts=T0 + 70,
                                         reason="no checkpoint by the deadline", signature=incident), cfg)
    [drain] = last.verdicts
    assert _actions(drain) == [ActionName.drain] and drain.actions[0].target == NODE
    assert (drain.incident, drain.ts, drain.fault_class) == (incident, T0 + 70, FaultClass.node_degrading)
    assert drain.evidence["jobs"] == ["job-a", "job-b"]
    assert h["state"] == ISOLATED


def test_a_job_moved_notice_of_another_incident_or_a_healthy_node_drains_nothing(cfg) -> None:
    h = _placed(cfg)
    assert node_on_notice(h, node_notice(NODE, "job_moved", JOB, ts=T0, signature="inc-x"), cfg).verdicts == []
    for i in range(3):
        node_on_anomaly(h, _warning(T0 + 10 + i), cfg)
    assert node_on_notice(h, node_notice(NODE, "job_moved", JOB, ts=T0 + 20, signature="inc-other"),
                          cfg).verdicts == []
