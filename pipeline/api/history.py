"""Recent per-GPU telemetry of the nodes an operator is looking at, for the node page.

Keeping every node's history would cost the worker tens of megabytes at 10,000 nodes
for pages nobody opens, so :class:`GpuHistory` records only *watched* nodes: a node
that is not healthy (the node track says so through :meth:`watch`), and a node whose
page was opened in the last ``opened_s``.  Each keeps its last ``keep`` samples
(two hours at the agent's 10 s when ``keep`` is 720), at most ``max_nodes`` nodes (the
longest unwatched go first).  A node starts recording when it is first watched: its
page says since when.

Channels per GPU: temperature, power, utilisation, volatile single- and double-bit ECC
counts, NVLink CRC errors and PCIe replays, as the agent reports them (NaN where a GPU
does not report one).  Beside them, a watched node's step time in its job against its
peers in the same progress event (the peers' median, minimum and maximum).
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from schemas.columns import GpuBatch

#: the series a node page plots: (column of the decoded batch, label, unit)
CHANNELS: tuple[tuple[str, str, str], ...] = (
    ("temp", "temperature", "°C"), ("power", "power", "W"), ("util", "utilisation", "%"),
    ("ecc_sbe", "ECC single-bit", "count"), ("ecc_dbe", "ECC double-bit", "count"),
    ("nvlink_crc", "NVLink CRC errors", "count"), ("pcie_replay", "PCIe replays", "count"),
)


@dataclass
class _Series:
    gpus: int
    keep: int
    since: float
    ts: np.ndarray = field(init=False)
    values: np.ndarray = field(init=False)  # (keep, channels, gpus)
    n: int = 0  # samples written (the ring's head is n % keep)

    def __post_init__(self) -> None:
        self.ts = np.full(self.keep, np.nan)
        self.values = np.full((self.keep, len(CHANNELS), self.gpus), np.nan, dtype=np.float32)

    def add(self, ts: float, row: np.ndarray) -> None:
        i = self.n % self.keep
        self.ts[i], self.values[i] = ts, row
        self.n += 1

    def ordered(self) -> tuple[np.ndarray, np.ndarray]:
        if self.n <= self.keep:
            idx = np.arange(self.n)
        else:
            head = self.n % self.keep
            idx = np.concatenate([np.arange(head, self.keep), np.arange(head)])
        ts, vals = self.ts[idx], self.values[idx]
        order = np.argsort(ts, kind="stable")  # samples may come a little out of order
        return ts[order], vals[order]


class GpuHistory:
    """Ring buffers of the watched nodes' GPU samples; ``clock`` is wall time (page opens)."""

    def __init__(self, *, keep: int = 720, max_nodes: int = 1024, opened_s: float = 3600.0,
                 clock: Callable[[], float] | None = None) -> None:
        import time

        self.keep, self.max_nodes, self.opened_s = keep, max_nodes, opened_s
        self.clock = clock or time.time
        self.series: OrderedDict[str, _Series] = OrderedDict()
        #: node -> until when it is watched (math.inf: while it is not healthy)
        self.watched: dict[str, float] = {}
        #: node -> (ts, job, its step time, the peers' median, minimum, maximum)
        self.steps: OrderedDict[str, deque[tuple[float, str, float, float, float, float]]] = OrderedDict()

    def watch(self, node: str, *, for_s: float | None = None) -> None:
        """Record ``node`` from now on: until it is healthy again (``for_s`` None), or for
        ``for_s`` seconds (a page was opened)."""
        until = math.inf if for_s is None else self.clock() + for_s
        if until > self.watched.get(node, -math.inf):
            self.watched[node] = until

    def unwatch(self, node: str) -> None:
        """The node is healthy again: it keeps recording while its page was opened lately."""
        if self.watched.get(node) == math.inf:
            self.watched[node] = self.clock() + self.opened_s

    def opened(self, node: str) -> None:
        self.watch(node, for_s=self.opened_s)

    def record(self, batch: GpuBatch) -> int:
        """Keep the samples of watched nodes; how many were kept."""
        if not self.watched or not len(batch):
            return 0
        now = self.clock()
        kept = 0
        for g, group in batch.groups.items():
            cols = [group.columns.get(c) for c, _, _ in CHANNELS]
            for k, pos in enumerate(group.rows.tolist()):
                node = batch.node[pos]
                until = self.watched.get(node)
                if until is None:
                    continue
                if until < now:
                    del self.watched[node]
                    continue
                s = self.series.get(node)
                if s is None or s.gpus != g:
                    s = self.series[node] = _Series(g, self.keep, float(batch.ts[pos]))
                    self._evict()
                else:
                    self.series.move_to_end(node)
                row = np.full((len(CHANNELS), g), np.nan, dtype=np.float32)
                for c, col in enumerate(cols):
                    if col is not None:
                        row[c] = col[k]
                s.add(float(batch.ts[pos]), row)
                kept += 1
        return kept

    def record_steps(self, job: str, ts: float, step_times: dict[str, float] | None) -> int:
        """Keep the step time of each watched node of a job's progress event beside its
        peers' (the other nodes of the same event); how many nodes were kept."""
        if not self.watched or not step_times or len(step_times) < 2:
            return 0
        now = self.clock()
        kept = 0
        for node, own in step_times.items():
            until = self.watched.get(node)
            if until is None or until < now:
                continue
            peers = np.fromiter((v for n, v in step_times.items() if n != node), dtype=np.float64)
            q = self.steps.get(node)
            if q is None:
                q = self.steps[node] = deque(maxlen=self.keep)
                while len(self.steps) > self.max_nodes:
                    self.steps.popitem(last=False)
            else:
                self.steps.move_to_end(node)
            q.append((float(ts), job, float(own), float(np.median(peers)), float(peers.min()), float(peers.max())))
            kept += 1
        return kept

    def _evict(self) -> None:
        while len(self.series) > self.max_nodes:
            self.series.popitem(last=False)

    def steps_of(self, node: str, *, last: int | None = None) -> dict[str, list[Any]]:
        rows = sorted(self.steps.get(node) or ())
        if last is not None:
            rows = rows[-last:]
        cols = ("ts", "job", "node", "peer_median", "peer_min", "peer_max")
        return {c: [r[i] if i == 1 else round(r[i], 4) for r in rows] for i, c in enumerate(cols)}

    def of(self, node: str, *, last: int | None = None) -> dict[str, Any]:
        """The node's series for the page: times, and per channel one list per GPU (None
        where absent)."""
        s = self.series.get(node)
        watched = node in self.watched
        steps = self.steps_of(node, last=last)
        if s is None:
            return {"node": node, "recording": watched, "since": None, "ts": [], "channels": [], "steps": steps}
        ts, vals = s.ordered()
        if last is not None:
            ts, vals = ts[-last:], vals[-last:]
        chans = []
        for c, (key, label, unit) in enumerate(CHANNELS):
            per_gpu = vals[:, c, :].T
            if np.isnan(per_gpu).all():
                continue
            chans.append({"key": key, "label": label, "unit": unit,
                          "gpus": [[None if math.isnan(v) else round(float(v), 3) for v in row] for row in per_gpu]})
        return {"node": node, "recording": watched, "since": s.since, "gpus": s.gpus,
                "ts": [round(float(t), 3) for t in ts], "channels": chans, "steps": steps}
