"""The correlator: one object that every caller drives.

:class:`Correlator` takes the records that reach the correlator (anomalies, node notices,
job events, job notices, switch notices) and the passing of time, and returns what the
rules of :mod:`pipeline.correlate.policy` decided: verdicts, and the notices that one
track sends another.  It keeps its state in three mappings that the caller injects
(the Faust tables in a worker, dicts in a replay), reads each record through the
versioned loaders of :mod:`pipeline.correlate.state`, and keeps the schedule of the
ticks that end a failure's grace and a switch's hold.  It has no clock of its own: the
event time is the records' and the watermark's the caller passes, the wall clock a
number the caller passes too.  No I/O, no Kafka, no Faust.

The Faust worker (:mod:`pipeline.worker.app`), the in-process replay
(:class:`pipeline.eval.replay.LocalPipeline`) and the closed-loop evaluation
(:mod:`pipeline.eval.closedloop`, through the replay) are adapters around it: they
decode, deliver notices (over Kafka topics or an in-memory queue) and publish verdicts.
"""

from __future__ import annotations

from collections.abc import Callable, MutableMapping
from dataclasses import dataclass, field
from typing import Any

import orjson

from schemas import Anomaly, JobEvent, JobNotice, NodeNotice, SwitchNotice

from pipeline.config import NetworkSettings, PolicySettings
from pipeline.correlate import policy
from pipeline.correlate.state import (
    JobHistory,
    NodeHealth,
    load_job,
    load_node,
    load_switch,
    new_job,
    new_node,
    new_switch,
)

#: what the correlator takes in
CorrelatorInput = Anomaly | NodeNotice | JobEvent | JobNotice | SwitchNotice

#: the state stores a caller injects: key -> the record kept as JSON
Store = MutableMapping[str, Any]


def state_key(rec: CorrelatorInput) -> str:
    """The key a record's state is kept under (and the key it is partitioned by)."""
    if isinstance(rec, Anomaly):
        return rec.node or rec.subject
    if isinstance(rec, NodeNotice):
        return rec.node
    if isinstance(rec, SwitchNotice):
        return rec.switch
    return rec.job


@dataclass
class Schedule:
    """Ticks the tracks asked for.  ``jobs``: job -> (event time, wall time) at which the
    grace of its oldest waiting failure ends (whichever comes first); ``switches``: switch
    -> event time at which a lone node's hold runs out."""

    jobs: dict[str, tuple[float, float]] = field(default_factory=dict)
    switches: dict[str, float] = field(default_factory=dict)


class Correlator:
    """The node, job and switch tracks over injected state.

    ``on_node_state(node, state, record)`` is called when a node's state changes and
    ``on_switch(switch, open)`` when a switch's incident opens or closes (the operator API
    keeps its views with them)."""

    def __init__(
        self,
        policy_cfg: PolicySettings,
        network_cfg: NetworkSettings,
        *,
        nodes: Store | None = None,
        jobs: Store | None = None,
        switches: Store | None = None,
        on_node_state: Callable[[str, str, NodeHealth], None] | None = None,
        on_switch: Callable[[str, bool], None] | None = None,
    ) -> None:
        self.policy = policy_cfg
        self.network = network_cfg
        self.nodes: Store = {} if nodes is None else nodes
        self.jobs: Store = {} if jobs is None else jobs
        self.switches: Store = {} if switches is None else switches
        self.schedule = Schedule()
        self.on_node_state = on_node_state
        self.on_switch = on_switch

    # ------------------------------------------------------------------ records

    def handle(self, rec: CorrelatorInput, wall_now: float) -> policy.Decision:
        """Decide on one record.  If a rule raises, the stored state of its key is left as
        it was and the error goes to the caller (which dead-letters the record)."""
        if isinstance(rec, (Anomaly, NodeNotice)):
            return self._node(rec)
        if isinstance(rec, SwitchNotice):
            return self._switch(rec)
        return self._job(rec, wall_now)

    def node(self, key: str) -> NodeHealth | None:
        raw = self.nodes.get(key)
        return None if raw is None else load_node(raw)

    def job(self, key: str) -> JobHistory | None:
        raw = self.jobs.get(key)
        return None if raw is None else load_job(raw)

    def _node(self, rec: Anomaly | NodeNotice) -> policy.Decision:
        key = state_key(rec)
        raw = self.nodes.get(key)
        h = new_node() if raw is None else load_node(_copy(raw))
        before = h["state"]
        if isinstance(rec, Anomaly):
            d = policy.node_on_anomaly(h, rec, self.policy)
        else:
            d = policy.node_on_notice(h, rec, self.policy, self.network)
        self.nodes[key] = h
        if h["state"] != before and self.on_node_state is not None:
            self.on_node_state(key, h["state"], h)
        return d

    def _job(self, rec: JobEvent | JobNotice, wall_now: float) -> policy.Decision:
        key = rec.job
        raw = self.jobs.get(key)
        hist = new_job(key) if raw is None else load_job(_copy(raw))
        if isinstance(rec, JobEvent):
            d = policy.job_on_event(hist, rec, self.policy, wall_now)
        else:
            d = policy.job_on_notice(hist, rec, self.policy, wall_now)
        self.jobs[key] = hist
        # what the job waits for is in its state: any step may leave it waiting (a move for
        # a checkpoint outlives the events that come meanwhile)
        due = policy.job_due(hist)
        if due is not None:
            self.schedule.jobs[key] = due
        else:
            self.schedule.jobs.pop(key, None)
        return d

    def _switch(self, rec: SwitchNotice) -> policy.Decision:
        key = rec.switch
        raw = self.switches.get(key)
        st = new_switch(key) if raw is None else load_switch(_copy(raw))
        was = bool(st["incident"])
        d = policy.switch_on_notice(st, rec, self.network)
        self.switches[key] = st
        if bool(st["incident"]) != was and self.on_switch is not None:
            self.on_switch(key, not was)
        due = policy.switch_due(st)
        if due is not None:
            self.schedule.switches[key] = due
        else:
            self.schedule.switches.pop(key, None)
        return d

    # ------------------------------------------------------------------ time

    def due_job_ticks(self, mark: float, wall_now: float) -> list[JobNotice]:
        """Ticks for the jobs whose grace has ended: the event-time ``mark`` (the telemetry
        watermark) has reached its end, or the wall clock its longest wait.  The tick
        carries the mark as its event time (the rule stamps its verdicts with the grace's
        end, whichever clock woke it)."""
        out = []
        for job, (ts, wall) in sorted(self.schedule.jobs.items(), key=lambda kv: (kv[1][0], kv[0])):
            if wall <= wall_now or ts <= mark:
                del self.schedule.jobs[job]
                out.append(JobNotice(ts=max(mark, 0.0), job=job, node="-", kind="tick",
                                     fault_class="unknown", incident="-"))
        return out

    def due_switch_ticks(self, mark: float) -> list[SwitchNotice]:
        """Ticks for the switches whose lone-node hold the fabric's event time ``mark`` has passed."""
        out = []
        for sw, ts in sorted(self.schedule.switches.items(), key=lambda kv: (kv[1], kv[0])):
            if ts <= mark:
                del self.schedule.switches[sw]
                out.append(SwitchNotice(ts=max(ts, 0.0), switch=sw, node="-", kind="tick"))
        return out

    def resume(self) -> None:
        """Rebuild the schedule from the stored state (after a restart or a rebalance)."""
        for job, raw in list(self.jobs.items()):
            if raw:
                job_due = policy.job_due(load_job(raw))
                if job_due is not None:
                    self.schedule.jobs[job] = job_due
        for sw, raw in list(self.switches.items()):
            if raw:
                due = policy.switch_due(load_switch(raw))
                if due is not None:
                    self.schedule.switches[sw] = due


def _copy(raw: Any) -> dict[str, Any]:
    """A working copy of a stored record, so a rule that raises leaves the store untouched
    (the records are JSON, so a JSON round trip copies them, faster than ``deepcopy``)."""
    out: dict[str, Any] = orjson.loads(orjson.dumps(raw))
    return out
