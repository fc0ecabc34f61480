"""The correlator's agents: the node, job and switch tracks, and the ticks that end a
failure's grace and a switch's hold.

Each agent decodes a record and hands it to the one correlator
(:class:`pipeline.correlate.core.Correlator`, whose state lives in the Faust tables);
what it decided is sent on: verdicts, and notices to the other tracks.  A rule that
fails dead-letters its record and leaves the stored state as it was.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import faust

from schemas import Anomaly, JobEvent, JobNotice, NodeNotice, SwitchNotice

from pipeline.correlate.core import state_key
from pipeline.worker.wiring import Wiring

log = logging.getLogger("fleetmedic")


def install(w: Wiring) -> tuple[Any, ...]:
    """The track agents and tick timers on ``w``; returns the agents."""
    app, specs, metrics, state, core = w.app, w.specs, w.metrics, w.state, w.core
    peer_detection = w.peer_detection
    node_source, job_source = w.node_source, w.job_source
    t_switch_in, t_job_in = w.topic("internal.switch-notices"), w.topic("internal.job-notices")
    job_marks, switch_marks, telemetry_watermark = w.job_marks, w.switch_marks, w.telemetry_watermark
    in_flight = w.in_flight
    decode_event, send_dead, emit_anomalies, emit_decision = w.decode_event, w.send_dead, w.emit_anomalies, w.emit_decision


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
                if isinstance(rec, Anomaly):
                    in_flight.done(rec.id)  # its notices are sent: a tick may follow them

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
                    if w.api is not None and w.api.history.watched:
                        w.api.history.record_steps(rec.job, rec.ts, rec.node_step_times)
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
        ``network.tick_lag_s`` ago, and below the anomalies still on their way through
        this worker's node track), so a replayed backlog is judged as it happened."""
        resume_schedule()
        wall = time.monotonic()
        mark = in_flight.bound(switch_marks.observe(wall, state.get("net_watermark", 0.0)), wall)
        if mark:
            for tick in core.due_switch_ticks(mark):
                await t_switch_in.send(key=tick.switch.encode(), value=tick.to_json())

    @app.timer(interval=0.25)
    async def send_ticks() -> None:
        """Wake the job track when a failure's grace for node evidence has ended: when the
        telemetry watermark of ``policy.correlation_lag_s`` ago has passed it (event time,
        so a replay at any speed is judged alike), or at the latest after
        ``policy.correlation_wait_max_s`` of wall time (telemetry stalled or absent).  The
        watermark stays below the anomalies still on their way through this worker's node
        track; the tick carries it as its event time."""
        resume_schedule()
        wall = time.monotonic()
        mark = in_flight.bound(job_marks.observe(wall, telemetry_watermark.value), wall)
        for tick in core.due_job_ticks(mark, time.time()):
            await t_job_in.send(key=tick.job.encode(), value=tick.to_json())

    return track_nodes, track_jobs, track_switches
