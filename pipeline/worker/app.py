"""The Faust application, declared: its parts are installed over one :class:`Wiring`.

Agents receive, call a plain object, send.  The decisions live in the correlator
(:mod:`pipeline.correlate`), the maths in :mod:`detectors`, the acting in :mod:`actuators`
through :mod:`pipeline.actuate`.  The parts: :mod:`~pipeline.worker.telemetry`,
:mod:`~pipeline.worker.tracks`, :mod:`~pipeline.worker.actuation`,
:mod:`~pipeline.worker.views`, and the operator API (:mod:`pipeline.api`).

=======================  ===============================  =====================================
agent                    reads                            writes
=======================  ===============================  =====================================
``detect_gpu``           ``telemetry.gpu`` (batches)      ``anomalies``
``detect_network``       ``telemetry.network`` (batches)  ``anomalies``
``track_nodes``          ``anomalies``, node notices      ``verdicts``, job notices
``track_jobs``           ``telemetry.job``, job notices   ``verdicts``, node notices, ``anomalies``
``track_switches``       switch notices                   ``verdicts``, node notices
``actuate``              ``verdicts``, action steps       ``actions``, action steps
=======================  ===============================  =====================================

Anything that cannot be decoded goes to ``deadletter`` with the reason; no agent stops on
bad input.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import faust

from pipeline.actuate.control import HELD, dry_run_record
from pipeline.api.gate import GateConfig, is_loopback, make_gate
from pipeline.config import Settings
from pipeline.worker import faust_fixes  # noqa: F401  (patches two record-loss races in Faust on import)
from pipeline.worker import actuation, telemetry, tracks, views
from pipeline.worker.build import app_options, build_auth, data_dir
from pipeline.worker.metrics import Metrics
from pipeline.worker.wiring import Wiring

__all__ = ["Metrics", "create_app", "data_dir", "faust_worker"]

log = logging.getLogger("fleetmedic")


def create_app(s: Settings, **faust_options: Any) -> faust.App:
    """Declare the fleetmedic Faust app for ``s``."""
    auth = build_auth(s)
    gate = GateConfig.for_worker(auth, web_host=s.worker.web_host, web_bind=s.worker.web_bind,
                                 extra_hosts=s.worker.allowed_hosts, metrics_public=s.auth.metrics_public)
    if not is_loopback(s.worker.web_bind) and not s.auth.enabled:
        log.warning("the worker listens on %s with sign-in OFF: anyone who reaches port %d can read every node's "
                    "history and hold or return nodes; turn auth.enabled on or bind to 127.0.0.1",
                    s.worker.web_bind, s.worker.web_port)
    app = faust.App(s.kafka.app_id, **app_options(s, [make_gate(gate)], **faust_options))
    w = Wiring.declare(app, s)
    w.api = _operator_api(w, auth, gate)

    @app.task
    async def follow_control() -> None:
        """The operator's decisions (dry-run, held isolations) from the compacted control topic."""
        await w.control.run(lambda: bool(app.should_stop))

    telemetry.install(w)
    agents = tracks.install(w) + actuation.install(w)
    views.install(w)
    app.fleetmedic_metrics = w.metrics  # type: ignore[attr-defined]
    app.fleetmedic_stats = w.stats  # type: ignore[attr-defined]
    app.fleetmedic_control = w.control  # type: ignore[attr-defined]
    app.fleetmedic_api = w.api  # type: ignore[attr-defined]
    app.fleetmedic_agents = agents  # type: ignore[attr-defined]
    return app


def faust_worker(app: faust.App, log_level: str) -> Any:
    """The Faust worker that runs ``app``, logging at ``log_level``, with no terminal spinner.

    Faust's worker feeds its startup spinner from the root logger: at ``warning`` or
    ``error`` it sets the root logger to DEBUG and lets its handler drop what is below the
    level. Every debug call in aiokafka, Faust and mode then builds a log record that is
    thrown away, a record per message produced (about 7 % of a worker's time in a burst of
    verdicts). Without the spinner the root logger stays at ``log_level``."""
    from faust.worker import Worker

    worker = Worker(app, loglevel=log_level, quiet=True, redirect_stdouts=False)
    worker.spinner = None
    return worker


def _holds_every_partition(app: faust.App, topic: str, partitions: int) -> bool:
    """Whether this worker reads every partition of ``topic`` (then its node table holds
    every node, and a node it does not know is unknown to fleetmedic)."""
    try:
        assigned = app.consumer.assignment()
    except Exception:  # not started yet
        return False
    return len({tp.partition for tp in assigned if tp.topic == topic}) >= partitions


def _operator_api(w: Wiring, auth: Any, gate: GateConfig) -> Any:
    """The operator API's context (its one view of the worker's state) and its routes."""
    from pipeline.api import views as api_mod

    control, control_state, t = w.control, w.control_state, w.topics

    async def set_dry_run(enabled: bool, who: str, why: str) -> None:
        await control.put(dry_run_record(enabled, who, why))

    ctx = api_mod.ApiContext(
        auth=auth, node_table=w.tables["node_to_health"], job_table=w.tables["job_to_history"],
        switch_table=w.tables["switch_to_state"],
        send_verdict=lambda v: t["verdicts"].send(key=v.subject.encode(), value=v.to_json()),
        send_node_notice=lambda n: t["internal.node-notices"].send(key=n.node.encode(), value=n.to_json()),
        dry_run=lambda: control_state.dry_run, set_dry_run=set_dry_run,
        held=control_state.held, settle_held=lambda key: control.delete(HELD + key),
        dry_run_origin=control_state.dry_run_origin,
        breaker=lambda: {"used": w.breaker.used(time.time()), "budget": w.breaker.budget(w.fleet_size()),
                         "window_s": w.breaker.window_s},
        human_hours=_manual_hours(), node_switches=w.net_detection.node_switches,
        owns_every_node=lambda: _holds_every_partition(w.app, w.specs["anomalies"].name, w.s.kafka.partitions),
    )
    gate.api_routes |= set(api_mod.install(w.app, ctx))
    return ctx


def _manual_hours() -> float | None:
    """The expected delay of a person under make eval's manual baseline (field.toml)."""
    from pipeline.api.kpi import expected_human_hours
    from pipeline.eval.field import load

    try:
        f = load()
    except Exception:  # the dashboard then shows no saving rather than a wrong one
        log.exception("field model not readable: GPU-hours saved will not be shown")
        return None
    return expected_human_hours(f.human_median_hours, f.human_sigma)
