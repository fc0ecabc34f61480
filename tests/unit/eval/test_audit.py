"""The API server's audit log read as the backend's request log, and judged by the checker.

The events are a real kube-apiserver's (tests/fixtures/k8s-audit/README.md says where they
come from); the planted faults are made from copies of its own events.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from pipeline.eval.audit import AuditLog, requests_from_audit, wall_of
from pipeline.eval.groundtruth import InjectedFault, blocked_drains, check

FIXTURE = Path(__file__).resolve().parents[2] / "fixtures" / "k8s-audit" / "chaos-run.jsonl"
FAULTY = ["ck-78fc6-00", "ck-78fc6-02", "ck-78fc6-03"]
HEALTHY = "ck-78fc6-07"
SA = "system:serviceaccount:fleetmedic:fleetmedic"


@pytest.fixture()
def events() -> list[dict]:
    return AuditLog.read(FIXTURE).events


def _faults(events: list[dict]) -> list[InjectedFault]:
    """Each faulty node struck once, before anything was done to it."""
    first = min(wall_of(e, "requestReceivedTimestamp") for e in events)
    return [InjectedFault("xid_79", n, first, True) for n in FAULTY]


def _ours(e: dict, resource: str, name_part: str, sub: str | None = None) -> bool:
    r = e["objectRef"]
    return ((e.get("impersonatedUser") or {}).get("username") == SA and r.get("resource") == resource
            and r.get("subresource") == sub and name_part in (r.get("name") or ""))


def test_the_real_log_as_it_is_shows_every_faulty_node_cordoned_once_and_the_budget_respected(events) -> None:
    entries = requests_from_audit(events)
    cordons = sorted(r["target"] for r in entries if r["action"] == "isolate" and r["changed"])
    assert cordons == FAULTY
    # one drain effect per node, though the log holds many eviction calls
    drains = sorted(r["target"] for r in entries if r["action"] == "drain" and r["changed"])
    assert drains == FAULTY
    assert sorted(r["target"] for r in entries if r["action"] == "diagnose") == FAULTY
    assert all(r["key"] for r in entries if r["action"] in ("isolate", "diagnose"))  # the verdict id
    report = check(entries, _faults(events))
    assert report["effects_lost"] == 0 and report["duplicate_effects"] == 0
    assert report["healthy_nodes_touched"] == []
    refused = blocked_drains(entries)
    assert refused == {"blocked": ["ck-78fc6-02", "ck-78fc6-03"], "not_done": []}


def test_only_fleetmedic_s_requests_are_entries(events) -> None:
    """The admin's and the controllers' writes shape the state but are not effects."""
    entries = requests_from_audit(events)
    assert {r["target"] for r in entries} == set(FAULTY)
    assert requests_from_audit(events, actor="system:serviceaccount:other:other") == []


def test_a_planted_duplicate_loss_healthy_touch_and_drain_never_done_are_all_reported(events) -> None:
    planted = copy.deepcopy(events)
    # a loss: the cordon of -03 never reached the API server
    planted = [e for e in planted if not _ours(e, "nodes", "ck-78fc6-03")]
    # a duplicate: a second diagnostics Job for -00 under another verdict, same incident
    job = copy.deepcopy(next(e for e in planted if _ours(e, "jobs", "ck-78fc6-00")))
    job["objectRef"]["name"] += "-again"
    job["requestObject"]["metadata"]["annotations"]["fleetmedic.dev/verdict"] = "another-verdict"
    planted.append(job)
    # a healthy node touched: -00's cordon, made to -07
    cordon = copy.deepcopy(next(e for e in planted if _ours(e, "nodes", "ck-78fc6-00")))
    cordon["objectRef"]["name"] = HEALTHY
    planted.append(cordon)
    # a drain never done: -02's granted eviction removed
    planted = [e for e in planted
               if not (_ours(e, "pods", "ck-78fc6-02", "eviction") and e["responseStatus"]["code"] == 201)]

    entries = requests_from_audit(planted)
    report = check(entries, _faults(events))
    assert [m["node"] for m in report["faulty_nodes_not_isolated"]] == ["ck-78fc6-03"]
    assert report["effects_lost"] == 1
    assert report["duplicate_effects"] == 1
    assert report["duplicates"][0]["action"] == "diagnose" and report["duplicates"][0]["target"] == "ck-78fc6-00"
    assert [h["node"] for h in report["healthy_nodes_touched"]] == [HEALTHY]
    assert blocked_drains(entries)["not_done"] == ["ck-78fc6-02"]


def test_a_second_cordon_after_fleetmedic_returned_the_node_is_no_duplicate_but_without_it_is(events) -> None:
    cordon = next(e for e in events if _ours(e, "nodes", "ck-78fc6-00"))
    uncordon = copy.deepcopy(cordon)
    uncordon["requestObject"] = {"metadata": {"annotations": {"fleetmedic.dev/verdict": None,
                                                              "fleetmedic.dev/cordoned": None}},
                                 "spec": {"unschedulable": None, "taints": None}}
    again = copy.deepcopy(cordon)
    returned = requests_from_audit([*events, uncordon, again])
    assert [r["action"] for r in returned if r["target"] == "ck-78fc6-00" and r["action"] in ("isolate", "return")
            and r["changed"]] == ["isolate", "return", "isolate"]
    assert check(returned, _faults(events))["duplicate_effects"] == 0
    # someone else uncordons it; fleetmedic's second cordon for the same fault is a second effect
    admin = copy.deepcopy(uncordon)
    admin.pop("impersonatedUser")
    fought = requests_from_audit([*events, admin, again])
    report = check(fought, _faults(events))
    assert report["duplicate_effects"] == 1 and report["duplicates"][0]["action"] == "isolate"


def test_a_cordon_the_api_server_refused_changes_nothing(events) -> None:
    refused = [copy.deepcopy(e) for e in events]
    for e in refused:
        if _ours(e, "nodes", "ck-78fc6-00"):
            e["responseStatus"] = {"metadata": {}, "status": "Failure", "reason": "Conflict", "code": 409}
    entries = requests_from_audit(refused)
    assert "ck-78fc6-00" not in {r["target"] for r in entries if r["action"] == "isolate" and r["changed"]}
    assert check(entries, _faults(events))["effects_lost"] == 1


def test_lines_that_are_not_json_are_counted_and_rotated_backups_are_read(tmp_path) -> None:
    lines = FIXTURE.read_text().splitlines()
    half = len(lines) // 2
    (tmp_path / "audit-2026-12-05T22-40-00.000.log").write_text("\n".join(lines[:half]) + "\n{not json\n")
    (tmp_path / "audit.log").write_text("\n".join(lines[half:]) + "\n")
    log = AuditLog.read(tmp_path / "audit.log")
    assert log.bad_lines == 1
    assert len(log.events) == len(lines)
    assert [wall_of(e, "stageTimestamp") for e in log.events] == sorted(wall_of(e, "stageTimestamp") for e in log.events)
    since = wall_of(json.loads(lines[half]), "requestReceivedTimestamp")
    assert 0 < len(AuditLog.read(tmp_path / "audit.log", since=since).events) < len(lines)


def test_no_audit_log_is_a_clear_error(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match="deploy/k8s.sh"):
        AuditLog.read(tmp_path / "audit.log")
