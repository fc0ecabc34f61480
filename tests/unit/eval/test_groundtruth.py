"""The chaos checker judges the backend's own log; planted faults in a log must be found."""

from __future__ import annotations

from pipeline.eval.groundtruth import InjectedFault, check, faults_of
from pipeline.sim.cluster import HARDWARE_KINDS, Cluster, Fault, SimConfig


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
