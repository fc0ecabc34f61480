"""The Faust application: topics, tables and agents, declared and wired.

Agents receive, call a pure function, send.  The decisions live in :mod:`pipeline.correlate.policy`,
the maths in :mod:`detectors`, the acting in :mod:`actuators` via :mod:`pipeline.actuate.core`.

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

import asyncio
import gc
import logging
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import faust
import faust.web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from actuators import CircuitBreaker, RetryPolicy
from actuators.dryrun import DryRunBackend
from schemas import (
    ActionName,
    ActionRecord,
    ActionStep,
    Anomaly,
    DecodeError,
    GpuSample,
    JobEvent,
    JobNotice,
    NetworkSample,
    NodeNotice,
    Outcome,
    Record,
    SwitchNotice,
    Verdict,
    dead_letter,
    decode,
)

from pipeline.worker import faust_fixes  # noqa: F401  (patches two record-loss races in Faust on import)
from pipeline.correlate.core import Correlator, state_key
from pipeline.correlate.policy import Decision
from pipeline.correlate.state import NodeState
from pipeline.actuate.core import ActionRunner, Actuation, BackendRouter, Work
from pipeline.config import Settings, state_dir
from pipeline.actuate.control import HELD, ControlLog, ControlState, dry_run_record, held_record
from pipeline.detect.glue import (
    GpuDetection,
    LaggedWatermark,
    NetworkDetection,
    PartitionWatermark,
    PeerDetection,
    late_reason,
    readiness,
)
from pipeline.worker.topics import topic_specs

log = logging.getLogger("fleetmedic")

#: escalation webhook deliveries in flight at most; beyond it a delivery is reported failed
NOTIFY_BACKLOG = 1000


def _backend(name: str, s: Settings):
    a = s.actuators
    if name == "sim":
        from actuators.sim import SimBackend

        return SimBackend(a.sim_url)
    if name == "kubernetes":
        from actuators.kubernetes import KubernetesBackend

        return KubernetesBackend.from_config(
            a.kubeconfig, context=a.kube_context, impersonate=a.kube_as,
            namespace=a.kube_diag_namespace, job_namespace=a.kube_job_namespace,
            diag_image=a.kube_diag_image, diag_command=a.kube_diag_command, taint_key=a.kube_taint_key,
            drain_mode=a.drain_mode, drain_timeout_s=a.drain_timeout_s,
        )
    if name == "slurm":
        from actuators.slurm import SlurmBackend

        return SlurmBackend(slurm_conf=a.slurm_conf, diag_command=a.slurm_diag_command)
    return DryRunBackend()


def build_router(s: Settings) -> "BackendRouter":
    """Backends by name, built once.  Dry-run (``safety.dry_run`` at start, then the operator
    API's switch) wraps them per action in :meth:`Actuation.backend_for`."""
    names = {s.actuators.backend, *(p.backend for p in s.actuators.pools)}
    backends = {n: _backend(n, s) for n in names}
    pools = [(p.nodes, p.backend) for p in s.actuators.pools]
    return BackendRouter(backends, default=s.actuators.backend, pools=pools)


def build_notifier(s: Settings):
    if not s.actuators.webhook_url:
        return None
    from actuators.webhook import WebhookNotifier

    return WebhookNotifier(s.actuators.webhook_url, secret=s.actuators.webhook_secret)


def build_auth(s: Settings) -> Any:
    from pipeline.api.auth import NoAuth, OidcAuth

    a = s.auth
    if not a.enabled:
        return NoAuth()
    return OidcAuth(issuer=a.issuer, audience=a.audience, jwks_url=a.jwks_url, roles_claim=a.roles_claim,
                    viewer_role=a.viewer_role, operator_role=a.operator_role, leeway_s=a.leeway_s,
                    client_id=a.client_id)


def build_alerts(s: Settings, on_outcome: Any) -> Any:
    """The alert dispatcher of ``s.alerts`` (None without webhooks)."""
    if not s.alerts.webhooks:
        return None
    from actuators.alerts import AlertDispatcher, Receiver
    from actuators.retry import RetryPolicy

    a = s.alerts
    skip = set(a.exclude_classes)
    return AlertDispatcher(
        [Receiver(w.name, w.url, format=w.format, secret=w.secret, timeout_s=w.timeout_s) for w in a.webhooks],
        on_outcome=on_outcome, retry=RetryPolicy(max_attempts=a.max_attempts, base_delay=a.base_delay_s,
                                                 max_delay=a.max_delay_s),
        source=s.kafka.app_id, external_url=a.external_url, queue_size=a.queue_size,
        want=lambda v: v.fault_class not in skip,
    )


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.records = Counter("fleetmedic_records_total", "records consumed", ["topic", "result"], registry=self.registry)
        self.anomalies = Counter("fleetmedic_anomalies_total", "anomalies emitted", ["kind"], registry=self.registry)
        self.verdicts = Counter("fleetmedic_verdicts_total", "verdicts emitted", ["scope", "fault_class"], registry=self.registry)
        self.actions = Counter("fleetmedic_actions_total", "actions recorded", ["action", "outcome"], registry=self.registry)
        self.breaker_used = Gauge("fleetmedic_breaker_isolations", "isolations counted in the breaker window", registry=self.registry)
        self.breaker_budget = Gauge("fleetmedic_breaker_budget", "isolations the breaker allows per window now",
                                    registry=self.registry)
        self.detect_seconds = Histogram(
            "fleetmedic_detect_seconds", "time to decode and run the detectors on one batch", ["detector"],
            buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5), registry=self.registry)
        self.batch_size = Histogram("fleetmedic_detect_batch_records", "records per detection batch", ["detector"],
                                    buckets=(1, 10, 50, 100, 500, 1000, 5000, 20000), registry=self.registry)
        self.lag = Gauge("fleetmedic_event_lag_seconds",
                         "wall time minus the event time of the newest record processed", ["topic"], registry=self.registry)


def data_dir(s: Settings) -> Path:
    """Where Faust keeps its files: ``worker.data_dir``, else ``faust`` in the state dir
    (never the working directory)."""
    if s.worker.data_dir:
        return Path(s.worker.data_dir).expanduser()
    return state_dir("worker") / "faust"


def create_app(s: Settings, **faust_options: Any) -> faust.App:
    """Declare the fleetmedic Faust app for ``s``."""
    from pipeline.api.gate import GateConfig, is_loopback, make_gate

    specs = topic_specs(s)
    auth = build_auth(s)
    gate = GateConfig.for_worker(auth, web_host=s.worker.web_host, web_bind=s.worker.web_bind,
                                 extra_hosts=s.worker.allowed_hosts, metrics_public=s.auth.metrics_public)
    if not is_loopback(s.worker.web_bind) and not s.auth.enabled:
        log.warning("the worker listens on %s with sign-in OFF: anyone who reaches port %d can read every node's "
                    "history and hold or return nodes; turn auth.enabled on or bind to 127.0.0.1",
                    s.worker.web_bind, s.worker.web_port)
    datadir = data_dir(s)
    datadir.mkdir(parents=True, exist_ok=True)  # Faust creates only the last level
    options = dict(
        broker=f"kafka://{s.kafka.bootstrap}",
        datadir=str(datadir / f"{s.kafka.app_id}-data"),
        store="memory://",
        key_serializer="raw",
        value_serializer="raw",
        topic_partitions=s.kafka.partitions,
        topic_replication_factor=s.kafka.replication,
        web_host=s.worker.web_host,
        web_port=s.worker.web_port,
        web_bind=s.worker.web_bind,
        web_enabled=True,
        # Faust's own views show tables, partitions and the graph to anyone: off; every
        # route passes the gate (pipeline.api.gate)
        web_tables_enabled=False,
        web_router_enabled=False,
        web_graph_enabled=False,
        web_application_options={"middlewares": [make_gate(gate)], "client_max_size": 256 * 1024},
        autodiscover=False,
        consumer_auto_offset_reset="earliest",
        producer_acks=-1,
        stream_buffer_maxsize=s.worker.stream_buffer_maxsize,
        broker_max_poll_records=s.worker.max_poll_records,
        consumer_max_fetch_size=s.worker.max_fetch_bytes,
        broker_session_timeout=s.worker.session_timeout_s,
        broker_heartbeat_interval=min(3.0, s.worker.session_timeout_s / 4),
    )
    options.update(faust_options)
    app = faust.App(s.kafka.app_id, **options)
    metrics = Metrics()
    app.fleetmedic_metrics = metrics  # type: ignore[attr-defined]

    def topic(short: str) -> faust.TopicT:
        spec = specs[short]
        return app.topic(spec.name, partitions=spec.partitions, key_type=bytes, value_type=bytes)

    t_gpu, t_net = topic("telemetry.gpu"), topic("telemetry.network")
    t_anom, t_verdicts, t_actions = topic("anomalies"), topic("verdicts"), topic("actions")
    t_dead = topic("deadletter")
    t_node_in, t_job_in = topic("internal.node-notices"), topic("internal.job-notices")
    t_switch_in = topic("internal.switch-notices")
    t_steps = topic("internal.actions")
    actuation_source = app.topic(specs["verdicts"].name, specs["internal.actions"].name,
                                 partitions=s.kafka.decision_partitions, key_type=bytes, value_type=bytes)
    node_source = app.topic(specs["anomalies"].name, specs["internal.node-notices"].name,
                            partitions=s.kafka.partitions, key_type=bytes, value_type=bytes)
    job_source = app.topic(specs["telemetry.job"].name, specs["internal.job-notices"].name,
                           partitions=s.kafka.partitions, key_type=bytes, value_type=bytes)

    json_schema = faust.Schema(key_serializer="json", value_serializer="json")
    node_to_health = app.Table("node_to_health", default=None, partitions=s.kafka.partitions,
                               schema=json_schema)
    job_to_history = app.Table("job_to_history", default=None, partitions=s.kafka.partitions,
                               schema=json_schema)
    switch_to_state = app.Table("switch_to_state", default=None, partitions=s.kafka.partitions,
                                schema=json_schema)
    action_to_outcome = app.Table("action_to_outcome", default=None, partitions=s.kafka.decision_partitions,
                                  schema=json_schema)
    breaker_state = app.Table("breaker_state", default=None, partitions=s.kafka.decision_partitions,
                              schema=json_schema)
    #: actions waiting for their next try (pipeline.actuate.core.Work), by idempotency key
    action_pending = app.Table("action_pending", default=None, partitions=s.kafka.decision_partitions,
                               schema=json_schema)

    gpu_detection = GpuDetection(s.detectors, capacity=s.safety.fleet_size)
    net_detection = NetworkDetection(s.detectors, capacity=s.safety.fleet_size, net=s.network)
    peer_detection = PeerDetection(s.detectors)
    breaker = CircuitBreaker(max_fraction=s.safety.max_fraction, max_absolute=s.safety.max_absolute,
                             window_s=s.safety.window_s)
    timing: dict[str, float] = {"decode_s": 0.0, "detect_s": 0.0}
    stats: dict[str, Any] = {"records": 0, "telemetry": 0, "deadletters": 0, "duplicates": 0, "anomalies": 0, "verdicts": 0,
                             "actions": 0, "first_telemetry_at": 0.0, "last_telemetry_at": 0.0}
    app.fleetmedic_stats = stats  # type: ignore[attr-defined]
    #: event time that the GPU and network telemetry of every partition has reached
    telemetry_watermark = PartitionWatermark()
    job_marks = LaggedWatermark(s.policy.correlation_lag_s)
    switch_marks = LaggedWatermark(s.network.tick_lag_s)
    state: dict[str, Any] = {"actuation": None, "runner": None, "woken": set(), "schedule_resumed": False,
                             "telemetry_consumer": None}
    # the correlator over the tables; the operator API hears of nodes and switches changing
    core = Correlator(s.policy, s.network, nodes=node_to_health, jobs=job_to_history, switches=switch_to_state,
                      on_node_state=lambda node, st, h: api_ctx.saw_node(node, st, h),
                      on_switch=lambda sw, opened: api_ctx.saw_switch(sw, opened))
    # operator decisions (dry-run, held isolations) from the compacted control topic
    control_state = ControlState(default_dry_run=s.safety.dry_run)

    async def send_control(key: str, value: bytes | None) -> None:
        await app.producer.send_and_wait(specs["control"].name, key.encode(), value, 0, None, None)

    control = ControlLog(s.kafka.bootstrap, specs["control"].name, control_state, send_control)
    app.fleetmedic_control = control  # type: ignore[attr-defined]

    @app.task
    async def follow_control() -> None:
        await control.run(lambda: bool(app.should_stop))

    release = asyncio.Event()  # the batch telemetry consumer reads once this is set
    if not s.worker.hold_telemetry:
        release.set()

    def nodes_seen() -> int:
        # the detectors' state holds every node that sent telemetry
        return max(gpu_detection.nodes, net_detection.nodes)

    def fleet_size() -> int:
        return s.safety.fleet_size or nodes_seen()

    async def dead_raw(topic: str, partition: int | None, offset: int | None, key: Any, value: Any, reason: str,
                       result: str = "deadletter") -> None:
        stats["deadletters"] += 1
        metrics.records.labels(topic, result).inc()
        dl = dead_letter(source_topic=topic, reason=reason, payload=value, ts=time.time(), key=key,
                         partition=partition, offset=offset)
        await t_dead.send(value=dl.to_json())

    async def send_dead(event: Any, reason: str) -> None:
        m = event.message
        await dead_raw(m.topic, m.partition, m.offset, event.key, event.value, reason)

    ok_counters: dict[str, Any] = {}

    def count_ok(topic: str, n: int = 1) -> None:
        c = ok_counters.get(topic)
        if c is None:
            c = ok_counters[topic] = metrics.records.labels(topic, "ok")
        c.inc(n)
        stats["records"] += n

    async def decode_event(event: Any, model: type[Record]) -> Record | None:
        try:
            rec = decode(model, event.value)
        except DecodeError as exc:
            await send_dead(event, exc.reason)
            return None
        count_ok(event.message.topic)
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

    async def emit_decision(d: Decision) -> None:
        for v in d.verdicts:
            await emit_verdict(v)
        for n in d.node_notices:
            await t_node_in.send(key=n.node.encode(), value=n.to_json())
        for j in d.job_notices:
            await t_job_in.send(key=j.job.encode(), value=j.to_json())
        for w in d.switch_notices:
            await t_switch_in.send(key=w.switch.encode(), value=w.to_json())

    # ------------------------------------------------------------------ detection agents

    async def handle_telemetry(msgs: list[Any], model: type[Record], detection: Any, what: str,
                               after: Any = None) -> None:
        """Decode a batch of records (``topic``, ``partition``, ``offset``, ``key``, ``value``
        attributes), detect over it at once, send anomalies; then ``after(samples)``."""
        samples = []
        parts: list[int] = []  # the partition of each decoded sample
        source: list[Any] = []  # the message of each decoded sample
        t0 = time.perf_counter()
        for m in msgs:
            try:
                samples.append(decode(model, m.value))
                parts.append(m.partition)
                source.append(m)
            except DecodeError as exc:
                await dead_raw(m.topic, m.partition, m.offset, m.key, m.value, exc.reason)
        stats["telemetry"] += len(msgs)
        task = state.get("refit_task")
        if detection is net_detection and samples and task is not None and not task.done() \
                and net_detection.waits_for(max(x.ts for x in samples)):
            await asyncio.shield(task)  # the stream reached the event time of a fit still running
        t1 = time.perf_counter()
        timing["decode_s"] += t1 - t0
        try:
            anomalies = detection.process(samples)
            if detection.refused:
                # a redelivered sample is counted and dropped; a late one (older than the
                # node's windows) goes to the dead-letter topic with its reason
                for r in detection.refused:
                    m = source[r.position]
                    if r.why == "duplicate":
                        stats["duplicates"] += 1
                        metrics.records.labels(m.topic, "duplicate").inc()
                    else:
                        await dead_raw(m.topic, m.partition, m.offset, m.key, m.value, late_reason(r), result="late")
            if samples:
                count_ok(msgs[0].topic, len(samples) - len(detection.refused))
                newest: dict[int, float] = {}
                for x, part in zip(samples, parts):
                    if x.ts > newest.get(part, 0.0):
                        newest[part] = x.ts
                for part, ts in newest.items():
                    telemetry_watermark.update((msgs[0].topic, part), ts)
            t2 = time.perf_counter()
            timing["detect_s"] += t2 - t1
            metrics.detect_seconds.labels(what).observe(t2 - t0)
            metrics.batch_size.labels(what).observe(len(msgs))
            if samples:
                metrics.lag.labels(msgs[0].topic).set(time.time() - max(x.ts for x in samples))
        except Exception as exc:  # a detector bug must not stop the stream
            log.exception("%s detection failed on a batch of %d samples", what, len(samples))
            for m in msgs:
                await dead_raw(m.topic, m.partition, m.offset, m.key, m.value, f"detector error: {exc!r}")
            return
        await emit_anomalies(anomalies)
        if after is not None and samples:
            after(samples, parts)
        now = time.time()
        if not stats["first_telemetry_at"]:
            stats["first_telemetry_at"] = now
        stats["last_telemetry_at"] = now

    net_watermark = PartitionWatermark()

    def after_network(samples: list[NetworkSample], parts: list[int]) -> None:
        # event-time watermark of the fabric, the time every partition has reached: the
        # switch track's holds run on it, so a lone node's hold does not run out while the
        # anomalies of its neighbours are still queued in another partition
        for x, part in zip(samples, parts):
            net_watermark.update(part, x.ts)
        state["net_watermark"] = net_watermark.value
        refit_network(net_watermark.value)

    def refit_network(watermark: float) -> None:
        """Fit the fabric model in a worker thread when the network watermark passes a fit's
        grid point (event time: every replay speed fits on the same windows, and the model
        scores from the same event time on); the stream waits only when it reaches that
        time before the fit is done."""
        if state.get("refitting"):
            return
        at = net_detection.refit_due(watermark)
        if at is None:
            return
        state["refitting"] = True
        rows = net_detection.training_rows(at)
        net_detection.begin(at)

        async def fit() -> None:
            try:
                t0 = time.perf_counter()
                model = await asyncio.to_thread(net_detection.fit_model, rows)
                net_detection.install(model, at)
                log.info("fabric model %s fitted on %d port windows in %.2fs (threshold %.3f)",
                         model.name, model.fitted_rows, time.perf_counter() - t0, model.threshold)
            except Exception:
                log.exception("fabric model fit failed; scoring goes on with the previous model")
            finally:
                state["refitting"] = False

        state["refit_task"] = asyncio.ensure_future(fit())

    def after_gpu(samples: list[GpuSample], parts: list[int]) -> None:
        # nodes that report telemetry are on the fleet view from their first sample
        if gpu_detection.nodes != state.get("gpu_nodes"):
            state["gpu_nodes"] = gpu_detection.nodes
            for x in samples:
                if x.node not in api_ctx.known:
                    api_ctx.known.add(x.node)
                    h = core.node(x.node)
                    api_ctx.saw_node(x.node, h["state"] if h else NodeState.healthy.value, h or {})

    telemetry = {specs["telemetry.gpu"].name: (GpuSample, gpu_detection, "GPU", after_gpu),
                 specs["telemetry.network"].name: (NetworkSample, net_detection, "network", after_network)}

    if s.worker.telemetry_consumer == "faust":
        async def detect_batches(stream: faust.StreamT, topic: str) -> None:
            model, detection, what, after = telemetry[topic]
            async for events in stream.take_events(s.worker.batch_size, within=s.worker.batch_within_s):
                msgs = [SimpleNamespace(topic=e.message.topic, partition=e.message.partition,
                                        offset=e.message.offset, key=e.key, value=e.value) for e in events]
                await handle_telemetry(msgs, model, detection, what, after)

        @app.agent(t_gpu, name="detect_gpu")
        async def detect_gpu(stream: faust.StreamT) -> None:
            await detect_batches(stream, specs["telemetry.gpu"].name)

        @app.agent(t_net, name="detect_network")
        async def detect_network(stream: faust.StreamT) -> None:
            await detect_batches(stream, specs["telemetry.network"].name)
    else:
        @app.task
        async def consume_telemetry() -> None:
            """Telemetry in batches straight from the consumer (see docs/decisions/0005)."""
            from aiokafka import AIOKafkaConsumer, ConsumerRebalanceListener, TopicPartition
            from aiokafka.errors import CommitFailedError, IllegalStateError

            consumer = AIOKafkaConsumer(
                bootstrap_servers=s.kafka.bootstrap, group_id=f"{s.kafka.app_id}-telemetry",
                enable_auto_commit=False, auto_offset_reset="earliest",
                max_partition_fetch_bytes=s.worker.max_fetch_bytes, fetch_max_bytes=4 * s.worker.max_fetch_bytes,
                session_timeout_ms=int(s.worker.session_timeout_s * 1000),
                heartbeat_interval_ms=int(min(3.0, s.worker.session_timeout_s / 4) * 1000),
            )
            state["telemetry_consumer"] = consumer
            # The hot path allocates many short-lived records; move everything alive now
            # out of the collector's view and collect young objects less often.
            gc.collect()
            gc.freeze()
            gc.set_threshold(s.worker.gc_threshold, 20, 100)
            offsets: dict[Any, int] = {}  # processed, not yet committed
            last_commit = time.monotonic()

            async def commit() -> None:
                # anomalies and dead letters are on the broker before the offsets move on
                await app.producer.flush()
                assigned = consumer.assignment()
                mine = {tp: o for tp, o in offsets.items() if tp in assigned}
                offsets.clear()
                if not mine:
                    return
                try:
                    await consumer.commit(mine)
                except (CommitFailedError, IllegalStateError) as exc:
                    # a rebalance took the partitions: their records are read again (at least once)
                    log.warning("telemetry offsets not committed (%s); they will be processed again", exc)

            class OnRebalance(ConsumerRebalanceListener):
                async def on_partitions_revoked(self, revoked: Any) -> None:
                    await commit()

                async def on_partitions_assigned(self, assigned: Any) -> None:
                    return None

            consumer.subscribe(list(telemetry), listener=OnRebalance())
            await consumer.start()
            if not release.is_set():
                log.info("telemetry held until POST /fleetmedic/release")
                await release.wait()

            try:
                while not app.should_stop:
                    # gather up to batch_size records, waiting at most batch_within_s for more
                    by_topic: dict[str, list] = {}
                    fetched: dict[Any, int] = {}
                    n = 0
                    deadline = None
                    while n < s.worker.batch_size:
                        wait = s.worker.batch_within_s if deadline is None else max(0.0, deadline - time.monotonic())
                        batch = await consumer.getmany(timeout_ms=int(wait * 1000), max_records=s.worker.batch_size - n)
                        for tp, recs in batch.items():
                            by_topic.setdefault(tp.topic, []).extend(recs)
                            fetched[TopicPartition(tp.topic, tp.partition)] = recs[-1].offset + 1
                            n += len(recs)
                        if n and deadline is None:
                            deadline = time.monotonic() + s.worker.batch_linger_s
                        if not batch or (deadline is not None and time.monotonic() >= deadline):
                            break
                    for topic, msgs in by_topic.items():
                        await handle_telemetry(msgs, *telemetry[topic])
                    offsets.update(fetched)
                    if offsets and time.monotonic() - last_commit >= s.worker.commit_interval_s:
                        await commit()
                        last_commit = time.monotonic()
            finally:
                if offsets:
                    try:
                        await commit()
                    except Exception:  # stopping: what is not committed is read again (at least once)
                        log.warning("could not commit telemetry offsets on stop")
                await consumer.stop()

    # ------------------------------------------------------------------ correlator

    async def correlate(event: Any, rec: Any) -> None:
        """One record through the correlator; a rule that fails dead-letters the record
        and leaves the stored state as it was."""
        try:
            d = core.handle(rec, time.time())
        except Exception as exc:
            log.exception("policy failed for %s", state_key(rec))
            await send_dead(event, f"policy error: {exc!r}")
            return
        await emit_decision(d)

    @app.agent(node_source, name="track_nodes")
    async def track_nodes(stream: faust.StreamT) -> None:
        anomalies_topic = specs["anomalies"].name
        async for event in stream.events():
            rec = await decode_event(event, Anomaly if event.message.topic == anomalies_topic else NodeNotice)
            if rec is not None:
                await correlate(event, rec)

    @app.agent(job_source, name="track_jobs")
    async def track_jobs(stream: faust.StreamT) -> None:
        job_topic = specs["telemetry.job"].name
        async for event in stream.events():
            rec = await decode_event(event, JobEvent if event.message.topic == job_topic else JobNotice)
            if rec is None:
                continue
            if isinstance(rec, JobEvent) and rec.event.value == "progress":
                try:
                    t0 = time.perf_counter()
                    found = peer_detection.process(rec)
                    metrics.detect_seconds.labels("peer").observe(time.perf_counter() - t0)
                    metrics.lag.labels(job_topic).set(time.time() - rec.ts)
                except Exception as exc:  # a detector bug must not stop the job track
                    log.exception("peer detection failed for %s", rec.job)
                    await send_dead(event, f"detector error: {exc!r}")
                    continue
                await emit_anomalies(found)
            await correlate(event, rec)

    @app.agent(t_switch_in, name="track_switches")
    async def track_switches(stream: faust.StreamT) -> None:
        async for event in stream.events():
            rec = await decode_event(event, SwitchNotice)
            if rec is not None:
                await correlate(event, rec)

    def resume_schedule() -> None:
        # after a restart, pick up failures and holds that were waiting when the worker stopped
        if not state["schedule_resumed"]:
            state["schedule_resumed"] = True
            core.resume()

    @app.timer(interval=1.0)
    async def send_switch_ticks() -> None:
        """Wake the switch track when a lone node's hold runs out, in the fabric's event time
        (the time the network samples of every partition have reached, as it was
        ``network.tick_lag_s`` ago), so a replayed backlog is judged as it happened."""
        resume_schedule()
        # the watermark of a moment ago: the anomalies of events up to it have had time to
        # pass through the node track onto the switch notices before the tick follows them
        mark = switch_marks.observe(time.monotonic(), state.get("net_watermark", 0.0))
        if mark:
            for tick in core.due_switch_ticks(mark):
                await t_switch_in.send(key=tick.switch.encode(), value=tick.to_json())

    @app.timer(interval=0.25)
    async def send_ticks() -> None:
        """Wake the job track when a failure's grace for node evidence has ended: when the
        telemetry watermark of ``policy.correlation_lag_s`` ago has passed it (event time,
        so a replay at any speed is judged alike), or at the latest after
        ``policy.correlation_wait_max_s`` of wall time (telemetry stalled or absent).  The
        tick carries that watermark as its event time."""
        resume_schedule()
        mark = job_marks.observe(time.monotonic(), telemetry_watermark.value)
        for tick in core.due_job_ticks(mark, time.time()):
            await t_job_in.send(key=tick.job.encode(), value=tick.to_json())

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
                dry_run=lambda: control_state.dry_run,
                deliver_later=deliver_later,
                drain_wait_s=a.drain_wait_s,
            )
        return state["actuation"]

    def owns_decisions(partition: int) -> bool:
        """Whether this worker holds that partition of the verdicts (it carries its work out)."""
        name = specs["verdicts"].name
        return any(tp.topic == name and tp.partition == partition for tp in app.consumer.assignment())

    async def report_step(w: Work, got: ActionRecord | Work) -> None:
        """A try's result goes back through the actuation agent, which writes it down (the
        pending table and the ledger are written in the stream that owns them)."""
        step = (ActionStep(ts=time.time(), kind="retry", key=w.key, work=got.to_dict()) if isinstance(got, Work)
                else ActionStep(ts=time.time(), kind="done", key=w.key, work=w.to_dict(), record=got))
        await t_steps.send(key=w.target.encode(), value=step.to_json(), partition=w.partition)

    def runner() -> ActionRunner:
        if state["runner"] is None:
            state["runner"] = ActionRunner(actuation(), report_step, max_in_flight=s.actuators.max_in_flight,
                                           owns=owns_decisions)
        return state["runner"]

    @app.task
    async def run_actions() -> None:
        await control.loaded.wait()
        await runner().run(lambda: bool(app.should_stop))

    @app.timer(interval=1.0)
    async def wake_actions() -> None:
        """After a start or a rebalance: tell the actuation agent of each partition newly
        held here to load the work kept for it (it reads the table in its own stream)."""
        if app.consumer is None or app.rebalancing:
            return
        name = specs["verdicts"].name
        held = {tp.partition for tp in app.consumer.assignment() if tp.topic == name}
        for p in sorted(held - state["woken"]):
            await t_steps.send(key=b"wake", value=ActionStep(ts=time.time(), kind="wake").to_json(), partition=p)
        state["woken"] = held

    # escalation webhook deliveries (actuators.webhook_url) run beside the actuate agent, at
    # most NOTIFY_BACKLOG at once; each settled delivery is an actions record
    notifying: set[asyncio.Task] = set()

    def deliver_later(delivery: Any) -> bool:
        if len(notifying) >= NOTIFY_BACKLOG:
            return False

        async def settle() -> None:
            try:
                await record_action(await delivery)
            except Exception:  # reported, never raised into the event loop
                log.exception("escalation webhook delivery could not be reported")

        task = asyncio.ensure_future(settle())
        notifying.add(task)
        task.add_done_callback(notifying.discard)
        return True

    async def record_action(r: ActionRecord) -> None:
        doc = r.to_dict()
        api_ctx.saw_action(doc)
        if r.outcome is Outcome.held_by_budget and r.action is ActionName.isolate:
            await control.put(held_record(doc))  # awaits a person, on every worker, after restarts
        stats["actions"] += 1
        metrics.actions.labels(r.action.value, r.outcome.value).inc()
        log.info("action %s %s: %s (%s) %s", r.action.value, r.target, r.outcome.value, r.backend, r.detail)
        await t_actions.send(key=r.target.encode(), value=r.to_json())

    # ------------------------------------------------------------------ operator API

    from pipeline.api import views as api_mod

    async def set_dry_run(enabled: bool, who: str, why: str) -> None:
        await control.put(dry_run_record(enabled, who, why))

    api_ctx = api_mod.ApiContext(
        auth=auth, node_table=node_to_health, job_table=job_to_history, switch_table=switch_to_state,
        send_verdict=lambda v: t_verdicts.send(key=v.subject.encode(), value=v.to_json()),
        send_node_notice=lambda n: t_node_in.send(key=n.node.encode(), value=n.to_json()),
        dry_run=lambda: control_state.dry_run, set_dry_run=set_dry_run,
        held=control_state.held, settle_held=lambda key: control.delete(HELD + key),
        dry_run_origin=control_state.dry_run_origin,
    )
    gate.api_routes |= set(api_mod.install(app, api_ctx))
    app.fleetmedic_api = api_ctx  # type: ignore[attr-defined]

    # verdicts to the alert webhooks, delivered in the background: a receiver that is down
    # delays no action; each delivery's outcome is an actions record
    alerts = build_alerts(s, record_action)
    app.fleetmedic_alerts = alerts  # type: ignore[attr-defined]

    async def settle_step(event: Any) -> None:
        """A try's result, from the runner: kept (retry) or settled (done)."""
        step = await decode_event(event, ActionStep)
        if step is None:
            return
        if step.kind == "wake":
            loaded = sum(runner().add(Work.from_dict(d)) for _, d in list(action_pending.items()) if d)
            if loaded:
                log.info("resuming %d actions kept for their next try", loaded)
            return
        if action_pending.get(step.key) is None or step.work is None:
            return  # settled already (a redelivered step)
        if step.kind == "retry":
            action_pending[step.key] = step.work
            return
        assert step.record is not None
        records = await actuation().finish(Work.from_dict(step.work), step.record)
        del action_pending[step.key]
        breaker_state["isolations"] = breaker.snapshot()
        metrics.breaker_used.set(len(breaker.snapshot()))
        for r in records:
            await record_action(r)

    @app.agent(actuation_source, name="actuate")
    async def actuate(stream: faust.StreamT) -> None:
        # nothing is carried out before the operator's decisions are known (dry-run above all)
        await control.loaded.wait()
        steps_topic = specs["internal.actions"].name
        async for event in stream.events():
            if event.message.topic == steps_topic:
                await settle_step(event)
                continue
            rec = await decode_event(event, Verdict)
            if rec is None:
                continue
            api_ctx.saw_verdict(rec.to_dict())
            if alerts is not None:
                alerts.submit(rec)
            saved = breaker_state.get("isolations")
            if saved and not breaker.snapshot():
                breaker.restore(saved)
            try:
                planned = await actuation().plan(rec, seq=event.message.offset, partition=event.message.partition)
            except Exception as exc:
                log.exception("actuation failed for verdict %s", rec.id)
                await send_dead(event, f"actuation error: {exc!r}")
                continue
            breaker_state["isolations"] = breaker.snapshot()
            metrics.breaker_used.set(len(breaker.snapshot()))
            metrics.breaker_budget.set(breaker.budget(fleet_size()))
            for step in planned:
                if isinstance(step, Work):
                    if action_pending.get(step.key) is None:
                        action_pending[step.key] = step.to_dict()
                    runner().add(step)
                else:
                    await record_action(step)

    # ------------------------------------------------------------------ web views

    started_at = time.time()

    @app.page("/healthz")
    async def healthz(web: Any, request: Any) -> Any:
        """Alive: the event loop answers (for a liveness probe)."""
        return web.json({"ok": True, "uptime_s": round(time.time() - started_at, 1)})

    async def lags() -> dict[str, int | None]:
        """Records left to read per assigned partition of the Faust consumer (its agents'
        topics; not table changelogs) and of the batch telemetry consumer."""
        out: dict[str, int | None] = {}
        c = app.consumer
        for tp in (c.assignment() if c is not None else ()):
            if tp.topic.endswith("-changelog"):
                continue
            try:
                hw, read = c.highwater(tp), c._read_offset.get(tp)
                out[f"{tp.topic}:{tp.partition}"] = None if hw is None else hw - (read + 1 if read is not None else 0)
            except Exception:  # a partition being revoked
                out[f"{tp.topic}:{tp.partition}"] = None
        tc = state.get("telemetry_consumer")
        for tp in (tc.assignment() if tc is not None else ()):
            hw = tc.highwater(tp)
            try:
                pos = await tc.position(tp)
            except Exception:
                pos = None
            out[f"{tp.topic}:{tp.partition}"] = None if hw is None or pos is None else hw - pos
        return out

    async def ready_state() -> dict[str, Any]:
        assigned = bool(app.consumer.assignment()) if app.consumer is not None else False
        tc = state.get("telemetry_consumer")
        if tc is not None:
            assigned = assigned and bool(tc.assignment())
        return readiness(assigned=assigned, rebalancing=bool(app.rebalancing), lags=await lags(),
                         max_lag=s.worker.ready_max_lag, control_loaded=control.loaded.is_set())

    @app.page("/readyz")
    async def readyz(web: Any, request: Any) -> Any:
        """Ready: partitions assigned, no rebalance, and caught up (at most worker.ready_max_lag
        records left to read)."""
        r = await ready_state()
        return web.json(r, status=200 if r["ready"] else 503)

    @app.page("/fleetmedic/ready")
    async def ready(web: Any, request: Any) -> Any:
        """Assigned and not rebalancing, caught up or not (the tools that start workers wait on it)."""
        r = await ready_state()
        ok = r["assigned"] and not r["rebalancing"] and r["control_loaded"]
        return web.json({**r, "ready": ok}, status=200 if ok else 503)

    @app.page("/fleetmedic/release")
    class ReleaseTelemetry(faust.web.View):
        """Start reading telemetry (a worker started with ``worker.hold_telemetry``)."""

        async def post(self, request: Any) -> Any:
            release.set()
            return self.json({"released": True})

    @app.page("/fleetmedic/stats")
    async def stats_view(web: Any, request: Any) -> Any:
        return web.json({**stats, "nodes_seen": nodes_seen(), "late_samples": gpu_detection.late + net_detection.late,
                         "fabric_model": {"name": net_detection.model.name, "ready": net_detection.model.ready,
                                          "fits": net_detection.fits,
                                          "training_rows": min(net_detection.reservoir_seen, 20000)},
                         "breaker_used": len(breaker.snapshot()),
                         "actions_waiting": state["runner"].pending if state["runner"] else 0,
                         "action_tries": state["runner"].tries if state["runner"] else 0, "detector_state_bytes": gpu_detection.nbytes() + net_detection.nbytes(),
                         "timing": timing,
                         "rss_bytes": _rss_bytes()})

    @app.page("/metrics")
    async def metrics_view(web: Any, request: Any) -> Any:
        return web.bytes(generate_latest(metrics.registry), content_type=CONTENT_TYPE_LATEST.split(";")[0])

    app.fleetmedic_agents = (track_nodes, track_jobs, actuate)  # type: ignore[attr-defined]
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

    def __setitem__(self, key: str, value: str) -> None:
        self.table[key] = value
