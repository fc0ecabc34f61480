"""GPU detectors: hard faults, counter-rate rises, thermal throttling."""

from __future__ import annotations

import numpy as np
import pytest

from detectors import (
    HW_POWER_BRAKE,
    HW_SLOWDOWN,
    HW_THERMAL,
    SW_THERMAL,
    HardFaultDetector,
    RateChangeDetector,
    ThrottleDetector,
    thermal_mask,
)

# -- hard faults -------------------------------------------------------------------


def _batch(n=4, g=8):
    return (np.zeros((n, g), dtype=np.int64), np.zeros((n, g), dtype=bool),
            np.zeros((n, g), dtype=bool))


def test_dbe_increase_is_a_critical_memory_finding():
    dbe, remap, lost = _batch()
    dbe[2, 5] = 1
    [f] = HardFaultDetector().detect(dbe, remap, lost)
    assert (f.kind, f.fault_class, f.severity) == ("ecc_dbe", "gpu_memory", "critical")
    assert (f.index, f.gpu) == (2, 5)
    assert f.evidence == {"dbe_delta": 1.0}


def test_remap_failure_and_lost_gpu():
    dbe, remap, lost = _batch()
    remap[0, 1] = True
    lost[3, 7] = True
    findings = HardFaultDetector().detect(dbe, remap, lost)
    kinds = {(f.kind, f.fault_class, f.index, f.gpu) for f in findings}
    assert kinds == {("row_remap_failure", "gpu_memory", 0, 1), ("gpu_lost", "gpu_hardware", 3, 7)}


def test_hard_fault_score_counts_indicators_and_ignores_missing_readings():
    dbe, remap, lost = _batch()
    dbe = dbe.astype(float)
    dbe[0, 0] = np.nan
    dbe[1, 1], remap[1, 1], lost[1, 1] = 3, True, True
    score = HardFaultDetector().score(dbe, remap, lost)
    assert score[1, 1] == 3.0 and score.sum() == 3.0


def test_negative_dbe_delta_is_rejected():
    dbe, remap, lost = _batch()
    dbe[0, 0] = -2
    with pytest.raises(ValueError, match="ecc_dbe_delta"):
        HardFaultDetector().detect(dbe, remap, lost)


def test_flags_must_be_bool():
    dbe, remap, lost = _batch()
    with pytest.raises(ValueError, match="remap_failure"):
        HardFaultDetector().detect(dbe, remap.astype(int), lost)


# -- counter rate ------------------------------------------------------------------

WINDOW, RECENT = 120, 30


def _rise(rng, n, base_rate, recent_rate, g=1):
    return np.concatenate(
        [rng.poisson(base_rate, (n, WINDOW - RECENT, g)), rng.poisson(recent_rate, (n, RECENT, g))],
        axis=1,
    )


def test_rate_rise_from_0_01_to_0_3_per_second_is_detected():
    det = RateChangeDetector()
    counts = _rise(np.random.default_rng(2), 1000, 0.01, 0.3)  # 1000 seeded windows
    flagged = det.score(counts)[:, 0] > -np.log10(det.alpha)
    # Power of one window: about 9 recent events against about 1 in the baseline is
    # close to what alpha = 1e-4 can resolve; measured 61.0 % (seed 2). A larger
    # rise or a longer recent part is caught almost always (0.5/s: 96 %).
    assert flagged.mean() > 0.5

    first = int(np.flatnonzero(flagged)[0])
    [f] = det.detect(counts[first:first + 1])
    assert (f.kind, f.fault_class, f.index, f.gpu) == ("ecc_sbe_rate", "node_degrading", 0, 0)
    ev = f.evidence
    assert ev["p_value"] < det.alpha and ev["window"] == WINDOW and ev["recent"] == RECENT
    assert ev["recent_rate"] > 10 * ev["baseline_rate"]
    assert f.score == pytest.approx(-np.log10(ev["p_value"]))

    stronger = _rise(np.random.default_rng(3), 1000, 0.01, 0.5)
    assert (det.score(stronger) > -np.log10(det.alpha)).mean() > 0.9


def test_flat_rate_false_positive_rate_is_below_1e_3():
    det = RateChangeDetector()
    counts = np.random.default_rng(7).poisson(0.05, (1000, WINDOW, 8))  # 1000 windows x 8 GPUs
    flagged = det.score(counts) > -np.log10(det.alpha)
    gpu_fpr = flagged.mean()
    window_fpr = flagged.any(axis=1).mean()
    # Measured: 0 of 8000 GPU windows (the exact test keeps it at or below alpha = 1e-4).
    assert gpu_fpr < 1e-3 and window_fpr < 1e-3
    assert len(det.detect(counts)) == int(flagged.sum())


def test_rate_warmup_and_min_events():
    det = RateChangeDetector()
    rng = np.random.default_rng(3)
    short = _rise(rng, 2, 0.0, 2.0)[:, -(2 * RECENT - 1):, :]  # baseline shorter than recent
    assert np.all(det.score(short) == 0.0)
    few = np.zeros((1, WINDOW, 1))
    few[0, -4:, 0] = 1  # four events, all recent: below min_events=5
    assert det.score(few)[0, 0] == 0.0
    few[0, -5:, 0] = 1
    assert det.score(few)[0, 0] > 0.0


def test_only_the_last_window_intervals_count():
    det = RateChangeDetector(window=60, recent=20)
    counts = np.random.default_rng(4).poisson(0.2, (5, 200, 3))
    np.testing.assert_array_equal(det.score(counts), det.score(counts[:, -60:, :]))


def test_missing_intervals_reduce_exposure_instead_of_counting_as_zero():
    det = RateChangeDetector()
    counts = _rise(np.random.default_rng(5), 4, 0.05, 0.4).astype(float)
    gappy = counts.copy()
    gappy[:, :40, :] = np.nan
    np.testing.assert_allclose(det.score(gappy), det.score(counts[:, 40:, :]))


def test_moderate_rise_is_a_warning_and_kind_follows_configuration():
    det = RateChangeDetector(kind="nvlink_error_rate", fault_class="nvlink")
    counts = np.zeros((1, WINDOW, 1))
    counts[0, :90:3, 0] = 1  # 30 baseline events: 1/3 per interval
    counts[0, 90:, 0] = 2  # 60 recent events: 2 per interval, ratio 6
    [f] = det.detect(counts)
    assert (f.kind, f.fault_class, f.severity) == ("nvlink_error_rate", "nvlink", "warning")
    assert f.evidence["rate_ratio"] == pytest.approx(6.0)


@pytest.mark.parametrize("bad", [-1.0, np.inf])
def test_bad_counts_are_rejected(bad):
    counts = np.zeros((1, WINDOW, 1))
    counts[0, 3, 0] = bad
    with pytest.raises(ValueError, match="counts"):
        RateChangeDetector().score(counts)


# -- thermal throttling --------------------------------------------------------------


def test_nvml_throttle_reason_bits():
    assert (HW_SLOWDOWN, SW_THERMAL, HW_THERMAL, HW_POWER_BRAKE) == (0x8, 0x20, 0x40, 0x80)


def test_thermal_mask_selects_thermal_bits_only():
    reasons = np.array([0x0, 0x1, 0x4, SW_THERMAL, HW_THERMAL, HW_SLOWDOWN, HW_POWER_BRAKE,
                        SW_THERMAL | 0x1], dtype=np.uint64)
    np.testing.assert_array_equal(thermal_mask(reasons),
                                  [False, False, False, True, True, False, False, True])
    assert thermal_mask(np.array([HW_SLOWDOWN]), reasons=HW_SLOWDOWN | HW_THERMAL)[0]
    with pytest.raises(ValueError, match="throttle"):
        thermal_mask(np.array([0.5]))


def test_sustained_thermal_throttling_is_reported_with_evidence():
    det = ThrottleDetector(window=60, min_fraction=0.5)
    thermal = np.zeros((3, 100, 4), dtype=bool)
    temp = np.full((3, 100, 4), 70.0)
    thermal[1, -35:, 2] = True  # 35 of the last 60 samples
    temp[1, -35:, 2] = 92.5
    thermal[0, :40, 0] = True  # old throttling outside the window
    thermal[2, -29:, 3] = True  # just below half
    [f] = det.detect(thermal, temp)
    assert (f.kind, f.fault_class, f.severity) == ("thermal_throttle", "node_degrading", "warning")
    assert (f.index, f.gpu) == (1, 2)
    assert f.evidence == {"fraction": pytest.approx(35 / 60), "samples": 60, "max_temp": 92.5}


def test_throttle_needs_bool_flags_and_tolerates_missing_temperatures():
    det = ThrottleDetector(warmup=2)
    with pytest.raises(ValueError, match="bool"):
        det.detect(np.ones((1, 5, 1), dtype=np.int64), np.zeros((1, 5, 1)))
    [f] = det.detect(np.ones((1, 5, 1), dtype=bool), np.full((1, 5, 1), np.nan))
    assert f.evidence["max_temp"] is None
