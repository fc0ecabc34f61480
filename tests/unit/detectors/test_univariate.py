"""UnivariateDetector: streaming anomaly likelihood over many series."""

from __future__ import annotations

import pickle

import numpy as np
import pytest

from detectors import UnivariateDetector


def _noise(n=3, t=600, seed=1):
    return np.random.default_rng(seed).normal(50.0, 2.0, (n, t))


def test_warmup_scores_zero():
    det = UnivariateDetector(warmup=100)
    x = _noise(t=99)
    x[:, -1] = 1e6  # a huge spike, but still in warm-up
    assert np.all(det.run(x) == 0.0)
    assert det.findings() == []


def test_spike_scores_high_and_stationary_noise_stays_low():
    det = UnivariateDetector()
    x = _noise()
    x[1, 500] = 50.0 + 2.0 * 12  # a 12-sigma spike on series 1
    s = det.run(x)
    assert s[1, 500] > 0.5
    assert s[1, 500] == s.max()
    quiet = np.delete(s, 500, axis=1)
    assert quiet.max() < det.threshold  # no step of plain noise reaches the decision rule
    assert np.all((s >= 0.0) & (s <= 1.0))


def test_spike_is_a_finding_with_evidence():
    det = UnivariateDetector(kind="gpu_temp", fault_class="gpu_hardware", severity="info")
    x = _noise()
    det.run(x[:, :500])
    scores = det.update(x[:, 500] + np.array([0.0, 30.0, 0.0]))
    [f] = det.findings(scores)
    assert (f.index, f.gpu, f.kind, f.fault_class) == (1, None, "gpu_temp", "gpu_hardware")
    assert f.severity in ("info", "critical")
    assert f.evidence["z_point"] > 10 and 0 < f.evidence["p_value"] < 1e-5
    assert f.evidence["baseline_mean"] == pytest.approx(50.0, abs=0.5)


def test_level_shift_is_flagged_once_not_on_every_step():
    det = UnivariateDetector(relearn_z=3.0, relearn_after=5)
    x = _noise(n=1, t=900)
    x[0, 500:] += 40.0  # a lasting 20-sigma shift
    s = det.run(x)[0]
    assert s[500] > det.threshold
    assert (s[501:] >= s[500]).sum() == 0  # the onset carries the highest score
    assert (s[560:] >= det.threshold).sum() < 5  # and the new level is learned
    assert det.relearned_[0] >= 1


def test_nan_scores_zero_and_leaves_state_untouched():
    x = _noise(n=2, t=400)
    a, b = UnivariateDetector(), UnivariateDetector()
    a.run(x[:, :300])
    b.run(x[:, :300])
    gap = np.full(2, np.nan)
    gap[1] = np.inf
    assert np.all(b.update(gap) == 0.0)
    for k in ("mu_", "var_", "count_", "seen_", "peak_", "short_"):
        np.testing.assert_array_equal(getattr(a, k), getattr(b, k))
    np.testing.assert_array_equal(a.run(x[:, 300:]), b.run(x[:, 300:]))


def test_nan_in_one_series_does_not_touch_the_others():
    x = _noise(n=2, t=400)
    y = x.copy()
    y[0, ::7] = np.nan
    s_x = UnivariateDetector().run(x)
    s_y = UnivariateDetector().run(y)
    np.testing.assert_array_equal(s_x[1], s_y[1])
    assert np.all(s_y[0, ::7] == 0.0) and np.all(np.isfinite(s_y))


def test_vectorised_equals_one_series_at_a_time():
    rng = np.random.default_rng(4)
    x = np.cumsum(rng.normal(0, 1, (4, 700)), axis=1)
    x[2, 450] += 40
    x[3, 300:] += 25
    x[0, 100:110] = np.nan
    together = UnivariateDetector(short_window=3, relearn_after=5).run(x)
    for i in range(4):
        alone = UnivariateDetector(short_window=3, relearn_after=5).run(x[i:i + 1])
        np.testing.assert_allclose(together[i], alone[0], rtol=0, atol=1e-12)


def test_score_replays_the_window_without_touching_streaming_state():
    det = UnivariateDetector()
    x = _noise(t=300)
    x[0, -1] += 30
    streamed = det.run(x)[:, -1]
    fresh = UnivariateDetector()
    np.testing.assert_array_equal(fresh.score(x), streamed)
    assert fresh.n_series_ is None
    assert [f.index for f in fresh.detect(x)] == [0]
    assert pickle.loads(pickle.dumps(det)).n_series_ == 3


def test_update_with_another_number_of_series_raises_until_reset():
    det = UnivariateDetector()
    det.update(np.zeros(3))
    with pytest.raises(ValueError, match="shape"):
        det.update(np.zeros(4))
    det.reset()
    assert det.update(np.zeros(4)).shape == (4,)
    with pytest.raises(ValueError, match="shape"):
        det.update(np.zeros((2, 2)))


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("long_window", 1),
        ("short_window", 0),
        ("short_window", 600),  # more than half of long_window
        ("quiet_window", 0),
        ("repeat_factor", 1.5),
        ("warmup", 1),
        ("relearn_z", 0.0),
        ("relearn_after", -1),
        ("decades", float("nan")),
        ("threshold", 0.0),
        ("critical", 2.0),
        ("kind", ""),
        ("fault_class", "bogus"),
        ("severity", "fatal"),
    ],
)
def test_invalid_parameter_raises_naming_it(name, value):
    with pytest.raises(ValueError, match=name):
        UnivariateDetector(**{name: value})


# ------------------------------------------------------------------------------ subsets and growth


@pytest.mark.parametrize("params", [{}, {"short_window": 3, "relearn_z": 3.0, "relearn_after": 5}])
def test_an_update_of_some_rows_equals_a_full_update_with_nan_elsewhere(params):
    rng = np.random.default_rng(7)
    x = np.cumsum(rng.normal(0, 1, (12, 500)), axis=1)
    x[4, 300:] += 50  # a level shift
    x[9, 250] += 40  # a spike
    x[2, ::11] = np.nan
    full, part = UnivariateDetector(warmup=20, **params), UnivariateDetector(warmup=20, **params)
    part.grow(12)
    for t in range(x.shape[1]):
        rows = rng.permutation(12)[: rng.integers(0, 13)]  # any subset, in any order
        v = np.full(12, np.nan)
        v[rows] = x[rows, t]
        np.testing.assert_array_equal(part.update_rows(rows, x[rows, t]), full.update(v)[rows])
        expected = [(f.index, f.score, f.severity, f.evidence) for f in full.findings()]
        got = sorted(part.findings(), key=lambda f: f.index)  # in the order of rows
        assert [(f.index, f.score, f.severity, f.evidence) for f in got] == expected
    for k in UnivariateDetector._STATE:
        np.testing.assert_array_equal(getattr(part, k), getattr(full, k))
    assert full.findings(full.update(x[:, -1] + 100.0))  # the comparison saw findings


def test_min_score_leaves_state_and_scores_from_it_up_unchanged():
    rng = np.random.default_rng(8)
    x = rng.normal(10.0, 1.0, (20, 400))
    x[rng.random(x.shape) < 0.01] += 8.0  # a sprinkle of spikes
    exact, fast = UnivariateDetector(warmup=30), UnivariateDetector(warmup=30)
    exact.grow(20), fast.grow(20)
    rows = np.arange(20)
    hits = 0
    for t in range(x.shape[1]):
        s = exact.update_rows(rows, x[:, t])
        f = fast.update_rows(rows, x[:, t], min_score=exact.threshold)
        high = s >= exact.threshold
        hits += high.sum()
        np.testing.assert_array_equal(f[high], s[high])
        assert np.all(f[~high] < exact.threshold)
        assert [(a.index, a.score, a.evidence) for a in fast.findings()] == \
            [(a.index, a.score, a.evidence) for a in exact.findings()]
    assert hits > 0
    for k in UnivariateDetector._STATE:
        np.testing.assert_array_equal(getattr(fast, k), getattr(exact, k))


def test_growth_keeps_the_state_and_new_rows_start_in_warmup():
    x = _noise(n=5, t=400)
    grown, three, two = UnivariateDetector(), UnivariateDetector(), UnivariateDetector()
    grown.run(x[:3, :200])
    three.run(x[:3, :200])
    grown.grow(5)
    assert grown.n_series_ == 5
    for k in UnivariateDetector._STATE:  # the old rows' state, untouched
        np.testing.assert_array_equal(getattr(grown, k)[:3], getattr(three, k))
    after = grown.run(x[:, 200:])
    np.testing.assert_array_equal(after[:3], three.run(x[:3, 200:]))
    np.testing.assert_array_equal(after[3:], two.run(x[3:, 200:]))  # as if new
    assert np.all(after[3:, : grown.warmup - 1] == 0.0)
    with pytest.raises(ValueError, match="n must be at least"):
        grown.grow(4)


def test_grow_before_any_update_builds_the_state_and_reset_rows_forgets_some():
    det = UnivariateDetector(warmup=10)
    det.grow(3)
    assert det.n_series_ == 3 and det.state_nbytes() > 0
    x = _noise(n=3, t=100)
    det.run(x)
    det.reset_rows(np.array([1]))
    assert det.seen_[1] == 0 and det.seen_[0] == 100 and det.seen_[2] == 100
    fresh = UnivariateDetector(warmup=10)
    np.testing.assert_array_equal(det.run(x)[1], fresh.run(x[1:2])[0])


def test_update_rows_checks_its_rows():
    det = UnivariateDetector()
    with pytest.raises(ValueError, match="rows must lie"):
        det.update_rows(np.array([0]), np.array([1.0]))  # no series yet: grow first
    det.grow(4)
    with pytest.raises(ValueError, match="rows must lie"):
        det.update_rows(np.array([4]), np.array([1.0]))
    with pytest.raises(ValueError, match="values must have shape"):
        det.update_rows(np.array([0, 1]), np.array([1.0]))
    with pytest.raises(ValueError, match="rows must be a integer"):
        det.update_rows(np.array([0.5]), np.array([1.0]))
    assert det.update_rows(np.array([], dtype=np.int64), np.array([])).shape == (0,)
    assert det.findings() == []
