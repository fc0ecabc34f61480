"""Telemetry in, anomalies out: GPU and fabric samples are decoded and scored in batches.

Batches come from the worker's own consumer (``worker.telemetry_consumer = "batch"``, the
default: see docs/decisions/0005) or from two Faust agents.  A record that cannot be
decoded, a late one and a detector's failure go to the dead-letter topic with the
reason; a redelivered one is counted and dropped.  The fabric model is refitted in a
thread when the network watermark passes a grid point of event time.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import time
from types import SimpleNamespace
from collections.abc import Callable
from typing import Any

import faust

from schemas import NetworkSample

from pipeline.correlate.state import NodeState
from pipeline.detect.glue import DecodedBatch, PartitionWatermark, decode_each, decode_gpu, late_reason
from pipeline.worker.wiring import Wiring

log = logging.getLogger("fleetmedic")


def install(w: Wiring) -> None:
    """The detection agents (or the batch consumer task) on ``w``."""
    s, app, specs, stats, timing, state, metrics = w.s, w.app, w.specs, w.stats, w.timing, w.state, w.metrics
    gpu_detection, net_detection = w.gpu_detection, w.net_detection
    telemetry_watermark, release = w.telemetry_watermark, w.release
    dead_raw, count_ok, emit_anomalies = w.dead_raw, w.count_ok, w.emit_anomalies
    t_gpu, t_net = w.topic("telemetry.gpu"), w.topic("telemetry.network")
    #: per telemetry topic, the partition each node's samples came from: the nodes of
    #: partitions assigned to another worker are forgotten (their detector state freed)
    where: dict[str, dict[str, int]] = {}

    async def handle_telemetry(msgs: list[Any], decoder: Callable[[list[Any]], DecodedBatch], detection: Any,
                               what: str,
                               after: Any = None) -> None:
        """Decode a batch of records (``topic``, ``partition``, ``offset``, ``key``, ``value``
        attributes), detect over it at once, send anomalies; then ``after(nodes, times,
        partitions)`` of the samples accepted."""
        t0 = time.perf_counter()
        try:
            samples, positions, errors, nodes, times = decoder([m.value for m in msgs])
        except Exception as exc:  # a decoder bug must not stop the stream either
            log.exception("%s decoding failed on a batch of %d messages", what, len(msgs))
            for m in msgs:
                await dead_raw(m.topic, m.partition, m.offset, m.key, m.value, f"decoder error: {exc!r}")
            return
        for k, reason in errors:
            m = msgs[k]
            await dead_raw(m.topic, m.partition, m.offset, m.key, m.value, reason)
        source = [msgs[k] for k in positions]  # the message of each decoded sample
        parts = [m.partition for m in source]  # and its partition
        stats["telemetry"] += len(msgs)
        task = state.get("refit_task")
        if detection is net_detection and times and task is not None and not task.done() \
                and net_detection.waits_for(max(times)):
            await asyncio.shield(task)  # the stream reached the event time of a fit still running
        t1 = time.perf_counter()
        timing["decode_s"] += t1 - t0
        newest: dict[int, float] = {}  # the newest event time of each partition in the batch
        try:
            anomalies = detection.process(samples)
            if detection is gpu_detection and w.api.history.watched:
                w.api.history.record(samples)
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
            if times:
                count_ok(msgs[0].topic, len(times) - len(detection.refused))
                where.setdefault(msgs[0].topic, {}).update(zip(nodes, parts))
                for ts, part in zip(times, parts):
                    if ts > newest.get(part, 0.0):
                        newest[part] = ts
            t2 = time.perf_counter()
            timing["detect_s"] += t2 - t1
            metrics.detect_seconds.labels(what).observe(t2 - t0)
            metrics.batch_size.labels(what).observe(len(msgs))
            if times:
                metrics.lag.labels(msgs[0].topic).set(time.time() - max(times))
        except Exception as exc:  # a detector bug must not stop the stream
            log.exception("%s detection failed on a batch of %d samples", what, len(times))
            for m in msgs:
                await dead_raw(m.topic, m.partition, m.offset, m.key, m.value, f"detector error: {exc!r}")
            return
        # the anomalies are in flight before the watermark passes them (a tick waits for them)
        await emit_anomalies(anomalies)
        for part, ts in newest.items():
            telemetry_watermark.update((msgs[0].topic, part), ts)
        if after is not None and times:
            after(nodes, times, parts)
        now = time.time()
        if not stats["first_telemetry_at"]:
            stats["first_telemetry_at"] = now
        stats["last_telemetry_at"] = now

    net_watermark = PartitionWatermark()

    def after_network(nodes: list[str], times: list[float], parts: list[int]) -> None:
        # event-time watermark of the fabric, the time every partition has reached: the
        # switch track's holds run on it, so a lone node's hold does not run out while the
        # anomalies of its neighbours are still queued in another partition
        for ts, part in zip(times, parts):
            net_watermark.update(part, ts)
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

    def after_gpu(nodes: list[str], times: list[float], parts: list[int]) -> None:
        # nodes that report telemetry are on the fleet view from their first sample
        if gpu_detection.rows != state.get("gpu_rows"):
            state["gpu_rows"] = gpu_detection.rows
            for node in nodes:
                if node not in w.api.known:
                    w.api.known.add(node)
                    h = w.core.node(node)
                    w.api.saw_node(node, h["state"] if h else NodeState.healthy.value, h or {})

    def forget_moved(assigned: Any) -> None:
        """State follows ownership: after a rebalance, make room for this worker's share of
        the fleet (``safety.fleet_size`` times its share of the partitions, plus a tenth),
        and free the detector state of the nodes whose partitions it no longer holds; a
        node that comes back later warms up again from its telemetry (its rate windows
        start empty)."""
        if s.safety.fleet_size:
            for topic, (_, detection, _, _) in telemetry.items():
                share = sum(1 for tp in assigned if tp.topic == topic) / s.kafka.partitions
                if share:
                    detection.reserve(int(s.safety.fleet_size * share * 1.1))
        for topic, nodes in where.items():
            mine = {tp.partition for tp in assigned if tp.topic == topic}
            gone = [n for n, part in nodes.items() if part not in mine]
            if not gone:
                continue
            detection = telemetry[topic][1]
            freed = detection.forget(gone)
            for n in gone:
                del nodes[n]
            stats["nodes_forgotten"] += freed
            log.info("freed the detector state of %d nodes of %s (their partitions moved to another worker)",
                     freed, topic)

    telemetry = {specs["telemetry.gpu"].name: (decode_gpu, gpu_detection, "GPU", after_gpu),
                 specs["telemetry.network"].name: (decode_each(NetworkSample), net_detection, "network",
                                                   after_network)}

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
                max_partition_fetch_bytes=s.worker.telemetry_fetch_bytes, fetch_max_bytes=4 * s.worker.telemetry_fetch_bytes,
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
            #: the commit under way beside the loop (the producer's flush waits for the broker's
            #: acknowledgements of everything sent, and telemetry keeps flowing meanwhile)
            committing: asyncio.Task | None = None

            async def commit() -> None:
                # the offsets of records whose anomalies and dead letters were sent before
                # the flush began: those are on the broker before the offsets move on
                todo = dict(offsets)
                offsets.clear()
                await app.producer.flush()
                assigned = consumer.assignment()
                mine = {tp: o for tp, o in todo.items() if tp in assigned}
                if not mine:
                    return
                try:
                    await consumer.commit(mine)
                except (CommitFailedError, IllegalStateError) as exc:
                    # a rebalance took the partitions: their records are read again (at least once)
                    log.warning("telemetry offsets not committed (%s); they will be processed again", exc)

            async def settle_commit() -> None:
                """Wait for the commit under way; its failure is raised here, in the loop."""
                nonlocal committing
                task, committing = committing, None
                if task is not None:
                    await task

            class OnRebalance(ConsumerRebalanceListener):
                async def on_partitions_revoked(self, revoked: Any) -> None:
                    await settle_commit()
                    await commit()

                async def on_partitions_assigned(self, assigned: Any) -> None:
                    forget_moved(assigned)
                    if not release.is_set() and assigned:
                        consumer.pause(*assigned)  # held: not even fetched ahead until released

            consumer.subscribe(list(telemetry), listener=OnRebalance())
            await consumer.start()
            if not release.is_set():
                log.info("telemetry held until POST /fleetmedic/release")
                await release.wait()
                consumer.resume(*consumer.assignment())

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
                    # let the verdict and actuation agents in: with records buffered, neither
                    # getmany nor the sends above need to suspend, and a backlog would
                    # otherwise hold the event loop batch after batch
                    await asyncio.sleep(0)
                    if committing is not None and committing.done():
                        await settle_commit()
                    if offsets and committing is None and time.monotonic() - last_commit >= s.worker.commit_interval_s:
                        committing = asyncio.ensure_future(commit())
                        last_commit = time.monotonic()
            finally:
                try:
                    await settle_commit()
                except Exception:  # stopping: what is not committed is read again (at least once)
                    log.warning("could not commit telemetry offsets on stop")
                if offsets:
                    try:
                        await commit()
                    except Exception:  # stopping: what is not committed is read again (at least once)
                        log.warning("could not commit telemetry offsets on stop")
                await consumer.stop()
