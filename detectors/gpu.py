"""GPU detectors: hard faults, counter-rate rises and thermal throttling.

Shapes: ``n`` node rows in the batch, ``g`` GPUs per node, ``t`` samples in a
node's window (oldest first). Nodes with fewer GPUs pad with zeros/False (or
NaN where a float is accepted), which scores neutral.
"""

from __future__ import annotations

from typing import TypedDict, cast

import numpy as np
from scipy import special

from .base import (
    Detector,
    FaultClass,
    Finding,
    as_array,
    check_choice,
    check_float,
    check_int,
    check_name,
    check_same_shape,
)

__all__ = [
    "HW_POWER_BRAKE",
    "HW_SLOWDOWN",
    "HW_THERMAL",
    "SW_THERMAL",
    "THERMAL_REASONS",
    "HardFaultDetector",
    "RateChangeDetector",
    "ThrottleDetector",
    "thermal_mask",
]

# NVML clock throttle (event) reason bits, ``nvmlClocksThrottleReason*``.
#: HW slowdown: clocks cut by 2x or more; thermal, power brake or fast power trigger.
HW_SLOWDOWN = 0x8
#: SW thermal slowdown: the driver holds the GPU under its temperature limits.
SW_THERMAL = 0x20
#: HW thermal slowdown: temperature too high, hardware cuts clocks.
HW_THERMAL = 0x40
#: HW power brake slowdown: an external power-brake signal (e.g. from the PSU).
HW_POWER_BRAKE = 0x80
#: Bits that mean "throttled for temperature". ``HW_SLOWDOWN`` is left out: it is
#: also set by power events, and NVML reports its thermal cause as ``HW_THERMAL``.
THERMAL_REASONS = SW_THERMAL | HW_THERMAL

_FAULT_CLASSES = frozenset(c.value for c in FaultClass)


def thermal_mask(throttle: np.ndarray, reasons: int = THERMAL_REASONS) -> np.ndarray:
    """Which samples have a thermal throttle reason set.

    Parameters
    ----------
    throttle: integer array of any shape, NVML clock throttle reason bitmasks.
    reasons: the bits that count (default :data:`THERMAL_REASONS`).

    Returns
    -------
    bool array of the same shape.
    """
    arr = np.asarray(throttle)
    if arr.dtype.kind not in "iu":
        raise ValueError(f"throttle must be an integer bitmask array, got dtype {arr.dtype}")
    check_int("reasons", reasons, minimum=1)
    return cast(np.ndarray, (arr & reasons) != 0)


class HardFaultDetector(Detector):
    """Hard GPU faults in one batch of node samples; stateless, no warm-up.

    Score
    -----
    ``score(...)`` -> ``(n, g)`` float: the number of hard-fault indicators on
    the GPU (new uncorrectable ECC errors, a row-remap failure, GPU lost), 0..3.

    Findings (all critical)
    -----------------------
    - ``ecc_dbe`` (``gpu_memory``): the double-bit (uncorrectable) ECC counter rose.
    - ``row_remap_failure`` (``gpu_memory``): a row could not be remapped.
    - ``gpu_lost`` (``gpu_hardware``): the GPU no longer answers.
    """

    def __init__(self) -> None:
        pass

    @staticmethod
    def _inputs(
        ecc_dbe_delta: np.ndarray, remap_failure: np.ndarray, lost: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        dbe = as_array("ecc_dbe_delta", ecc_dbe_delta, 2, "(n, g)", "f")
        remap = as_array("remap_failure", remap_failure, 2, "(n, g)", "b")
        gone = as_array("lost", lost, 2, "(n, g)", "b")
        check_same_shape(("ecc_dbe_delta", "remap_failure", "lost"), (dbe, remap, gone))
        dbe = np.nan_to_num(dbe.astype(np.float64, copy=False), nan=0.0)
        if dbe.size and dbe.min() < 0:
            raise ValueError(
                f"ecc_dbe_delta must be non-negative increments, got {dbe.min():g} "
                "(a counter reset must be handled before the detector)"
            )
        return dbe, remap, gone

    def score(
        self, ecc_dbe_delta: np.ndarray, remap_failure: np.ndarray, lost: np.ndarray
    ) -> np.ndarray:
        """Hard-fault indicator count per GPU.

        Parameters
        ----------
        ecc_dbe_delta: ``(n, g)`` int or float, increase of the DBE counter since
            the previous sample (NaN: no reading).
        remap_failure: ``(n, g)`` bool, row-remap failure flag.
        lost: ``(n, g)`` bool, GPU lost / not answering.

        Returns
        -------
        ``(n, g)`` float64.
        """
        dbe, remap, gone = self._inputs(ecc_dbe_delta, remap_failure, lost)
        return cast(np.ndarray, (dbe > 0).astype(np.float64) + remap + gone)

    def detect(
        self, ecc_dbe_delta: np.ndarray, remap_failure: np.ndarray, lost: np.ndarray
    ) -> list[Finding]:
        """Critical findings, one per indicator per GPU (see :meth:`score` for shapes)."""
        dbe, remap, gone = self._inputs(ecc_dbe_delta, remap_failure, lost)
        score = (dbe > 0).astype(np.float64) + remap + gone
        findings = []
        for i, j in zip(*np.nonzero(dbe > 0), strict=True):
            evidence = {"dbe_delta": float(dbe[i, j])}
            findings.append(
                Finding("ecc_dbe", "gpu_memory", "critical", score[i, j], i, j, evidence)
            )
        for i, j in zip(*np.nonzero(remap), strict=True):
            evidence = {"remap_failure": True}
            findings.append(
                Finding("row_remap_failure", "gpu_memory", "critical", score[i, j], i, j, evidence)
            )
        for i, j in zip(*np.nonzero(gone), strict=True):
            evidence = {"lost": True}
            findings.append(
                Finding("gpu_lost", "gpu_hardware", "critical", score[i, j], i, j, evidence)
            )
        findings.sort(key=lambda f: (f.index, f.gpu))
        return findings


class _RateStats(TypedDict):
    """The rate test per GPU: p-values and the sums behind them, ``(n, g)`` each;
    ``window`` is one number or ``(n, g)``."""

    p: np.ndarray
    e_base: np.ndarray
    e_rec: np.ndarray
    k_base: np.ndarray
    k_rec: np.ndarray
    window: np.int64 | np.ndarray


class RateChangeDetector(Detector):
    """A rise in the rate of a cumulative error counter, by an exact test.

    The last ``window`` intervals of each GPU's per-interval increments are
    split into a baseline (all but the last ``recent``) and a recent part.
    Under H0 (one Poisson rate throughout), the recent count given the total
    is Binomial(total, e_recent / e_all), where e is the number of intervals
    with a reading. The one-sided p-value is
    ``binom.sf(recent_count - 1, total, e_recent / e_all)``, so the decision
    tracks the evidence rather than a fixed count: three errors after a quiet
    day matter, three more among hundreds do not.

    Parameters
    ----------
    window: intervals considered (the latest ``window`` of the input).
    recent: intervals at the end that form the recent part.
    alpha: significance level; a GPU is reported when ``p < alpha``.
    min_events: below this many events in the window the score is 0.
    kind: finding kind, e.g. ``"ecc_sbe_rate"``, ``"nvlink_error_rate"``
        (with ``fault_class="nvlink"``), ``"pcie_replay_rate"``.
    fault_class: the class findings carry.
    critical_ratio: recent/baseline rate ratio from which a finding is critical.

    Score
    -----
    ``score(counts)`` -> ``(n, g)`` float: ``-log10(p)`` (0 = no evidence of a
    rise; ``alpha = 1e-4`` is score 4). Warm-up gives 0: fewer than
    ``recent`` baseline intervals with a reading, no recent reading, or fewer
    than ``min_events`` events in the window.

    Under H0 the test is exact and conservative (discrete), so the false
    positive rate per GPU window is at most ``alpha``.
    """

    def __init__(
        self,
        window: int = 120,
        recent: int = 30,
        alpha: float = 1e-4,
        min_events: int = 5,
        kind: str = "ecc_sbe_rate",
        fault_class: str = "node_degrading",
        critical_ratio: float = 10.0,
    ) -> None:
        self.window = check_int("window", window, minimum=2)
        self.recent = check_int("recent", recent, minimum=1)
        if self.window < 2 * self.recent:
            raise ValueError(
                f"window must be >= 2 * recent so the baseline is at least as long as the "
                f"recent part, got window={window!r}, recent={recent!r}"
            )
        self.alpha = check_float("alpha", alpha, low=0.0, high=1.0, low_open=True, high_open=True)
        self.min_events = check_int("min_events", min_events, minimum=1)
        self.kind = check_name("kind", kind)
        self.fault_class = check_choice("fault_class", fault_class, _FAULT_CLASSES)
        self.critical_ratio = check_float("critical_ratio", critical_ratio, low=1.0)

    def _stats(self, counts: np.ndarray) -> _RateStats:
        c = as_array("counts", counts, 3, "(n, t, g)", "f").astype(np.float64, copy=False)
        c = c[:, -self.window:, :]
        finite = ~np.isnan(c)
        if np.isinf(c).any():
            raise ValueError("counts must be finite (NaN marks a missing interval), got inf")
        if finite.any():
            low = np.min(c, where=finite, initial=0.0)
            if low < 0:
                raise ValueError(
                    f"counts must be non-negative increments, got {low:g} "
                    "(a counter reset must be handled before the detector)"
                )
        split = max(c.shape[1] - self.recent, 0)
        base, rec = c[:, :split, :], c[:, split:, :]
        e_base = (~np.isnan(base)).sum(axis=1)
        e_rec = (~np.isnan(rec)).sum(axis=1)
        k_base = np.nansum(base, axis=1)
        k_rec = np.nansum(rec, axis=1)
        return self._test(k_base, k_rec, e_base, e_rec, c.shape[1])

    def _test(self, k_base: np.ndarray, k_rec: np.ndarray, e_base: np.ndarray, e_rec: np.ndarray,
              window: int | np.ndarray) -> _RateStats:
        total = k_base + k_rec
        active = (e_base >= self.recent) & (e_rec >= 1) & (total >= self.min_events) & (k_rec >= 1)
        p = np.ones(np.shape(total))
        if active.any():
            e_b = np.broadcast_to(e_base, p.shape)[active]
            e_r = np.broadcast_to(e_rec, p.shape)[active]
            q = e_r / (e_b + e_r)
            # the binomial survival function P(X >= k_rec) for X ~ Bin(total, q), from
            # scipy.special (scipy.stats would cost every worker about 50 MB of imports)
            k = np.rint(k_rec[active]).astype(np.int64) - 1
            p[active] = special.bdtrc(k, np.rint(total[active]).astype(np.int64), q)
        return {"p": p, "e_base": np.broadcast_to(e_base, p.shape), "e_rec": np.broadcast_to(e_rec, p.shape),
                "k_base": k_base, "k_rec": k_rec, "window": np.int64(window)}

    @staticmethod
    def _to_score(p: np.ndarray) -> np.ndarray:
        return cast(np.ndarray, np.maximum(-np.log10(np.clip(p, 1e-300, 1.0)), 0.0))

    def score(self, counts: np.ndarray) -> np.ndarray:
        """``-log10`` p-value of a rate rise per GPU.

        Parameters
        ----------
        counts: ``(n, t, g)`` non-negative per-interval increments, oldest
            first; NaN marks an interval without a reading.

        Returns
        -------
        ``(n, g)`` float64.
        """
        return self._to_score(self._stats(counts)["p"])

    def detect_sums(self, k_base: np.ndarray, k_rec: np.ndarray, e_base: int | np.ndarray,
                    e_rec: int | np.ndarray) -> list[Finding]:
        """The same findings as :meth:`detect`, from window sums kept elsewhere.

        For callers that keep running sums instead of whole windows (the streaming
        hot path): ``k_base`` and ``k_rec`` are ``(n, g)`` event counts in the
        baseline and recent parts of a window; ``e_base`` and ``e_rec`` the intervals
        with a reading in each part, one for all rows or one per row (``(n,)``).
        """
        kb = as_array("k_base", k_base, 2, "(n, g)", "f").astype(np.float64, copy=False)
        kr = as_array("k_rec", k_rec, 2, "(n, g)", "f").astype(np.float64, copy=False)
        check_same_shape(("k_base", "k_rec"), (kb, kr))
        if (kb < 0).any() or (kr < 0).any():
            raise ValueError("k_base and k_rec must be non-negative event counts")
        if not ((kr >= 1) & (kb + kr >= self.min_events)).any():
            return []  # nothing can be significant: skip the test
        eb, er = (np.asarray(e, dtype=np.int64) for e in (e_base, e_rec))
        if (eb < 0).any() or (er < 0).any():
            raise ValueError("e_base and e_rec must be non-negative interval counts")
        if eb.ndim == 1:
            eb, er = eb[:, None], er[:, None]
        return self._findings(self._test(kb, kr, eb, er, np.broadcast_to(eb + er, kb.shape)))

    def detect(self, counts: np.ndarray) -> list[Finding]:
        """Findings for GPUs with ``p < alpha`` (see :meth:`score` for shapes).

        Evidence rates are events per interval; ``rate_ratio`` floors the
        baseline at half an event so a quiet baseline gives a finite ratio.
        """
        return self._findings(self._stats(counts))

    def _findings(self, s: _RateStats) -> list[Finding]:
        p = s["p"]
        score = self._to_score(p)
        findings = []
        for i, j in zip(*np.nonzero(p < self.alpha), strict=True):
            base_rate = s["k_base"][i, j] / s["e_base"][i, j]
            rec_rate = s["k_rec"][i, j] / s["e_rec"][i, j]
            ratio = rec_rate / (max(s["k_base"][i, j], 0.5) / s["e_base"][i, j])
            findings.append(
                Finding(
                    kind=self.kind,
                    fault_class=self.fault_class,
                    severity="critical" if ratio >= self.critical_ratio else "warning",
                    score=score[i, j],
                    index=i,
                    gpu=j,
                    evidence={
                        "baseline_rate": float(base_rate),
                        "recent_rate": float(rec_rate),
                        "rate_ratio": float(ratio),
                        "p_value": float(p[i, j]),
                        "baseline_count": float(s["k_base"][i, j]),
                        "recent_count": float(s["k_rec"][i, j]),
                        "window": int(np.broadcast_to(s["window"], p.shape)[i, j]),
                        "recent": self.recent,
                    },
                )
            )
        return findings


class ThrottleDetector(Detector):
    """Sustained thermal throttling of a GPU.

    Parameters
    ----------
    window: samples considered (the latest ``window`` of the input).
    min_fraction: share of those samples with a thermal throttle reason from
        which a GPU is reported, in (0, 1].
    warmup: fewer samples than this score 0.

    Score
    -----
    ``score(thermal, temp)`` -> ``(n, g)`` float in [0, 1]: the share of the
    window's samples with thermal throttling; 0 during warm-up.

    Findings
    --------
    ``thermal_throttle`` (``node_degrading``, warning) where the share is
    ``>= min_fraction``; evidence: fraction, samples, max_temp.
    """

    def __init__(self, window: int = 60, min_fraction: float = 0.5, warmup: int = 10) -> None:
        self.window = check_int("window", window, minimum=1)
        self.min_fraction = check_float(
            "min_fraction", min_fraction, low=0.0, high=1.0, low_open=True
        )
        self.warmup = check_int("warmup", warmup, minimum=1)
        if self.warmup > self.window:
            raise ValueError(f"warmup must be <= window, got warmup={warmup!r}, window={window!r}")

    def _inputs(self, thermal: np.ndarray, temp: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        th = as_array("thermal", thermal, 3, "(n, t, g)", "b")
        tp = as_array("temp", temp, 3, "(n, t, g)", "f")
        check_same_shape(("thermal", "temp"), (th, tp))
        return th[:, -self.window:, :], tp[:, -self.window:, :]

    def _fraction(self, th: np.ndarray) -> np.ndarray:
        if th.shape[1] < self.warmup:
            return np.zeros((th.shape[0], th.shape[2]))
        return cast(np.ndarray, th.mean(axis=1))

    def score(self, thermal: np.ndarray, temp: np.ndarray) -> np.ndarray:
        """Share of thermally throttled samples per GPU.

        Parameters
        ----------
        thermal: ``(n, t, g)`` bool, a thermal throttle reason was set
            (see :func:`thermal_mask`).
        temp: ``(n, t, g)`` float, GPU temperature in degrees C (NaN: no reading).

        Returns
        -------
        ``(n, g)`` float64.
        """
        th, _ = self._inputs(thermal, temp)
        return self._fraction(th)

    def detect_counts(self, throttled: np.ndarray, samples: int | np.ndarray,
                      max_temp: np.ndarray | None = None) -> list[Finding]:
        """The same findings as :meth:`detect`, from counts kept elsewhere.

        ``throttled``: ``(n, g)`` samples with thermal throttling among the last
        ``samples`` (one count for all rows, or ``(n,)``); ``max_temp``: ``(n, g)`` or None.
        """
        th = as_array("throttled", throttled, 2, "(n, g)", "f").astype(np.float64, copy=False)
        n = np.broadcast_to(np.asarray(samples, dtype=np.int64).reshape(-1, 1) if np.ndim(samples) else
                            np.int64(samples), (th.shape[0], 1))
        if (n < 0).any():
            raise ValueError("samples must be non-negative counts")
        ok = n >= self.warmup
        hit = ok & (th >= self.min_fraction * n)
        if not hit.any():
            return []
        frac = th / np.maximum(n, 1)
        findings = []
        for i, j in zip(*np.nonzero(hit), strict=True):
            mt = None if max_temp is None or not np.isfinite(max_temp[i, j]) else float(max_temp[i, j])
            findings.append(Finding(
                kind="thermal_throttle", fault_class="node_degrading", severity="warning", score=frac[i, j],
                index=i, gpu=j, evidence={"fraction": float(frac[i, j]), "samples": int(n[i, 0]), "max_temp": mt},
            ))
        return findings

    def detect(self, thermal: np.ndarray, temp: np.ndarray) -> list[Finding]:
        """Findings for GPUs throttled in at least ``min_fraction`` of the window."""
        th, tp = self._inputs(thermal, temp)
        frac = self._fraction(th)
        findings = []
        for i, j in zip(*np.nonzero(frac >= self.min_fraction), strict=True):
            temps = tp[i, :, j].astype(np.float64)
            max_temp = float(np.nanmax(temps)) if np.isfinite(temps).any() else None
            findings.append(
                Finding(
                    kind="thermal_throttle",
                    fault_class="node_degrading",
                    severity="warning",
                    score=frac[i, j],
                    index=i,
                    gpu=j,
                    evidence={
                        "fraction": float(frac[i, j]),
                        "samples": int(th.shape[1]),
                        "max_temp": max_temp,
                    },
                )
            )
        return findings
