"""What the worker's parts share: its topics and tables, the detection and correlation
objects, the operator's control state, the counters, and the senders every agent uses.

:meth:`Wiring.declare` declares them on a Faust app; the parts of the worker
(:mod:`~pipeline.worker.telemetry`, :mod:`~pipeline.worker.tracks`,
:mod:`~pipeline.worker.actuation`, :mod:`~pipeline.worker.views`) install their agents,
timers and pages over one :class:`Wiring`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import faust
from faust.types import TP

from actuators import CircuitBreaker
from schemas import Anomaly, DecodeError, Record, Verdict, dead_letter, decode

from pipeline.actuate.control import ControlLog, ControlState
from pipeline.config import Settings
from pipeline.correlate.core import Correlator
from pipeline.correlate.policy import Decision
from pipeline.detect.glue import GpuDetection, InFlight, LaggedWatermark, NetworkDetection, PartitionWatermark, PeerDetection
from pipeline.worker.metrics import Metrics
from pipeline.worker.topics import TopicSpec, topic_specs

#: detector rows allocated at start (they grow with the nodes a worker is given)
INITIAL_ROWS = 1024

log = logging.getLogger("fleetmedic")

#: the tables, each co-partitioned with the sources of the agent that writes it
TRACK_TABLES = ("node_to_health", "job_to_history", "switch_to_state")
ACTUATION_TABLES = ("action_to_outcome", "breaker_state", "action_pending")


@dataclass
class Wiring:
    s: Settings
    app: faust.App
    specs: dict[str, TopicSpec]
    metrics: Metrics
    topics: dict[str, faust.TopicT]
    tables: dict[str, Any]
    #: verdicts and the actuation's own steps, read by the ``actuate`` agent
    actuation_source: faust.TopicT
    #: anomalies and node notices (``track_nodes``); job events and job notices (``track_jobs``)
    node_source: faust.TopicT
    job_source: faust.TopicT
    gpu_detection: GpuDetection
    net_detection: NetworkDetection
    peer_detection: PeerDetection
    breaker: CircuitBreaker
    core: Correlator
    control_state: ControlState
    control: ControlLog
    #: the batch telemetry consumer reads once this is set (``worker.hold_telemetry``)
    release: asyncio.Event
    #: event time that the GPU and network telemetry of every partition has reached
    telemetry_watermark: PartitionWatermark = field(default_factory=PartitionWatermark)
    job_marks: LaggedWatermark = field(default_factory=lambda: LaggedWatermark(0.0))
    switch_marks: LaggedWatermark = field(default_factory=lambda: LaggedWatermark(0.0))
    #: anomalies sent and not yet through this worker's node track: the ticks wait for them
    in_flight: InFlight = field(default_factory=lambda: InFlight(30.0))
    stats: dict[str, Any] = field(default_factory=lambda: {
        "records": 0, "telemetry": 0, "deadletters": 0, "duplicates": 0, "anomalies": 0, "verdicts": 0,
        "actions": 0, "first_telemetry_at": 0.0, "last_telemetry_at": 0.0, "nodes_forgotten": 0})
    timing: dict[str, float] = field(default_factory=lambda: {"decode_s": 0.0, "detect_s": 0.0})
    #: handles made at run time (the actuation, its runner, the batch telemetry consumer, ...)
    state: dict[str, Any] = field(default_factory=lambda: {
        "actuation": None, "runner": None, "woken": set(), "schedule_resumed": False, "telemetry_consumer": None})
    #: the operator API's context (pipeline.api.views.ApiContext), set once it is built
    api: Any = None
    _ok: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def declare(cls, app: faust.App, s: Settings) -> Wiring:
        specs = topic_specs(s)

        def topic(short: str) -> faust.TopicT:
            spec = specs[short]
            return app.topic(spec.name, partitions=spec.partitions, key_type=bytes, value_type=bytes)

        def source(a: str, b: str, partitions: int) -> faust.TopicT:
            return app.topic(specs[a].name, specs[b].name, partitions=partitions, key_type=bytes, value_type=bytes)

        topics = {short: topic(short) for short in (
            "telemetry.gpu", "telemetry.network", "telemetry.job", "anomalies", "verdicts", "actions", "deadletter",
            "internal.node-notices", "internal.job-notices", "internal.switch-notices", "internal.actions")}
        json_schema = faust.Schema(key_serializer="json", value_serializer="json")
        tables = {name: app.Table(name, default=None, partitions=s.kafka.partitions, schema=json_schema)
                  for name in TRACK_TABLES}
        tables.update({name: app.Table(name, default=None, partitions=s.kafka.decision_partitions, schema=json_schema)
                       for name in ACTUATION_TABLES})
        control_state = ControlState(default_dry_run=s.safety.dry_run)

        async def send_control(key: str, value: bytes | None) -> None:
            await app.producer.send_and_wait(specs["control"].name, key.encode(), value, 0, None, None)

        release = asyncio.Event()
        if not s.worker.hold_telemetry:
            release.set()
        w = cls(
            s=s, app=app, specs=specs, metrics=Metrics(), topics=topics, tables=tables,
            actuation_source=source("verdicts", "internal.actions", s.kafka.decision_partitions),
            node_source=source("anomalies", "internal.node-notices", s.kafka.partitions),
            job_source=source("telemetry.job", "internal.job-notices", s.kafka.partitions),
            # rows for the nodes this worker sees, grown as they appear (a quarter at a time):
            # sized for the whole fleet, each of two workers held the state of all of it
            gpu_detection=GpuDetection(s.detectors, capacity=INITIAL_ROWS),
            net_detection=NetworkDetection(s.detectors, capacity=INITIAL_ROWS, net=s.network),
            peer_detection=PeerDetection(s.detectors),
            breaker=CircuitBreaker(max_fraction=s.safety.max_fraction, max_absolute=s.safety.max_absolute,
                                   window_s=s.safety.window_s),
            # the correlator over the tables; the operator API hears of nodes and switches changing
            core=Correlator(s.policy, s.network, nodes=tables["node_to_health"], jobs=tables["job_to_history"],
                            switches=tables["switch_to_state"]),
            control_state=control_state,
            control=ControlLog(s.kafka.bootstrap, specs["control"].name, control_state, send_control),
            release=release,
            job_marks=LaggedWatermark(s.policy.correlation_lag_s),
            switch_marks=LaggedWatermark(s.network.tick_lag_s),
            in_flight=InFlight(s.policy.correlation_wait_max_s),
        )
        w.core.on_node_state = lambda node, st, h: w.api.saw_node(node, st, h)
        w.core.on_switch = lambda sw, opened: w.api.saw_switch(sw, opened)
        return w

    def topic(self, short: str) -> faust.TopicT:
        return self.topics[short]

    # ------------------------------------------------------------------ fleet

    def nodes_seen(self) -> int:
        """Nodes that sent telemetry (the detectors' state holds every one), counted as rows:
        it is read for every verdict (the breaker's fleet size when none is configured), and
        only a node whose GPU or port count changed is counted twice."""
        return max(self.gpu_detection.rows, self.net_detection.rows)

    def fleet_size(self) -> int:
        return self.s.safety.fleet_size or self.nodes_seen()

    # ------------------------------------------------------------------ senders

    async def dead_raw(self, topic: str, partition: int | None, offset: int | None, key: Any, value: Any, reason: str,
                       result: str = "deadletter") -> None:
        self.stats["deadletters"] += 1
        self.metrics.records.labels(topic, result).inc()
        dl = dead_letter(source_topic=topic, reason=reason, payload=value, ts=time.time(), key=key,
                         partition=partition, offset=offset)
        await self.topics["deadletter"].send(value=dl.to_json())

    async def send_dead(self, event: Any, reason: str) -> None:
        m = event.message
        await self.dead_raw(m.topic, m.partition, m.offset, event.key, event.value, reason)

    def count_ok(self, topic: str, n: int = 1) -> None:
        c = self._ok.get(topic)
        if c is None:
            c = self._ok[topic] = self.metrics.records.labels(topic, "ok")
        c.inc(n)
        self.stats["records"] += n

    async def decode_event(self, event: Any, model: type[Record]) -> Record | None:
        """The event's record, or None (dead-lettered with the reason)."""
        try:
            rec = decode(model, event.value)
        except DecodeError as exc:
            await self.send_dead(event, exc.reason)
            return None
        self.count_ok(event.message.topic)
        return rec

    async def emit_anomalies(self, anomalies: list[Anomaly]) -> None:
        wall = time.monotonic()
        for a in anomalies:  # all in flight before the first send yields to a tick
            self.in_flight.sent(a.id, a.ts, wall)
        for a in anomalies:
            self.stats["anomalies"] += 1
            self.metrics.anomalies.labels(a.kind).inc()
            await self.topics["anomalies"].send(key=(a.node or a.subject).encode(), value=a.to_json(),
                                                callback=partial(self._landed, a.id))

    def _landed(self, key: str, fut: Any) -> None:
        """The broker placed anomaly ``key``: the ticks wait for it only where this worker's
        node track reads it."""
        md = fut.result()
        self.in_flight.landed(key, TP(md.topic, md.partition) in self.app.consumer.assignment())

    async def emit_verdict(self, v: Verdict) -> None:
        self.stats["verdicts"] += 1
        self.metrics.verdicts.labels(v.scope, v.fault_class.value).inc()
        log.info("verdict %s %s %s -> %s", v.scope, v.subject, v.fault_class.value,
                 ", ".join(f"{a.action.value} {a.target}" for a in v.actions))
        await self.topics["verdicts"].send(key=v.subject.encode(), value=v.to_json())

    async def emit_decision(self, d: Decision) -> None:
        """A correlator decision: its verdicts, and the notices to the other tracks."""
        for v in d.verdicts:
            await self.emit_verdict(v)
        t = self.topics
        for n in d.node_notices:
            await t["internal.node-notices"].send(key=n.node.encode(), value=n.to_json())
        for j in d.job_notices:
            await t["internal.job-notices"].send(key=j.job.encode(), value=j.to_json())
        for sw in d.switch_notices:
            await t["internal.switch-notices"].send(key=sw.switch.encode(), value=sw.to_json())
