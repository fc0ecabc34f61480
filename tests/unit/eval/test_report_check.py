"""`pipeline eval --check`: the targets it holds the evaluation to, and what it flags."""

from __future__ import annotations

import copy

import pytest

from pipeline.eval import report


def _ev() -> dict:
    """An evaluation that meets every target."""
    good = {"ettr": 0.995, "gpu_hours_lost": 100.0, "healthy_nodes_isolated": 0, "precursor_false_alarms": 3,
            "needed_human": 5}
    return {
        "hw_recall": 1.0, "hw_precision": 1.0, "false_isolations": 0, "user_errors_blamed_on_hardware": 0,
        "degrading_isolated_before_failure": 1.0, "median_lead_s": 700.0, "quality": {},
        "policies": {"fleetmedic": dict(good), "fleetmedic_checkpoint_now": dict(good, gpu_hours_lost=85.0),
                     "reactive_oracle": dict(good, gpu_hours_lost=100.0, precursor_false_alarms=0)},
        "ratios": {"fleetmedic_over_reactive_oracle": 1.0, "checkpoint_now_over_reactive_oracle": 0.85,
                   "fleetmedic_over_naive_cordon": 0.1, "fleetmedic_over_manual": 0.12},
        "closed_loop": {"precursors": {"figures": [
            {"name": "precursors.hbm3.share", "value": 0.5, "source": "[DRAM] Conclusion 2"},
            {"name": "checkpoint_now.save_seconds", "value": 120.0, "source": "assumption: a synchronous save"}]}},
    }


def test_an_evaluation_that_meets_every_target_passes():
    assert report.check(_ev()) == []


@pytest.mark.parametrize("path,value,needle", [
    (("ratios", "fleetmedic_over_reactive_oracle"), 1.2, "fleetmedic_over_reactive_oracle = 1.2"),
    (("ratios", "checkpoint_now_over_reactive_oracle"), 0.95, "checkpoint_now_over_reactive_oracle = 0.95"),
    (("ratios", "fleetmedic_over_naive_cordon"), 0.5, "fleetmedic_over_naive_cordon"),
    (("policies", "fleetmedic", "ettr"), 0.985, "fleetmedic ettr = 0.985"),
    (("policies", "fleetmedic_checkpoint_now", "ettr"), 0.989, "fleetmedic_checkpoint_now ettr = 0.989"),
    (("policies", "fleetmedic_checkpoint_now", "healthy_nodes_isolated"), 1,
     "fleetmedic_checkpoint_now healthy_nodes_isolated = 1"),
    (("hw_recall",), 0.9, "hw_recall = 0.9"),
])
def test_a_missed_target_is_flagged(path, value, needle):
    ev = _ev()
    cur = ev
    for k in path[:-1]:
        cur = cur[k]
    cur[path[-1]] = value
    missed = report.check(ev)
    assert len(missed) == 1 and needle in missed[0], missed


def test_a_missing_ratio_is_a_miss():
    ev = _ev()
    del ev["ratios"]["checkpoint_now_over_reactive_oracle"]
    assert any("checkpoint_now_over_reactive_oracle = None" in m for m in report.check(ev))


def test_a_precursor_figure_without_a_source_is_flagged():
    ev = _ev()
    ev["closed_loop"]["precursors"]["figures"].append({"name": "precursors.gsp.share", "value": 0.3, "source": ""})
    assert report.check(ev) == ["precursor figure precursors.gsp.share = 0.3 has no source"]
    ev = _ev()
    ev["closed_loop"]["precursors"] = {}
    assert any("precursor figures: none" in m for m in report.check(ev))


def test_the_retired_target_on_manual_handling_is_not_checked():
    ev = _ev()
    ev["ratios"]["fleetmedic_over_manual"] = 0.5  # reported, no longer a target
    assert report.check(ev) == []


def test_each_part_is_checked_when_it_ran():
    closed = {k: v for k, v in _ev().items() if k not in {k for k, _, _ in report.ACCEPTANCE} | {"quality"}}
    assert report.check(closed) == []
    quality = {k: v for k, v in _ev().items() if k not in ("policies", "ratios", "closed_loop")}
    assert report.check(quality) == []
    bad = copy.deepcopy(closed)
    bad["policies"]["fleetmedic"]["ettr"] = 0.9
    assert report.check(bad) == ["fleetmedic ettr = 0.9 (wanted >= 0.99)"]
