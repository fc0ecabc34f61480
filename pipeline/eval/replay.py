"""The pipeline's decisions in one process, without Kafka.

:class:`LocalPipeline` wires the very functions the Faust agents call (the detection
glue of :mod:`pipeline.detect.glue` and the policy of :mod:`pipeline.correlate.policy`) with in-memory
state and an in-memory queue for the notices between the node and job tracks.  It is
for replaying a scenario quickly and deterministically: comparing backends, evaluating
scenarios at scale, and checking that the in-process path gives the pipeline's verdicts.
Its clock is the records' event time (the correlation grace runs on it, as in the worker).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from typing import Any

from schemas import Anomaly, GpuSample, JobEvent, JobNotice, NetworkSample, NodeNotice, Record, SwitchNotice, Verdict

from pipeline.correlate import policy
from pipeline.config import Settings
from pipeline.detect.glue import GpuDetection, NetworkDetection, PeerDetection


class LocalPipeline:
    def __init__(self, settings: Settings) -> None:
        self.s = settings
        self.gpu = GpuDetection(settings.detectors)
        self.net = NetworkDetection(settings.detectors, net=settings.network)
        self.peer = PeerDetection(settings.detectors)
        self.node_to_health: dict[str, dict[str, Any]] = {}
        self.job_to_history: dict[str, dict[str, Any]] = {}
        self.switch_to_state: dict[str, dict[str, Any]] = {}
        self.switch_ticks: dict[str, float] = {}
        self.verdicts: list[Verdict] = []
        self.anomalies: list[Anomaly] = []
        self.ticks: dict[str, float] = {}
        self.now = 0.0
        self._queue: deque[Record] = deque()

    # ------------------------------------------------------------------ inputs

    def feed(self, records: Iterable[Record]) -> list[Verdict]:
        """Process records in order (event time); returns the verdicts they caused."""
        start = len(self.verdicts)
        gpu_batch: list[GpuSample] = []
        net_batch: list[NetworkSample] = []
        for rec in records:
            self._advance(rec.ts)
            if isinstance(rec, GpuSample):
                self._flush_net(net_batch)
                gpu_batch.append(rec)
                continue
            self._flush_gpu(gpu_batch)
            if isinstance(rec, NetworkSample):
                if net_batch and (rec.ts > net_batch[0].ts or len(net_batch) >= 1024):
                    self._flush_net(net_batch)  # one batch per time step, as a live worker sees them
                net_batch.append(rec)
                continue
            self._flush_net(net_batch)
            self._queue.append(rec)
            self._drain()
        self._flush_gpu(gpu_batch)
        self._flush_net(net_batch)
        self._drain()
        return self.verdicts[start:]

    def finish(self, until: float | None = None) -> list[Verdict]:
        """Let pending grace periods run out (as if time moved on to ``until``)."""
        start = len(self.verdicts)
        self._advance(until if until is not None else self.now + self.s.policy.correlation_grace_s + 1)
        self._drain()
        return self.verdicts[start:]

    # ------------------------------------------------------------------ internals

    def _flush_gpu(self, batch: list[GpuSample]) -> None:
        if batch:
            self._anomalies(self.gpu.process(batch))
            batch.clear()
            self._drain()

    def _flush_net(self, batch: list[NetworkSample]) -> None:
        if batch:
            self._anomalies(self.net.process(batch))
            self.net.refit(batch[-1].ts)
            batch.clear()
            self._drain()

    def _anomalies(self, anomalies: list[Anomaly]) -> None:
        for a in anomalies:
            self.anomalies.append(a)
            self._queue.append(a)

    def _advance(self, ts: float) -> None:
        if ts > self.now:
            self.now = ts
        due = sorted((t, j) for j, t in self.ticks.items() if t <= self.now)
        for t, job in due:
            del self.ticks[job]
            self._queue.append(JobNotice(ts=max(t, 0.0), job=job, node="-", kind="tick", fault_class="unknown", incident="-"))
        for t, sw in sorted((t, w) for w, t in self.switch_ticks.items() if t <= self.now):
            del self.switch_ticks[sw]
            self._queue.append(SwitchNotice(ts=max(t, 0.0), switch=sw, node="-", kind="tick"))

    def _drain(self) -> None:
        while self._queue:
            rec = self._queue.popleft()
            if isinstance(rec, Anomaly):
                node = rec.node or rec.subject
                h = self.node_to_health.setdefault(node, policy.new_node_health())
                self._apply(policy.node_on_anomaly(h, rec, self.s.policy))
            elif isinstance(rec, NodeNotice):
                h = self.node_to_health.setdefault(rec.node, policy.new_node_health())
                self._apply(policy.node_on_notice(h, rec, self.s.policy, self.s.network))
            elif isinstance(rec, SwitchNotice):
                st = self.switch_to_state.setdefault(rec.switch, policy.new_switch_state(rec.switch))
                self._apply(policy.switch_on_notice(st, rec, self.s.network))
                due = policy.switch_due(st)
                if due is not None:
                    self.switch_ticks[rec.switch] = due
                else:
                    self.switch_ticks.pop(rec.switch, None)
            elif isinstance(rec, (JobEvent, JobNotice)):
                hist = self.job_to_history.setdefault(rec.job, policy.new_job_history(rec.job))
                if isinstance(rec, JobEvent):
                    if rec.event.value == "progress":
                        self._anomalies(self.peer.process(rec))
                    d = policy.job_on_event(hist, rec, self.s.policy, self.now)
                else:
                    d = policy.job_on_notice(hist, rec, self.s.policy, self.now)
                if d.tick_ts is not None:  # this clock is the records' event time
                    self.ticks[rec.job] = d.tick_ts
                self._apply(d)

    def _apply(self, d: policy.Decision) -> None:
        self.verdicts.extend(d.verdicts)
        self._queue.extend(d.node_notices)
        self._queue.extend(d.job_notices)
        self._queue.extend(d.switch_notices)
