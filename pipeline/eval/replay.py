"""The pipeline's decisions in one process, without Kafka.

:class:`LocalPipeline` is an adapter, as the Faust worker is one: it runs the detection
glue of :mod:`pipeline.detect.glue` over the telemetry and drives the correlator
(:class:`pipeline.correlate.core.Correlator`) with dicts for its state and an in-memory
queue for the notices between the node, job and switch tracks.  It is
for replaying a scenario quickly and deterministically: comparing backends, evaluating
scenarios at scale, and checking that the in-process path gives the pipeline's verdicts.
Its clock is the records' event time (the correlation grace runs on it, as in the worker).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from typing import Any

from schemas import Anomaly, GpuSample, JobEvent, JobNotice, NetworkSample, NodeNotice, Record, SwitchNotice, Verdict

from pipeline.correlate.core import Correlator
from pipeline.correlate.policy import Decision
from pipeline.config import Settings
from pipeline.detect.glue import GpuDetection, NetworkDetection, PeerDetection


class LocalPipeline:
    def __init__(self, settings: Settings) -> None:
        self.s = settings
        self.gpu = GpuDetection(settings.detectors)
        self.net = NetworkDetection(settings.detectors, net=settings.network)
        self.peer = PeerDetection(settings.detectors)
        self.core = Correlator(settings.policy, settings.network)
        self.verdicts: list[Verdict] = []
        self.anomalies: list[Anomaly] = []
        self.now = 0.0
        self._queue: deque[Record] = deque()

    @property
    def node_to_health(self) -> dict[str, Any]:
        return self.core.nodes  # type: ignore[return-value]

    @property
    def job_to_history(self) -> dict[str, Any]:
        return self.core.jobs  # type: ignore[return-value]

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
        """Event time moves on to ``ts``: the ticks it makes due join the queue (this
        clock is the records' event time, for the job track's wall clock as well)."""
        if ts > self.now:
            self.now = ts
        self._queue.extend(self.core.due_job_ticks(self.now, self.now))
        self._queue.extend(self.core.due_switch_ticks(self.now))

    def _drain(self) -> None:
        while self._queue:
            rec = self._queue.popleft()
            if isinstance(rec, JobEvent) and rec.event.value == "progress":
                self._anomalies(self.peer.process(rec))
            if isinstance(rec, (Anomaly, NodeNotice, SwitchNotice, JobEvent, JobNotice)):
                self._apply(self.core.handle(rec, self.now))

    def _apply(self, d: Decision) -> None:
        self.verdicts.extend(d.verdicts)
        self._queue.extend(d.node_notices)
        self._queue.extend(d.job_notices)
        self._queue.extend(d.switch_notices)
