"""The correlator core and its typed, versioned state: transitions, migrations, the
schedule of ticks, and state left as it was when a rule fails."""

from __future__ import annotations

import itertools

import pytest

from pipeline.config import NetworkSettings, PolicySettings
from pipeline.correlate import policy
from pipeline.correlate.core import Correlator
from pipeline.detect.glue import InFlight
from pipeline.correlate.state import (
    JOB_VERSION,
    NODE_VERSION,
    TRANSITIONS,
    IllegalTransition,
    NodeState,
    StateVersionError,
    enter,
    load_job,
    load_node,
    new_job,
    new_node,
)

from schemas import Anomaly, FaultClass, Severity

from .builders import T0, critical_gpu_lost, job_event

GRACE = 3.0
WAIT = 30.0
NODES = ["node-0001", "node-0002"]


def _core(**stores) -> Correlator:
    return Correlator(PolicySettings(correlation_grace_s=GRACE, correlation_wait_max_s=WAIT), NetworkSettings(),
                      **stores)


@pytest.mark.parametrize("frm,to", list(itertools.product(NodeState, NodeState)))
def test_a_node_moves_only_along_the_lifecycle_table(frm: NodeState, to: NodeState) -> None:
    h = new_node()
    h["state"] = frm.value
    if to in TRANSITIONS[frm]:
        enter(h, to, T0, incident="i-1")
        assert (h["state"], h["since"], h["incident"]) == (to.value, T0, "i-1")
    else:
        with pytest.raises(IllegalTransition, match=f"from {frm.value} to {to.value}"):
            enter(h, to, T0)
        assert h["state"] == frm.value and h["since"] == 0.0


def test_the_table_lets_every_state_be_reached_and_every_out_of_pool_state_be_returned() -> None:
    reached = {to for tos in TRANSITIONS.values() for to in tos}
    assert reached == set(NodeState)
    assert all(NodeState.healthy in TRANSITIONS[s] for s in NodeState)


def test_records_carry_their_version_and_a_newer_one_is_refused() -> None:
    assert new_node()["v"] == NODE_VERSION and new_job("j")["v"] == JOB_VERSION
    with pytest.raises(StateVersionError, match="newer"):
        load_node({**new_node(), "v": NODE_VERSION + 1})
    with pytest.raises(ValueError):
        load_node({**new_node(), "state": "sleeping"})


def test_a_job_record_of_version_1_has_its_waiting_failure_moved_to_the_list() -> None:
    old = {"job": "j", "status": "failed", "attempt": 2, "nodes": NODES, "scheduler": "sim", "checkpoint": None,
           "failures": [], "node_faults": {}, "retries": {"transient": 0, "user": 0, "unknown": 0},
           "pending": {"kind": "failure", "attempt": 2, "ts": T0, "deadline_ts": T0 + GRACE, "deadline_wall": 99.0}}
    h = load_job(old)
    assert h["v"] == JOB_VERSION and h["pending"] is None and h["decided"] == []
    assert h["waiting"] == [{"attempt": 2, "ts": T0, "deadline_ts": T0 + GRACE, "deadline_wall": 99.0}]


def test_a_failure_is_ticked_when_the_watermark_or_the_wall_clock_ends_its_grace() -> None:
    core = _core()
    core.handle(job_event("j", "started", T0, nodes=NODES), 1000.0)
    d = core.handle(job_event("j", "failed", T0 + 10, nodes=NODES, exit_code=1, reason="exit code 1"), 1000.0)
    assert d.verdicts == [] and core.schedule.jobs == {"j": (T0 + 10 + GRACE, 1000.0 + WAIT)}
    assert core.due_job_ticks(T0 + 10 + GRACE - 0.1, 1000.0 + WAIT - 0.1) == []
    [tick] = core.due_job_ticks(T0 + 10 + GRACE, 1001.0)
    assert (tick.job, tick.kind, tick.ts) == ("j", "tick", T0 + 10 + GRACE)
    assert core.schedule.jobs == {}
    [v] = core.handle(tick, 1001.0).verdicts
    assert v.ts == T0 + 10 + GRACE  # stamped with the grace's end, whichever clock woke it
    # the wall clock alone ends a grace when telemetry stalls
    core.handle(job_event("j", "started", T0 + 20, nodes=NODES, attempt=2), 1002.0)
    core.handle(job_event("j", "failed", T0 + 30, nodes=NODES, attempt=2, exit_code=1), 1002.0)
    assert [t.job for t in core.due_job_ticks(0.0, 1002.0 + WAIT)] == ["j"]


def test_a_new_correlator_over_the_same_stores_resumes_the_schedule() -> None:
    jobs: dict = {}
    core = _core(jobs=jobs)
    core.handle(job_event("j", "started", T0, nodes=NODES), 1000.0)
    core.handle(job_event("j", "failed", T0 + 10, nodes=NODES, exit_code=1), 1000.0)
    again = _core(jobs=jobs)
    assert again.schedule.jobs == {}
    again.resume()
    assert again.schedule.jobs == core.schedule.jobs


def test_a_rule_that_fails_leaves_the_stored_state_as_it_was(monkeypatch) -> None:
    nodes: dict = {}
    core = _core(nodes=nodes)
    core.handle(job_event("j", "started", T0, nodes=NODES), 1000.0)
    for n in core.handle(job_event("j", "started", T0, nodes=NODES), 1000.0).node_notices:
        core.handle(n, 1000.0)
    before = repr(nodes["node-0001"])

    def broken(h, a, cfg):
        h["state"] = "isolated"
        h["jobs"].clear()
        raise RuntimeError("a bug in a rule")

    monkeypatch.setattr(policy, "node_on_anomaly", broken)
    with pytest.raises(RuntimeError):
        core.handle(critical_gpu_lost("node-0001", T0 + 5), 1000.0)
    assert repr(nodes["node-0001"]) == before


def test_the_caller_hears_of_each_change_of_a_nodes_state_once() -> None:
    seen: list[tuple[str, str]] = []
    core = Correlator(PolicySettings(), NetworkSettings(), on_node_state=lambda n, st, h: seen.append((n, st)))
    core.handle(critical_gpu_lost("node-0001", T0), T0)
    core.handle(critical_gpu_lost("node-0001", T0 + 1), T0)
    assert seen == [("node-0001", "isolated")]
    h = core.node("node-0001")
    assert h is not None and h["v"] == NODE_VERSION


def test_a_move_waiting_for_a_checkpoint_stays_scheduled_through_the_jobs_other_events() -> None:
    from schemas import JobEvent, JobEventKind, JobNotice

    core = Correlator(PolicySettings(checkpoint_deadline_s=60.0), NetworkSettings())
    core.handle(JobEvent(ts=T0, job="j", event=JobEventKind.started, nodes=["n1", "n2"]), wall_now=1000.0)
    core.handle(JobNotice(ts=T0 + 5, job="j", node="n2", kind="node_degrading", fault_class="node_degrading",
                          incident="inc"), wall_now=1000.0)
    assert core.schedule.jobs == {"j": (T0 + 65, 1060.0)}
    # our own request and the job's progress come back meanwhile: the deadline stays due
    core.handle(JobEvent(ts=T0 + 6, job="j", event=JobEventKind.checkpoint_requested, checkpoint_deadline=T0 + 65),
                wall_now=1001.0)
    core.handle(JobEvent(ts=T0 + 7, job="j", event=JobEventKind.progress, step=10), wall_now=1002.0)
    assert core.schedule.jobs == {"j": (T0 + 65, 1060.0)}
    [tick] = core.due_job_ticks(mark=T0 + 8, wall_now=1060.0)
    d = core.handle(tick, wall_now=1060.0)
    assert [a.action.value for v in d.verdicts for a in v.actions] == ["requeue"]
    assert core.schedule.jobs == {}


def _port_anomaly(node: str, ts: float, switch: str = "leaf-01") -> Anomaly:
    return Anomaly(ts=ts, id=f"p-{node}-{ts}", detector="fabric_model", subject_type="port",
                   subject=f"{node}/mlx5_0/1", node=node, kind="port_errors", fault_class=FaultClass.node_network,
                   score=9.0, severity=Severity.warning, evidence={"switch": switch, "port": "mlx5_0/1"})


def test_a_switch_tick_waits_for_the_neighbours_anomalies_still_in_flight() -> None:
    """The race of a loaded worker: the fabric's watermark is far past a lone node's hold,
    but the anomalies of two neighbours under the same leaf are still on their way through
    the node track.  Bounded by what is in flight, the tick waits for them, and the leaf
    is blamed instead of the first node alone; unbounded, the first node is blamed."""

    def run(bounded: bool) -> tuple[list, list]:
        core = Correlator(PolicySettings(), NetworkSettings(hold_s=60.0, switch_min_nodes=3))
        flight = InFlight(max_wait_s=30.0)
        found = [_port_anomaly(n, T0 + k * 5) for k, n in enumerate(["n1", "n2", "n3"])]
        for a in found:
            flight.sent(a.id, a.ts, wall=100.0)
        verdicts, notices = [], []

        def through_node_track(a: Anomaly) -> None:
            for sw in core.handle(a, 1000.0).switch_notices:
                d = core.handle(sw, 1000.0)
                verdicts.extend(d.verdicts)
                notices.extend(d.node_notices)
            flight.done(a.id)

        through_node_track(found[0])
        watermark = T0 + 200.0  # every partition's samples are detected far past the hold
        mark = flight.bound(watermark, wall=101.0) if bounded else watermark
        for tick in core.due_switch_ticks(mark):
            d = core.handle(tick, 1000.0)
            verdicts.extend(d.verdicts)
            notices.extend(d.node_notices)
        for a in found[1:]:
            through_node_track(a)
        return verdicts, notices

    verdicts, notices = run(bounded=True)
    assert [(v.scope, v.subject) for v in verdicts] == [("switch", "leaf-01")]
    assert not [n for n in notices if n.kind == "network_fault"]
    verdicts, notices = run(bounded=False)
    assert [(n.kind, n.node) for n in notices if n.kind == "network_fault"] == [("network_fault", "n1")]


def test_in_flight_holds_a_mark_below_its_oldest_anomaly_until_done_landed_elsewhere_or_expired() -> None:
    flight = InFlight(max_wait_s=30.0)
    assert flight.floor(0.0) is None and flight.bound(T0 + 100, 0.0) == T0 + 100
    flight.sent("a", T0 + 10, wall=0.0)
    flight.sent("b", T0 + 20, wall=1.0)
    flight.sent("b", T0 + 20, wall=2.0)  # redelivered: two copies, each correlated once
    assert len(flight) == 3
    assert flight.floor(5.0) == T0 + 10
    mark = flight.bound(T0 + 100, 5.0)
    assert mark < T0 + 10 and mark == pytest.approx(T0 + 10)
    assert flight.bound(T0 + 5, 5.0) == T0 + 5  # a mark below what is in flight is kept
    flight.done("a")
    assert flight.floor(5.0) == T0 + 20
    flight.landed("b", mine=False)  # one copy is read by another worker's node track
    assert flight.floor(5.0) == T0 + 20
    flight.done("b")
    assert flight.floor(5.0) is None and len(flight) == 0
    flight.done("b")  # a redelivery of one already done changes nothing
    # one never done (dead-lettered, or its partition moved) stops holding after max_wait_s
    flight.sent("c", T0 + 30, wall=10.0)
    flight.sent("d", T0 + 40, wall=20.0)
    flight.landed("d", mine=True)
    assert flight.floor(39.9) == T0 + 30
    assert flight.floor(40.0) == T0 + 40 and flight.expired == 1
    assert flight.floor(50.0) is None and flight.expired == 2
