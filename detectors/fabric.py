"""Learned fabric-port anomaly scoring: features over a short window, a PyOD model.

Features (per port, over the last few samples; see :data:`FEATURES`) are per-second
rates of the error counters and two ratios to traffic, ``log1p``-compressed so that one
burst does not dwarf everything else:

* ``symbol_errors``, ``link_error_recovery``, ``link_downed``, ``rcv_errors``,
  ``xmit_discards``: events per second;
* ``wait_per_mb``: transmit-wait ticks per MB sent (congestion: the port waits for
  credits while sending little);
* ``rcv_err_per_gb``: receive errors per GB received.

:class:`PortModel` fits one of PyOD's unsupervised detectors (HBOS, ECOD, COPOD,
IForest) on rows from ports believed healthy, calibrates a threshold on held-out
healthy rows (a high quantile of their scores, times a margin), and scores many rows
per call.  PyOD's ECOD and COPOD rebuild their empirical CDFs over the whole training
set on every ``decision_function`` call (a sort of every column: about 20 ms per call
on 16,000 rows, whatever the batch size), so ECOD is scored through
:class:`ReferenceECOD`: PyOD fits it, and new rows are ranked against the training
columns sorted once at fit time (a binary search per value).  For one row at a time
that is exactly PyOD's score; a batch is scored as if each row came alone, so the
rows of one batch do not dilute each other's tails (a leaf switch fault flags many
similar ports at once).  Evidence for a flagged row names the features furthest
above the healthy baseline.

Pure: numpy and PyOD only; no I/O.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, cast

import numpy as np

#: Feature names, in column order.
FEATURES = ("symbol_errors", "link_error_recovery", "link_downed", "rcv_errors", "xmit_discards",
            "wait_per_mb", "rcv_err_per_gb")
#: Counter columns the features are computed from, in the order callers supply them.
COUNTERS = ("symbol_errors", "link_error_recovery", "link_downed", "rcv_errors", "xmit_discards",
            "xmit_wait", "xmit_bytes", "rcv_bytes")

MODELS = ("hbos", "ecod", "copod", "iforest")


def port_features(increments: np.ndarray, seconds: np.ndarray) -> np.ndarray:
    """Features of each port from its counter increments over a window.

    Parameters
    ----------
    increments: ``(n, 8, p)`` counter increments over the window, columns as
        :data:`COUNTERS` (negative values, i.e. counter resets, must already be 0).
    seconds: ``(n,)`` window length in seconds (> 0).

    Returns
    -------
    ``(n, p, 7)`` float64 features, columns as :data:`FEATURES`.
    """
    inc = np.asarray(increments, dtype=np.float64)
    if inc.ndim != 3 or inc.shape[1] != len(COUNTERS):
        raise ValueError(f"increments must be (n, {len(COUNTERS)}, p), got {inc.shape}")
    sec = np.maximum(np.asarray(seconds, dtype=np.float64), 1e-9)[:, None]
    rates = inc[:, :5, :] / sec[:, :, None]                       # (n, 5, p)
    sent_mb = inc[:, 6, :] / 1e6
    recv_gb = inc[:, 7, :] / 1e9
    wait_per_mb = inc[:, 5, :] / (sent_mb + 1.0)
    err_per_gb = inc[:, 3, :] / (recv_gb + 1.0)
    feats = np.concatenate([rates, wait_per_mb[:, None, :], err_per_gb[:, None, :]], axis=1)  # (n, 7, p)
    return cast(np.ndarray, np.log1p(np.maximum(feats, 0.0)).transpose(0, 2, 1))


def make_model(name: str, *, seed: int = 0) -> Any:
    """A fresh PyOD detector by name (contamination is not used: we calibrate ourselves)."""
    if name == "hbos":
        from pyod.models.hbos import HBOS

        return HBOS(n_bins=20, alpha=0.1, tol=0.5)
    if name == "ecod":
        return ReferenceECOD()
    if name == "copod":
        from pyod.models.copod import COPOD

        return COPOD()
    if name == "iforest":
        from pyod.models.iforest import IForest

        return IForest(n_estimators=100, random_state=seed)
    raise ValueError(f"unknown model {name!r}; one of {', '.join(MODELS)}")


class ReferenceECOD:
    """PyOD's ECOD (Li et al., 2022) with its reference frozen at fit time.

    ``fit`` runs PyOD's ``ECOD.fit`` and keeps each training column sorted, and the
    sign of its skewness; ``decision_function`` gives each row the ECOD score it would
    get if it were scored alone against the training set: left and right tail
    probabilities ``(#train <= x + 1) / (n + 1)`` and ``(#train >= x + 1) / (n + 1)``
    by binary search, ``-log`` of each, the skew-corrected tail, the largest of the
    three per feature, summed over the features.  O(m log n) per call instead of
    PyOD's O((n + m) log(n + m)).
    """

    def __init__(self) -> None:
        from pyod.models.ecod import ECOD

        self.ecod = ECOD()
        self.sorted: np.ndarray | None = None
        self.skew_sign = np.zeros(0)

    def fit(self, X: np.ndarray) -> ReferenceECOD:
        from pyod.models.ecod import skew  # scipy's, with a constant column's NaN as 0

        x = np.asarray(X, dtype=np.float64)
        self.ecod.fit(x)
        self.sorted = np.sort(x, axis=0)
        self.skew_sign = np.sign(skew(x, axis=0))
        return self

    @property
    def decision_scores_(self) -> np.ndarray:
        return cast(np.ndarray, self.ecod.decision_scores_)

    def decision_function(self, X: np.ndarray) -> np.ndarray:
        if self.sorted is None:
            raise RuntimeError("ReferenceECOD is not fitted")
        x = np.asarray(X, dtype=np.float64)
        if x.ndim != 2 or x.shape[1] != self.sorted.shape[1]:
            raise ValueError(f"X must be (m, {self.sorted.shape[1]}), got {x.shape}")
        n = len(self.sorted)
        below = np.empty(x.shape)
        above = np.empty(x.shape)
        for j in range(x.shape[1]):  # a handful of features: one vectorised search each
            col = self.sorted[:, j]
            below[:, j] = np.searchsorted(col, x[:, j], side="right")
            above[:, j] = n - np.searchsorted(col, x[:, j], side="left")
        u_l = -np.log((below + 1.0) / (n + 1.0))
        u_r = -np.log((above + 1.0) / (n + 1.0))
        s = self.skew_sign
        u_skew = u_l * -np.sign(s - 1) + u_r * np.sign(s + 1)
        return cast(np.ndarray, np.maximum(u_skew, np.maximum(u_l, u_r)).sum(axis=1))


@dataclass
class Flag:
    """One row above the threshold: its score and the features that stand out most."""

    index: int
    score: float
    features: dict[str, float]


class PortModel:
    """A PyOD detector over port features with a calibrated threshold.

    ``quantile`` of held-out healthy scores times ``margin`` is the threshold: with
    healthy training data, rows above it are rare by construction, and ``margin`` keeps
    normal variation of a large fleet from crossing it.
    """

    def __init__(self, name: str = "ecod", *, quantile: float = 0.999, margin: float = 1.5,
                 floor_quantile: float = 0.995, z_gate: float = 8.0, z_min: float = 3.0,
                 seed: int = 0) -> None:
        if name not in MODELS:
            raise ValueError(f"unknown model {name!r}; one of {', '.join(MODELS)}")
        if not 0.5 < quantile < 1:
            raise ValueError(f"quantile must be in (0.5, 1), got {quantile}")
        self.name = name
        self.quantile = quantile
        self.margin = margin
        self.seed = seed
        self.model: Any = None
        self.threshold = np.inf
        self.center = np.zeros(len(FEATURES))
        self.scale = np.ones(len(FEATURES))
        self.fitted_rows = 0
        self.floor_quantile = floor_quantile
        self.z_gate = z_gate
        self.z_min = z_min
        self.floor = np.zeros(len(FEATURES))

    @property
    def ready(self) -> bool:
        return self.model is not None

    def fit(self, rows: np.ndarray) -> PortModel:
        """Fit on healthy rows ``(m, 7)``; a fifth of them calibrate the threshold."""
        x = np.asarray(rows, dtype=np.float64)
        if x.ndim != 2 or x.shape[1] != len(FEATURES) or len(x) < 50:
            raise ValueError(f"need at least 50 rows of {len(FEATURES)} features, got {x.shape}")
        rng = np.random.default_rng(self.seed)
        order = rng.permutation(len(x))
        cut = max(10, len(x) // 5)
        hold, train = x[order[:cut]], x[order[cut:]]
        # The healthy noise floor of each feature (isolated errors, ordinary waits) is
        # taken off first: what is left is excess over what a healthy fleet shows, and a
        # port with a few stray errors no longer looks like one in trouble.
        self.floor = np.quantile(train, self.floor_quantile, axis=0)
        model = make_model(self.name, seed=self.seed)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model.fit(self._excess(train))
            held = model.decision_function(self._excess(hold))
            base = model.decision_function(self._excess(train))
        q = float(np.quantile(np.concatenate([held, base]), self.quantile))
        spread = float(np.quantile(base, 0.99) - np.quantile(base, 0.5))
        self.threshold = q + self.margin * max(spread, 1e-6)
        self.center = np.median(train, axis=0)
        self.scale = np.maximum(np.quantile(train, 0.999, axis=0) - self.center, 0.05)
        self.model = model
        self.fitted_rows = len(train)
        return self

    def scores(self, rows: np.ndarray) -> np.ndarray:
        """Outlier scores of ``rows`` ``(m, 7)`` (higher: more anomalous); one call per batch."""
        if self.model is None:
            raise RuntimeError("model not fitted")
        x = np.asarray(rows, dtype=np.float64)
        if len(x) == 0:
            return np.zeros(0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return np.asarray(self.model.decision_function(self._excess(x)), dtype=np.float64)

    def _excess(self, x: np.ndarray) -> np.ndarray:
        return np.maximum(x - self.floor, 0.0)

    def flag(self, rows: np.ndarray) -> tuple[np.ndarray, list[Flag]]:
        """Scores of every row, and the flagged rows with their evidence.

        A row is flagged when its model score is above the threshold and one feature is
        clearly above the healthy range (``z_min`` healthy spreads above the median: a
        stray error or two on an otherwise quiet port is not enough), or when one
        feature lies far beyond that range (``z_gate``): histogram, tree and empirical-CDF models cannot tell "just beyond the
        largest healthy value" from "a hundred times it", so one extreme feature among
        six ordinary ones can score no higher than a healthy port with two stray errors.
        """
        s = self.scores(rows)
        out = []
        x = np.asarray(rows, dtype=np.float64)
        z_all = (x - self.center) / self.scale
        zmax = z_all.max(axis=1)
        for i in np.flatnonzero(((s > self.threshold) & (zmax >= self.z_min)) | (zmax >= self.z_gate)):
            z = z_all[i]
            top = np.argsort(-z)[:3]
            out.append(Flag(index=int(i), score=float(s[i]),
                            features={FEATURES[j]: round(float(x[i, j]), 4) for j in top if z[j] > 1.0}))
        return s, out
