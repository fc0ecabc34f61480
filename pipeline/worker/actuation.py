"""The actuation agent and its runner: verdicts become backend actions.

The ``actuate`` agent plans each verdict (the idempotency ledger, the circuit breaker,
the operator's holds and dry-run: :class:`pipeline.actuate.core.Actuation`) and keeps
the actions that need a backend as work items in the ``action_pending`` table; the
runner tries them beside the stream and reports each try back on ``internal.actions``,
which the agent writes down (see docs/decisions/0014).  Every outcome is an ``actions``
record; escalation webhooks and alerts are delivered in the background.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import faust

from actuators import RetryPolicy
from schemas import ActionName, ActionRecord, ActionStep, Outcome, Verdict

from pipeline.actuate.control import held_record
from pipeline.actuate.core import ActionRunner, Actuation, Work, checkpoint_request, failure_alert
from pipeline.worker.build import build_alerts, build_notifier, build_router
from pipeline.worker.wiring import Wiring

log = logging.getLogger("fleetmedic")

#: escalation webhook deliveries in flight at most; beyond it a delivery is reported failed
NOTIFY_BACKLOG = 1000


def install(w: Wiring) -> tuple[Any, ...]:
    """The actuation agent, runner task and wake timer on ``w``; returns the agent."""
    s, app, specs, state, stats, metrics = w.s, w.app, w.specs, w.state, w.stats, w.metrics
    breaker, fleet_size, control, control_state = w.breaker, w.fleet_size, w.control, w.control_state
    action_to_outcome, action_pending = w.tables["action_to_outcome"], w.tables["action_pending"]
    breaker_state = w.tables["breaker_state"]
    t_steps, t_actions, t_jobs = w.topic("internal.actions"), w.topic("actions"), w.topic("telemetry.job")
    actuation_source = w.actuation_source
    decode_event, send_dead = w.decode_event, w.send_dead


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
        if isinstance(got, ActionRecord) and (asked := checkpoint_request(w, got)) is not None:
            await t_jobs.send(key=asked.job.encode(), value=asked.to_json())

    def runner() -> ActionRunner:
        if state["runner"] is None:
            state["runner"] = ActionRunner(actuation(), report_step, max_in_flight=s.actuators.max_in_flight,
                                           owns=owns_decisions, durable=app.producer.flush,
                                           contain_quiet_s=s.actuators.contain_quiet_s)
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
        w.api.saw_action(doc)
        if r.outcome is Outcome.held_by_budget and r.action is ActionName.isolate:
            await control.put(held_record(doc))  # awaits a person, on every worker, after restarts
        stats["actions"] += 1
        metrics.actions.labels(r.action.value, r.outcome.value).inc()
        log.info("action %s %s: %s (%s) %s", r.action.value, r.target, r.outcome.value, r.backend, r.detail)
        await t_actions.send(key=r.target.encode(), value=r.to_json())

    # verdicts to the alert webhooks, delivered in the background: a receiver that is down
    # delays no action; each delivery's outcome is an actions record
    alerts = build_alerts(s, record_action)
    app.fleetmedic_alerts = alerts  # type: ignore[attr-defined]

    window = BreakerWindow(breaker, breaker_state)

    def sync_breaker() -> None:
        if window.sync():
            metrics.breaker_used.set(window.used)

    def keep_breaker() -> None:
        if window.keep():
            metrics.breaker_used.set(window.used)

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
        sync_breaker()
        done = Work.from_dict(step.work)
        records = await actuation().finish(done, step.record)
        del action_pending[step.key]
        keep_breaker()
        for r in records:
            await record_action(r)
        if alerts is not None and (alert := failure_alert(done, step.record)) is not None:
            alerts.submit(alert)  # a person is told of an action that failed for good

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
            w.api.saw_verdict(rec.to_dict())
            if alerts is not None:
                alerts.submit(rec)
            sync_breaker()
            try:
                planned = await actuation().plan(rec, seq=event.message.offset, partition=event.message.partition)
            except Exception as exc:
                log.exception("actuation failed for verdict %s", rec.id)
                await send_dead(event, f"actuation error: {exc!r}")
                continue
            keep_breaker()
            metrics.breaker_budget.set(breaker.budget(fleet_size()))
            for step in planned:
                if isinstance(step, Work):
                    if action_pending.get(step.key) is None:
                        action_pending[step.key] = step.to_dict()
                    runner().add(step)
                else:
                    await record_action(step)

    return (actuate,)


class BreakerWindow:
    """The circuit breaker's window kept in a table (a Faust table: its changelog carries it
    across restarts and rebalances): one key per counted isolation (``isolation:<node>``,
    its time) and a marker under ``isolations``.

    The table is the truth. :meth:`sync` runs first in every actuation event: the marker is
    the object this worker last wrote unless the table was recovered from the changelog
    since (a start, a rebalance), and then the breaker takes the window from the table's
    entries before any check, release or write. :meth:`keep` writes after the event what
    changed, only when something did: the isolations added and those gone. The whole
    window under one key cost a write of all of it per verdict, the square of a burst's
    size in changelog bytes (17 MB for 1,000 nodes); an older worker's whole-window value
    under ``isolations`` is still read once.
    """

    KEY = "isolations"
    PREFIX = "isolation:"

    def __init__(self, breaker: Any, table: Any) -> None:
        self.breaker, self.table = breaker, table
        self.window: Any = None  # the marker object last written or read
        self.changes = -1  # the breaker's change count then
        self.written: dict[str, float] = {}  # node -> time, as the table's entries hold them

    @property
    def used(self) -> int:
        return int(self.breaker.size)

    def sync(self) -> bool:
        """The breaker from the table if the table changed under it; whether it did."""
        marker = self.table.get(self.KEY)
        if marker is self.window:
            return False
        if isinstance(marker, list):  # an older worker's whole window
            events = [(float(t), str(n)) for t, n in marker]
        else:
            events = [(float(t), str(k)[len(self.PREFIX):]) for k, t in list(self.table.items())
                      if isinstance(k, str) and k.startswith(self.PREFIX) and t is not None]
        self.breaker.restore(events)
        self.written = {n: t for t, n in events} if not isinstance(marker, list) else {}
        self.window, self.changes = marker, self.breaker.changes
        return True

    def keep(self) -> bool:
        """What changed in the breaker's window into the table; whether anything did."""
        if self.breaker.changes == self.changes:
            return False
        dirty = self.breaker.take_changes()
        if dirty is None:  # restored since: compare the whole window, once
            now = {n: t for t, n in self.breaker.snapshot()}
            dirty = set(now) | set(self.written)
        for node in dirty:
            t = self.breaker.counted_at(node)
            if t is None:
                if self.written.pop(node, None) is not None:
                    self.table.pop(self.PREFIX + node, None)
            elif self.written.get(node) != t:
                self.table[self.PREFIX + node] = t
                self.written[node] = t
        if self.window is None or isinstance(self.window, list):
            self.window = {"entries": self.PREFIX + "<node>"}
            self.table[self.KEY] = self.window
        self.changes = self.breaker.changes
        return True


class _TableLedger:
    """The idempotency ledger on a Faust table (survives restarts through its changelog)."""

    def __init__(self, table: Any) -> None:
        self.table = table

    def get(self, key: str, default: Any = None) -> Any:
        v = self.table.get(key)
        return default if v is None else v

    def __setitem__(self, key: str, value: str) -> None:
        self.table[key] = value
