"""The worker's own pages: liveness, readiness, its counters and its Prometheus metrics.

``/healthz`` answers while the event loop does; ``/readyz`` once the operator's
decisions are loaded, partitions are assigned and the backlog is small;
``/fleetmedic/ready`` for the tools that start workers; ``/fleetmedic/stats`` and
``/metrics`` for people and Prometheus.  Every route passes the gate
(:mod:`pipeline.api.gate`).
"""

from __future__ import annotations

import time
from typing import Any

import faust
import faust.web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from pipeline.detect.glue import readiness
from pipeline.worker.metrics import rss_bytes
from pipeline.worker.wiring import Wiring


def install(w: Wiring) -> None:
    s, app, state, stats, timing, metrics = w.s, w.app, w.state, w.stats, w.timing, w.metrics
    gpu_detection, net_detection, breaker, control, release = (w.gpu_detection, w.net_detection, w.breaker,
                                                               w.control, w.release)
    nodes_seen = w.nodes_seen


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

    def assigned() -> bool:
        """Both consumers have partitions; False while they are starting (Faust's consumer
        raises ConsumerNotStarted then) or stopping."""
        try:
            ok = bool(app.consumer.assignment()) if app.consumer is not None else False
            tc = state.get("telemetry_consumer")
            return ok and (tc is None or bool(tc.assignment()))
        except Exception:
            return False

    async def ready_state() -> dict[str, Any]:
        up = assigned()
        try:
            lag = await lags() if up else {}
        except Exception:  # a consumer stopping or starting between the two calls
            up, lag = False, {}
        return readiness(assigned=up, rebalancing=bool(app.rebalancing), lags=lag,
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
                         "breaker_used": breaker.size,
                         "anomalies_in_flight": len(w.in_flight), "in_flight_expired": w.in_flight.expired,
                         "actions_waiting": state["runner"].pending if state["runner"] else 0,
                         "action_tries": state["runner"].tries if state["runner"] else 0, "detector_state_bytes": gpu_detection.nbytes() + net_detection.nbytes(),
                         "timing": timing,
                         "rss_bytes": rss_bytes()})

    @app.page("/metrics")
    async def metrics_view(web: Any, request: Any) -> Any:
        return web.bytes(generate_latest(metrics.registry), content_type=CONTENT_TYPE_LATEST.split(";")[0])
