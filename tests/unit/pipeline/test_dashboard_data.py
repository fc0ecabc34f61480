"""What the dashboard's header and node page are made of: the GPU history of watched
nodes, the fleet counts and the GPU-hours saved against the manual baseline."""

from __future__ import annotations

import math

import orjson
import pytest

from pipeline.api.history import GpuHistory
from pipeline.api.kpi import expected_human_hours, fleet_counts, saved_vs_manual
from pipeline.detect.glue import decode_gpu

from .builders import gpu_wire


def _sample(node: str, ts: float, temp: float) -> bytes:
    rec = gpu_wire(node, ts, temp=[temp] * 8)
    rec.pop("nvlink_crc", None)  # a GPU without NVLink counters
    return orjson.dumps(rec)


def test_only_watched_nodes_are_recorded_and_a_page_open_watches_for_a_while() -> None:
    now = [1000.0]
    h = GpuHistory(keep=4, max_nodes=2, opened_s=60, clock=lambda: now[0])
    batch = decode_gpu([_sample(n, 500.0 + k, 60.0 + k) for k in range(6) for n in ("a", "b", "c")]).samples
    assert h.record(batch) == 0 and h.of("a")["ts"] == []
    h.watch("a")          # not healthy: recorded until healthy again
    h.opened("b")         # a page opened: recorded for opened_s
    assert h.record(batch) == 12
    a = h.of("a")
    assert a["ts"] == [502.0, 503.0, 504.0, 505.0]  # the last keep samples, in time order
    temp = next(c for c in a["channels"] if c["key"] == "temp")
    assert len(temp["gpus"]) == 8 and temp["gpus"][0] == [62.0, 63.0, 64.0, 65.0]
    assert "nvlink_crc" not in {c["key"] for c in a["channels"]}  # absent: not plotted as zero
    now[0] += 61
    assert h.record(batch) == 6 and "b" not in h.watched  # the opened page's time ran out
    h.unwatch("a")        # healthy again: kept while a page may still look at it
    assert h.watched["a"] == now[0] + 60
    h.watch("c")
    h.record(batch)
    assert set(h.series) == {"a", "c"}  # max_nodes: the longest unrecorded goes first


def test_the_saving_is_the_expected_human_delay_less_the_time_to_act_times_the_gpus() -> None:
    hh = expected_human_hours(2.0, 1.0)
    assert hh == pytest.approx(2.0 * math.exp(0.5))
    verdicts = [{"id": "v1", "ts": 0.0, "nodes": ["n1", "n2"]}, {"id": "v2", "ts": 100.0, "nodes": ["n3"]},
                {"id": "v3", "ts": 0.0, "nodes": ["n4"]}]
    actions = [
        {"verdict_id": "v1", "action": "requeue", "target": "j1", "outcome": "applied", "ts": 36.0},
        {"verdict_id": "v1", "action": "requeue", "target": "j1", "outcome": "applied", "ts": 40.0},  # replayed
        {"verdict_id": "v2", "action": "retry", "target": "j2", "outcome": "dry_run", "ts": 101.0},    # not done
        {"verdict_id": "v3", "action": "isolate", "target": "n4", "outcome": "applied", "ts": 1.0},    # no job wait
    ]
    got = saved_vs_manual(verdicts, actions, human_hours=hh, gpus_per_node=8)
    assert got["recoveries"] == 1
    assert got["gpu_hours"] == pytest.approx(round((hh - 36.0 / 3600) * 2 * 8, 1))


def test_fleet_counts_say_what_is_out_and_why() -> None:
    got = fleet_counts([{"state": "healthy"}, {"state": "isolated", "fault_class": "gpu_hardware"},
                        {"state": "diagnosing", "fault_class": "gpu_hardware"}, {"state": "suspect"},
                        {"state": "failed", "fault_class": None}])
    assert got["total"] == 5 and got["out"] == 3
    assert got["out_by_class"] == {"gpu_hardware": 2, "unknown": 1}
    assert got["by_state"]["suspect"] == 1
    # an isolation the breaker held for a person leaves its node in service
    held = fleet_counts([{"node": "a", "state": "isolated", "fault_class": "gpu_hardware"},
                         {"node": "b", "state": "isolated", "fault_class": "nvlink"}], held=["b"])
    assert held["out"] == 1 and held["out_by_class"] == {"gpu_hardware": 1} and held["held_in_service"] == 1


def test_a_watched_nodes_step_time_is_kept_beside_its_peers_of_the_same_event() -> None:
    h = GpuHistory(keep=3, max_nodes=8, clock=lambda: 0.0)
    steps = {"n1": 1.0, "n2": 1.1, "n3": 0.9, "slow": 2.5}
    assert h.record_steps("j", 10.0, steps) == 0  # nobody watched
    h.watch("slow")
    for k in range(4):
        assert h.record_steps("j", 10.0 + k, {**steps, "slow": 2.5 + k}) == 1
    assert h.record_steps("j", 20.0, {"slow": 3.0}) == 0  # no peers to compare with
    got = h.of("slow")["steps"]
    assert got["ts"] == [11.0, 12.0, 13.0] and got["node"] == [3.5, 4.5, 5.5]  # the last keep
    assert got["peer_median"] == [1.0] * 3 and got["peer_min"] == [0.9] * 3 and got["peer_max"] == [1.1] * 3
    assert got["job"] == ["j"] * 3
    assert h.of("n1")["steps"]["ts"] == []
