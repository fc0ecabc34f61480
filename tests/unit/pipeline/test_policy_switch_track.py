"""The switch track: several nodes under one switch blame the switch; a lone node is its own fault."""

from __future__ import annotations

from pipeline.correlate import policy, state
from pipeline.config import NetworkSettings, PolicySettings
from schemas import ActionName, FaultClass, NodeNotice, SwitchNotice

from .builders import T0

NET = NetworkSettings(switch_min_nodes=3, hold_s=60, window_s=600)


def notice(node: str, ts: float, switch: str = "leaf-03", kind: str = "port_anomaly") -> SwitchNotice:
    return SwitchNotice(ts=ts, switch=switch, node=node, kind=kind, port="mlx5_0/1", anomaly=f"a-{node}-{ts}",
                        anomaly_kind="port_errors")


def test_three_nodes_under_one_switch_give_one_switch_verdict_and_no_node_fault() -> None:
    st = state.new_switch("leaf-03")
    d1 = policy.switch_on_notice(st, notice("n1", T0), NET)
    d2 = policy.switch_on_notice(st, notice("n2", T0 + 10), NET)
    assert not d1.verdicts and not d2.verdicts and not d1.node_notices
    d3 = policy.switch_on_notice(st, notice("n3", T0 + 20), NET)
    [v] = d3.verdicts
    assert (v.scope, v.subject, v.fault_class) == ("switch", "leaf-03", FaultClass.fabric_switch)
    assert [(a.action, a.target, a.params["alert_only"]) for a in v.actions] == [(ActionName.escalate, "leaf-03", True)]
    assert sorted(n.node for n in d3.node_notices) == ["n1", "n2", "n3"]
    assert {n.kind for n in d3.node_notices} == {"fabric_switch"}
    # a fourth node joining later is attributed to the same incident, once
    d4 = policy.switch_on_notice(st, notice("n4", T0 + 30), NET)
    assert not d4.verdicts and [n.node for n in d4.node_notices] == ["n4"]
    assert not policy.switch_on_notice(st, notice("n4", T0 + 40), NET).node_notices
    # held nodes are never reported as node faults afterwards
    tick = policy.switch_on_notice(st, notice("-", T0 + 500, kind="tick"), NET)
    assert not [n for n in tick.node_notices if n.kind == "network_fault"]


def test_a_lone_node_is_its_own_fault_after_the_hold() -> None:
    st = state.new_switch("leaf-03")
    assert not policy.switch_on_notice(st, notice("n1", T0), NET).node_notices
    assert not policy.switch_on_notice(st, notice("-", T0 + 30, kind="tick"), NET).node_notices
    d = policy.switch_on_notice(st, notice("-", T0 + 61, kind="tick"), NET)
    [n] = d.node_notices
    assert (n.kind, n.node) == ("network_fault", "n1") and "only" in n.reason
    assert not d.verdicts


def test_anomalies_spread_over_time_do_not_add_up_to_a_switch_fault() -> None:
    st = state.new_switch("leaf-03")
    policy.switch_on_notice(st, notice("n1", T0), NET)
    policy.switch_on_notice(st, notice("n2", T0 + 700), NET)  # n1's anomaly is out of the window
    d = policy.switch_on_notice(st, notice("n3", T0 + 710), NET)
    assert not d.verdicts


def _health_after(kind: str, enforce: bool):
    h = state.new_node()
    n = NodeNotice(ts=T0, node="n1", kind=kind, job="port_errors", reason="port anomalies on mlx5_0/1 only",
                   signature="a-1")
    return h, policy.node_on_notice(h, n, PolicySettings(), NetworkSettings(enforce=enforce))


def test_network_faults_are_advisory_unless_enforced() -> None:
    h, d = _health_after("network_fault", enforce=False)
    [v] = d.verdicts
    assert [a.action for a in v.actions] == [ActionName.escalate] and v.evidence["advisory"] is True
    assert h["state"] == policy.NodeState.healthy
    h, d = _health_after("network_fault", enforce=True)
    [v] = d.verdicts
    assert [a.action for a in v.actions] == [ActionName.isolate, ActionName.drain, ActionName.diagnose]
    assert v.fault_class is FaultClass.node_network and h["state"] == policy.NodeState.isolated


def test_a_job_failing_under_a_bad_switch_is_not_blamed_nor_its_nodes() -> None:
    from schemas import JobEvent, JobNotice

    cfg = PolicySettings()
    hist = state.new_job("j1")
    policy.job_on_event(hist, JobEvent(ts=T0, job="j1", event="started", nodes=["n1", "n2"]), cfg, T0)
    policy.job_on_notice(hist, JobNotice(ts=T0 + 5, job="j1", node="n1", kind="fabric",
                                         fault_class=FaultClass.fabric_switch, incident="sw-1"), cfg, T0 + 5)
    d = policy.job_on_event(hist, JobEvent(ts=T0 + 10, job="j1", event="failed", nodes=["n1", "n2"], exit_code=1,
                                           reason="NCCL watchdog timeout"), cfg, T0 + 10)
    assert d.verdicts == []  # judged when the grace for node evidence has passed
    [v] = policy.job_on_tick(hist, cfg, T0 + 11, T0 + 10 + cfg.correlation_grace_s).verdicts
    assert v.fault_class is FaultClass.fabric_switch
    assert v.actions[0].action is ActionName.requeue and v.actions[0].params["exclude"] == []


def test_a_notice_from_a_node_far_ahead_does_not_end_another_nodes_hold() -> None:
    """The node track's partitions run apart: n1's second anomaly, 150 s on, can reach the
    switch before n2's and n3's first ones.  It must not end n1's hold (a lone-node fault
    while the neighbours are still on their way); only the tick, which follows the
    fabric's watermark, does, and by then the neighbours are in."""
    st = state.new_switch("leaf-03")
    assert not policy.switch_on_notice(st, notice("n1", T0), NET).node_notices
    d = policy.switch_on_notice(st, notice("n1", T0 + 150), NET)
    assert not d.node_notices and not d.verdicts
    policy.switch_on_notice(st, notice("n2", T0 + 5), NET)
    [v] = policy.switch_on_notice(st, notice("n3", T0 + 10), NET).verdicts
    assert (v.scope, v.subject) == ("switch", "leaf-03")
    # held alone, n1 is decided by the tick that ends its hold, stamped with the hold's end
    st = state.new_switch("leaf-03")
    policy.switch_on_notice(st, notice("n1", T0), NET)
    policy.switch_on_notice(st, notice("n1", T0 + 150), NET)
    assert policy.switch_due(st) == T0 + 60
    [n] = policy.switch_on_notice(st, notice("-", T0 + 60, kind="tick"), NET).node_notices
    assert (n.kind, n.node, n.ts) == ("network_fault", "n1", T0 + 60)
