"""Glue between telemetry records and the pure detectors.

Each node gets a fixed-size ring of per-interval counter increments (one row per sample,
one column per GPU or port).  A batch of samples updates the rings, then every detector
scores all the updated nodes at once over stacked arrays.  The rings live in memory:
after a restart a node's window warms up again (detectors return a neutral score while
warming up), which the node track tolerates because degradation needs confirmations.
"""

from __future__ import annotations

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


@dataclass
class GpuWindow:
    width: int
    ts: float = -1.0
    prev: dict[str, np.ndarray] = field(default_factory=dict)
    rings: dict[str, Ring] = field(default_factory=dict)
    first_ts: float | None = None


COUNTER_GROUPS: dict[str, tuple[str, ...]] = {
    "ecc_sbe": ("ecc_sbe",),
    "nvlink": ("nvlink_crc", "nvlink_replay", "nvlink_recovery"),
    "pcie": ("pcie_replay",),
}


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


class GpuDetection:
    """Runs the GPU detectors over batches of :class:`GpuSample`."""

    def __init__(self, cfg: DetectorSettings) -> None:
        self.cfg = cfg
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
        self.windows: dict[str, GpuWindow] = {}
        self.cooldown = Cooldown(cfg.anomaly_cooldown_s)
        self.late = 0
        self._pending: dict[tuple[int, str], list] = {}
        self._snapped: set[tuple[str, str, float]] = set()

    def _window(self, node: str, width: int) -> GpuWindow:
        w = self.windows.get(node)
        if w is None or w.width != width:
            w = GpuWindow(width=width)
            for name in COUNTER_GROUPS:
                w.rings[name] = Ring(self.cfg.window, width)
            w.rings["thermal"] = Ring(self.throttle_window, width, dtype=bool)
            w.rings["temp"] = Ring(self.throttle_window, width)
            self.windows[node] = w
        return w

    def process(self, samples: Sequence[GpuSample]) -> list[Anomaly]:
        """Update windows with ``samples`` (any order of nodes) and return anomalies."""
        out: list[Anomaly] = []
        if not samples:
            return out
        accepted: list[GpuSample] = []
        dbe_delta: list[np.ndarray] = []
        touched: dict[str, GpuWindow] = {}
        for s in samples:
            g = s.gpu_count
            w = self._window(s.node, g)
            if s.ts <= w.ts:
                self.late += 1  # duplicate or out of order: the window already moved past it
                continue
            w.ts = s.ts
            if w.first_ts is None:
                w.first_ts = s.ts
            cur = {
                "ecc_sbe": np.asarray(s.ecc_sbe, dtype=np.float64),
                "nvlink": np.asarray(s.nvlink_crc, dtype=np.float64)
                + np.asarray(s.nvlink_replay, dtype=np.float64)
                + np.asarray(s.nvlink_recovery, dtype=np.float64),
                "pcie": np.asarray(s.pcie_replay, dtype=np.float64),
                "ecc_dbe": np.asarray(s.ecc_dbe, dtype=np.float64),
            }
            for name, value in cur.items():
                prev = w.prev.get(name)
                # A counter that went down was reset (driver reload): count no increment.
                inc = np.zeros(g) if prev is None else np.maximum(value - prev, 0.0)
                w.prev[name] = value
                if name == "ecc_dbe":
                    dbe_delta.append(inc)
                else:
                    w.rings[name].push(inc)
            w.rings["thermal"].push(thermal_mask(np.asarray(s.throttle, dtype=np.int64)))
            w.rings["temp"].push(np.asarray(s.temp, dtype=np.float64))
            accepted.append(s)
            touched[s.node] = w
            self._snapshot(s.node, w, last=False)

        # hard faults, per sample, over the whole batch at once (grouped by GPU count)
        by_width: dict[int, list[int]] = {}
        for i, s in enumerate(accepted):
            by_width.setdefault(s.gpu_count, []).append(i)
        for width, rows in by_width.items():
            dbe = np.stack([dbe_delta[i] for i in rows])
            remap = np.array([accepted[i].remap_failure for i in rows], dtype=bool)
            lost = np.array([accepted[i].lost for i in rows], dtype=bool)
            for f in self.hard.detect(dbe, remap, lost):
                s = accepted[rows[f.index]]
                if self.cooldown.allow((s.node, f.gpu, f.kind), s.ts):
                    out.append(_anomaly("gpu_hard", s.node, f, s.ts))
        xid_rows = [(i, x.gpu, x.code) for i, s in enumerate(accepted) for x in s.xids]
        if xid_rows:
            arr = np.array(xid_rows, dtype=np.int64)
            for f in self.xid.detect(arr[:, 2], arr[:, 0], arr[:, 1]):
                s = accepted[f.index]
                if self.cooldown.allow((s.node, f.gpu, f.kind, f.evidence.get("xid")), s.ts):
                    out.append(_anomaly("xid", s.node, f, s.ts))

        # windowed trends: every queued window of every node, scored at once
        for node, w in touched.items():
            self._snapshot(node, w, last=True)
        out.extend(self._trends(touched))
        return out

    def _snapshot(self, node: str, w: GpuWindow, last: bool) -> None:
        """Queue the node's current windows for scoring.

        Every full window is scored at every accepted sample, so a backlog read in one
        large batch gives the same findings, at the same event times, as the same samples
        read one at a time.  (``last`` is kept for callers; scoring is per step.)
        """
        for name in (*self.rates, "thermal"):
            ring = w.rings[name]
            if not ring.full or (node, name, w.ts) in self._snapped:
                continue
            self._snapped.add((node, name, w.ts))
            data = (ring.ordered(), w.rings["temp"].ordered()) if name == "thermal" else ring.ordered()
            self._pending.setdefault((w.width, name), []).append((node, w.ts, data))

    def _trends(self, touched: dict[str, GpuWindow]) -> list[Anomaly]:
        out: list[Anomaly] = []
        pending, self._pending = self._pending, {}
        self._snapped.clear()
        for (width, name), items in pending.items():
            if name == "thermal":
                thermal = np.stack([x[2][0] for x in items])
                temp = np.stack([x[2][1] for x in items])
                findings = self.throttle.detect(thermal, temp)
                detector = "throttle"
            else:
                findings = self.rates[name].detect(np.stack([x[2] for x in items]))
                detector = "rate_change"
            for f in findings:
                node, ts, _ = items[f.index]
                if self.cooldown.allow((node, f.gpu, f.kind), ts):
                    win = Window(start=ts - self.cfg.window, end=ts) if detector == "rate_change" else None
                    out.append(_anomaly(detector, node, f, ts, window=win))
        out.sort(key=lambda a: a.ts)
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
