"""Glue between telemetry records and the pure detectors.

Each node gets fixed-size rings of counter increments over event time (:class:`TimeRing`:
one slot per ``bucket_s`` of event time, one column per GPU or port), so windows count
seconds whatever the sampling interval.  A batch of samples updates the rings, then every
detector scores all the updated nodes at once over stacked arrays.  The rings live in memory:
after a restart a node's window warms up again (detectors return a neutral score while
warming up), which the node track tolerates because degradation needs confirmations.

Besides the rule and rate detectors, streaming baselines (:class:`UnivariateDetector`)
follow each busy GPU's temperature and power and each node's step time in each job;
their deviations are info anomalies (``temp_drift``, ``power_drift``, ``step_time_drift``):
evidence in the node's history, never a reason to isolate on their own.
"""

from __future__ import annotations

import heapq
import itertools
import math
import operator
import re
import time
import zlib
from collections import deque
from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import Any, NamedTuple

import numpy as np

from detectors import (
    Finding,
    HardFaultDetector,
    PeerDetector,
    RateChangeDetector,
    ThrottleDetector,
    UnivariateDetector,
    XidDetector,
    thermal_mask,
)
from detectors.fabric import COUNTERS as FABRIC_COUNTERS
from detectors.fabric import FEATURES as FABRIC_FEATURES
from detectors.fabric import PortModel, port_features
from detectors.links import BASIS as LINK_BASIS
from detectors.links import links_below
from detectors.xid import sxid_findings
from schemas import (
    Anomaly,
    DecodeError,
    FaultClass,
    GpuSample,
    JobEvent,
    JobEventKind,
    NetworkSample,
    Record,
    Severity,
    Window,
    decode,
)
from schemas.columns import GpuBatch, decode_gpu_batch

from pipeline.config import DetectorSettings, NetworkSettings
from schemas.ids import stable_id


def _sev(s: str) -> Severity:
    return Severity(s)


class Refused(NamedTuple):
    """A sample that detection did not use: its position in the batch given to
    ``process``, why (``duplicate``: a sample of that node with the same event time was
    already used, a redelivery; ``late``: older than the node's last used sample, which
    the windows have moved past), and that last used sample's event time."""

    position: int
    why: str
    node: str
    ts: float
    last_ts: float


def _row_keys(node_keys: np.ndarray, p: int, ts: np.ndarray) -> np.ndarray:
    """Stable pseudo-random 64-bit keys of windows (node, port, event time): ``(n * p,)``
    for ``n`` node keys and times, ports in order (splitmix64 of the three)."""
    with np.errstate(over="ignore"):
        t = np.round(ts * 1000.0).astype(np.int64).astype(np.uint64)
        x = (node_keys[:, None] * np.uint64(0x9E3779B97F4A7C15) + np.arange(p, dtype=np.uint64)[None, :]
             * np.uint64(0xBF58476D1CE4E5B9)) ^ t[:, None]
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return (x ^ (x >> np.uint64(31))).reshape(-1)


def late_reason(r: Refused) -> str:
    """The dead-letter reason of a late sample (it starts with ``late:``)."""
    return (f"late: event time {r.ts:.3f} is {r.last_ts - r.ts:.3f} s before node {r.node}'s last used sample "
            f"({r.last_ts:.3f}); its detection windows have moved past it")


class Cooldown:
    """Emit the same (subject, gpu, kind) finding at most once per ``seconds`` of event time."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.last: dict[tuple, float] = {}

    def allow(self, key: tuple, ts: float) -> bool:
        prev = self.last.get(key)
        if prev is not None and ts - prev < self.seconds and ts >= prev:
            return False
        self.last[key] = ts
        return True


def _driver(port: str) -> str:
    """The driver part of a port's device ("mlx5_3/1" -> "mlx5"): its model where none is given."""
    return re.sub(r"_?\d+$", "", port.split("/", 1)[0])


def _anomaly(detector: str, node: str, f: Finding, ts: float, *, subject_type: str = "gpu",
             subject: str | None = None, window: Window | None = None) -> Anomaly:
    gpu = f.gpu
    subj = subject or (f"{node}/gpu{gpu}" if gpu is not None and subject_type == "gpu" else node)
    return Anomaly(
        ts=ts,
        id=stable_id(detector, subj, f.kind, ts),
        detector=detector,
        subject_type=subject_type,  # type: ignore[arg-type]
        subject=subj,
        node=node,
        gpu=gpu,
        kind=f.kind,
        fault_class=FaultClass(f.fault_class),
        score=float(f.score) if np.isfinite(f.score) else 1e9,
        severity=_sev(f.severity),
        evidence=f.evidence,
        window=window,
    )


RATE_COUNTERS = ("ecc_sbe", "nvlink", "pcie")
#: healthy port windows kept for fitting the fabric model
RESERVOIR = 20000
#: the fabric model's fits happen on this event-time grid (seconds); a fit at grid point
#: G uses the healthy windows before G and scores from G + MODEL_DELAY_S on
FIT_GRID_S = 60.0
#: event time between a fit's data and the windows it scores: a fit runs in a thread
#: while the stream goes on, and this much event time later its model takes over
#: whatever the replay speed (the stream waits for a fit that is late)
MODEL_DELAY_S = 60.0
#: accepted event times kept per node to tell a redelivered (duplicate) sample from a late one
SEEN_TS = 16
#: the per-GPU fields whose changes the GPU detectors read, in the order they are stacked
#: (temperature is read apart: it is throttle evidence only)
DETECTOR_FIELDS = ("ecc_sbe", "nvlink_crc", "nvlink_replay", "nvlink_recovery", "pcie_replay", "ecc_dbe",
                   "throttle", "remap_failure", "lost")
SBE, NVL_CRC, NVL_REPLAY, NVL_RECOVERY, PCIE, DBE, THROTTLE, REMAP_FAILURE, LOST = range(len(DETECTOR_FIELDS))
_PORTS = operator.attrgetter("ports")
_WIRING = operator.attrgetter("port", "switch")
_STATE = operator.attrgetter("state")
_RATE = operator.attrgetter("rate_gbps")
_PORT_COUNTERS = operator.attrgetter(*FABRIC_COUNTERS)
#: the columns GPU detection reads: what a decoded batch for it holds
#: (:func:`schemas.columns.decode_gpu_batch`)
GPU_DETECTION_COLUMNS = ("util", "temp", "power", *DETECTOR_FIELDS)
#: a GPU is busy above this utilisation (percent); its temperature and power are
#: learnt and judged only while it is busy, so idle periods do not shape the baseline
BUSY_UTIL = 50.0
#: event-time seconds a GPU must have been busy before its temperature and power count:
#: a GPU heats up over tens of seconds after a job starts (its heat sink's time
#: constant), and that ramp is no drift
BUSY_SETTLE_S = 60.0
#: a job without progress for this long (event time) is forgotten by the step-time baselines
JOB_IDLE_S = 3600.0


class DecodedBatch(NamedTuple):
    """A batch of telemetry messages as detection takes it: the valid ``samples`` (a
    :class:`GpuBatch` or records), the message position of each, ``(position, reason)``
    of each message that is not valid, and the samples' nodes and event times."""

    samples: Any
    positions: list[int]
    errors: list[tuple[int, str]]
    nodes: list[str]
    times: list[float]


def decode_gpu(values: Sequence[Any]) -> DecodedBatch:
    """GPU samples as the columns GPU detection reads (see :mod:`schemas.columns`)."""
    d = decode_gpu_batch(values, GPU_DETECTION_COLUMNS)
    return DecodedBatch(d.batch, d.positions, d.errors, d.batch.node, d.batch.ts.tolist())


def decode_each(model: type[Record]) -> Callable[[Sequence[Any]], DecodedBatch]:
    """A batch decoder of ``model`` records, one message at a time."""
    def dec(values: Sequence[Any]) -> DecodedBatch:
        records: list[Any] = []
        positions: list[int] = []
        errors: list[tuple[int, str]] = []
        for k, v in enumerate(values):
            try:
                records.append(decode(model, v))
                positions.append(k)
            except DecodeError as exc:
                errors.append((k, exc.reason))
        return DecodedBatch(records, positions, errors, [r.node for r in records], [r.ts for r in records])
    return dec


def _bank(kind: str, threshold: float) -> UnivariateDetector:
    """A bank of univariate baselines at the detector's defaults; findings are info."""
    return UnivariateDetector(kind=kind, fault_class="node_degrading", severity="info", threshold=threshold)


def _univariate_findings(det: UnivariateDetector, scores: np.ndarray) -> list[Finding]:
    """The bank's findings, info whatever their score (evidence, never a verdict), with
    the direction of the deviation."""
    out = []
    for fd in det.findings(scores):
        ev = fd.evidence
        ev["direction"] = "high" if ev.get("value", 0.0) >= ev.get("baseline_mean", 0.0) else "low"
        out.append(Finding(kind=fd.kind, fault_class=fd.fault_class, severity="info", score=fd.score,
                           index=fd.index, gpu=None, evidence=ev))
    return out


def _filled(shape: tuple[int, ...], fill: float, dtype: Any) -> np.ndarray:
    """An array of ``fill``; zeros come from ``np.zeros``, whose pages the kernel provides
    only when a row is first written, so rows reserved ahead cost neither time nor memory
    until their nodes arrive."""
    return np.zeros(shape, dtype=dtype) if fill == 0 else np.full(shape, fill, dtype=dtype)


class TimeRing:
    """Running totals of per-node channels over event time, in buckets of ``bucket_s``.

    The windows of the rate and throttle tests count seconds, not samples, so a node
    that reports every second and one that reports every minute are judged over the
    same span, and memory does not grow with the sampling rate.  Bucket ``b`` holds the
    events with ``floor(ts / bucket_s) == b``.  For every node the ring keeps, per bucket
    of the last ``buckets`` (one slot more, so a window's both ends are in it):

    * ``tot``: the running total of each channel at the bucket's end (a wrapping integer
      type: differences over a window stay exact while a window holds fewer than half
      the type's range);
    * ``nread``: the running count of buckets that had a reading (the exposure of a
      window, so buckets without telemetry count neither for nor against a rate).

    Buckets a node skipped (no telemetry) take the totals of the last one it reported.
    Slots a young node has not reached yet are 0: a window that starts before the
    node's first sample sees an empty (short) baseline.  Arrays are indexed by node row.
    """

    def __init__(self, shape: tuple[int, ...], buckets: int, bucket_s: float, capacity: int,
                 dtype: Any = np.int32) -> None:
        self.shape, self.buckets, self.slots, self.bucket_s, self.dtype = shape, buckets, buckets + 1, bucket_s, dtype
        self.cap = 0
        self.grow(capacity)

    def grow(self, cap: int) -> None:
        self._realloc(cap, slice(0, self.cap))

    def select(self, keep: np.ndarray, cap: int) -> None:
        """Keep rows ``keep`` (row ``j`` is then old row ``keep[j]``) in arrays of ``cap`` rows."""
        self._realloc(cap, keep)

    def _realloc(self, cap: int, rows: slice | np.ndarray) -> None:
        """Arrays of ``cap`` rows holding the old ``rows`` first (none before the first call)."""
        for name, shape, dtype, fill in (("tot", (self.slots, *self.shape), self.dtype, 0),
                                         ("nread", (self.slots,), np.int32, 0),
                                         ("acc", self.shape, np.int64, 0), ("nr", (), np.int64, 0),
                                         ("last", (), np.int64, -1)):
            arr = _filled((cap, *shape), fill, dtype)
            if self.cap:
                kept = getattr(self, name)[rows]
                arr[:len(kept)] = kept
            setattr(self, name, arr)
        self.cap = cap

    def reset(self, i: int) -> None:
        """Forget node row ``i`` (its next sample starts a new history)."""
        self.tot[i] = 0
        self.nread[i] = 0
        self.acc[i] = 0
        self.nr[i] = 0
        self.last[i] = -1

    def nbytes(self) -> int:
        return sum(getattr(self, n).nbytes for n in ("tot", "nread", "acc", "nr", "last"))

    def bucket(self, ts: np.ndarray) -> np.ndarray:
        return np.floor_divide(ts, self.bucket_s).astype(np.int64)

    def add(self, idx: np.ndarray, b: np.ndarray, values: np.ndarray) -> None:
        """Add ``values`` (``(m, *shape)``) to distinct rows ``idx`` at buckets ``b``
        (not before each row's last bucket)."""
        last = self.last[idx]
        new = last < 0
        gap = np.where(new, 1, b - last)
        big = int(gap.max(initial=0))
        if big > 1:  # fill skipped buckets with the totals before this sample
            old_tot = self.acc[idx].astype(self.dtype)
            old_nr = self.nr[idx]
            for j in range(1, min(big - 1, self.slots) + 1):
                sel = (gap - 1 >= j) & ~new
                if not sel.any():
                    break
                rows, slots = idx[sel], (last[sel] + j) % self.slots
                self.tot[rows, slots] = old_tot[sel]
                self.nread[rows, slots] = old_nr[sel]
        self.nr[idx] += gap >= 1
        self.acc[idx] += values.astype(np.int64, copy=False)
        slot = b % self.slots
        self.tot[idx, slot] = self.acc[idx].astype(self.dtype)  # wraps
        self.nread[idx, slot] = self.nr[idx]
        self.last[idx] = b

    def since(self, idx: np.ndarray, b: np.ndarray, back: int) -> tuple[np.ndarray, np.ndarray]:
        """Totals and reading buckets of rows ``idx`` over the ``back`` buckets up to and
        including ``b`` (``back <= buckets``): ``(sums (m, *shape), buckets read (m,))``."""
        now, then = b % self.slots, (b - back) % self.slots
        sums = self.tot[idx, now] - self.tot[idx, then]  # wrapping arithmetic, like the totals
        return sums, self.nread[idx, now] - self.nread[idx, then]

    def between(self, idx: np.ndarray, b: np.ndarray, newer: int, older: int) -> tuple[np.ndarray, np.ndarray]:
        """As :meth:`since`, over the buckets ``(b - older, b - newer]``."""
        hi, lo = (b - newer) % self.slots, (b - older) % self.slots
        return self.tot[idx, hi] - self.tot[idx, lo], self.nread[idx, hi] - self.nread[idx, lo]


class _NodeRows:
    """Per-node detector state as rows of preallocated arrays, grown as nodes appear.

    Subclasses list their arrays in :meth:`_fields` (name -> per-row shape and dtype).
    Besides the arrays, every node has: the event time of its last accepted sample
    (samples not after it are refused), the event times of its last :data:`SEEN_TS`
    accepted samples (to tell a redelivered sample from a late one), and the batch it
    was last seen in with its rank there (which round of that batch its next sample
    goes to).
    """

    def __init__(self, capacity: int) -> None:
        self.index: dict[str, int] = {}
        self.names: list[str] = []
        self.stamp: list[int] = []
        self.rank: list[int] = []
        self.cap = 0
        self._grow(capacity)

    #: what row arrays start as where not zero: the remembered event times unknown (NaN),
    #: the last accepted one before any (-inf)
    _fills: dict[str, float] = {"seen_ts": np.nan, "last_seen": -np.inf}

    def _fields(self) -> dict[str, tuple[tuple[int, ...], Any]]:
        raise NotImplementedError

    def _rings(self) -> list[TimeRing]:
        return []

    def _all_fields(self) -> dict[str, tuple[tuple[int, ...], Any]]:
        return {**self._fields(), "seen_ts": ((SEEN_TS,), np.float64), "seen_at": ((), np.int64),
                "last_seen": ((), np.float64)}

    def _grow(self, cap: int) -> None:
        self._realloc(cap, slice(0, len(self.names)))
        for ring in self._rings():
            ring.grow(cap)

    def _realloc(self, cap: int, rows: slice | np.ndarray) -> None:
        """The row arrays at ``cap`` rows, holding the old ``rows`` first."""
        for name, (shape, dtype) in self._all_fields().items():
            arr = _filled((cap, *shape), self._fills.get(name, 0), dtype)
            if self.cap:
                kept = getattr(self, name)[rows]
                arr[:len(kept)] = kept
            setattr(self, name, arr)
        self.cap = cap

    def _add(self, name: str) -> int:
        i = len(self.names)
        if i >= self.cap:
            self._grow(self.cap + max(64, self.cap // 4))
        self.index[name] = i
        self.names.append(name)
        self.stamp.append(0)
        self.rank.append(0)
        return i

    def forget(self, names: Iterable[str]) -> int:
        """Free the rows of ``names`` (nodes this worker no longer reads); the arrays are
        compacted and shrunk. How many rows were freed."""
        drop = {self.index[n] for n in names if n in self.index}
        if not drop:
            return 0
        keep = np.fromiter((i for i in range(len(self.names)) if i not in drop), dtype=np.int64)
        n = len(keep)
        cap = max(64, n + n // 4)
        self._realloc(cap, keep)
        for ring in self._rings():
            ring.select(keep, cap)
        for attr in ("names", "stamp", "rank", *self._row_lists()):
            old_list = getattr(self, attr)
            setattr(self, attr, [old_list[i] for i in keep])
        self.index = {name: i for i, name in enumerate(self.names)}
        self._selected(keep)
        return len(drop)

    def _row_lists(self) -> tuple[str, ...]:
        """Per-row Python lists of a subclass (kept in step with the arrays)."""
        return ()

    def _selected(self, keep: np.ndarray) -> None:
        """A subclass's other per-row state after :meth:`forget` kept rows ``keep``."""

    def accept(self, i: int, ts: float, batch: int) -> int | None:
        """The round of batch ``batch`` that node ``i``'s sample at ``ts`` goes to, or
        None when the sample is late (not after the node's last accepted one)."""
        if ts <= self.last_seen[i]:
            return None
        self.last_seen[i] = ts
        if self.stamp[i] != batch:
            self.stamp[i] = batch
            self.rank[i] = 0
            return 0
        self.rank[i] += 1
        return self.rank[i]

    def remember(self, idx: np.ndarray, ts: np.ndarray) -> None:
        """Note the event times ``ts`` of accepted samples of distinct rows ``idx``."""
        self.seen_ts[idx, self.seen_at[idx] % SEEN_TS] = ts
        self.seen_at[idx] += 1

    def refusal(self, i: int, ts: float) -> str:
        """Why node ``i``'s sample at ``ts`` was refused: ``duplicate`` when a sample
        with that event time was accepted (a redelivery), else ``late``."""
        return "duplicate" if ts == self.last_seen[i] or bool((self.seen_ts[i] == ts).any()) else "late"

    def nbytes(self) -> int:
        return sum(getattr(self, f).nbytes for f in self._all_fields()) + sum(r.nbytes() for r in self._rings())


class GpuFleetState(_NodeRows):
    """Detector state of every node of one GPU count, as arrays indexed by node.

    Per node: the last cumulative counters, and :class:`TimeRing` totals of the counter
    increments (the rate tests) and of thermally throttled samples (the throttle test),
    so the sum over any window is a difference of two ring entries.  Scoring a window
    costs O(GPUs), not O(window x GPUs), and all nodes of a batch are scored in one call.
    """

    def __init__(self, gpus: int, window_buckets: int, throttle_buckets: int, bucket_s: float,
                 capacity: int = 64) -> None:
        self.g, self.tb = gpus, throttle_buckets
        self.rates = TimeRing((len(RATE_COUNTERS), gpus), window_buckets, bucket_s, capacity)
        #: per GPU: thermally throttled samples; the last column: samples
        self.throttled = TimeRing((gpus + 1,), throttle_buckets, bucket_s, capacity)
        #: univariate baselines of busy GPUs' readings (rows: node row x GPUs + GPU), made
        #: by :class:`GpuDetection` when enabled
        self.banks: dict[str, UnivariateDetector] = {}
        super().__init__(capacity)

    #: the last known counters: none known until a node reports them
    _fills = {**_NodeRows._fills, "prev": np.nan}

    def _rings(self) -> list[TimeRing]:
        return [self.rates, self.throttled]

    def _selected(self, keep: np.ndarray) -> None:
        g = self.g
        series = (keep[:, None] * g + np.arange(g)).ravel()
        for bank in self.banks.values():
            bank.select_rows(series)

    def _fields(self) -> dict[str, tuple[tuple[int, ...], Any]]:
        g, c, tb = self.g, len(RATE_COUNTERS), self.tb
        return {
            "count": ((), np.int64),
            "prev": ((c + 1, g), np.float64),          # + ecc_dbe
            # the hottest throttled reading of each throttle bucket (evidence), and its bucket
            "tmax": ((tb + 1, g), np.float16), "tstamp": ((tb + 1,), np.int64),
            # whether each GPU was busy at the last sample, and since when (event time)
            "busy": ((g,), np.bool_), "busy_since": ((g,), np.float64),
        }

    def nbytes(self) -> int:
        return super().nbytes() + sum(b.state_nbytes() for b in self.banks.values())

    def node(self, name: str) -> int:
        i = self.index.get(name)
        if i is None:
            i = self._add(name)
        return i


class _FleetRows:
    """What GPU and fabric detection share about their per-node rows: room made before
    the nodes arrive, and the rows of nodes gone to another worker freed."""

    capacity: int
    fleets: dict[int, Any]
    cooldown: Cooldown

    @property
    def nodes(self) -> int:
        """Distinct nodes with state here (a node whose GPU or port count changed has a row
        in each of its fleets): a pass over every node, for reports."""
        return len({n for f in self.fleets.values() for n in f.names})

    @property
    def rows(self) -> int:
        """Node rows held here, without a pass over the nodes: for the hot path, where a
        change of it says that new nodes arrived."""
        return sum(len(f.names) for f in self.fleets.values())

    def nbytes(self) -> int:
        """Bytes of the per-node arrays of every fleet."""
        return sum(f.nbytes() for f in self.fleets.values())

    refused: list[Refused]
    late: int
    duplicates: int

    def _refuse(self, refused: list[tuple[int, _NodeRows, int, str, float]]) -> None:
        """Note the samples refused (position, fleet, row, node, event time) and count them."""
        self.refused = [Refused(pos, f.refusal(i, ts), name, ts, float(f.last_seen[i]))
                        for pos, f, i, name, ts in refused]
        dup = sum(r.why == "duplicate" for r in self.refused)
        self.duplicates += dup
        self.late += len(self.refused) - dup

    def reserve(self, rows: int) -> None:
        """Make room for ``rows`` nodes per fleet before they arrive (growing the arrays a
        quarter at a time as nodes appear costs a copy each time)."""
        self.capacity = max(64, rows)
        for f in self.fleets.values():
            if f.cap < self.capacity:
                f._grow(self.capacity)

    def forget(self, names: Iterable[str]) -> int:
        """Free the state of ``names`` (their partitions went to another worker): a node
        seen again starts over, as a new node. How many nodes were freed. (The fabric
        model and its training sample stay: they describe the fabric, not one node.)"""
        gone = set(names)
        self.cooldown.last = {k: v for k, v in self.cooldown.last.items() if k[0] not in gone}
        freed = {n for f in self.fleets.values() for n in f.names if n in gone}
        for f in self.fleets.values():
            f.forget(gone)
        return len(freed)


class GpuDetection(_FleetRows):
    """Runs the GPU detectors over batches of :class:`GpuSample`, vectorised over nodes.

    A batch is processed in rounds: round *k* holds the *k*-th sample of every node in
    the batch, so each round touches each node at most once and is one set of array
    operations.  In steady state (one sample per node per batch) a batch is one round;
    a backlog read in large batches gives the same findings, step by step.
    """

    def __init__(self, cfg: DetectorSettings, *, capacity: int = 64) -> None:
        self.cfg = cfg
        self.capacity = max(64, capacity)
        self.hard = HardFaultDetector()
        self.xid = XidDetector()
        self.wb, self.rb, self.tb = cfg.buckets(cfg.window_s), cfg.buckets(cfg.recent_s), cfg.buckets(
            cfg.throttle_window_s)
        kw = dict(window=self.wb, recent=self.rb, alpha=cfg.alpha, min_events=cfg.min_events)
        self.rates = {
            "ecc_sbe": RateChangeDetector(**kw, kind="ecc_sbe_rate", fault_class="node_degrading"),
            "nvlink": RateChangeDetector(**kw, kind="nvlink_error_rate", fault_class="nvlink"),
            "pcie": RateChangeDetector(**kw, kind="pcie_replay_rate", fault_class="node_degrading"),
        }
        self.throttle = ThrottleDetector(min_fraction=cfg.throttle_fraction)  # over throttle_window_s (detect_counts)
        self.univariate = cfg.univariate
        self.fleets: dict[int, GpuFleetState] = {}
        self.cooldown = Cooldown(cfg.anomaly_cooldown_s)
        #: samples refused so far, late and duplicate
        self.late = 0
        self.duplicates = 0
        #: the samples the last :meth:`process` call refused
        self.refused: list[Refused] = []
        self._batch = 0

    def _fleet(self, g: int) -> GpuFleetState:
        f = self.fleets.get(g)
        if f is None:
            f = self.fleets[g] = GpuFleetState(g, self.wb, self.tb, self.cfg.bucket_s, capacity=self.capacity)
            if self.univariate:
                th = self.cfg.univariate_threshold
                f.banks = {"temp": _bank("temp_drift", th), "power": _bank("power_drift", th)}
        return f

    def process(self, samples: GpuBatch | Sequence[GpuSample]) -> list[Anomaly]:
        """Update the state with ``samples`` (any order of nodes) and return anomalies.
        ``samples`` is a decoded batch (:func:`schemas.columns.decode_gpu_batch` with
        :data:`GPU_DETECTION_COLUMNS`) or records."""
        b = samples if isinstance(samples, GpuBatch) else GpuBatch.from_records(samples, GPU_DETECTION_COLUMNS)
        for group in b.groups.values():
            if missing := [c for c in GPU_DETECTION_COLUMNS if c not in group.columns]:
                raise ValueError(f"GPU detection needs the columns {', '.join(missing)} (decode with decode_gpu)")
        self._batch += 1
        if len(b.groups) == 1 and len(set(b.node)) == len(b.node):
            return self._once_each(b)
        # One pass in arrival order: drop duplicates and out-of-order samples, and number
        # the rest per node: the k-th accepted sample of a node in this batch goes to
        # round k of its fleet (nodes grouped by GPU count).
        out: list[Anomaly] = []
        rounds_by_g: dict[int, list[tuple[list[int], list[int]]]] = {}
        batch = self._batch
        fleets = self.fleets
        refused: list[tuple[int, _NodeRows, int, str, float]] = []
        for pos, (name, ts, g) in enumerate(zip(b.node, b.ts.tolist(), b.gpus.tolist(), strict=True)):
            f = fleets.get(g) or self._fleet(g)
            i = f.index.get(name)
            if i is None:
                i = f.node(name)
            k = f.accept(i, ts, batch)
            if k is None:
                refused.append((pos, f, i, name, ts))
                continue
            rounds = rounds_by_g.get(g)
            if rounds is None:
                rounds = rounds_by_g[g] = [([], [])]
            if k == len(rounds):
                rounds.append(([], []))
            rounds[k][0].append(i)
            rounds[k][1].append(pos)
        for g, rounds in rounds_by_g.items():
            f = fleets[g]
            for rows, positions in rounds:
                out.extend(self._round(f, np.asarray(rows, dtype=np.int64), np.asarray(positions, dtype=np.int64), b))
        self._refuse(refused)
        out.sort(key=lambda a: a.ts)
        return out

    def _once_each(self, b: GpuBatch) -> list[Anomaly]:
        """:meth:`process` for the usual batch: one GPU count, no node twice. One round,
        with late and duplicate samples found over the whole batch at once."""
        [g] = b.groups
        f = self.fleets.get(g) or self._fleet(g)
        rows = list(map(f.index.get, b.node))
        if None in rows:
            rows = [f.node(name) if i is None else i for i, name in zip(rows, b.node, strict=True)]
        idx = np.asarray(rows, dtype=np.int64)
        ok = b.ts > f.last_seen[idx]
        refused: list[tuple[int, _NodeRows, int, str, float]] = []
        if ok.all():
            pos = np.arange(len(idx))
        else:
            pos = np.flatnonzero(ok)
            refused = [(p, f, rows[p], b.node[p], float(b.ts[p])) for p in np.flatnonzero(~ok).tolist()]
            idx = idx[pos]
        f.last_seen[idx] = b.ts[pos]
        out = self._round(f, idx, pos, b) if len(pos) else []
        self._refuse(refused)
        out.sort(key=lambda a: a.ts)
        return out

    def _round(self, f: GpuFleetState, idx: np.ndarray, pos: np.ndarray, b: GpuBatch) -> list[Anomaly]:
        """One round: the samples at batch positions ``pos``, of the distinct node rows ``idx``."""
        out: list[Anomaly] = []
        m, g = len(idx), f.g
        cols = b.groups[g].columns
        local = b.local[pos]
        names = [b.node[p] for p in pos.tolist()]
        ts = b.ts[pos]
        tsl = ts.tolist()
        raw = np.stack([cols[name][local] for name in DETECTOR_FIELDS], axis=1)  # (m, 9, g); NaN: unknown
        cur = np.stack([raw[:, SBE], raw[:, NVL_CRC] + raw[:, NVL_REPLAY] + raw[:, NVL_RECOVERY], raw[:, PCIE],
                        raw[:, DBE]], axis=1)  # (m, 4, g)
        # A counter that went down was reset (driver reload): count no increment. An
        # unknown count (null, absent, or none known before) is no increment either, and
        # the last known count stays.
        prev = f.prev[idx]
        known = ~np.isnan(cur)
        delta = np.maximum(cur - prev, 0.0)
        delta[~known | np.isnan(prev)] = 0.0
        delta[f.count[idx] == 0] = 0.0
        f.prev[idx] = np.where(known, cur, prev)
        remap = raw[:, REMAP_FAILURE] > 0  # NaN (unknown) is no flag
        lost = raw[:, LOST] > 0
        th = raw[:, THROTTLE]
        thermal = thermal_mask(np.where(np.isnan(th), 0.0, th).astype(np.int64))
        # temperatures matter only as evidence of throttling: kept for throttled samples
        temp = np.where(thermal != 0, cols["temp"][local], np.nan)
        dbe = delta[:, 3]
        if dbe.any() or remap.any() or lost.any():
            for fd in self.hard.detect(dbe, remap, lost):
                node, t = names[fd.index], tsl[fd.index]
                if self.cooldown.allow((node, fd.gpu, fd.kind), t):
                    out.append(_anomaly("gpu_hard", node, fd, t))
        if b.xids or b.sxids:
            at = {p: k for k, p in enumerate(pos.tolist())}
            xids = [(at[p], x) for p, x in b.xids if p in at]
            if xids:
                arr = np.array([(k, -1 if x.gpu is None else x.gpu, x.code) for k, x in xids], dtype=np.int64)
                for fd in self.xid.detect(arr[:, 2], arr[:, 0], arr[:, 1], [x.detail for _, x in xids],
                                          [x.count for _, x in xids]):
                    node, t = names[fd.index], tsl[fd.index]
                    if self.cooldown.allow((node, fd.gpu, fd.kind, fd.evidence.get("xid")), t):
                        out.append(_anomaly("xid", node, fd, t))
            sxids = [(at[p], x) for p, x in b.sxids if p in at]
            if sxids:
                for fd in sxid_findings([x.code for _, x in sxids], [k for k, _ in sxids], [x.fatal for _, x in sxids],
                                        [x.detail for _, x in sxids], [x.switch_pci_bus_id for _, x in sxids]):
                    node, t = names[fd.index], tsl[fd.index]
                    if self.cooldown.allow((node, fd.evidence.get("switch_pci"), fd.kind, fd.evidence.get("sxid")), t):
                        out.append(_anomaly("sxid", node, fd, t, subject_type="node"))
        # event-time windows: counter increments and throttled samples per bucket
        f.remember(idx, ts)
        bk = f.rates.bucket(ts)
        f.count[idx] += 1
        f.rates.add(idx, bk, delta[:, :3])
        throttled = thermal != 0
        f.throttled.add(idx, bk, np.concatenate([throttled, np.ones((m, 1), dtype=bool)], axis=1))
        slot = bk % (f.tb + 1)
        fresh = f.tstamp[idx, slot] != bk
        f.tmax[idx, slot] = np.where(fresh[:, None], temp, np.fmax(f.tmax[idx, slot].astype(np.float64), temp))
        f.tstamp[idx, slot] = bk
        # rate-change tests: the recent part against the rest of the window
        k_base, e_base = f.rates.between(idx, bk, self.rb, self.wb)
        k_rec, e_rec = f.rates.since(idx, bk, self.rb)
        for c, name in enumerate(RATE_COUNTERS):
            det = self.rates[name]
            for fd in det.detect_sums(k_base[:, c], k_rec[:, c], e_base, e_rec):
                node, t = names[fd.index], tsl[fd.index]
                if self.cooldown.allow((node, fd.gpu, fd.kind), t):
                    fd.evidence.update(window_s=self.cfg.window_s, recent_s=self.cfg.recent_s,
                                       bucket_s=self.cfg.bucket_s)
                    win = Window(start=t - self.cfg.window_s, end=t)
                    out.append(_anomaly("rate_change", node, fd, t, window=win))
        # sustained thermal throttling over the throttle window
        sums, read = f.throttled.since(idx, bk, self.tb)
        n_samples, n_throttled = sums[:, g], sums[:, :g]
        warm = (read >= max(1, self.tb // 2)) & (n_samples >= self.throttle.warmup)
        if (warm[:, None] & (n_throttled >= self.throttle.min_fraction * n_samples[:, None])).any():
            sel = np.flatnonzero(warm)
            recent = f.tstamp[idx[sel]] > (bk[sel] - self.tb)[:, None]                      # (n, tb + 1)
            tt = np.where(recent[:, :, None], f.tmax[idx[sel]].astype(np.float64), np.nan)
            max_temp = np.where(np.isnan(tt), -np.inf, tt).max(axis=1)
            max_temp[np.isneginf(max_temp)] = np.nan
            for fd in self.throttle.detect_counts(n_throttled[sel], n_samples[sel], max_temp):
                k = int(sel[fd.index])
                node, t = names[k], tsl[k]
                if self.cooldown.allow((node, fd.gpu, fd.kind), t):
                    fd.evidence["window_s"] = self.cfg.throttle_window_s
                    out.append(_anomaly("throttle", node, fd, t))
        if f.banks:
            out.extend(self._univariate_round(f, idx, local, names, ts, cols))
        return out

    def _univariate_round(self, f: GpuFleetState, idx: np.ndarray, local: np.ndarray, names: list[str],
                          ts: np.ndarray, cols: dict[str, np.ndarray]) -> list[Anomaly]:
        """Temperature and power of every GPU busy for :data:`BUSY_SETTLE_S` into their
        baselines (one row per node row and GPU); deviations are info anomalies."""
        g = f.g
        r = [cols[name][local] for name in ("util", "temp", "power")]
        util = r[0]
        busy = util > BUSY_UTIL  # a null utilisation is not busy
        since = np.where(busy & ~f.busy[idx], ts[:, None], f.busy_since[idx])
        f.busy[idx] = busy
        f.busy_since[idx] = since
        k, j = np.nonzero(busy & (ts[:, None] - since >= BUSY_SETTLE_S))
        if not k.size:
            return []
        rows = idx[k] * g + j
        out: list[Anomaly] = []
        for col, name in ((1, "temp"), (2, "power")):
            det = f.banks[name]
            if det.n_series_ != f.cap * g:
                det.grow(f.cap * g)  # the fleet grew: new nodes' rows start in warm-up
            v = r[col][k, j]
            fin = np.isfinite(v)
            brows = rows
            if not fin.all():
                brows, v = rows[fin], v[fin]
            scores = det.update_rows(brows, v, min_score=det.threshold)
            if not (scores >= det.threshold).any():
                continue
            for fd in _univariate_findings(det, scores):
                node_row, gpu = divmod(fd.index, g)
                p = int(np.flatnonzero(idx == node_row)[0])
                node, t = names[p], float(ts[p])
                if self.cooldown.allow((node, gpu, fd.kind), t):
                    ev = {**fd.evidence, "util": float(util[p, gpu]), "busy_s": float(t - since[p, gpu])}
                    fd2 = Finding(kind=fd.kind, fault_class=fd.fault_class, severity=fd.severity, score=fd.score,
                                  index=p, gpu=gpu, evidence=ev)
                    out.append(_anomaly("univariate", node, fd2, t))
        return out


class NetFleetState(_NodeRows):
    """Detector state of every node with ``p`` fabric ports, as arrays indexed by node.

    Per node: the last cumulative counters, :class:`TimeRing` totals of symbol-error
    increments (the rate test, as for GPUs), and the running totals of every counter
    over the last ``feature_samples`` samples (the learned model's features).
    """

    def __init__(self, p: int, window_buckets: int, bucket_s: float, capacity: int = 64,
                 feature_samples: int = 6) -> None:
        self.p, self.fw = p, feature_samples
        self.symbols = TimeRing((p,), window_buckets, bucket_s, capacity)
        self.wiring: list[tuple[tuple[str, str], ...]] = []
        #: a stable hash of each node's name (the training sample's keys)
        self.hkey: list[int] = []
        self.ports: list[tuple[str, ...]] = []
        self.switches: list[tuple[str, ...]] = []
        super().__init__(capacity)

    def _rings(self) -> list[TimeRing]:
        return [self.symbols]

    def _row_lists(self) -> tuple[str, ...]:
        return ("wiring", "hkey", "ports", "switches")

    def _fields(self) -> dict[str, tuple[tuple[int, ...], Any]]:
        p = self.p
        fw, c = self.fw, len(FABRIC_COUNTERS)
        return {"count": ((), np.int64), "prev": ((c, p), np.float64),
                # running totals of every counter and their times over the feature window
                "ftot": ((c, p), np.float64), "fring": ((fw + 1, c, p), np.float64),
                "fts": ((fw + 1,), np.float64), "fhit": ((p,), np.int16),
                # a counter of the port is unknown now (no PMA, saturated); highest rate it ran at
                "unknown": ((p,), bool), "best": ((p,), np.float64)}

    def node(self, name: str, wiring: tuple[tuple[str, str], ...]) -> int:
        """Row of ``name``; a node whose ports or cabling (port -> switch) changed starts
        over (a new window)."""
        ports = tuple(p for p, _ in wiring)
        switches = tuple(sw for _, sw in wiring)
        i = self.index.get(name)
        if i is None:
            i = self._add(name)
            self.hkey.append(zlib.crc32(name.encode()))
            self.wiring.append(wiring)
            self.ports.append(ports)
            self.switches.append(switches)
        elif self.wiring[i] != wiring:
            self.wiring[i], self.ports[i], self.switches[i] = wiring, ports, switches
            self.count[i] = 0
            self.symbols.reset(i)
            self.ftot[i] = 0
            self.fhit[i] = 0
            self.unknown[i] = False
            self.best[i] = 0.0
        return i


class NetworkDetection(_FleetRows):
    """Fast rules (link down, link flap) and a symbol-error rate test per port, vectorised
    over nodes with the same number of ports, in rounds as :class:`GpuDetection`."""

    def node_switches(self) -> dict[str, tuple[str, ...]]:
        """Each node's switches, by port, as its last sample wired them (for the dashboard)."""
        out: dict[str, tuple[str, ...]] = {}
        for f in self.fleets.values():
            for name, sws in zip(f.names, f.switches):
                if name is not None:
                    out[name] = sws
        return out

    def __init__(self, cfg: DetectorSettings, *, capacity: int = 64, net: NetworkSettings | None = None,
                 seed: int = 0) -> None:
        self.cfg = cfg
        self.net = net or NetworkSettings()
        self.capacity = max(64, capacity)
        self.seed = seed
        #: fitted models as (event time from which each scores, model), oldest first
        self.models: list[tuple[float, PortModel]] = []
        self.fitted_at = -np.inf  # the grid point of the last fit (event time)
        self.fits = 0
        #: healthy feature rows kept for (re)fitting: per FIT_GRID_S cell of event time, the
        #: rows with the smallest stable hashes of (node, port, time): the same rows
        #: whatever the order and batching they arrive in (bottom-k sampling), and a cell's
        #: rows are never pushed out by later ones
        self.cells: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self.cells_kept = max(1, int(np.ceil(self.net.refit_s / FIT_GRID_S)))
        self.cell_cap = max(1, RESERVOIR // self.cells_kept)
        self.reservoir_seen = 0
        self.score_s = 0.0
        self.scored_rows = 0
        self.wb, self.rb = cfg.buckets(cfg.window_s), cfg.buckets(cfg.recent_s)
        self.rate = RateChangeDetector(
            window=self.wb, recent=self.rb, alpha=cfg.alpha, min_events=cfg.min_events,
            kind="symbol_error_rate", fault_class="node_network",
        )
        self.fleets: dict[int, NetFleetState] = {}
        self.cooldown = Cooldown(cfg.anomaly_cooldown_s)
        self.late = 0
        self.duplicates = 0
        self.refused: list[Refused] = []
        self._batch = 0

    @property
    def model(self) -> PortModel:
        """The newest fitted model (an unfitted one before the first fit)."""
        return self.models[-1][1] if self.models else PortModel(self.net.model, seed=self.seed)

    def process(self, samples: Iterable[NetworkSample]) -> list[Anomaly]:
        out: list[Anomaly] = []
        rounds_by_p: dict[int, list[list[tuple[int, NetworkSample]]]] = {}
        self._batch += 1
        batch = self._batch
        refused: list[tuple[int, _NodeRows, int, str, float]] = []
        for pos, s in enumerate(samples):
            p = len(s.ports)
            f = self.fleets.get(p)
            if f is None:
                f = self.fleets[p] = NetFleetState(p, self.wb, self.cfg.bucket_s, self.capacity,
                                                   self.net.feature_samples)
            i = f.index.get(s.node)
            wiring = tuple(map(_WIRING, s.ports))
            if i is None or f.wiring[i] != wiring:
                i = f.node(s.node, wiring)
            k = f.accept(i, s.ts, batch)
            if k is None:
                refused.append((pos, f, i, s.node, s.ts))
                continue
            rounds = rounds_by_p.setdefault(p, [[]])
            if k == len(rounds):
                rounds.append([])
            rounds[k].append((i, s))
        for p, rounds in rounds_by_p.items():
            for rnd in rounds:
                out.extend(self._round(self.fleets[p], rnd))
        self._refuse(refused)
        out.sort(key=lambda a: a.ts)
        return out

    def _round(self, f: NetFleetState, rnd: list[tuple[int, NetworkSample]]) -> list[Anomaly]:
        out: list[Anomaly] = []
        chain = itertools.chain.from_iterable
        idx = np.fromiter((i for i, _ in rnd), dtype=np.int64, count=len(rnd))
        ss = [s for _, s in rnd]
        m, p = len(ss), f.p
        c = len(FABRIC_COUNTERS)
        nan = np.nan
        ports = list(chain(map(_PORTS, ss)))
        # numpy reads an unknown (null) counter as NaN
        cur = np.fromiter(chain(map(_PORT_COUNTERS, ports)), dtype=np.float64,
                          count=m * p * c).reshape(m, p, c).transpose(0, 2, 1)  # (m, 8, p)
        down = (np.asarray(list(map(_STATE, ports))) == "down").reshape(m, p)
        first = f.count[idx] == 0
        prev = np.where(first[:, None, None], nan, f.prev[idx])
        # an unknown counter (no PMA, saturated) has no increments, and its last known value
        # is kept; a counter that went down was reset
        with np.errstate(invalid="ignore"):
            delta = np.nan_to_num(np.maximum(cur - prev, 0.0), nan=0.0)
        known = ~np.isnan(cur)
        f.prev[idx] = np.where(known, cur, prev)
        f.unknown[idx] = ~known.all(axis=1)
        out.extend(self._links(f, rnd, ss, down))
        inc_down = delta[:, 2]
        flagged = down | (inc_down > 0)
        if flagged.any():
            for k, j in zip(*np.nonzero(flagged), strict=True):
                s, i = ss[k], rnd[k][0]
                port = f.ports[i][j]
                kind = "link_down" if down[k, j] else "link_flap"
                if self.cooldown.allow((s.node, port, kind), s.ts):
                    fd = Finding(kind=kind, fault_class="node_network", severity="warning",
                                 score=float(inc_down[k, j] + down[k, j]), index=0, gpu=None,
                                 evidence={"port": port, "switch": f.switches[i][j],
                                           "link_downed_delta": int(inc_down[k, j]),
                                           "state": "down" if down[k, j] else "up"})
                    out.append(_anomaly("link_rules", s.node, fd, s.ts, subject_type="port", subject=f"{s.node}/{port}"))
        count = f.count[idx]
        ts = np.fromiter((s.ts for s in ss), dtype=np.float64, count=m)
        f.remember(idx, ts)
        b = f.symbols.bucket(ts)
        f.symbols.add(idx, b, delta[:, 0])
        f.ftot[idx] += delta
        f.fring[idx, count % (f.fw + 1)] = f.ftot[idx]
        f.fts[idx, count % (f.fw + 1)] = ts
        count = count + 1
        f.count[idx] = count
        out.extend(self._model_round(f, rnd, idx, count, flagged))
        k_base, e_base = f.symbols.between(idx, b, self.rb, self.wb)
        k_rec, e_rec = f.symbols.since(idx, b, self.rb)
        for fd in self.rate.detect_sums(k_base, k_rec, e_base, e_rec):
            s, i = ss[fd.index], rnd[fd.index][0]
            port = f.ports[i][fd.gpu] if fd.gpu is not None else "?"
            if self.cooldown.allow((s.node, port, fd.kind), s.ts):
                ev = {**fd.evidence, "port": port, "switch": f.switches[i][fd.gpu] if fd.gpu is not None else None,
                      "window_s": self.cfg.window_s, "recent_s": self.cfg.recent_s, "bucket_s": self.cfg.bucket_s}
                f2 = Finding(kind=fd.kind, fault_class=fd.fault_class, severity=fd.severity, score=fd.score,
                             index=fd.index, gpu=None, evidence=ev)
                out.append(_anomaly("fabric_rate", s.node, f2, s.ts, subject_type="port",
                                    subject=f"{s.node}/{port}"))
        return out

    def _links(self, f: NetFleetState, rnd: list[tuple[int, NetworkSample]], ss: list[NetworkSample],
               down: np.ndarray) -> list[Anomaly]:
        """Ports that trained below their rated speed, their peers or their own past (link_degraded)."""
        m, p = down.shape
        rate = np.fromiter(map(_RATE, itertools.chain.from_iterable(map(_PORTS, ss))), dtype=np.float64,
                           count=m * p).reshape(m, p)  # null: NaN
        if np.isnan(rate).all():
            return []
        codes: dict[tuple[str, str | None], int] = {}
        group = np.fromiter((codes.setdefault((q.hca or _driver(q.port), q.link_layer), len(codes))
                             for s in ss for q in s.ports), dtype=np.int64, count=m * p).reshape(m, p)
        rated_cfg = self.net.rated_gbps
        rated = np.full((m, p), np.nan)
        if rated_cfg:
            for k, s in enumerate(ss):
                for j, q in enumerate(s.ports):
                    v = rated_cfg.get(q.port) or rated_cfg.get(q.port.split("/", 1)[0]) or rated_cfg.get("*")
                    rated[k, j] = np.nan if v is None else v
        idx = np.fromiter((i for i, _ in rnd), dtype=np.int64, count=m)
        up = ~down
        flag, expected, basis = links_below(rate, group, up, f.best[idx], rated)
        f.best[idx] = np.where(up & ~np.isnan(rate), np.fmax(f.best[idx], rate), f.best[idx])
        out: list[Anomaly] = []
        for k, j in zip(*np.nonzero(flag), strict=True):
            s, i = ss[k], rnd[k][0]
            q = s.ports[j]
            if self.cooldown.allow((s.node, q.port, "link_degraded"), s.ts):
                fd = Finding(kind="link_degraded", fault_class="node_network", severity="warning",
                             score=float(1.0 - rate[k, j] / expected[k, j]), index=0, gpu=None,
                             evidence={"port": q.port, "switch": f.switches[i][j], "rate_gbps": float(rate[k, j]),
                                       "expected_gbps": float(expected[k, j]), "width": q.width, "speed": q.speed,
                                       "basis": LINK_BASIS[int(basis[k, j])]})
                out.append(_anomaly("link_rules", s.node, fd, s.ts, subject_type="port", subject=f"{s.node}/{q.port}"))
        return out

    # ------------------------------------------------------------------ learned model

    def _model_round(self, f: NetFleetState, rnd: list[tuple[int, NetworkSample]], idx: np.ndarray,
                     count: np.ndarray, ruled: np.ndarray) -> list[Anomaly]:
        """Features of every port with a full feature window; healthy ones feed the
        training reservoir, and (once fitted) the model scores all of them at once."""
        full = count > f.fw
        if not full.any():
            return []
        sel = np.flatnonzero(full)
        fi, fc, fw = idx[sel], count[sel], f.fw
        now, then = (fc - 1) % (fw + 1), (fc - 1 - fw) % (fw + 1)
        inc = np.maximum(f.fring[fi, now] - f.fring[fi, then], 0.0)          # (n, 8, p)
        secs = f.fts[fi, now] - f.fts[fi, then]
        feats = port_features(inc, secs)                                     # (n, p, 7)
        rows = feats.reshape(-1, feats.shape[2])
        out: list[Anomaly] = []
        flagged_rows = np.zeros(len(rows), dtype=bool)
        # each window is scored by the model in force at its event time
        ts_sel = f.fts[fi, now]
        which = self._model_at(ts_sel)
        if (which >= 0).any():
            hit = np.zeros((len(sel), f.p), dtype=bool)
            evidence: dict[tuple[int, int], Any] = {}
            scored_by: dict[tuple[int, int], PortModel] = {}
            unknown = f.unknown[fi].reshape(-1)
            for m in np.unique(which[which >= 0]).tolist():
                model = self.models[m][1]
                samples = np.flatnonzero(which == m)
                ridx = (samples[:, None] * f.p + np.arange(f.p)).reshape(-1)
                t0 = time.perf_counter()
                _, flags = model.flag(rows[ridx])
                self.score_s += time.perf_counter() - t0
                self.scored_rows += len(ridx)
                for fl in flags:
                    r = int(ridx[fl.index])
                    if unknown[r]:  # a feature from an unknown counter reads as 0: no verdict on it
                        continue
                    k, j = divmod(r, f.p)
                    hit[k, j] = True
                    evidence[(k, j)] = fl
                    scored_by[(k, j)] = model
                    flagged_rows[r] = True
            f.fhit[fi] = np.where(hit, f.fhit[fi] + 1, 0)
            confirmed = f.fhit[fi] == self.net.confirm
            for k, j in zip(*np.nonzero(confirmed), strict=True):
                fl = evidence[(k, j)]
                s, i = rnd[sel[k]][1], rnd[sel[k]][0]
                port, switch = f.ports[i][j], f.switches[i][j]
                top = next(iter(fl.features), "")
                kind, sev = ("congestion", "info") if top == "wait_per_mb" else ("port_errors", "warning")
                if self.cooldown.allow((s.node, port, kind), s.ts):
                    model = scored_by[(k, j)]
                    fd = Finding(kind=kind, fault_class="node_network", severity=sev, score=fl.score, index=0,
                                 gpu=None, evidence={"port": port, "switch": switch, "model": model.name,
                                                     "threshold": round(model.threshold, 4),
                                                     "features": fl.features, "windows": self.net.confirm})
                    out.append(_anomaly("fabric_model", s.node, fd, s.ts, subject_type="port",
                                        subject=f"{s.node}/{port}"))
        # healthy rows (no rule and no model flag on the node) feed the reservoir
        node_ok = ~ruled[sel].any(axis=1)
        ok = np.repeat(node_ok, f.p) & ~flagged_rows & ~f.unknown[fi].reshape(-1)
        if ok.any():
            keys = _row_keys(np.asarray([f.hkey[i] for i in fi.tolist()], dtype=np.uint64), f.p, ts_sel)
            self._keep(rows[ok], keys[ok], np.repeat(ts_sel, f.p)[ok])
        return out

    def _model_at(self, ts: np.ndarray) -> np.ndarray:
        """Index into :attr:`models` of the model in force at each event time (-1: none)."""
        if not self.models:
            return np.full(len(ts), -1, dtype=np.int64)
        starts = np.fromiter((t for t, _ in self.models), dtype=np.float64, count=len(self.models))
        return np.searchsorted(starts, ts, side="right") - 1

    def _keep(self, rows: np.ndarray, keys: np.ndarray, ts: np.ndarray) -> None:
        """Keep the rows with the smallest keys of each FIT_GRID_S cell (bottom-k)."""
        self.reservoir_seen += len(rows)
        cell = np.floor_divide(ts, FIT_GRID_S).astype(np.int64)
        for c in np.unique(cell).tolist():
            sel = cell == c
            kept = self.cells.get(c)
            k_new, r_new = keys[sel], rows[sel]
            if kept is not None:
                if len(kept[0]) >= self.cell_cap:
                    below = k_new < kept[0].max()  # only rows that can get in
                    k_new, r_new = k_new[below], r_new[below]
                    if not len(k_new):
                        continue
                k_new, r_new = np.concatenate([kept[0], k_new]), np.concatenate([kept[1], r_new])
            if len(k_new) > self.cell_cap:
                top = np.argpartition(k_new, self.cell_cap - 1)[: self.cell_cap]
                k_new, r_new = k_new[top], r_new[top]
            self.cells[c] = (k_new, r_new)
        if len(self.cells) > 2 * self.cells_kept + 2:  # cells too old to be fitted on again
            newest = max(self.cells)
            for c in [c for c in self.cells if c <= newest - 2 * self.cells_kept - 2]:
                del self.cells[c]

    def training_rows(self, at: float) -> np.ndarray:
        """The healthy windows of the last ``network.refit_s`` before grid point ``at``, in a
        fixed order (by key): the same rows at any replay speed."""
        hi = int(round(at / FIT_GRID_S))
        parts = [self.cells[c] for c in sorted(self.cells) if hi - self.cells_kept <= c < hi]
        if not parts:
            return np.zeros((0, len(FABRIC_FEATURES)))
        keys = np.concatenate([p[0] for p in parts])
        rows = np.concatenate([p[1] for p in parts])
        return rows[np.argsort(keys, kind="stable")]

    def refit_due(self, watermark: float) -> float | None:
        """The grid point to fit at, once the network watermark has passed it: the first
        with ``network.min_train_rows`` healthy windows before it, then every
        ``network.refit_s``; None when no fit is due."""
        at = np.floor(watermark / FIT_GRID_S) * FIT_GRID_S
        if at <= self.fitted_at:
            return None
        if self.models and at < self.fitted_at + self.net.refit_s:
            return None
        hi = int(round(at / FIT_GRID_S))
        have = sum(len(v[0]) for c, v in self.cells.items() if hi - self.cells_kept <= c < hi)
        return float(at) if have >= self.net.min_train_rows else None

    def fit_model(self, rows: np.ndarray) -> PortModel:
        """A new model fitted on ``rows`` (slow: call it from a worker thread); install it
        with :meth:`install`."""
        return PortModel(self.net.model, seed=self.fits).fit(rows)

    def begin(self, at: float) -> None:
        """A fit at grid point ``at`` has started (the next is due ``refit_s`` later)."""
        self.fitted_at = at
        self.fits += 1

    def install(self, model: PortModel, at: float) -> None:
        """``model``, fitted at grid point ``at``, scores windows from ``at + MODEL_DELAY_S``."""
        self.models = (self.models + [(at + MODEL_DELAY_S, model)])[-3:]

    def waits_for(self, ts: float) -> bool:
        """Whether windows at event time ``ts`` need a fit that has begun but is not installed."""
        pending = self.fitted_at if self.fits and (not self.models or self.models[-1][0] < self.fitted_at
                                                  + MODEL_DELAY_S) else None
        return pending is not None and ts >= pending + MODEL_DELAY_S

    def refit(self, watermark: float) -> bool:
        """Fit in this thread when due (for in-process replays); True if it did."""
        at = self.refit_due(watermark)
        if at is None:
            return False
        self.begin(at)
        self.install(self.fit_model(self.training_rows(at)), at)
        return True


class PeerDetection:
    """Peer comparison within one job: step time (slow node) and GPU power (low); and,
    when enabled, each node's step time in a job against its own baseline (a
    :class:`UnivariateDetector` bank, one row per (job, node))."""

    def __init__(self, cfg: DetectorSettings) -> None:
        self.step = PeerDetector(threshold=cfg.peer_threshold, direction="high", kind="peer_step_time")
        self.power = PeerDetector(threshold=cfg.peer_threshold, direction="low", kind="peer_power")
        self.cooldown = Cooldown(cfg.anomaly_cooldown_s)
        self.univariate = cfg.univariate
        self.step_uv = _bank("step_time_drift", cfg.univariate_threshold)
        #: (job, node) -> row of ``step_uv``; rows of forgotten jobs are reused
        self.rows: dict[tuple[str, str], int] = {}
        self.free: list[int] = []
        #: job -> [attempt, event time of its last progress, its (node, row) pairs]
        self.jobs: dict[str, list] = {}
        self._swept = -np.inf

    def process(self, e: JobEvent) -> list[Anomaly]:
        out: list[Anomaly] = []
        for det, values in ((self.step, e.node_step_times), (self.power, e.node_power)):
            if not values:
                continue
            nodes = list(values)
            arr = np.array([values[n] for n in nodes], dtype=np.float64)
            for f in det.detect(arr):
                node = nodes[f.index]
                if self.cooldown.allow((node, f.kind), e.ts):
                    f2 = Finding(kind=f.kind, fault_class=f.fault_class, severity=f.severity, score=f.score,
                                 index=f.index, gpu=None, evidence={**f.evidence, "job": e.job})
                    out.append(_anomaly("peer", node, f2, e.ts, subject_type="node", subject=node))
        if self.univariate:
            if e.node_step_times:
                out.extend(self._step_drift(e, e.node_step_times))
            if e.event in (JobEventKind.completed, JobEventKind.failed):
                self.forget(e.job)
        return out

    def _step_drift(self, e: JobEvent, values: dict[str, float]) -> list[Anomaly]:
        """Each node's step time in the job against its own baseline (info anomalies)."""
        if e.ts - self._swept >= JOB_IDLE_S / 6:
            self._swept = e.ts
            for job in [j for j, (_, last, _) in self.jobs.items() if e.ts - last > JOB_IDLE_S]:
                self.forget(job)
        job = self.jobs.get(e.job)
        if job is not None and job[0] != e.attempt:
            self.forget(e.job)  # a new attempt (maybe on other nodes) starts over
            job = None
        if job is None:
            job = self.jobs[e.job] = [e.attempt, e.ts, []]
        job[1] = e.ts
        nodes = list(values)
        rows = np.fromiter((self._row(e.job, n, job) for n in nodes), dtype=np.int64, count=len(nodes))
        x = np.fromiter(values.values(), dtype=np.float64, count=len(nodes))
        det = self.step_uv
        scores = det.update_rows(rows, x, min_score=det.threshold)
        out: list[Anomaly] = []
        if not (scores >= det.threshold).any():
            return out
        for fd in _univariate_findings(det, scores):
            node = nodes[int(np.flatnonzero(rows == fd.index)[0])]
            if self.cooldown.allow((node, fd.kind), e.ts):
                f2 = Finding(kind=fd.kind, fault_class=fd.fault_class, severity=fd.severity, score=fd.score,
                             index=0, gpu=None, evidence={**fd.evidence, "job": e.job, "attempt": e.attempt})
                out.append(_anomaly("univariate", node, f2, e.ts, subject_type="node", subject=node))
        return out

    def _row(self, job: str, node: str, entry: list) -> int:
        key = (job, node)
        i = self.rows.get(key)
        if i is None:
            if self.free:
                i = self.free.pop()
            else:
                i = len(self.rows)
                n = self.step_uv.n_series_ or 0
                if i >= n:
                    self.step_uv.grow(n + max(64, n // 4))
            self.rows[key] = i
            entry[2].append((node, i))
        return i

    def forget(self, job: str) -> None:
        """Drop a job's step-time baselines (its rows start from warm-up when reused)."""
        entry = self.jobs.pop(job, None)
        if not entry or not entry[2]:
            return
        freed = [i for _, i in entry[2]]
        for node, _ in entry[2]:
            del self.rows[(job, node)]
        self.step_uv.reset_rows(np.asarray(freed, dtype=np.int64))
        self.free.extend(freed)


def readiness(*, assigned: bool, rebalancing: bool, lags: dict[str, int | None], max_lag: int,
              control_loaded: bool = True) -> dict[str, Any]:
    """What ``/readyz`` answers: ready when the operator's decisions are loaded, the
    consumers have partitions, no rebalance is under way, and the records left to read on
    them (``lags``: per topic-partition, None where not known yet) are at most ``max_lag``."""
    known = [v for v in lags.values() if v is not None]
    lag = sum(max(0, v) for v in known)
    caught_up = lag <= max_lag
    return {"ready": control_loaded and assigned and not rebalancing and caught_up, "assigned": assigned,
            "rebalancing": rebalancing, "control_loaded": control_loaded,
            "caught_up": caught_up, "lag_records": lag, "max_lag": max_lag,
            "partitions": len(lags), "partitions_unknown": len(lags) - len(known)}


class LaggedWatermark:
    """A watermark as it was ``lag_s`` of wall time ago.

    Records processed up to a watermark still have to pass through the later stages
    (anomalies through the node track onto the notices of the job and switch tracks);
    a tick that follows the watermark of a moment ago arrives after them.  Feed it
    ``observe(wall, value)`` regularly (a monotonic wall clock); it answers the newest
    value observed at least ``lag_s`` ago (0 until there is one).
    """

    def __init__(self, lag_s: float) -> None:
        self.lag_s = lag_s
        self.marks: deque[tuple[float, float]] = deque()  # (wall time, watermark), oldest first

    def observe(self, wall: float, value: float) -> float:
        marks = self.marks
        marks.append((wall, value))
        cutoff = wall - self.lag_s
        while len(marks) > 1 and marks[1][0] <= cutoff:
            marks.popleft()  # keep the newest mark at least lag_s old, and those after it
        return marks[0][1] if marks[0][0] <= cutoff else 0.0


class InFlight:
    """Anomalies this worker sent whose correlation its node track has not yet finished.

    The ticks that end a failure's grace and a lone node's switch hold follow the
    telemetry watermark; the anomalies of that time go out through the ``anomalies``
    topic and come back through the node track, whose notices reach the job and switch
    tracks.  A tick must not overtake them: it waits for the oldest event time still
    in flight (:meth:`floor`).  ``sent`` when an anomaly is handed to the producer,
    ``landed`` once the broker placed it (``mine``: in a partition this worker's node
    track reads; one read elsewhere is forgotten, as this worker cannot see it finish),
    ``done`` when the node track has sent what it decided.  An anomaly that is not
    done ``max_wait_s`` of wall time after it was sent (dead-lettered, or its partition
    moved) stops holding the ticks back; each is counted in ``expired``.
    """

    def __init__(self, max_wait_s: float) -> None:
        self.max_wait_s = max_wait_s
        self.expired = 0
        self._count: dict[str, int] = {}  # id -> copies in flight
        self._times: list[tuple[float, str]] = []  # heap of (event time, id), stale entries dropped lazily
        self._sent: deque[tuple[float, str]] = deque()  # (wall time sent, id), oldest first

    def __len__(self) -> int:
        return sum(self._count.values())

    def sent(self, key: str, ts: float, wall: float) -> None:
        self._count[key] = self._count.get(key, 0) + 1
        heapq.heappush(self._times, (ts, key))
        self._sent.append((wall, key))

    def landed(self, key: str, mine: bool) -> None:
        if not mine:
            self._drop(key)

    def done(self, key: str) -> None:
        self._drop(key)

    def _drop(self, key: str) -> None:
        n = self._count.get(key, 0)
        if n > 1:
            self._count[key] = n - 1
        elif n:
            del self._count[key]

    def bound(self, mark: float, wall: float) -> float:
        """``mark``, held back below the oldest event time still in flight."""
        floor = self.floor(wall)
        return mark if floor is None else min(mark, math.nextafter(floor, -math.inf))

    def floor(self, wall: float) -> float | None:
        """The oldest event time of an anomaly still in flight (None: none is)."""
        cutoff = wall - self.max_wait_s
        sent, count = self._sent, self._count
        while sent and (sent[0][0] <= cutoff or sent[0][1] not in count):
            _, key = sent.popleft()
            if key in count:
                self.expired += 1
                self._drop(key)
        times = self._times
        while times and times[0][1] not in count:
            heapq.heappop(times)
        if not count:
            times.clear()
            sent.clear()
            return None
        return times[0][0]


class PartitionWatermark:
    """Event time that every partition of a topic has reached.

    The newest event time seen in each partition, and their minimum: one partition's
    records can be processed seconds of wall time after another's (batches interleave
    partitions), so the newest time seen anywhere would run ahead of events still queued
    elsewhere.  A partition more than ``idle_s`` of event time behind the newest is left
    out (its nodes went away: it must not stop the clock).  Never moves backwards.
    """

    def __init__(self, idle_s: float = 300.0) -> None:
        if idle_s <= 0:
            raise ValueError(f"idle_s must be > 0, got {idle_s}")
        self.idle_s = idle_s
        self.newest: dict[Hashable, float] = {}
        self._value = 0.0

    def update(self, partition: Hashable, ts: float) -> None:
        if ts > self.newest.get(partition, float("-inf")):
            self.newest[partition] = ts

    @property
    def value(self) -> float:
        if self.newest:
            top = max(self.newest.values())
            self._value = max(self._value, min(v for v in self.newest.values() if v >= top - self.idle_s))
        return self._value
