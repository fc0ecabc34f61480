"""The count-based entry points give exactly the findings of the window-based ones."""

from __future__ import annotations

import numpy as np
import pytest

from detectors import RateChangeDetector, ThrottleDetector


@pytest.mark.parametrize("seed", range(5))
def test_rate_change_on_window_sums_equals_rate_change_on_windows(seed):
    rng = np.random.default_rng(seed)
    det = RateChangeDetector(window=120, recent=30, alpha=1e-4)
    counts = rng.poisson(0.02, (200, 120, 8)).astype(float)
    counts[:20, -30:, 3] += rng.poisson(0.5, (20, 30))  # a rise on some GPUs
    k_base, k_rec = counts[:, :90].sum(axis=1), counts[:, 90:].sum(axis=1)
    a = [(f.index, f.gpu, f.severity, round(f.score, 9)) for f in det.detect(counts)]
    b = [(f.index, f.gpu, f.severity, round(f.score, 9)) for f in det.detect_sums(k_base, k_rec, 90, 30)]
    assert a == b
    assert len(a) >= 10


def test_rate_change_sums_refuse_negative_counts():
    det = RateChangeDetector()
    with pytest.raises(ValueError, match="non-negative"):
        det.detect_sums(np.array([[-1.0]]), np.array([[5.0]]), 90, 30)


def test_throttle_on_counts_equals_throttle_on_windows():
    rng = np.random.default_rng(3)
    det = ThrottleDetector(window=60, min_fraction=0.5)
    thermal = rng.random((50, 60, 8)) < 0.1
    thermal[5, :, 2] = True
    thermal[9, 20:, 6] = True
    temp = rng.normal(70, 3, (50, 60, 8))
    a = [(f.index, f.gpu, round(f.score, 9)) for f in det.detect(thermal, temp)]
    b = [(f.index, f.gpu, round(f.score, 9)) for f in det.detect_counts(thermal.sum(axis=1), 60, temp.max(axis=1))]
    assert a == b
    assert [(i, g) for i, g, _ in a] == [(5, 2), (9, 6)]


@pytest.mark.parametrize("seed", range(3))
def test_rate_change_p_values_are_scipy_stats_binomial_tail(seed):
    """The rate test's p-value is the conditional binomial test, P(X >= recent count) for
    X ~ Bin(window total, recent share of the readings); computed with scipy.special in
    the detector, checked here against scipy.stats' own binomial distribution."""
    from scipy import stats

    rng = np.random.default_rng(seed)
    det = RateChangeDetector(window=120, recent=30)
    counts = rng.poisson(0.05, (300, 120, 8)).astype(float)
    counts[:40, -30:, :] += rng.poisson(rng.uniform(0.05, 2.0, (40, 1, 8)), (40, 30, 8))
    k_rec, total = counts[:, 90:].sum(axis=1), counts.sum(axis=1)
    active = (k_rec >= 1) & (total >= det.min_events)
    want = np.ones(total.shape)
    want[active] = stats.binom.sf(k_rec[active] - 1, total[active], 30 / 120)
    got = 10.0 ** -det.score(counts)
    assert active.sum() > 500 and (want < 1e-6).sum() > 20  # quiet and raised series both covered
    np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-300)
