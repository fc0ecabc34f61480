"""The chaos checker judges the backend's own log; planted faults in a log must be found."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from pipeline.eval.chaos import WINDOWS, kill_plan
from pipeline.eval.groundtruth import InjectedFault, blocked_drains, check, faults_of
from pipeline.sim.cluster import CHAOS_KINDS, HARDWARE_KINDS, Cluster, Fault, SimConfig, demo_faults


def req(t, key, action, target, changed=True, **before):
    return {"t": t, "key": key, "action": action, "target": target, "params": {}, "changed": changed,
            "before": before}


FAULTS = [InjectedFault("xid79", "n1", 10.0, True), InjectedFault("ecc_dbe", "n2", 20.0, True),
          InjectedFault("user_bug", None, 30.0, False)]


def clean_log():
    return [
        req(11, "k1", "isolate", "n1", cordoned=False), req(11, "k2", "drain", "n1", cordoned=True),
        req(11, "k3", "requeue", "j1", attempt=1, status="failed"),
        req(12, "k1", "isolate", "n1", changed=False, cordoned=True),  # the same key again: no effect
        req(21, "k4", "isolate", "n2", cordoned=False),
        req(31, "k5", "retry", "j2", attempt=1, status="failed"), req(40, "k6", "stop", "j2", attempt=2),
    ]


def test_a_clean_log_reports_no_loss_no_duplicate_and_no_healthy_node_touched() -> None:
    r = check(clean_log(), FAULTS)
    assert (r["effects_lost"], r["duplicate_effects"], r["healthy_nodes_touched"]) == (0, 0, [])
    assert r["faulty_nodes"] == 2 and r["job_moves"] == {"j1": [1], "j2": [1]}


def test_a_planted_duplicate_and_a_planted_loss_are_both_reported() -> None:
    log = [r for r in clean_log() if r["target"] != "n2"]  # n2's isolation is lost
    # the same job moved twice from one attempt, and n1 cordoned again under its fault,
    # each under a key of its own
    log += [req(13, "k7", "requeue", "j1", attempt=1, status="failed"), req(14, "k8", "isolate", "n1", cordoned=False)]
    r = check(log, FAULTS)
    assert r["effects_lost"] == 1 and [m["node"] for m in r["faulty_nodes_not_isolated"]] == ["n2"]
    assert r["duplicate_effects"] == 2
    assert {(d["action"], d["target"]) for d in r["duplicates"]} == {("requeue", "j1"), ("isolate", "n1")}
    assert all(len(set(d["keys"])) == 2 for d in r["duplicates"])


def test_a_node_returned_then_cordoned_again_is_not_a_duplicate_but_a_healthy_node_cordoned_is_reported() -> None:
    log = clean_log() + [req(50, "k9", "return", "n1", cordoned=True), req(60, "k10", "isolate", "n1", cordoned=False),
                         req(61, "k11", "isolate", "n7", cordoned=False)]
    r = check(log, FAULTS)
    assert r["duplicate_effects"] == 0
    assert [h["node"] for h in r["healthy_nodes_touched"]] == ["n7"]


def test_an_isolation_the_breaker_held_explains_a_node_left_in_service() -> None:
    log = [r for r in clean_log() if r["target"] != "n2"]
    held = [{"action": "isolate", "target": "n2", "outcome": "held_by_budget", "detail": "3 of 3 used"}]
    r = check(log, FAULTS, held)
    assert r["effects_lost"] == 0
    assert r["faulty_nodes_not_isolated"][0]["explained_by"].startswith("breaker")


def test_the_simulated_backend_logs_every_request_with_its_effect() -> None:
    c = Cluster(SimConfig(nodes=4, speed=1.0, duration=1e9, seed=1, faults="none"), t0=1_800_000_000.0)
    f = Fault(kind="xid79", at=5.0)
    c.faults, c.pending_faults = [f], [f]
    for _ in range(10):
        c.tick()
    assert f.applied_ts is not None
    c.act({"key": "a", "verdict_id": "v", "action": "isolate", "target": f.node})
    c.act({"key": "b", "verdict_id": "v2", "action": "isolate", "target": f.node})
    c.act({"key": "c", "verdict_id": "v3", "action": "isolate", "target": "nowhere"})
    assert [(r["key"], r["status"], r["changed"], r["before"]) for r in c.requests] == [
        ("a", 200, True, {"cordoned": False}), ("b", 200, False, {"cordoned": True}), ("c", 404, False, {})]
    r = check(c.requests, faults_of(c, HARDWARE_KINDS))
    assert (r["effects_lost"], r["duplicate_effects"]) == (0, 0)


def drain(wall, target, status):
    return {"wall": wall, "action": "drain", "target": target, "status": status}


def test_a_drain_the_budget_refused_and_never_done_after_is_reported() -> None:
    log = [drain(10, "n1", 429), drain(12, "n2", 429), drain(15, "n1", 429), drain(30, "n1", 200),
           drain(31, "n3", 429)]  # n3 refused outside the window: not this block's
    r = blocked_drains(log, [(9.0, 20.0)])
    assert r == {"blocked": ["n1", "n2"], "not_done": ["n2"]}
    # a success before the refusal does not count as the drain being done
    assert blocked_drains([drain(5, "n4", 200), drain(6, "n4", 429)])["not_done"] == ["n4"]
    assert blocked_drains([drain(5, "n4", 429), drain(6, "n4", 503), drain(9, "n4", 200)])["not_done"] == []


def test_the_kill_plan_strikes_in_every_phase_and_opens_its_windows_where_asked() -> None:
    plan = kill_plan(22, 400.0, 80.0, 60.0, random.Random(1))
    phases = Counter(p for _, p in plan)
    assert sum(phases.values()) == 22
    assert phases["drain_blocked"] == phases["dry_run"] == 2
    assert min(phases[p] for p in ("running", "starting", "rebalance", "outage")) >= 4
    assert sorted(t for t, p in plan if p == "dry_run") == [400.0 * x for x in WINDOWS["dry_run"]]
    assert all(80.0 < t < 141.0 for t, p in plan if p == "outage")
    # a starting kill follows a kill that started a new worker at once
    for i, (_, p) in enumerate(plan):
        if p == "starting":
            assert plan[i - 1][1] in ("running", "outage")
    small = Counter(p for _, p in kill_plan(6, 180.0, 36.0, 30.0, random.Random(2)))
    assert small == Counter({"running": 1, "starting": 1, "rebalance": 1, "outage": 1, "drain_blocked": 1,
                             "dry_run": 1})


def test_the_chaos_fault_plan_has_every_kind_in_turn() -> None:
    plan = demo_faults(SimConfig(nodes=96, speed=3.0, duration=400.0, faults="chaos:60"), random.Random(1))
    kinds = Counter(f.kind for f in plan)
    assert len(plan) == 60 and set(kinds) == set(CHAOS_KINDS) and set(kinds.values()) == {6}
    assert all(130.0 <= f.at <= 950.0 for f in plan) and plan == sorted(plan, key=lambda f: f.at)
    with pytest.raises(ValueError, match="chaos:N"):
        demo_faults(SimConfig(faults="chaos:x"), random.Random(1))
