"""Peer comparison: a node that is slower (or weaker) than the other nodes of its job."""

from __future__ import annotations

import numpy as np

from .base import Detector, Finding, as_array, check_choice, check_float, check_int, check_name

__all__ = ["PeerDetector"]

#: 1.4826 * MAD estimates the standard deviation of a normal sample.
MAD_TO_SIGMA = 1.4826


class PeerDetector(Detector):
    """Robust z-score of each node against the other nodes of one job.

    ``z = (x - median) / scale`` (``direction="high"``, e.g. step time) or
    ``(median - x) / scale`` (``direction="low"``, e.g. power draw), with
    ``scale = max(1.4826 * MAD, rel_floor * |median|)``. The floor keeps a
    job whose nodes agree almost exactly from turning a tiny difference into a
    large z; with the defaults a node is flagged only when it is at least
    ``threshold * rel_floor`` = 25 % away from the median *and* 5 robust
    standard deviations out.

    Parameters
    ----------
    threshold: z above which a node is reported.
    min_peers: fewer valid (non-NaN) values than this score 0 (warm-up).
    direction: ``"high"`` flags large values, ``"low"`` small ones.
    kind: finding kind, e.g. ``"peer_step_time"`` or ``"peer_power"``.
    rel_floor: lower bound of the scale relative to ``|median|``.

    Score
    -----
    ``score(values)`` -> ``(m,)`` float: z in the chosen direction (negative:
    better than the median). 0 for NaN values, for jobs with fewer than
    ``min_peers`` values, and when the scale is 0 (median and MAD both 0).

    Calibration
    -----------
    Measured on the per-worker mini-batch times of the Alibaba PAI trace
    (``alibaba-minibatch``: 10 workers per job, one z per worker and
    iteration, no smoothing), on its healthy stretches: job 1 without the
    worker-6 straggler episode (iterations 1811-1941), job 2, and job 3 up to
    iteration 2001, before its stragglers; 7,270 worker-iterations. These
    jobs are not homogeneous: some workers run persistently 5-12 % slower than
    the median, and with 10 workers the MAD is often well below that spread,
    which is what the relative floor absorbs.

    ====================  ======================================  ==========
    threshold, rel_floor  false positives per worker-iteration    1.5x found
    ====================  ======================================  ==========
    4.0, 0.01             105 of 7,270 (job 3 alone: 2.9e-2)      96 %
    4.0, 0.05             6 of 7,270 = 8.3e-4 (job 1: 1.7e-3)     96 %
    5.0, 0.05 (default)   0 of 7,270 (95 % upper bound 4.1e-4)    87 %
    ====================  ======================================  ==========

    "1.5x found" is the share of healthy iterations in which one worker, set
    to 1.5x that iteration's median, is flagged from that single iteration
    (default: job 1 / 2 / 3 = 89 % / 74 % / 98 %; job 2 has the widest
    spread). A straggler that lasts a few iterations is therefore found within
    a few steps; the real worker-6 episode of job 1 is flagged in 6 of its 14
    iterations. Several simultaneous stragglers that shift the median (job 3
    after iteration 2001, four workers about 1.17x) are out of reach of a
    median-based comparison. ``tests/unit/detectors/test_peer.py`` re-measures
    these numbers from the data.
    """

    def __init__(
        self,
        threshold: float = 5.0,
        min_peers: int = 4,
        direction: str = "high",
        kind: str = "peer_step_time",
        rel_floor: float = 0.05,
    ) -> None:
        self.threshold = check_float("threshold", threshold, low=0.0, low_open=True)
        self.min_peers = check_int("min_peers", min_peers, minimum=3)
        self.direction = check_choice("direction", direction, ("high", "low"))
        self.kind = check_name("kind", kind)
        self.rel_floor = check_float("rel_floor", rel_floor, low=0.0)

    def _stats(self, values: np.ndarray) -> tuple[np.ndarray, np.ndarray, float, float, int]:
        """Return ``(x, z, median, scale, valid_count)``."""
        x = as_array("values", values, 1, "(m,)", "f").astype(np.float64, copy=False)
        if np.isinf(x).any():
            raise ValueError("values must be finite or NaN, got inf")
        valid = ~np.isnan(x)
        n_valid = int(valid.sum())
        if n_valid < self.min_peers:
            return x, np.zeros(x.shape), float("nan"), 0.0, n_valid
        v = x[valid]
        median = float(np.median(v))
        mad = float(np.median(np.abs(v - median)))
        scale = max(MAD_TO_SIGMA * mad, self.rel_floor * abs(median))
        if scale == 0.0:
            return x, np.zeros(x.shape), median, scale, n_valid
        z = (x - median) / scale if self.direction == "high" else (median - x) / scale
        return x, np.where(valid, z, 0.0), median, scale, n_valid

    def score(self, values: np.ndarray) -> np.ndarray:
        """Robust z per node.

        Parameters
        ----------
        values: ``(m,)`` float, one value per node of the job (NaN: no value).

        Returns
        -------
        ``(m,)`` float64.
        """
        return self._stats(values)[1]

    def detect(self, values: np.ndarray) -> list[Finding]:
        """Findings (``node_degrading``, warning) for nodes with ``z > threshold``."""
        x, z, median, scale, n_valid = self._stats(values)
        findings = []
        for i in np.flatnonzero(z > self.threshold):
            findings.append(
                Finding(
                    kind=self.kind,
                    fault_class="node_degrading",
                    severity="warning",
                    score=z[i],
                    index=int(i),
                    gpu=None,
                    evidence={
                        "value": float(x[i]),
                        "median": median,
                        "scale": scale,
                        "ratio_to_median": float(x[i] / median) if median else None,
                        "peers": n_valid,
                        "direction": self.direction,
                    },
                )
            )
        return findings
