"""A streaming anomaly detector for many independent univariate series at once.

The series are GPU temperatures, power draws, job step times, ...: one value
per series per interval, ``n`` series side by side. The detector keeps a few
numbers per series (arrays of shape ``(n,)`` and one ``(n, short_window)``
ring) and scores every new value in O(1) vectorised work, so one call serves
a whole fleet.

Each step, per series:

1. **Deviation from a long baseline.** The baseline is an exponentially
   weighted mean and variance with a memory of about ``long_window`` values
   (``alpha = 1 / long_window``; an arithmetic mean while fewer values have
   been seen). Two deviations in baseline standard deviations: the new
   value's (``z_point``: a spike) and the mean of the last ``short_window``
   values' (``z_short``, scaled by ``sqrt(short_window)`` so it is a z-score
   of that mean: a level shift too small for any single value to stand out).
   ``z = max(z_point, z_short)``.
2. **Tail probability.** ``p`` is the two-sided Gaussian tail of ``z``; the
   score is ``min(1, -log10(p) / decades)``: 0 is neutral, 0.1 with the
   default ``decades = 50`` means ``p = 1e-5`` (z about 4.4), 1 means
   ``p <= 1e-50`` (z about 15). A log scale keeps very different spikes
   apart instead of all at 1.
3. **Flag once.** A deviation that is not larger than the series' recent
   peak deviation (a running maximum that decays with a memory of about
   ``quiet_window`` steps) is scored ``repeat_factor`` times its tail score:
   a sustained excursion is reported at its onset and when it grows, not on
   every step it lasts.
4. **Re-learning a new level.** When ``z_short`` has stayed above
   ``relearn_z`` for ``relearn_after`` consecutive steps, the baseline mean
   restarts from the short mean (its variance is kept): a lasting shift is
   flagged when it happens and then becomes the new normal.

The score at step ``t`` depends on values up to ``t`` only (no look-ahead).
A series scores 0 until it has seen ``warmup`` values. A NaN (or infinite)
value scores 0 and leaves that series' state untouched.

A stream in which only some series have a new value (the nodes whose
telemetry arrived) steps those rows alone with :meth:`UnivariateDetector.update_rows`,
at a cost in the rows stepped; :meth:`UnivariateDetector.grow` adds series
(new nodes) and :meth:`UnivariateDetector.reset_rows` frees some for reuse.
The pipeline (``pipeline.detect.glue``) keeps banks of these over busy GPUs'
temperature and power and over each node's step time in each job.
"""

from __future__ import annotations

import math

import numpy as np
from scipy import special

from .base import (
    SEVERITIES,
    Detector,
    FaultClass,
    Finding,
    as_array,
    check_choice,
    check_float,
    check_int,
    check_name,
)

__all__ = ["UnivariateDetector"]

_FAULT_CLASSES = frozenset(c.value for c in FaultClass)
_LN10 = math.log(10.0)
_LOG10_2 = math.log10(2.0)


def _as_rows(rows: np.ndarray) -> np.ndarray:
    r = np.asarray(rows)
    if r.ndim == 1 and r.size == 0:
        return np.zeros(0, dtype=np.int64)
    return as_array("rows", r, 1, "(k,)", "i").astype(np.int64, copy=False)


class UnivariateDetector(Detector):
    """Streaming anomaly likelihood for ``n`` univariate series, vectorised.

    Parameters
    ----------
    long_window: memory of the baseline mean and variance, in values.
    short_window: values whose mean is tested for a level shift (1: spikes only).
    quiet_window: memory, in steps, of the recent peak deviation (flag once).
    repeat_factor: factor, in [0, 1], on the score of a deviation no larger
        than the recent peak (1: no flag-once damping).
    warmup: values a series must have seen before it scores (>= 2).
    relearn_z: ``z_short`` that counts as a new level.
    relearn_after: consecutive steps above ``relearn_z`` before the baseline
        mean restarts at the new level; 0 disables re-learning.
    decades: ``-log10(p)`` that maps to score 1.
    threshold: score from which :meth:`detect` and :meth:`findings` report
        (default 0.1: ``p = 1e-5``).
    critical: score from which a finding is ``"critical"`` rather than ``severity``.
    kind, fault_class, severity: what findings carry.

    Score
    -----
    ``update(values)`` -> ``(n,)`` float in [0, 1], an anomaly likelihood on a
    log scale: ``min(1, -log10(p) / decades)`` with ``p`` the Gaussian tail
    probability of the deviation (times ``repeat_factor`` for a repeat).
    0 during warm-up and for NaN input.

    Streaming state (built on the first :meth:`update` or :meth:`grow`,
    cleared by :meth:`reset`) lives in attributes ending in ``_``;
    :meth:`update_rows` steps some series only, :meth:`grow` adds series and
    :meth:`reset_rows` restarts some; :meth:`score` and :meth:`detect` replay
    a window on a fresh copy and leave it alone.
    """

    def __init__(
        self,
        long_window: int = 700,
        short_window: int = 1,
        quiet_window: int = 300,
        repeat_factor: float = 0.25,
        warmup: int = 150,
        relearn_z: float = 8.0,
        relearn_after: int = 0,
        decades: float = 50.0,
        threshold: float = 0.1,
        critical: float = 0.5,
        kind: str = "univariate",
        fault_class: str = "node_degrading",
        severity: str = "warning",
    ) -> None:
        self.long_window = check_int("long_window", long_window, minimum=2)
        self.short_window = check_int("short_window", short_window, minimum=1)
        if self.short_window * 2 > self.long_window:
            raise ValueError(
                f"short_window must be at most half of long_window, got short_window="
                f"{short_window!r}, long_window={long_window!r}"
            )
        self.quiet_window = check_int("quiet_window", quiet_window, minimum=1)
        self.repeat_factor = check_float("repeat_factor", repeat_factor, low=0.0, high=1.0)
        self.warmup = check_int("warmup", warmup, minimum=2)
        self.relearn_z = check_float("relearn_z", relearn_z, low=0.0, low_open=True)
        self.relearn_after = check_int("relearn_after", relearn_after, minimum=0)
        self.decades = check_float("decades", decades, low=0.0, low_open=True)
        self.threshold = check_float("threshold", threshold, low=0.0, high=1.0, low_open=True)
        self.critical = check_float("critical", critical, low=0.0, high=1.0, low_open=True)
        self.kind = check_name("kind", kind)
        self.fault_class = check_choice("fault_class", fault_class, _FAULT_CLASSES)
        self.severity = check_choice("severity", severity, SEVERITIES)

    # -- streaming ---------------------------------------------------------

    def reset(self) -> None:
        """Forget all series: the next :meth:`update` starts from warm-up."""
        for name in [k for k in vars(self) if k.endswith("_")]:
            delattr(self, name)

    @property
    def n_series_(self) -> int | None:
        """Series in the streaming state, ``None`` before the first update."""
        mu = getattr(self, "mu_", None)
        return None if mu is None else mu.shape[0]

    #: the per-series state arrays (first axis: series)
    _STATE = ("mu_", "var_", "count_", "seen_", "short_", "short_pos_", "peak_", "run_", "relearned_")

    def _init_state(self, n: int) -> None:
        self.mu_ = np.zeros(n)  # baseline mean
        self.var_ = np.zeros(n)  # baseline variance
        self.count_ = np.zeros(n, dtype=np.int64)  # values in the baseline
        self.seen_ = np.zeros(n, dtype=np.int64)  # valid values seen in total
        self.short_ = np.zeros((n, self.short_window))  # last short_window values
        self.short_pos_ = np.zeros(n, dtype=np.int64)
        self.peak_ = np.zeros(n)  # decaying recent peak of z
        self.run_ = np.zeros(n, dtype=np.int64)  # consecutive steps beyond relearn_z
        self.relearned_ = np.zeros(n, dtype=np.int64)
        self.last_: dict[str, np.ndarray] = {}

    def update(self, values: np.ndarray) -> np.ndarray:
        """Take one new value per series and return their scores.

        Parameters
        ----------
        values: ``(n,)`` float, the newest value of each series; NaN: no
            reading (scores 0, state unchanged). ``n`` is fixed by the first
            call; :meth:`grow` to add series, :meth:`reset` to start over.

        Returns
        -------
        ``(n,)`` float64 in [0, 1] (see the class docstring).
        """
        x = as_array("values", values, 1, "(n,)", "f").astype(np.float64, copy=False)
        if self.n_series_ is None:
            self._init_state(x.shape[0])
        elif x.shape[0] != self.n_series_:
            raise ValueError(
                f"values must have shape ({self.n_series_},) as in the first update, got shape "
                f"{x.shape} (grow() to add series, reset() to start over with another number)"
            )
        score, last = self._step(slice(None), x)
        self.last_ = last
        return score

    def update_rows(self, rows: np.ndarray, values: np.ndarray, *, min_score: float | None = None) -> np.ndarray:
        """Take one new value for some series only; the others are not touched.

        The same as :meth:`update` with NaN for every series not in ``rows``
        (identical scores and state), at a cost in ``len(rows)``, not ``n``.

        Parameters
        ----------
        rows: ``(k,)`` int, distinct series in ``[0, n)``.
        values: ``(k,)`` float, the newest value of each of those series
            (NaN: no reading). Before the first update or :meth:`grow` there
            are no series: grow first.
        min_score: when given, a score below it may read 0 (its tail
            probability is not computed: the costliest part of a step); the
            state, and every score from ``min_score`` up, are the same. Pass
            :attr:`threshold` when only :meth:`findings` matter.

        Returns
        -------
        ``(k,)`` float64 in [0, 1], the scores of ``rows`` in their order.
        :meth:`findings` then reports findings whose ``index`` is the row.
        """
        r = _as_rows(rows)
        x = as_array("values", values, 1, "(k,)", "f").astype(np.float64, copy=False)
        if x.shape != r.shape:
            raise ValueError(f"values must have shape {r.shape} like rows, got shape {x.shape}")
        n = self.n_series_ or 0
        if r.size and (r.min() < 0 or r.max() >= n):
            raise ValueError(f"rows must lie in [0, {n}) (grow() to add series), got {r.min()}..{r.max()}")
        score = np.zeros(r.shape[0])
        ok = np.isfinite(x)
        if ok.all():
            score, last = self._step(r, x, min_score)
        else:
            # a NaN leaves its row alone: only the others are worked on
            sub = np.flatnonzero(ok)
            score[sub], part = self._step(r[sub], x[sub], min_score)
            last = {k: np.zeros(r.shape[0], dtype=v.dtype) for k, v in part.items()}
            for k, v in part.items():
                last[k][sub] = v
            last["value"] = x
            last["mean"][~ok] = np.nan
            last["sd"][~ok] = np.nan
        last["rows"] = r
        self.last_ = last
        return score

    def grow(self, n: int) -> None:
        """Make room for ``n`` series, keeping the state of the existing ones; the new
        series start in warm-up. Before the first update this builds the state."""
        n = check_int("n", n, minimum=0)
        old = self.n_series_
        if old is None:
            self._init_state(n)
            return
        if n < old:
            raise ValueError(f"n must be at least the current number of series {old}, got {n}")
        if n == old:
            return
        for name in self._STATE:
            arr = getattr(self, name)
            new = np.zeros((n, *arr.shape[1:]), dtype=arr.dtype)
            new[:old] = arr
            setattr(self, name, new)
        self.last_ = {}

    def select_rows(self, rows: np.ndarray) -> None:
        """Keep only the series ``rows`` (in that order; series ``j`` is then old series
        ``rows[j]``) and free the others. A row past the current series starts in warm-up."""
        r = _as_rows(rows)
        old = self.n_series_
        if old is None:
            return
        have = r < old
        for name in self._STATE:
            arr = getattr(self, name)
            new = np.zeros((r.size, *arr.shape[1:]), dtype=arr.dtype)
            new[have] = arr[r[have]]
            setattr(self, name, new)
        self.last_ = {}

    def reset_rows(self, rows: np.ndarray) -> None:
        """Forget some series: they start from warm-up again (the others are kept)."""
        r = _as_rows(rows)
        if self.n_series_ is None or not r.size:
            return
        for name in self._STATE:
            getattr(self, name)[r] = 0
        self.last_ = {}

    def state_nbytes(self) -> int:
        """Bytes of streaming state (0 before the first update)."""
        if self.n_series_ is None:
            return 0
        return sum(getattr(self, name).nbytes for name in self._STATE)

    def _z_floor(self, min_score: float | None) -> float:
        """The largest ``z`` whose score is surely below ``min_score`` (0: none)."""
        if min_score is None or min_score <= 0.0:
            return 0.0
        # score >= min_score needs -log10(p) >= min_score * decades, p the two-sided tail
        half_p = 0.5 * 10.0 ** (-min(min_score, 1.0) * self.decades)
        if not half_p > 0.0:
            return 0.0
        return max(0.0, -float(special.ndtri(half_p)) * (1.0 - 1e-6) - 1e-6)

    def _step(self, sel: slice | np.ndarray, x: np.ndarray,
              min_score: float | None = None) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """One step of the series ``sel`` (all: ``slice(None)``; else distinct rows)
        with values ``x``; returns their scores and the evidence of this step (see
        :meth:`update_rows` for ``min_score``)."""
        sw = self.short_window
        mu, var, count, seen, peak = self.mu_[sel], self.var_[sel], self.count_[sel], self.seen_[sel], self.peak_[sel]
        ok = np.isfinite(x)
        xv = np.where(ok, x, mu)
        seen += ok
        if sw == 1:  # the short mean is the last value: no ring to turn
            short = short_pos = None
            short_mean = np.where(ok, x, self.short_[sel, 0])
            self.short_[sel, 0] = short_mean
        else:
            short, short_pos = self.short_[sel], self.short_pos_[sel]
            rows = np.flatnonzero(ok)
            short[rows, short_pos[rows]] = x[rows]
            short_pos[rows] = (short_pos[rows] + 1) % sw
            short_mean = short.mean(axis=1)

        # Deviation from the baseline of the values before this one.
        sd = np.sqrt(var) + 1e-9 * (1.0 + np.abs(mu))
        live = ok & (seen >= self.warmup) & (count >= 2)
        z_point = np.where(live, np.abs(xv - mu) / sd, 0.0)
        if sw == 1:  # the short mean of a live series is its value
            z_short = z = z_point
        else:
            z_short = np.abs(short_mean - mu) / sd * math.sqrt(sw)
            z_short = np.where(live & (seen >= sw), z_short, 0.0)
            z = np.maximum(z_point, z_short)
        z_floor = self._z_floor(min_score)
        if not z.size:
            log10_p = z
        elif z_floor <= 0.0:
            log10_p = special.log_ndtr(-z) / _LN10 + _LOG10_2
        else:  # only the deviations that can reach min_score
            log10_p = np.zeros(z.shape)
            far = np.flatnonzero(z > z_floor)
            log10_p[far] = special.log_ndtr(-z[far]) / _LN10 + _LOG10_2
        tail = np.clip(-log10_p / self.decades, 0.0, 1.0)
        repeat = z <= peak
        score = np.where(live, np.where(repeat, self.repeat_factor * tail, tail), 0.0)
        decay = math.exp(-1.0 / self.quiet_window)
        peak = np.where(ok, np.maximum(z, peak * decay), peak)

        # Fold the value into the baseline.
        alpha = np.maximum(1.0 / self.long_window, 1.0 / (count + 1.0))
        d = xv - mu
        mu = np.where(ok, mu + alpha * d, mu)
        var = np.where(ok, (1.0 - alpha) * (var + alpha * d * d), var)
        count = count + ok

        # A lasting new level: the mean restarts there.
        if self.relearn_after:
            run = self.run_[sel]
            beyond = live & (z_short > self.relearn_z)
            run = np.where(beyond, run + 1, np.where(ok, 0, run))
            hit = run >= self.relearn_after
            if hit.any():
                mu = np.where(hit, short_mean, mu)
                count = np.where(hit, self.short_window, count)
                run = np.where(hit, 0, run)
                self.relearned_[sel] = self.relearned_[sel] + hit
            self.run_[sel] = run

        if isinstance(sel, slice):  # every series: the new arrays are the state
            self.mu_, self.var_, self.count_, self.peak_ = mu, var, count, peak
        else:  # seen, short and short_pos were changed in place for a slice
            self.mu_[sel], self.var_[sel], self.count_[sel], self.peak_[sel] = mu, var, count, peak
            self.seen_[sel] = seen
            if short is not None and short_pos is not None:
                self.short_[sel], self.short_pos_[sel] = short, short_pos
        last = {"value": x, "score": score, "mean": np.where(live, mu, np.nan),
                "sd": sd, "z_point": z_point, "z_short": z_short,
                "log10_p": np.where(live, log10_p, 0.0), "repeat": repeat & live}
        return score, last

    def run(self, series: np.ndarray) -> np.ndarray:
        """Stream a block of ``t`` steps through :meth:`update`, keeping the state.

        ``series``: ``(n, t)`` float, oldest first. Returns ``(n, t)`` scores.
        """
        v = as_array("series", series, 2, "(n, t)", "f").astype(np.float64, copy=False)
        out = np.zeros(v.shape)
        for j in range(v.shape[1]):
            out[:, j] = self.update(v[:, j])
        return out

    def findings(self, scores: np.ndarray | None = None) -> list[Finding]:
        """Findings for the series whose latest score is ``>= threshold``.

        ``scores``: the array the latest :meth:`update` or :meth:`update_rows`
        returned (the default); evidence comes from that update. After
        :meth:`update_rows` a finding's ``index`` is its series' row.
        """
        last = getattr(self, "last_", None) or {}
        if scores is None:
            if not last:
                return []
            scores = last["score"]
        s = as_array("scores", scores, 1, "(n,)", "f").astype(np.float64, copy=False)
        same = bool(last) and last["score"].shape == s.shape
        rows = last.get("rows") if same else None
        out = []
        for i in np.flatnonzero(s >= self.threshold):
            ev = {"score": float(s[i])}
            if same:
                ev.update(
                    value=float(last["value"][i]),
                    baseline_mean=float(last["mean"][i]),
                    baseline_sd=float(last["sd"][i]),
                    repeat=bool(last["repeat"][i]),
                    z_point=float(last["z_point"][i]),
                    z_short=float(last["z_short"][i]),
                    p_value=float(10.0 ** last["log10_p"][i]),
                )
            severity = "critical" if s[i] >= self.critical else self.severity
            index = int(i if rows is None else rows[i])
            out.append(Finding(self.kind, self.fault_class, severity, s[i], index, None, ev))
        return out

    # -- the base contract: a window per call --------------------------------

    def _replay(self, values: np.ndarray) -> UnivariateDetector:
        v = as_array("values", values, 2, "(n, t)", "f")
        det = self.clone()
        det._init_state(v.shape[0])
        det.run(v)
        if v.shape[1] == 0:
            det.last_ = {}
        return det

    def score(self, values: np.ndarray) -> np.ndarray:
        """Score of each series' newest value given its window.

        Parameters
        ----------
        values: ``(n, t)`` float, each series' last ``t`` values, oldest first
            (NaN: no reading). The window is replayed on fresh state; this
            detector's streaming state is left alone.

        Returns
        -------
        ``(n,)`` float64 in [0, 1]; 0 when ``t`` is shorter than the warm-up.
        """
        det = self._replay(values)
        if not det.last_:
            return np.zeros(np.asarray(values).shape[0])
        return det.last_["score"].copy()

    def detect(self, values: np.ndarray) -> list[Finding]:
        """Findings for series whose newest value scores ``>= threshold`` (shapes as :meth:`score`)."""
        det = self._replay(values)
        return det.findings() if det.last_ else []
