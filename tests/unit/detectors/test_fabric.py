"""The fabric port model: ECOD scored against a frozen reference, and the calibrated flag."""

from __future__ import annotations

import numpy as np
import pytest
from pyod.models.ecod import ECOD

from detectors.fabric import FEATURES, PortModel, ReferenceECOD


def _healthy(rng: np.random.Generator, n: int) -> np.ndarray:
    # log1p-compressed rates: mostly zero error features, traffic-driven waits
    x = np.zeros((n, len(FEATURES)))
    x[:, 0] = np.log1p(rng.poisson(0.05, n))          # stray symbol errors
    x[:, 5] = np.log1p(rng.gamma(2.0, 3.0, n))        # wait per MB
    x[:, 6] = np.log1p(rng.exponential(0.01, n))      # receive errors per GB
    return x


def test_one_row_at_a_time_is_exactly_pyods_ecod() -> None:
    rng = np.random.default_rng(3)
    train = _healthy(rng, 3000)
    ours = ReferenceECOD().fit(train)
    theirs = ECOD().fit(train)
    rows = np.vstack([_healthy(rng, 40), _healthy(rng, 10) + np.array([3.0, 1.0, 0, 2.0, 0, 0, 1.5])])
    for r in rows:
        assert ours.decision_function(r[None, :])[0] == pytest.approx(theirs.decision_function(r[None, :])[0], rel=1e-9)


def test_a_batch_scores_each_row_as_if_alone() -> None:
    rng = np.random.default_rng(4)
    ours = ReferenceECOD().fit(_healthy(rng, 2000))
    batch = np.vstack([_healthy(rng, 30), np.tile([4.0, 2.0, 0, 3.0, 0, 0, 2.0], (30, 1))])
    together = ours.decision_function(batch)
    alone = np.array([ours.decision_function(r[None, :])[0] for r in batch])
    np.testing.assert_allclose(together, alone)
    # thirty identical faulty ports do not dilute each other: each scores as high as one alone
    assert together[30:].min() > np.quantile(together[:30], 0.99)


def test_unfitted_and_wrong_shape_are_refused() -> None:
    with pytest.raises(RuntimeError, match="not fitted"):
        ReferenceECOD().decision_function(np.zeros((1, len(FEATURES))))
    m = ReferenceECOD().fit(_healthy(np.random.default_rng(5), 200))
    with pytest.raises(ValueError, match="X must be"):
        m.decision_function(np.zeros((2, 3)))


def test_port_model_flags_a_failing_port_not_healthy_ones() -> None:
    rng = np.random.default_rng(6)
    model = PortModel("ecod").fit(_healthy(rng, 5000))
    healthy = _healthy(rng, 2000)
    failing = _healthy(rng, 5)
    failing[:, 0] = np.log1p(50.0)  # 50 symbol errors per second
    failing[:, 1] = np.log1p(0.5)   # and link recoveries
    _, flags = model.flag(np.vstack([healthy, failing]))
    flagged = {f.index for f in flags}
    assert set(range(2000, 2005)) <= flagged
    assert len(flagged - set(range(2000, 2005))) <= 4  # at most 0.2% of healthy ports
    assert "symbol_errors" in flags[-1].features
