"""Glue between telemetry records and the pure detectors.

Each node gets a fixed-size ring of per-interval counter increments (one row per sample,
one column per GPU or port).  A batch of samples updates the rings, then every detector
scores all the updated nodes at once over stacked arrays.  The rings live in memory:
after a restart a node's window warms up again (detectors return a neutral score while
warming up), which the node track tolerates because degradation needs confirmations.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from detectors import (
    Finding,
    HardFaultDetector,
    PeerDetector,
    RateChangeDetector,
    ThrottleDetector,
    XidDetector,
    thermal_mask,
)
from schemas import Anomaly, FaultClass, GpuSample, JobEvent, NetworkSample, Severity, Window

from .config import DetectorSettings
from .policy import stable_id


class Ring:
    """A (capacity, width) ring buffer of rows; ``ordered()`` returns oldest-first rows."""

    __slots__ = ("buf", "pos", "count")

    def __init__(self, capacity: int, width: int, dtype: type = np.float64) -> None:
        self.buf = np.zeros((capacity, width), dtype=dtype)
        self.pos = 0
        self.count = 0

    def push(self, row: np.ndarray) -> None:
        self.buf[self.pos] = row
        self.pos = (self.pos + 1) % self.buf.shape[0]
        self.count += 1

    @property
    def full(self) -> bool:
        return self.count >= self.buf.shape[0]

    def ordered(self, last: int | None = None) -> np.ndarray:
        out = np.roll(self.buf, -self.pos, axis=0)
        return out if last is None else out[-last:]


def _sev(s: str) -> Severity:
    return Severity(s)


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
#: the per-GPU fields the GPU detectors read, in the order of :func:`_detector_fields`
DETECTOR_FIELDS = ("ecc_sbe", "nvlink_crc", "nvlink_replay", "nvlink_recovery", "pcie_replay", "ecc_dbe",
                   "throttle", "temp", "remap_failure", "lost")


def _detector_fields(ss: Sequence[GpuSample], g: int) -> np.ndarray:
    """The fields of :data:`DETECTOR_FIELDS` of ``ss`` as one (m, 10, g) array.

    One conversion for the whole round when every field is complete (what simulators
    and most agents send); otherwise absent fields and ``null`` entries (unsupported,
    or a lost GPU) count as 0: no evidence, never a fault.
    """
    chain = itertools.chain.from_iterable
    try:
        return np.fromiter(
            chain(chain((s.ecc_sbe, s.nvlink_crc, s.nvlink_replay, s.nvlink_recovery, s.pcie_replay, s.ecc_dbe,
                         s.throttle, s.temp, s.remap_failure, s.lost)) for s in ss),
            dtype=np.float64, count=len(ss) * 10 * g,
        ).reshape(len(ss), 10, g)
    except TypeError:  # a None field or entry
        out = np.zeros((len(ss), len(DETECTOR_FIELDS), g), dtype=np.float64)
        for k, s in enumerate(ss):
            for c, name in enumerate(DETECTOR_FIELDS):
                values = getattr(s, name)
                if values is not None:
                    out[k, c] = [0.0 if v is None else v for v in values]
        return out


class GpuFleetState:
    """Detector state of every node of one GPU count, as arrays indexed by node.

    Per node: the last cumulative counters, and rings of *running totals* of the
    counter increments (``W + 1`` entries), so the sum of increments over any suffix of
    the window is a difference of two ring entries.  Scoring a window costs O(GPUs),
    not O(window x GPUs), and all nodes of a batch are scored in one call.
    """

    def __init__(self, gpus: int, window: int, recent: int, throttle_window: int, capacity: int = 64) -> None:
        self.g, self.w, self.r, self.tw = gpus, window, recent, throttle_window
        self.index: dict[str, int] = {}
        self.names: list[str] = []
        self._alloc(capacity)

    def _alloc(self, cap: int) -> None:
        g, w, tw, c = self.g, self.w, self.tw, len(RATE_COUNTERS)
        old = getattr(self, "count", None)
        n = 0 if old is None else len(self.names)
        fields = {
            "count": ((cap,), np.int64), "last_ts": ((cap,), np.float64),
            "prev": ((cap, c + 1, g), np.float64),          # + ecc_dbe
            # running totals wrap around in 32 bits: differences over a window stay exact
            # as long as one window holds fewer than 2**31 events
            "acc": ((cap, c, g), np.int64), "ring": ((cap, w + 1, c, g), np.int32),
            "th_acc": ((cap, g), np.int64), "th_ring": ((cap, tw + 1, g), np.int16),
            "temp": ((cap, tw, g), np.float16),
        }
        for name, (shape, dtype) in fields.items():
            arr = np.zeros(shape, dtype=dtype)
            if old is not None:
                arr[:n] = getattr(self, name)[:n]
            setattr(self, name, arr)
        self.cap = cap

    def node(self, name: str) -> int:
        i = self.index.get(name)
        if i is None:
            i = len(self.names)
            if i >= self.cap:
                self._alloc(self.cap + max(64, self.cap // 4))
            self.index[name] = i
            self.names.append(name)
            self.last_ts[i] = -np.inf
        return i

    def nbytes(self) -> int:
        return sum(getattr(self, f).nbytes for f in ("count", "last_ts", "prev", "acc", "ring", "th_acc", "th_ring", "temp"))


class GpuDetection:
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
        kw = dict(window=cfg.window, recent=cfg.recent, alpha=cfg.alpha, min_events=cfg.min_events)
        self.rates = {
            "ecc_sbe": RateChangeDetector(**kw, kind="ecc_sbe_rate", fault_class="node_degrading"),
            "nvlink": RateChangeDetector(**kw, kind="nvlink_error_rate", fault_class="nvlink"),
            "pcie": RateChangeDetector(**kw, kind="pcie_replay_rate", fault_class="node_degrading"),
        }
        self.throttle_window = min(60, cfg.window)
        self.throttle = ThrottleDetector(window=self.throttle_window, min_fraction=cfg.throttle_fraction)
        self.fleets: dict[int, GpuFleetState] = {}
        self.cooldown = Cooldown(cfg.anomaly_cooldown_s)
        self.late = 0

    @property
    def nodes(self) -> int:
        return sum(len(f.names) for f in self.fleets.values())

    def nbytes(self) -> int:
        return sum(f.nbytes() for f in self.fleets.values())

    def _fleet(self, g: int) -> GpuFleetState:
        f = self.fleets.get(g)
        if f is None:
            f = self.fleets[g] = GpuFleetState(g, self.cfg.window, self.cfg.recent, self.throttle_window,
                                               capacity=self.capacity)
        return f

    def process(self, samples: Sequence[GpuSample]) -> list[Anomaly]:
        """Update the state with ``samples`` (any order of nodes) and return anomalies."""
        # One pass in arrival order: drop duplicates and out-of-order samples, and number
        # the rest per node: the k-th accepted sample of a node in this batch goes to
        # round k of its fleet (nodes grouped by GPU count).
        out: list[Anomaly] = []
        rounds_by_g: dict[int, list[list[tuple[int, GpuSample]]]] = {}
        last: dict[tuple[int, int], float] = {}
        rank: dict[tuple[int, int], int] = {}
        fleets = self.fleets
        for s in samples:
            g = len(s.util)
            f = fleets.get(g) or self._fleet(g)
            i = f.index.get(s.node)
            if i is None:
                i = f.node(s.node)
            key = (g, i)
            prev = last.get(key)
            if prev is None:
                prev = f.last_ts[i]
            if s.ts <= prev:
                self.late += 1
                continue
            last[key] = s.ts
            k = rank.get(key, 0)
            rank[key] = k + 1
            rounds = rounds_by_g.get(g)
            if rounds is None:
                rounds = rounds_by_g[g] = []
            if k == len(rounds):
                rounds.append([])
            rounds[k].append((i, s))
        for g, rounds in rounds_by_g.items():
            f = fleets[g]
            for rnd in rounds:
                out.extend(self._round(f, rnd))
        out.sort(key=lambda a: a.ts)
        return out

    def _round(self, f: GpuFleetState, rnd: list[tuple[int, GpuSample]]) -> list[Anomaly]:
        out: list[Anomaly] = []
        idx = np.fromiter((i for i, _ in rnd), dtype=np.int64, count=len(rnd))
        ss = [s for _, s in rnd]
        raw = _detector_fields(ss, f.g)
        cur = np.stack([raw[:, 0], raw[:, 1] + raw[:, 2] + raw[:, 3], raw[:, 4], raw[:, 5]], axis=1)  # (m, 4, g)
        ts = np.fromiter((s.ts for s in ss), dtype=np.float64, count=len(ss))
        first = f.count[idx] == 0
        # A counter that went down was reset (driver reload): count no increment.
        delta = np.maximum(cur - f.prev[idx], 0.0)
        delta[first] = 0.0
        f.prev[idx] = cur
        f.last_ts[idx] = ts
        # hard faults: double-bit ECC increments, row-remap failures, lost GPUs
        remap = raw[:, 8] > 0
        lost = raw[:, 9] > 0
        dbe = delta[:, 3]
        if dbe.any() or remap.any() or lost.any():
            for fd in self.hard.detect(dbe, remap, lost):
                s = ss[fd.index]
                if self.cooldown.allow((s.node, fd.gpu, fd.kind), s.ts):
                    out.append(_anomaly("gpu_hard", s.node, fd, s.ts))
        xid_rows = [(k, x.gpu, x.code) for k, s in enumerate(ss) for x in s.xids]
        if xid_rows:
            arr = np.array(xid_rows, dtype=np.int64)
            for fd in self.xid.detect(arr[:, 2], arr[:, 0], arr[:, 1]):
                s = ss[fd.index]
                if self.cooldown.allow((s.node, fd.gpu, fd.kind, fd.evidence.get("xid")), s.ts):
                    out.append(_anomaly("xid", s.node, fd, s.ts))
        # running totals and their rings
        count = f.count[idx]
        f.acc[idx] += delta[:, :3].astype(np.int64)
        f.ring[idx, count % (f.w + 1)] = f.acc[idx].astype(np.int32)  # modulo 2**32
        thermal = thermal_mask(raw[:, 6].astype(np.int64))
        f.th_acc[idx] += thermal
        f.th_ring[idx, count % (f.tw + 1)] = f.th_acc[idx].astype(np.int16)  # modulo 2**16
        f.temp[idx, count % f.tw] = raw[:, 7]
        count = count + 1
        f.count[idx] = count
        # rate-change tests on every full window
        full = count > f.w
        if full.any():
            fi, fc = idx[full], count[full]
            now = f.ring[fi, (fc - 1) % (f.w + 1)]
            at_r = f.ring[fi, (fc - 1 - f.r) % (f.w + 1)]
            at_w = f.ring[fi, (fc - 1 - f.w) % (f.w + 1)]
            k_rec, k_base = now - at_r, at_r - at_w  # int32 arithmetic wraps like the totals
            sel = np.flatnonzero(full)
            for c, name in enumerate(RATE_COUNTERS):
                det = self.rates[name]
                for fd in det.detect_sums(k_base[:, c], k_rec[:, c], f.w - f.r, f.r):
                    s = ss[sel[fd.index]]
                    if self.cooldown.allow((s.node, fd.gpu, fd.kind), s.ts):
                        win = Window(start=s.ts - self.cfg.window, end=s.ts)
                        out.append(_anomaly("rate_change", s.node, fd, s.ts, window=win))
        warm = count > f.tw
        if warm.any():
            wi, wc = idx[warm], count[warm]
            throttled = f.th_ring[wi, (wc - 1) % (f.tw + 1)] - f.th_ring[wi, (wc - 1 - f.tw) % (f.tw + 1)]
            if (throttled >= self.throttle.min_fraction * f.tw).any():
                max_temp = f.temp[wi].max(axis=1).astype(np.float64)
                sel = np.flatnonzero(warm)
                for fd in self.throttle.detect_counts(throttled, f.tw, max_temp):
                    s = ss[sel[fd.index]]
                    if self.cooldown.allow((s.node, fd.gpu, fd.kind), s.ts):
                        out.append(_anomaly("throttle", s.node, fd, s.ts))
        return out


@dataclass
class NetWindow:
    ports: tuple[str, ...]
    switches: tuple[str, ...]
    ts: float = -1.0
    prev: dict[str, np.ndarray] = field(default_factory=dict)
    ring: Ring | None = None


class NetworkDetection:
    """Fast rules (link down) and a symbol-error rate test per port."""

    def __init__(self, cfg: DetectorSettings) -> None:
        self.cfg = cfg
        self.rate = RateChangeDetector(
            window=cfg.window, recent=cfg.recent, alpha=cfg.alpha, min_events=cfg.min_events,
            kind="symbol_error_rate", fault_class="node_network",
        )
        self.windows: dict[str, NetWindow] = {}
        self.cooldown = Cooldown(cfg.anomaly_cooldown_s)
        self.late = 0
        self._pending: dict[int, list] = {}
        self._queued: set[tuple[str, float]] = set()

    def process(self, samples: Iterable[NetworkSample]) -> list[Anomaly]:
        out: list[Anomaly] = []
        touched: dict[str, NetWindow] = {}
        for s in samples:
            ports = tuple(p.port for p in s.ports)
            w = self.windows.get(s.node)
            if w is None or w.ports != ports:
                w = NetWindow(ports=ports, switches=tuple(p.switch for p in s.ports))
                w.ring = Ring(self.cfg.window, len(ports))
                self.windows[s.node] = w
            if s.ts <= w.ts:
                self.late += 1
                continue
            w.ts = s.ts
            sym = np.array([p.symbol_errors for p in s.ports], dtype=np.float64)
            downed = np.array([p.link_downed for p in s.ports], dtype=np.float64)
            down_now = np.array([p.state == "down" for p in s.ports])
            inc_sym = np.zeros(len(ports)) if "sym" not in w.prev else np.maximum(sym - w.prev["sym"], 0)
            inc_down = np.zeros(len(ports)) if "down" not in w.prev else np.maximum(downed - w.prev["down"], 0)
            w.prev["sym"], w.prev["down"] = sym, downed
            assert w.ring is not None
            w.ring.push(inc_sym)
            touched[s.node] = w
            self._queue(s.node, w, last=False)
            for j in np.flatnonzero(down_now | (inc_down > 0)):
                port = ports[j]
                kind = "link_down" if down_now[j] else "link_flap"
                if self.cooldown.allow((s.node, port, kind), s.ts):
                    f = Finding(kind=kind, fault_class="node_network", severity="warning", score=float(inc_down[j] + down_now[j]),
                                index=0, gpu=None, evidence={"port": port, "switch": w.switches[j],
                                                             "link_downed_delta": int(inc_down[j]), "state": "down" if down_now[j] else "up"})
                    out.append(_anomaly("link_rules", s.node, f, s.ts, subject_type="port", subject=f"{s.node}/{port}"))
        for node, w in touched.items():
            self._queue(node, w, last=True)
        pending, self._pending = self._pending, {}
        self._queued.clear()
        for _, items in pending.items():
            for f in self.rate.detect(np.stack([x[2] for x in items])):
                node, ts, _, w = items[f.index]
                port = w.ports[f.gpu] if f.gpu is not None else "?"
                if self.cooldown.allow((node, port, f.kind), ts):
                    ev = {**f.evidence, "port": port, "switch": w.switches[f.gpu] if f.gpu is not None else None}
                    f2 = Finding(kind=f.kind, fault_class=f.fault_class, severity=f.severity, score=f.score,
                                 index=f.index, gpu=None, evidence=ev)
                    out.append(_anomaly("fabric_rate", node, f2, ts, subject_type="port", subject=f"{node}/{port}"))
        out.sort(key=lambda a: a.ts)
        return out

    def _queue(self, node: str, w: NetWindow, *, last: bool) -> None:
        ring = w.ring
        if ring is None or not ring.full or (node, w.ts) in self._queued:
            return
        self._queued.add((node, w.ts))
        self._pending.setdefault(len(w.ports), []).append((node, w.ts, ring.ordered(), w))


class PeerDetection:
    """Peer comparison within one job: step time (slow node) and GPU power (low)."""

    def __init__(self, cfg: DetectorSettings) -> None:
        self.step = PeerDetector(threshold=cfg.peer_threshold, direction="high", kind="peer_step_time")
        self.power = PeerDetector(threshold=cfg.peer_threshold, direction="low", kind="peer_power")
        self.cooldown = Cooldown(cfg.anomaly_cooldown_s)

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
        return out
