"""The Faust application: topics, tables and agents, declared and wired.

Agents receive, call a pure function, send.  The decisions live in :mod:`pipeline.policy`,
the maths in :mod:`detectors`, the acting in :mod:`actuators` via :mod:`pipeline.actuate`.

=======================  ===============================  =====================================
agent                    reads                            writes
=======================  ===============================  =====================================
``detect_gpu``           ``telemetry.gpu`` (batches)      ``anomalies``
``detect_network``       ``telemetry.network`` (batches)  ``anomalies``
``track_nodes``          ``anomalies``, node notices      ``verdicts``, job notices
``track_jobs``           ``telemetry.job``, job notices   ``verdicts``, node notices, ``anomalies``
``actuate``              ``verdicts``                     ``actions``
=======================  ===============================  =====================================

Anything that cannot be decoded goes to ``deadletter`` with the reason; no agent stops on
bad input.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import faust
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, generate_latest

from actuators import CircuitBreaker, RetryPolicy
from actuators.dryrun import DryRun, DryRunBackend
from schemas import (
    Anomaly,
    DecodeError,
    GpuSample,
    JobEvent,
    JobNotice,
    NetworkSample,
    NodeNotice,
    Record,
    Verdict,
    dead_letter,
    decode,
)

from . import policy
from .actuate import Actuation, BackendRouter
from .config import Settings
from .detect import GpuDetection, NetworkDetection, PeerDetection
from .topics import topic_specs

log = logging.getLogger("fleetmedic")


def _backend(name: str, s: Settings):
    a = s.actuators
    if name == "sim":
        from actuators.sim import SimBackend

        return SimBackend(a.sim_url)
    if name == "kubernetes":
        from actuators.kubernetes import KubernetesBackend

        return KubernetesBackend.from_config(a.kubeconfig, context=a.kube_context)
    if name == "slurm":
        from actuators.slurm import SlurmBackend

        return SlurmBackend(slurm_conf=a.slurm_conf, diag_command=a.slurm_diag_command)
    return DryRunBackend()


def build_router(s: Settings) -> "BackendRouter":
    """Backends by name, built once, each wrapped in dry-run when ``safety.dry_run``."""
    names = {s.actuators.backend, *(p.backend for p in s.actuators.pools)}
    backends = {}
    for n in names:
        b = _backend(n, s)
        backends[n] = DryRun(b) if s.safety.dry_run and n != "dryrun" else b
    pools = [(p.nodes, p.backend) for p in s.actuators.pools]
    return BackendRouter(backends, default=s.actuators.backend, pools=pools)


def build_notifier(s: Settings):
    if not s.actuators.webhook_url:
        return None
    from actuators.webhook import WebhookNotifier

    return WebhookNotifier(s.actuators.webhook_url, secret=s.actuators.webhook_secret)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.records = Counter("fleetmedic_records_total", "records consumed", ["topic", "result"], registry=self.registry)
        self.anomalies = Counter("fleetmedic_anomalies_total", "anomalies emitted", ["kind"], registry=self.registry)
        self.verdicts = Counter("fleetmedic_verdicts_total", "verdicts emitted", ["scope", "fault_class"], registry=self.registry)
        self.actions = Counter("fleetmedic_actions_total", "actions recorded", ["action", "outcome"], registry=self.registry)
        self.breaker_used = Gauge("fleetmedic_breaker_isolations", "isolations counted in the breaker window", registry=self.registry)


def create_app(s: Settings, **faust_options: Any) -> faust.App:
    """Declare the fleetmedic Faust app for ``s``."""
    specs = topic_specs(s)
    options = dict(
        broker=f"kafka://{s.kafka.bootstrap}",
        store="memory://",
        key_serializer="raw",
        value_serializer="raw",
        topic_partitions=s.kafka.partitions,
        topic_replication_factor=s.kafka.replication,
        web_host=s.worker.web_host,
        web_port=s.worker.web_port,
        web_enabled=True,
        autodiscover=False,
        consumer_auto_offset_reset="earliest",
        producer_acks=-1,
    )
    options.update(faust_options)
    app = faust.App(s.kafka.app_id, **options)
    metrics = Metrics()
    app.fleetmedic_metrics = metrics  # type: ignore[attr-defined]

    def topic(short: str) -> faust.TopicT:
        spec = specs[short]
        return app.topic(spec.name, partitions=spec.partitions, key_type=bytes, value_type=bytes)

    t_gpu, t_net, t_job = topic("telemetry.gpu"), topic("telemetry.network"), topic("telemetry.job")
    t_anom, t_verdicts, t_actions = topic("anomalies"), topic("verdicts"), topic("actions")
    t_dead = topic("deadletter")
    t_node_in, t_job_in = topic("internal.node-notices"), topic("internal.job-notices")
    node_source = app.topic(specs["anomalies"].name, specs["internal.node-notices"].name,
                            partitions=s.kafka.partitions, key_type=bytes, value_type=bytes)
    job_source = app.topic(specs["telemetry.job"].name, specs["internal.job-notices"].name,
                           partitions=s.kafka.partitions, key_type=bytes, value_type=bytes)

    json_schema = faust.Schema(key_serializer="json", value_serializer="json")
    node_to_health = app.Table("node_to_health", default=None, partitions=s.kafka.partitions,
                               schema=json_schema)
    job_to_history = app.Table("job_to_history", default=None, partitions=s.kafka.partitions,
                               schema=json_schema)
    action_to_outcome = app.Table("action_to_outcome", default=None, partitions=s.kafka.decision_partitions,
                                  schema=json_schema)
    breaker_state = app.Table("breaker_state", default=None, partitions=s.kafka.decision_partitions,
                              schema=json_schema)

    gpu_detection = GpuDetection(s.detectors)
    net_detection = NetworkDetection(s.detectors)
    peer_detection = PeerDetection(s.detectors)
    breaker = CircuitBreaker(max_fraction=s.safety.max_fraction, max_absolute=s.safety.max_absolute,
                             window_s=s.safety.window_s)
    seen_nodes: set[str] = set()
    stats: dict[str, Any] = {"records": 0, "telemetry": 0, "deadletters": 0, "anomalies": 0, "verdicts": 0,
                             "actions": 0, "first_telemetry_at": 0.0, "last_telemetry_at": 0.0}
    app.fleetmedic_stats = stats  # type: ignore[attr-defined]
    pending_ticks: dict[str, float] = {}
    state: dict[str, Any] = {"actuation": None, "ticks_scanned": False}

    def fleet_size() -> int:
        return s.safety.fleet_size or len(seen_nodes)

    async def send_dead(event: Any, reason: str) -> None:
        msg = event.message
        stats["deadletters"] += 1
        metrics.records.labels(msg.topic, "deadletter").inc()
        dl = dead_letter(source_topic=msg.topic, reason=reason, payload=event.value, ts=time.time(),
                         key=event.key, partition=msg.partition, offset=msg.offset)
        await t_dead.send(value=dl.to_json())

    async def decode_event(event: Any, model: type[Record]) -> Record | None:
        try:
            rec = decode(model, event.value)
        except DecodeError as exc:
            await send_dead(event, exc.reason)
            return None
        metrics.records.labels(event.message.topic, "ok").inc()
        stats["records"] += 1
        return rec

    async def emit_anomalies(anomalies: list[Anomaly]) -> None:
        for a in anomalies:
            stats["anomalies"] += 1
            metrics.anomalies.labels(a.kind).inc()
            await t_anom.send(key=(a.node or a.subject).encode(), value=a.to_json())

    async def emit_verdict(v: Verdict) -> None:
        stats["verdicts"] += 1
        metrics.verdicts.labels(v.scope, v.fault_class.value).inc()
        log.info("verdict %s %s %s -> %s", v.scope, v.subject, v.fault_class.value,
                 ", ".join(f"{a.action.value} {a.target}" for a in v.actions))
        await t_verdicts.send(key=v.subject.encode(), value=v.to_json())

    async def emit_decision(d: policy.Decision) -> None:
        for v in d.verdicts:
            await emit_verdict(v)
        for n in d.node_notices:
            await t_node_in.send(key=n.node.encode(), value=n.to_json())
        for j in d.job_notices:
            await t_job_in.send(key=j.job.encode(), value=j.to_json())

    # ------------------------------------------------------------------ detection agents

    async def detect_batches(stream: faust.StreamT, model: type[Record], detection: Any, what: str) -> None:
        """Decode a batch, run the detection over it at once, send its anomalies."""
        async for events in stream.take_events(s.worker.batch_size, within=s.worker.batch_within_s):
            samples = []
            for ev in events:
                rec = await decode_event(ev, model)
                if rec is not None:
                    samples.append(rec)
                    seen_nodes.add(rec.node)
            stats["telemetry"] += len(events)
            now = time.time()
            if not stats["first_telemetry_at"]:
                stats["first_telemetry_at"] = now
            stats["last_telemetry_at"] = now
            try:
                anomalies = detection.process(samples)
            except Exception as exc:  # a detector bug must not stop the stream
                log.exception("%s detection failed on a batch of %d samples", what, len(samples))
                for ev in events:
                    await send_dead(ev, f"detector error: {exc!r}")
                continue
            await emit_anomalies(anomalies)

    @app.agent(t_gpu, name="detect_gpu")
    async def detect_gpu(stream: faust.StreamT) -> None:
        await detect_batches(stream, GpuSample, gpu_detection, "GPU")

    @app.agent(t_net, name="detect_network")
    async def detect_network(stream: faust.StreamT) -> None:
        await detect_batches(stream, NetworkSample, net_detection, "network")

    # ------------------------------------------------------------------ correlator

    @app.agent(node_source, name="track_nodes")
    async def track_nodes(stream: faust.StreamT) -> None:
        anomalies_topic = specs["anomalies"].name
        async for event in stream.events():
            model = Anomaly if event.message.topic == anomalies_topic else NodeNotice
            rec = await decode_event(event, model)
            if rec is None:
                continue
            node = rec.node if isinstance(rec, NodeNotice) else (rec.node or rec.subject)
            health = node_to_health.get(node) or policy.new_node_health()
            try:
                if isinstance(rec, Anomaly):
                    d = policy.node_on_anomaly(health, rec, s.policy)
                else:
                    d = policy.node_on_notice(health, rec, s.policy)
            except Exception as exc:
                log.exception("node policy failed for %s", node)
                await send_dead(event, f"policy error: {exc!r}")
                continue
            node_to_health[node] = health
            await emit_decision(d)

    @app.agent(job_source, name="track_jobs")
    async def track_jobs(stream: faust.StreamT) -> None:
        job_topic = specs["telemetry.job"].name
        async for event in stream.events():
            model = JobEvent if event.message.topic == job_topic else JobNotice
            rec = await decode_event(event, model)
            if rec is None:
                continue
            hist = job_to_history.get(rec.job) or policy.new_job_history(rec.job)
            now = time.time()
            try:
                if isinstance(rec, JobEvent):
                    if rec.event.value == "progress":
                        await emit_anomalies(peer_detection.process(rec))
                    d = policy.job_on_event(hist, rec, s.policy, now)
                else:
                    d = policy.job_on_notice(hist, rec, s.policy, now)
            except Exception as exc:
                log.exception("job policy failed for %s", rec.job)
                await send_dead(event, f"policy error: {exc!r}")
                continue
            job_to_history[rec.job] = hist
            if d.tick_at is not None:
                pending_ticks[rec.job] = d.tick_at
            elif hist.get("pending") is None:
                pending_ticks.pop(rec.job, None)
            await emit_decision(d)

    @app.timer(interval=0.25)
    async def send_ticks() -> None:
        """Wake the job track when a failure's grace period for node evidence ends."""
        if not state["ticks_scanned"]:
            # after a restart, pick up failures that were waiting when the worker stopped
            state["ticks_scanned"] = True
            for job, hist in list(job_to_history.items()):
                p = (hist or {}).get("pending")
                if p and p.get("kind") == "failure":
                    pending_ticks[job] = time.time()
        now = time.time()
        due = [j for j, t in pending_ticks.items() if t <= now]
        for job in due:
            pending_ticks.pop(job, None)
            tick = JobNotice(ts=now, job=job, node="-", kind="tick", fault_class="unknown", incident="-")
            await t_job_in.send(key=job.encode(), value=tick.to_json())

    # ------------------------------------------------------------------ actuation

    def actuation() -> Actuation:
        if state["actuation"] is None:
            a = s.actuators
            router = build_router(s)
            state["actuation"] = Actuation(
                backend=router.default_backend,
                router=router,
                breaker=breaker,
                fleet_size=fleet_size,
                retry=RetryPolicy(max_attempts=a.max_attempts, base_delay=a.base_delay_s, max_delay=a.max_delay_s),
                notifier=build_notifier(s),
                ledger=_TableLedger(action_to_outcome),
            )
        return state["actuation"]

    @app.agent(t_verdicts, name="actuate")
    async def actuate(stream: faust.StreamT) -> None:
        async for event in stream.events():
            rec = await decode_event(event, Verdict)
            if rec is None:
                continue
            saved = breaker_state.get("isolations")
            if saved and not breaker.snapshot():
                breaker.restore(saved)
            try:
                records = await actuation().carry_out(rec)
            except Exception as exc:
                log.exception("actuation failed for verdict %s", rec.id)
                await send_dead(event, f"actuation error: {exc!r}")
                continue
            breaker_state["isolations"] = breaker.snapshot()
            metrics.breaker_used.set(len(breaker.snapshot()))
            for r in records:
                stats["actions"] += 1
                metrics.actions.labels(r.action.value, r.outcome.value).inc()
                log.info("action %s %s: %s (%s) %s", r.action.value, r.target, r.outcome.value, r.backend, r.detail)
                await t_actions.send(key=r.target.encode(), value=r.to_json())

    # ------------------------------------------------------------------ web views

    @app.page("/fleetmedic/ready")
    async def ready(web: Any, request: Any) -> Any:
        assigned = bool(app.consumer.assignment()) if app.consumer is not None else False
        ok = assigned and not app.rebalancing
        return web.json({"ready": ok, "assigned": assigned}, status=200 if ok else 503)

    @app.page("/fleetmedic/stats")
    async def stats_view(web: Any, request: Any) -> Any:
        return web.json({**stats, "nodes_seen": len(seen_nodes), "late_samples": gpu_detection.late + net_detection.late,
                         "breaker_used": len(breaker.snapshot()), "detector_state_bytes": gpu_detection.nbytes(),
                         "rss_bytes": _rss_bytes()})

    @app.page("/metrics")
    async def metrics_view(web: Any, request: Any) -> Any:
        return web.bytes(generate_latest(metrics.registry), content_type=CONTENT_TYPE_LATEST.split(";")[0])

    app.fleetmedic_agents = (detect_gpu, detect_network, track_nodes, track_jobs, actuate)  # type: ignore[attr-defined]
    return app


def _rss_bytes() -> int:
    """Resident memory of this process (Linux), 0 where unknown."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


class _TableLedger:
    """The idempotency ledger on a Faust table (survives restarts through its changelog)."""

    def __init__(self, table: Any) -> None:
        self.table = table

    def get(self, key: str, default: Any = None) -> Any:
        v = self.table.get(key)
        return default if v is None else v

    def __getitem__(self, key: str) -> Any:
        v = self.table.get(key)
        if v is None:
            raise KeyError(key)
        return v

    def __setitem__(self, key: str, value: str) -> None:
        self.table[key] = value

    def __delitem__(self, key: str) -> None:
        del self.table[key]

    def __iter__(self):
        return iter(self.table)

    def __len__(self) -> int:
        return len(self.table)

