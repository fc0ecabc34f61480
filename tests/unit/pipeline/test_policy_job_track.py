"""The job track: job events and node notices about one job become job verdicts."""

from __future__ import annotations

import pytest

from pipeline.config import PolicySettings
from pipeline.eval.failures import excerpt
from pipeline.correlate.policy import job_on_event, job_on_notice, job_on_tick
from pipeline.correlate.state import new_job
from schemas import ActionName, FaultClass, JobEventKind, JobNotice

from .builders import T0, job_event, job_notice

JOB = "train-0001"
NODES = ["node-0001", "node-0002"]
GRACE = 3.0
WALL = 5000.0  # the job track's wall clock, independent of event time

NCCL = dict(exit_code=-6, reason="NCCL watchdog timeout",
            log_tail="Watchdog caught collective operation timeout: WorkNCCL(SeqNum=88213) ran for 600042 ms")
#: a preempted Slurm job as submitit logs it (tests/data/failures/tune)
PREEMPTED = excerpt("t-submitit-1701-slurm-preempted-sighup-requeued").failed_fields()
TRACEBACK = dict(exit_code=1, reason="exit code 1",
                 log_tail='Traceback (most recent call last):\n  File "train.py", line 211\nKeyError: \'labels\'')


@pytest.fixture
def cfg() -> PolicySettings:
    return PolicySettings(correlation_grace_s=GRACE, transient_retries=2, user_error_retries=1,
                          checkpoint_deadline_s=600.0, degrade_window_s=600.0)


def _running(cfg: PolicySettings, attempt: int = 1, hist: dict | None = None, nodes=NODES, ts: float = T0) -> dict:
    hist = hist or new_job(JOB)
    job_on_event(hist, job_event(JOB, "started", ts, nodes=nodes, attempt=attempt), cfg, WALL)
    return hist


def _fail(hist: dict, cfg: PolicySettings, ts: float, attempt: int = 1, wall: float = WALL, **detail):
    return job_on_event(hist, job_event(JOB, "failed", ts, nodes=NODES, attempt=attempt, **detail), cfg, wall)


def _judged(hist: dict, cfg: PolicySettings, ts: float, attempt: int = 1, **detail):
    """A failure with no node evidence, judged once the grace has passed."""
    waiting = _fail(hist, cfg, ts, attempt, **detail)
    assert waiting.verdicts == []
    return job_on_tick(hist, cfg, WALL + 1, ts + GRACE)  # the telemetry watermark passed the grace


def _only(d):
    [v] = d.verdicts
    [a] = v.actions
    return v, a


def test_starting_a_job_tells_each_node_it_was_placed(cfg) -> None:
    hist = new_job(JOB)
    d = job_on_event(hist, job_event(JOB, "started", T0, nodes=NODES), cfg, WALL)
    assert [(n.node, n.kind) for n in d.node_notices] == [(n, "placed") for n in NODES]


def test_a_failure_after_a_node_fault_requeues_excluding_that_node(cfg) -> None:
    hist = _running(cfg)
    job_on_notice(hist, job_notice(JOB, "node-0002", "node_fault", T0 + 5, incident="inc-xid79"), cfg, WALL)
    assert _fail(hist, cfg, T0 + 6, exit_code=1, reason="CUDA error: unspecified launch failure").verdicts == []
    d = job_on_tick(hist, cfg, WALL + 1, T0 + 6 + GRACE)
    v, a = _only(d)
    assert a.action is ActionName.requeue and a.target == JOB
    assert a.params["exclude"] == ["node-0002"]
    assert v.incident == "inc-xid79"
    assert v.fault_class is FaultClass.gpu_hardware
    assert d.tick_at is None


def test_a_failure_without_node_evidence_waits_for_the_grace(cfg) -> None:
    hist = _running(cfg)
    d = _fail(hist, cfg, T0 + 6, **NCCL)
    assert d.verdicts == [] and d.node_notices == []
    # it waits in event time (the telemetry watermark) and, at most, a while of wall time
    assert (d.tick_ts, d.tick_at) == (T0 + 6 + GRACE, WALL + cfg.correlation_wait_max_s)
    early = job_on_tick(hist, cfg, WALL + cfg.correlation_wait_max_s / 2, T0 + 6 + GRACE - 0.1)
    assert early.verdicts == [] and (early.tick_ts, early.tick_at) == (d.tick_ts, d.tick_at)
    # however slowly or quickly the wall clock went, the watermark's passing judges it,
    # stamped with the end of the grace
    v, _ = _only(job_on_tick(hist, cfg, WALL + 0.001, T0 + 6 + GRACE))
    assert v.ts == T0 + 6 + GRACE


def test_a_failure_is_judged_on_the_wall_clock_when_telemetry_stalls(cfg) -> None:
    hist = _running(cfg)
    _fail(hist, cfg, T0 + 6, **NCCL)
    assert job_on_tick(hist, cfg, WALL + cfg.correlation_wait_max_s - 1, 0.0).verdicts == []
    v, _ = _only(job_on_tick(hist, cfg, WALL + cfg.correlation_wait_max_s, 0.0))
    assert v.ts == T0 + 6 + GRACE and v.fault_class is FaultClass.unknown


def test_node_evidence_after_the_grace_in_event_time_is_not_the_failures(cfg) -> None:
    # a node fault stamped after the failure's grace reached the job track before the tick
    # (its node's telemetry ran ahead of the others'): at any replay speed it is not evidence
    hist = _running(cfg)
    _fail(hist, cfg, T0 + 6, **NCCL)
    late = job_notice(JOB, "node-0001", "node_fault", T0 + 6 + GRACE + 1, incident="inc-later",
                      fault_class=FaultClass.gpu_memory)
    assert job_on_notice(hist, late, cfg, WALL + 1).verdicts == []
    v, _ = _only(job_on_tick(hist, cfg, WALL + 2, T0 + 6 + GRACE))
    assert v.fault_class is FaultClass.unknown


def test_an_nccl_timeout_without_node_evidence_is_unknown_run_once_more_elsewhere_and_counted_against_each_node(
        cfg) -> None:
    hist = _running(cfg)
    _fail(hist, cfg, T0 + 6, **NCCL)
    tick = JobNotice(ts=T0 + 9, job=JOB, node="-", kind="tick", fault_class=FaultClass.unknown, incident="-")
    d = job_on_notice(hist, tick, cfg, WALL + GRACE)
    v, a = _only(d)
    assert a.action is ActionName.requeue and a.params["exclude"] == []
    assert v.fault_class is FaultClass.unknown
    assert v.evidence["decided_by"] == "nccl_watchdog_timeout" and v.evidence["triage"]["why"]
    assert [(n.node, n.kind, n.job, n.job_nodes, n.origin) for n in d.node_notices] == [
        (n, "job_failed", JOB, len(NODES), False) for n in NODES]


def test_the_node_a_failure_began_on_is_told_so(cfg) -> None:
    hist = _running(cfg)
    _fail(hist, cfg, T0 + 6, **NCCL, origin_node=NODES[1])
    tick = JobNotice(ts=T0 + 9, job=JOB, node="-", kind="tick", fault_class=FaultClass.unknown, incident="-")
    d = job_on_notice(hist, tick, cfg, WALL + GRACE)
    assert [n.node for n in d.node_notices if n.origin] == [NODES[1]]
    # an origin outside the job's nodes (a stale or foreign name) tells no node
    hist = _running(cfg)
    _fail(hist, cfg, T0 + 6, **NCCL, origin_node="node-9999")
    d = job_on_notice(hist, tick, cfg, WALL + GRACE)
    assert not [n for n in d.node_notices if n.origin]


def test_a_node_fault_arriving_while_a_failure_waits_is_its_evidence_when_the_grace_ends(cfg) -> None:
    hist = _running(cfg)
    _fail(hist, cfg, T0 + 6, **NCCL)
    d = job_on_notice(hist, job_notice(JOB, "node-0001", "node_fault", T0 + 7, incident="inc-ecc",
                                       fault_class=FaultClass.gpu_memory), cfg, WALL + 1)
    assert d.verdicts == []  # another node's evidence may still be on its way
    assert job_on_tick(hist, cfg, WALL + 1, T0 + 6 + GRACE - 0.1).verdicts == []
    d = job_on_tick(hist, cfg, WALL + 2, T0 + 6 + GRACE)
    v, a = _only(d)
    assert a.action is ActionName.requeue and a.params["exclude"] == ["node-0001"]
    assert (v.incident, v.fault_class) == ("inc-ecc", FaultClass.gpu_memory)
    assert d.node_notices == []
    # the grace expiring later does not judge the failure a second time
    assert job_on_tick(hist, cfg, WALL + GRACE, T0 + 9).verdicts == []


def test_a_node_fault_from_long_before_the_failure_is_no_evidence_and_does_not_crash(cfg) -> None:
    # the notice reached the job late (its node's owner saw the fault an hour earlier):
    # outside the window it is not evidence, the failure is judged on its own after the grace
    hist = _running(cfg)
    _fail(hist, cfg, T0 + 4000, **NCCL)
    d = job_on_notice(hist, job_notice(JOB, "node-0001", "node_fault", T0 + 100, incident="inc-old",
                                       fault_class=FaultClass.gpu_memory), cfg, WALL + 1)
    assert d.verdicts == []
    v, a = _only(job_on_tick(hist, cfg, WALL + GRACE, T0 + 4003))
    assert a.action is ActionName.requeue and v.fault_class is FaultClass.unknown


def test_a_node_fault_on_a_node_the_job_does_not_use_is_no_evidence(cfg) -> None:
    hist = _running(cfg)
    _fail(hist, cfg, T0 + 6, **NCCL)
    d = job_on_notice(hist, job_notice(JOB, "node-0099", "node_fault", T0 + 7), cfg, WALL + 1)
    assert d.verdicts == []
    v, a = _only(job_on_tick(hist, cfg, WALL + GRACE, T0 + 9))
    assert a.action is ActionName.requeue and v.fault_class is FaultClass.unknown


def test_the_same_traceback_twice_stops_the_job_as_a_user_error(cfg) -> None:
    hist = _running(cfg)
    first, a1 = _only(_judged(hist, cfg, T0 + 20, **TRACEBACK))
    assert a1.action is ActionName.retry
    _running(cfg, attempt=2, hist=hist, ts=T0 + 30)
    second, a2 = _only(_judged(hist, cfg, T0 + 50, attempt=2, **TRACEBACK))
    assert a2.action is ActionName.stop
    assert second.fault_class is FaultClass.user_error
    assert second.evidence["repeats"] == 2


def test_a_traceback_is_the_codes_and_counts_against_no_node(cfg) -> None:
    hist = _running(cfg)
    d = _judged(hist, cfg, T0 + 6, **TRACEBACK)
    assert d.verdicts and d.node_notices == []


def test_transient_failures_beyond_the_retry_budget_are_requeued(cfg) -> None:
    hist = new_job(JOB)
    actions = []
    for attempt in range(1, cfg.transient_retries + 3):
        _running(cfg, attempt=attempt, hist=hist, ts=T0 + 100 * attempt)
        v, a = _only(_judged(hist, cfg, T0 + 100 * attempt + 50, attempt=attempt, **PREEMPTED))
        assert v.fault_class is FaultClass.transient_software and v.evidence["decided_by"] == "preempted"
        actions.append(a.action)
    assert actions[: cfg.transient_retries] == [ActionName.retry] * cfg.transient_retries
    assert set(actions[cfg.transient_retries:]) == {ActionName.requeue}


def test_a_degrading_node_moves_the_job_at_its_next_checkpoint(cfg) -> None:
    hist = _running(cfg)
    notice = job_notice(JOB, "node-0002", "node_degrading", T0 + 10, incident="inc-sbe",
                        fault_class=FaultClass.node_degrading)
    asked = job_on_notice(hist, notice, cfg, WALL)
    v, a = _only(asked)  # checkpoint-now: the job is asked to save its state before the node is taken
    assert (a.action, a.target) == (ActionName.checkpoint, JOB)
    assert a.params["deadline"] == T0 + 10 + cfg.checkpoint_deadline_s and a.params["node"] == "node-0002"
    assert (v.incident, v.ts) == ("inc-sbe", T0 + 10)
    assert asked.tick_ts == T0 + 10 + cfg.checkpoint_deadline_s  # the deadline comes as a tick
    progress = job_on_event(hist, job_event(JOB, "progress", T0 + 20, nodes=NODES, step=100), cfg, WALL)
    assert progress.verdicts == []
    d = job_on_event(hist, job_event(JOB, "checkpoint", T0 + 60, nodes=NODES, step=120, checkpoint_step=120),
                     cfg, WALL)
    v, a = _only(d)
    assert a.action is ActionName.requeue
    assert a.params["exclude"] == ["node-0002"] and a.params["from_checkpoint"] is True
    assert v.incident == "inc-sbe"
    assert v.evidence["checkpoint"]["step"] == 120
    # the node's owner hears that the job left (it drains the node once no job is left on it)
    [moved] = d.node_notices
    assert (moved.node, moved.kind, moved.job, moved.signature) == ("node-0002", "job_moved", JOB, "inc-sbe")
    # the deadline passing later changes nothing
    assert job_on_tick(hist, cfg, WALL + 1, T0 + 10 + cfg.checkpoint_deadline_s + 1).verdicts == []


def test_without_checkpoint_now_a_degrading_node_waits_for_the_next_scheduled_checkpoint(cfg) -> None:
    cfg = cfg.model_copy(update={"checkpoint_now": False})
    hist = _running(cfg)
    notice = job_notice(JOB, "node-0002", "node_degrading", T0 + 10, incident="inc-sbe",
                        fault_class=FaultClass.node_degrading)
    assert job_on_notice(hist, notice, cfg, WALL).verdicts == []
    d = job_on_event(hist, job_event(JOB, "checkpoint", T0 + 60, nodes=NODES, checkpoint_step=120), cfg, WALL)
    assert _only(d)[1].action is ActionName.requeue


def test_the_checkpoint_deadline_moves_the_job_on_a_tick_without_any_job_event(cfg) -> None:
    hist = _running(cfg)
    job_on_event(hist, job_event(JOB, "checkpoint", T0 + 5, nodes=NODES, checkpoint_step=40), cfg, WALL)
    notice = job_notice(JOB, "node-0002", "node_degrading", T0 + 10, incident="inc-thermal",
                        fault_class=FaultClass.node_degrading)
    job_on_notice(hist, notice, cfg, WALL)
    deadline = T0 + 10 + cfg.checkpoint_deadline_s
    # our own request coming back on telemetry.job is not an answer
    req = job_event(JOB, "checkpoint_requested", T0 + 11, nodes=NODES, checkpoint_deadline=deadline)
    assert job_on_event(hist, req, cfg, WALL).verdicts == []
    assert job_on_tick(hist, cfg, WALL + 1, deadline - 1).verdicts == []
    d = job_on_tick(hist, cfg, WALL + 2, deadline + 30)
    v, a = _only(d)
    assert (a.action, a.params["exclude"], a.params["from_checkpoint"]) == (ActionName.requeue, ["node-0002"], True)
    assert v.ts == deadline  # stamped with the deadline (event time), whatever the tick's watermark
    assert v.evidence["checkpoint"]["step"] == 40 and "deadline" in v.evidence["reason"]
    assert [n.kind for n in d.node_notices] == ["job_moved"]
    assert job_on_tick(hist, cfg, WALL + 3, deadline + 60).verdicts == []


def test_the_checkpoint_deadline_also_holds_in_wall_time_when_telemetry_stalls(cfg) -> None:
    hist = _running(cfg)
    notice = job_notice(JOB, "node-0002", "node_degrading", T0 + 10, incident="inc-thermal",
                        fault_class=FaultClass.node_degrading)
    asked = job_on_notice(hist, notice, cfg, WALL)
    assert asked.tick_at == WALL + cfg.checkpoint_deadline_s
    assert job_on_tick(hist, cfg, WALL + cfg.checkpoint_deadline_s - 1, T0 + 20).verdicts == []
    v, a = _only(job_on_tick(hist, cfg, WALL + cfg.checkpoint_deadline_s, T0 + 20))
    assert a.action is ActionName.requeue and v.ts == T0 + 10 + cfg.checkpoint_deadline_s  # the deadline's time


def test_a_job_that_ends_before_its_deadline_is_not_moved(cfg) -> None:
    hist = _running(cfg)
    notice = job_notice(JOB, "node-0002", "node_degrading", T0 + 10, incident="inc-thermal",
                        fault_class=FaultClass.node_degrading)
    job_on_notice(hist, notice, cfg, WALL)
    job_on_event(hist, job_event(JOB, "completed", T0 + 30, nodes=NODES), cfg, WALL)
    assert job_on_tick(hist, cfg, WALL + 1, T0 + 10 + cfg.checkpoint_deadline_s).verdicts == []


def test_a_degrading_node_moves_the_job_when_the_checkpoint_deadline_passes(cfg) -> None:
    hist = _running(cfg)
    notice = job_notice(JOB, "node-0002", "node_degrading", T0 + 10, incident="inc-thermal",
                        fault_class=FaultClass.node_degrading)
    assert _only(job_on_notice(hist, notice, cfg, WALL))[1].action is ActionName.checkpoint
    before = job_on_event(hist, job_event(JOB, "progress", T0 + 10 + cfg.checkpoint_deadline_s - 1, nodes=NODES),
                          cfg, WALL)
    assert before.verdicts == []
    after = job_on_event(hist, job_event(JOB, "progress", T0 + 10 + cfg.checkpoint_deadline_s, nodes=NODES),
                         cfg, WALL)
    v, a = _only(after)
    assert a.action is ActionName.requeue and a.params["exclude"] == ["node-0002"]
    assert v.evidence["reason"] == "checkpoint deadline passed"


def test_a_duplicate_failure_event_of_a_decided_attempt_produces_nothing(cfg) -> None:
    hist = _running(cfg)
    _judged(hist, cfg, T0 + 6, **NCCL)
    again = _fail(hist, cfg, T0 + 6, **NCCL)
    assert again.verdicts == [] and again.node_notices == [] and again.tick_at is None
    assert job_on_tick(hist, cfg, WALL + 10 * GRACE, T0 + 20).verdicts == []


def test_a_duplicate_failure_event_while_judging_does_not_restart_the_grace(cfg) -> None:
    hist = _running(cfg)
    _fail(hist, cfg, T0 + 6, **NCCL)
    again = _fail(hist, cfg, T0 + 6, wall=WALL + 2, **NCCL)
    assert again.tick_at is None
    assert len(job_on_tick(hist, cfg, WALL + GRACE, T0 + 9).verdicts) == 1


def _replay(cfg: PolicySettings) -> list[str]:
    hist = _running(cfg)
    ids = [v.id for v in _judged(hist, cfg, T0 + 6, **NCCL).verdicts]
    _running(cfg, attempt=2, hist=hist, ts=T0 + 20)
    job_on_notice(hist, job_notice(JOB, "node-0001", "node_fault", T0 + 25, incident="inc-2"), cfg, WALL)
    _fail(hist, cfg, T0 + 26, attempt=2, **NCCL)
    ids += [v.id for v in job_on_tick(hist, cfg, WALL, T0 + 26 + GRACE).verdicts]
    return ids


def test_verdict_ids_are_deterministic(cfg) -> None:
    first, second = _replay(cfg), _replay(cfg)
    assert len(first) == 2
    assert first == second
    assert first[0] != first[1]


def test_diagnostics_job_events_become_diagnostics_notices_for_the_node(cfg) -> None:
    hist = new_job("diag-node-0003-1")
    kinds = []
    for event, extra in (("started", {}), ("completed", {"reason": "dcgmi diag -r 2: pass"})):
        e = job_event("diag-node-0003-1", event, T0, nodes=["node-0003"], diagnostics_for="node-0003", **extra)
        d = job_on_event(hist, e, cfg, WALL)
        assert d.verdicts == []
        kinds += [(n.node, n.kind) for n in d.node_notices]
    failed = job_event("diag-node-0003-2", JobEventKind.failed, T0, nodes=["node-0003"],
                       diagnostics_for="node-0003", reason="dcgmi diag -r 2: fail")
    [n] = job_on_event(new_job("diag-node-0003-2"), failed, cfg, WALL).node_notices
    kinds.append((n.node, n.kind))
    assert kinds == [("node-0003", "diag_started"), ("node-0003", "diag_passed"), ("node-0003", "diag_failed")]
    assert n.reason == "dcgmi diag -r 2: fail"


def _user_bug_twice(cfg: PolicySettings, fast: bool) -> list[tuple]:
    """A user's bug fails attempt 1 at T0+20; attempt 2 starts at T0+30 and fails at T0+50.
    Slow: each failure is judged (the watermark passed its grace) before the next event.
    Fast (a replay at high speed): every event arrives before the first judgement."""
    hist = _running(cfg)
    out = []
    _fail(hist, cfg, T0 + 20, **TRACEBACK)
    if not fast:
        out += job_on_tick(hist, cfg, WALL, T0 + 20 + GRACE).verdicts
    _running(cfg, attempt=2, hist=hist, ts=T0 + 30)
    waiting = _fail(hist, cfg, T0 + 50, attempt=2, **TRACEBACK)
    if fast:
        assert waiting.tick_ts == T0 + 20 + GRACE  # the older failure is due first
    out += job_on_tick(hist, cfg, WALL, T0 + 50 + GRACE).verdicts
    return [(v.ts, v.id, v.fault_class, [(a.action, a.params) for a in v.actions], v.nodes) for v in out]


def test_failures_judged_late_are_judged_in_order_as_if_on_time(cfg) -> None:
    slow, fast = _user_bug_twice(cfg, fast=False), _user_bug_twice(cfg, fast=True)
    assert slow == fast
    assert [(x[2], x[3][0][0], x[3][0][1]["attempt"]) for x in slow] == [
        (FaultClass.user_error, ActionName.retry, 1), (FaultClass.user_error, ActionName.stop, 2)]


def test_a_later_failure_with_node_evidence_waits_behind_an_older_one(cfg) -> None:
    # attempt 1 fails without evidence; before it is judged, attempt 2 fails on a node
    # whose fault is known: the verdicts still come in the order of the attempts
    hist = _running(cfg)
    _fail(hist, cfg, T0 + 20, **NCCL)
    _running(cfg, attempt=2, hist=hist, ts=T0 + 30)
    job_on_notice(hist, job_notice(JOB, "node-0002", "node_fault", T0 + 40, incident="inc-79"), cfg, WALL)
    assert _fail(hist, cfg, T0 + 41, attempt=2, exit_code=1).verdicts == []
    d = job_on_tick(hist, cfg, WALL, T0 + 41 + GRACE)
    assert [(v.fault_class, v.actions[0].params["attempt"], v.ts) for v in d.verdicts] == [
        (FaultClass.unknown, 1, T0 + 20 + GRACE), (FaultClass.gpu_hardware, 2, T0 + 41)]


#: pytorch/pytorch#34220 (2020-03-04), as posted: the user's own model code fails the same
#: way whenever the batch size is above 1 (a program's bug, not the GPU's)
ILLEGAL_ADDRESS = dict(exit_code=1, reason="exit code 1", log_tail=(
    "Traceback (most recent call last):\n"
    '  File "/home/penuoz/Celldetection/train.py", line 34, in <module>\n'
    "    loss_tmp += np.array(model.get_current_losses())\n"
    '  File "/home/penuoz/Celldetection/models/base_model.py", line 152, in get_current_losses\n'
    "    errors_ret.append(float(getattr(self, 'loss_' + name)))  # float(...) works for both scalar tensor and float number\n"
    "RuntimeError: CUDA error: an illegal memory access was encountered\n"))


def test_an_illegal_memory_access_runs_once_elsewhere_and_a_users_bug_is_then_stopped(cfg) -> None:
    # NVIDIA's Xid 13/31 guidance: the application's unless it repeats on the same GPU; only
    # a run on other nodes tells a failing board from a bad kernel
    hist = _running(cfg)
    v1, a1 = _only(_judged(hist, cfg, T0 + 20, origin_node=NODES[0], **ILLEGAL_ADDRESS))
    assert a1.action is ActionName.requeue and a1.params["exclude"] == [NODES[0]]
    assert v1.evidence["decided_by"] == "cuda_error_ambiguous"
    # the user's bug fails the same way on new nodes: stopped at its second attempt
    job_on_event(hist, job_event(JOB, "started", T0 + 30, nodes=["node-0101", "node-0102"], attempt=2), cfg, WALL)
    waiting = job_on_event(hist, job_event(JOB, "failed", T0 + 60, nodes=["node-0101", "node-0102"], attempt=2,
                                           origin_node="node-0101", **ILLEGAL_ADDRESS), cfg, WALL)
    assert waiting.verdicts == []
    v2, a2 = _only(job_on_tick(hist, cfg, WALL, T0 + 60 + GRACE))
    assert a2.action is ActionName.stop and v2.fault_class is FaultClass.user_error
    assert v2.evidence["decided_by"] == "same_failure_on_other_nodes"


def test_faults_on_two_nodes_just_before_a_failure_exclude_both_whatever_order_they_arrive_in(cfg) -> None:
    # GPUs of two nodes fall off the bus 0.1 s apart and the job fails 0.15 s later; the
    # second node's notice reaches the job track after the failure (its anomaly was still
    # in flight).  Both nodes are excluded, in any arrival order.
    fault_a = job_notice(JOB, "node-0001", "node_fault", T0 + 10.0, incident="inc-a")
    fault_b = job_notice(JOB, "node-0002", "node_fault", T0 + 10.1, incident="inc-b")
    fail = job_event(JOB, "failed", T0 + 10.25, nodes=NODES, exit_code=1, reason="CUDA error: unknown error")
    orders = [[fault_a, fail, fault_b], [fail, fault_a, fault_b], [fault_b, fault_a, fail], [fail, fault_b, fault_a]]
    got = []
    for order in orders:
        hist = _running(cfg)
        verdicts = []
        for rec in order:
            d = (job_on_event(hist, rec, cfg, WALL) if rec.schema_ == "job/1" else job_on_notice(hist, rec, cfg, WALL))
            verdicts += d.verdicts
        verdicts += job_on_tick(hist, cfg, WALL + 1, T0 + 10.25 + GRACE).verdicts
        [v] = verdicts
        [a] = v.actions
        got.append((v.id, a.action, tuple(a.params["exclude"])))
    assert got[0][1:] == (ActionName.requeue, ("node-0001", "node-0002"))
    assert len(set(got)) == 1, got


def test_a_hard_fault_under_a_running_job_moves_it_off_the_node_before_it_fails(cfg) -> None:
    hist = _running(cfg)
    job_on_event(hist, job_event(JOB, "checkpoint", T0 + 50, nodes=NODES, checkpoint_step=400), cfg, WALL)
    d = job_on_notice(hist, job_notice(JOB, "node-0002", "node_fault", T0 + 60, incident="inc-nvlink",
                                       fault_class=FaultClass.nvlink), cfg, WALL)
    assert d.verdicts == [] and d.tick_ts == T0 + 60 + GRACE  # waits for faults on its other nodes
    v, a = _only(job_on_tick(hist, cfg, WALL + 1, T0 + 60 + GRACE))
    assert (a.action, a.params["exclude"], a.params["from_checkpoint"]) == (ActionName.requeue, ["node-0002"], True)
    assert (v.fault_class, v.incident, v.ts) == (FaultClass.nvlink, "inc-nvlink", T0 + 60 + GRACE)
    assert v.evidence["checkpoint"]["step"] == 400
    # the attempt then dies as its node is drained: no second verdict
    assert _fail(hist, cfg, T0 + 70, exit_code=137, reason="Evicted").verdicts == []
    assert job_on_tick(hist, cfg, WALL + 9, T0 + 80).verdicts == []


def test_a_job_that_fails_while_it_is_about_to_be_moved_is_judged_once_as_a_failure(cfg) -> None:
    hist = _running(cfg)
    job_on_notice(hist, job_notice(JOB, "node-0002", "node_fault", T0 + 60, incident="inc-x"), cfg, WALL)
    assert _fail(hist, cfg, T0 + 60.5, exit_code=1, reason="CUDA error: unknown error").verdicts == []
    d = job_on_tick(hist, cfg, WALL + 1, T0 + 60 + GRACE)  # no later than the move was due
    v, a = _only(d)
    assert a.params["exclude"] == ["node-0002"] and v.evidence["failure"]["attempt"] == 1
    assert job_on_tick(hist, cfg, WALL + 9, T0 + 90).verdicts == []


def test_a_fault_on_a_node_the_job_left_or_a_finished_job_moves_nothing(cfg) -> None:
    hist = _running(cfg)
    assert job_on_notice(hist, job_notice(JOB, "node-0099", "node_fault", T0 + 5), cfg, WALL).tick_ts is None
    job_on_event(hist, job_event(JOB, "completed", T0 + 6, nodes=NODES), cfg, WALL)
    assert job_on_notice(hist, job_notice(JOB, "node-0001", "node_fault", T0 + 7), cfg, WALL).tick_ts is None
    assert job_on_tick(hist, cfg, WALL + 99, T0 + 99).verdicts == []


def test_a_checkpoint_answering_the_request_counts_whatever_attempt_it_names(cfg) -> None:
    # a job's replaced pod cannot know which attempt the watcher counts: its ack says 1
    hist = _running(cfg, attempt=3)
    notice = job_notice(JOB, "node-0002", "node_degrading", T0 + 10, incident="inc-sbe",
                        fault_class=FaultClass.node_degrading)
    job_on_notice(hist, notice, cfg, WALL)
    stale = job_on_event(hist, job_event(JOB, "checkpoint", T0 + 5, nodes=NODES, attempt=1, checkpoint_step=7),
                         cfg, WALL)
    assert stale.verdicts == []  # saved before the request: a late record of an older attempt
    d = job_on_event(hist, job_event(JOB, "checkpoint", T0 + 40, nodes=NODES, attempt=1, checkpoint_step=90),
                     cfg, WALL)
    v, a = _only(d)
    assert a.action is ActionName.requeue and a.params["attempt"] == 3
    assert v.evidence["checkpoint"]["step"] == 90


def test_a_job_whose_pod_the_drain_replaced_elsewhere_is_still_moved_as_a_whole(cfg) -> None:
    # the node's drain evicts one pod of a gang, its controller puts a new one on another
    # node, and the watcher reports the new placement within the grace: the job is still
    # requeued without the faulty node (a gang restarts together from its checkpoint)
    hist = _running(cfg)
    job_on_notice(hist, job_notice(JOB, "node-0002", "node_fault", T0 + 60, incident="inc-79",
                                   fault_class=FaultClass.gpu_hardware), cfg, WALL)
    job_on_event(hist, job_event(JOB, "started", T0 + 61, nodes=["node-0001", "node-0003"]), cfg, WALL)
    v, a = _only(job_on_tick(hist, cfg, WALL + 1, T0 + 60 + GRACE))
    assert (a.action, a.params["exclude"]) == (ActionName.requeue, ["node-0002"])


def test_a_checkpoint_saved_after_the_degradation_moves_the_job_in_either_arrival_order(cfg) -> None:
    notice = job_notice(JOB, "node-0002", "node_degrading", T0 + 10, incident="inc-sbe",
                        fault_class=FaultClass.node_degrading)
    saved = job_event(JOB, "checkpoint", T0 + 11, nodes=NODES, checkpoint_step=300)
    got = []
    for first, second in ((notice, saved), (saved, notice)):  # event-time order, then the record first
        hist = _running(cfg)
        verdicts = []
        for rec in (first, second):
            d = (job_on_event(hist, rec, cfg, WALL) if rec.schema_ == "job/1" else job_on_notice(hist, rec, cfg, WALL))
            verdicts += [(v.ts, v.id, v.actions[0].action, v.evidence.get("reason")) for v in d.verdicts]
        got.append(sorted(verdicts))
    assert got[0] == got[1]
    assert [a for _, _, a, _ in got[0]] == [ActionName.checkpoint, ActionName.requeue]
    assert got[0][1][0] == T0 + 11 and got[0][1][3] == "checkpoint reached"
    # a checkpoint from before the degradation does not move it
    hist = _running(cfg)
    job_on_event(hist, job_event(JOB, "checkpoint", T0 + 9, nodes=NODES, checkpoint_step=200), cfg, WALL)
    assert [v.actions[0].action for v in job_on_notice(hist, notice, cfg, WALL).verdicts] == [ActionName.checkpoint]


def test_a_job_no_longer_on_a_degrading_node_answers_at_once_so_the_drain_need_not_wait(cfg) -> None:
    hist = _running(cfg)
    job_on_event(hist, job_event(JOB, "failed", T0 + 5, nodes=NODES, exit_code=1, reason="x"), cfg, WALL)
    d = job_on_notice(hist, job_notice(JOB, "node-0002", "node_degrading", T0 + 10, incident="inc-sbe",
                                       fault_class=FaultClass.node_degrading), cfg, WALL)
    assert d.verdicts == []
    [moved] = d.node_notices
    assert (moved.kind, moved.node, moved.signature, moved.reason) == ("job_moved", "node-0002", "inc-sbe",
                                                                         "not running on it")
