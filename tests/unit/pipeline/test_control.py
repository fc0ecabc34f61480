"""The operator's decisions as the control topic holds them: latest record per key wins,
a tombstone ends a decision, the configuration holds until someone switches, and bad
records are skipped without losing the rest."""

from __future__ import annotations

from pipeline.actuate.control import DRY_RUN, HELD, ControlState, dry_run_record, held_record


def _held(key: str, node: str) -> dict:
    return {"schema": "action/1", "ts": 1.0, "verdict_id": "v-1", "action": "isolate", "target": node,
            "backend": "kubernetes", "outcome": "held_by_budget", "key": key, "detail": "circuit breaker"}


def test_the_configuration_holds_until_an_operator_switches_then_the_latest_switch_holds() -> None:
    st = ControlState(default_dry_run=True)
    assert st.dry_run is True
    assert st.dry_run_origin()["set_by"].startswith("configuration")
    off = dry_run_record(False, "alice", "dry-run off", ts=10.0)
    st.apply(DRY_RUN, off.to_json())
    assert st.dry_run is False
    assert st.dry_run_origin() == {"dry_run": False, "set_by": "alice", "at": 10.0, "reason": "dry-run off"}
    st.apply(DRY_RUN, dry_run_record(True, "bob", ts=11.0).to_json())
    assert st.dry_run is True and st.dry_run_origin()["set_by"] == "bob"


def test_a_state_rebuilt_from_the_same_messages_holds_the_same_decisions() -> None:
    msgs = [
        (DRY_RUN, dry_run_record(True, "alice", ts=1.0).to_json()),
        ("held/k1", held_record(_held("k1", "n1"), ts=2.0).to_json()),
        ("held/k2", held_record(_held("k2", "n2"), ts=3.0).to_json()),
        ("held/k1", None),  # approved: a tombstone
        (DRY_RUN, dry_run_record(False, "bob", ts=4.0).to_json()),
        (DRY_RUN, dry_run_record(True, "carol", ts=5.0).to_json()),
    ]
    a, b = ControlState(), ControlState()
    for k, v in msgs:
        a.apply(k, v)
    # compaction keeps only each key's last message; the state is the same
    last = {k: v for k, v in msgs}
    for k, v in last.items():
        b.apply(k, v)
    for st in (a, b):
        assert st.dry_run is True and st.dry_run_origin()["set_by"] == "carol"
        assert list(st.held()) == ["k2"]
        assert st.held()["k2"]["target"] == "n2"


def test_bad_records_are_skipped_and_counted_and_the_rest_kept() -> None:
    st = ControlState()
    st.apply(DRY_RUN, dry_run_record(True, "alice").to_json())
    st.apply(DRY_RUN, b"{not json")
    st.apply(DRY_RUN, b'{"schema": "control/1", "ts": 1, "key": "dry_run", "value": {"enabled": false}}')  # no who
    st.apply("held/x", dry_run_record(False, "mallory").to_json())  # its key is not the message key
    st.apply("other", b'{"schema": "control/1", "ts": 1, "key": "other", "value": {}, "who": "x"}')  # unknown key
    assert st.skipped == 4
    assert st.dry_run is True and st.held() == {}


def test_a_held_record_is_keyed_by_the_actions_idempotency_key() -> None:
    r = held_record(_held("v-1:isolate:n1", "n1"))
    assert r.key == HELD + "v-1:isolate:n1"
    st = ControlState()
    st.apply(r.key, r.to_json())
    assert st.held() == {"v-1:isolate:n1": _held("v-1:isolate:n1", "n1")}
