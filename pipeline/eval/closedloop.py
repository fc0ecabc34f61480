"""Closed loop at field rates: a 2,048-node cluster over 54 days, six policies, one fault sequence.

``python -m pipeline.eval.closedloop [--quick] [--seed N] [--out FILE]``

A discrete-event simulation (a heap of timed events) of 2,048 nodes x 8 GPUs running
gang-scheduled training jobs, with fault arrivals and the cause mix of published field
data (``field.toml``: Llama 3's 419 unexpected interruptions in 54 days on 16,384 GPUs,
Table 5's causes; lemon nodes after Kokolis et al., HPCA 2025).  One seed draws one fault
sequence (arrival time, cause, simulator fault kind, node draw, ramp); the same sequence
is then run with each of six policies acting:

* ``fleetmedic``: what the real code decides.  Every incident is first run as its own
  micro-simulation through :class:`pipeline.eval.inproc.InProcessLoop` (the detection
  glue and correlator the Faust agents call, and the real ``Actuation`` with its circuit
  breaker): a 4-node :class:`pipeline.sim.cluster.Cluster`, GPU telemetry every 5 s, a
  healthy warm-up of one detector window, then the one fault with its ramp, seeded per
  incident.  Its verdicts give the detection delay, the fault class, whether and when the
  node was isolated (for degrading faults: before the failure, and the lead time), the
  job's action (retry / requeue / stop) and its delay, and any other node isolated.
  The fleet-level simulation applies those outcomes.  Across incidents it keeps one real
  node-health state per node in the correlator (:class:`pipeline.correlate.core.Correlator`,
  the object the worker and the replay drive) and passes it: ``job_failed`` notices of unattributed failures
  (the repeat-failure rules: a node in many small failed jobs, or the node failures keep
  beginning on, which the scheduler reports for every cause but silent data corruption,
  ``field.toml`` ``[hidden]``) and ``diag_passed`` / ``diag_failed`` notices (the lemon rule).
* ``fleetmedic_checkpoint_now``: fleetmedic with ``policy.checkpoint_now`` (the default;
  the ``fleetmedic`` policy above models it off): when a node of a running job shows a sign
  before it fails (``field.toml`` ``[precursors]``: the degrading kinds, found or not by the
  real detectors in the incident's micro-simulation) it asks the job to save now; a job
  that answers (``[checkpoint_now]`` ``non_honouring_share`` do not) loses the save and the
  restart, nothing since its last checkpoint, and is requeued without the node; one that
  does not is moved as plain fleetmedic moves it.  The same decisions otherwise.
* ``reactive_oracle``: right the instant each failure happens, on the same sequence: a
  failing node (hidden faults and lemons included) isolated at once and the job requeued
  without it, a user's bug stopped at once, anything else requeued in place; no detection
  delay, no wrong verdict, no person for the fault, no healthy node isolated.  It acts on
  failures only, never on a sign before one: the floor of any policy that reacts.
* ``manual``: a person notices every failure, finds its cause and fixes it after a delay
  drawn from the documented human-delay distribution; the job holds its nodes meanwhile.
* ``naive_cordon``: every node of a failed job is cordoned at once and the job requeued
  on spare nodes (it waits when too few are free); a cordoned node comes back after
  diagnostics and a person's review.
* ``retry_only``: the job's controller restarts it on the same nodes, never isolating;
  a job still failing after its retries waits for a person.

Rules the fleet-level simulation applies itself (not the real code): fault arrivals and
placement; checkpoint timing and restart cost; the baselines' behaviour; that a node with
a persistent fault fails the job again when it restarts there (within a minute for a dead
GPU or port, after an exponential time for hidden faults and lemons); that a job which
keeps failing after its automatic retries (``controller_retries`` for the baselines,
``PolicySettings.transient_retries`` for fleetmedic) waits for a person (all policies);
migration of a job off a degrading node at its next checkpoint or after
``checkpoint_deadline_s`` (the rule of :func:`pipeline.correlate.policy.job_on_notice`, whose timing
the micro-simulation's 60 s checkpoints cannot show); diagnostics (1 h) and repair times;
that lemons pass diagnostics and hidden faults fail them; that a person retires a node
after as many returns as fleetmedic's lemon rule allows; benign rises (``[precursors]``
``false_alarms_per_true``: a real sign on a node that would not have failed), which both
fleetmedic policies isolate and move the job off, as the rate tests would, and whose
diagnostics pass.  Recurrences of one incident
(a hidden fault crashing again) reuse that incident's micro-simulation outcome; every
incident, lemon recurrences included, has its own micro-simulation.

Measures (per policy, over the scenario's duration T):

* ``ettr``: productive GPU time / allocated GPU time.  Allocated: every job slot's GPUs for
  all of T.  Productive: allocated minus ``job_gpu_hours_lost``.
* ``job_gpu_hours_lost``: for every job failure, the work since the job's last checkpoint
  (a job that fails while restarting loses the restart), the time the job is down waiting
  for a decision, a person or replacement nodes, the restart cost, and the save a job makes
  on a checkpoint-now request (``checkpoint_save``); a job fleetmedic
  stops (a deterministic user error) releases its nodes, which the queue backfills.
* ``healthy_held_out_gpu_hours``: GPU time of healthy nodes held out of service (cordoned
  or isolated though nothing is wrong with them), counted only while no job is waiting
  for nodes (when one is, that capacity is already counted as the job's wait).
* ``gpu_hours_lost``: the sum of the two.  Broken nodes under repair are not counted (the
  same for every policy; ``repair_node_hours`` reports them).
* ``healthy_nodes_isolated``: isolations or cordons of nodes with nothing wrong with them.
* ``precursor_false_alarms``: isolations on a benign rise: judged by the ground truth, the
  node had a real sign, so it is not counted as healthy; its cost (the job's move, the
  node's time out) is in the GPU-hours lost.
* ``needed_human``: failures whose recovery waited on a person (all failures under manual
  handling; user errors; faults no automation attributed; jobs waiting on returns by a person).

fleetmedic's per-fault detection delays (seconds from the fault to the node's isolation,
or from the job's failure to the job's verdict when no node is at fault) and the lead
times of degrading faults (isolation before the failure) come from the micro-simulations.
"""

from __future__ import annotations

import argparse
import bisect
import heapq
import json
import math
import os
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from schemas import NodeNotice

from pipeline import paths
from pipeline.correlate.core import Correlator
from pipeline.correlate.state import OUT_OF_POOL, NodeState, enter, new_node
from pipeline.config import Settings, load_settings
from pipeline.sim.cluster import DEGRADING_KINDS, HARDWARE_KINDS, KIND_CLASS, Cluster, Fault, SimConfig
from pipeline.eval import field as fieldmod
from pipeline.eval.inproc import InProcessLoop

POLICIES = ("fleetmedic", "fleetmedic_checkpoint_now", "reactive_oracle", "manual", "naive_cordon", "retry_only")
#: the policies that run the real code's decisions (and act on precursors)
FLEETMEDIC = frozenset({"fleetmedic", "fleetmedic_checkpoint_now"})
#: each policy's random stream (repairs, a person's delays): fleetmedic and its
#: checkpoint-now variant draw alike, so that they differ by their decisions alone
STREAM = {"fleetmedic": 0, "manual": 1, "naive_cordon": 2, "retry_only": 3, "reactive_oracle": 4,
          "fleetmedic_checkpoint_now": 0}
HOUR = 3600.0
DAY = 86400.0
T0 = 1_800_000_000.0
MICRO_NODES = 4
#: the Alibaba PAI mini-batch traces' step-time variation, under the data sets' root
ALIBABA_COV = "alibaba-minibatch/data/coefficient_variation.csv"
#: kinds whose node stays faulty after the failure (until it is taken out and repaired)
PERSISTENT = HARDWARE_KINDS | {"hidden"}


# ----------------------------------------------------------------------------- incidents


@dataclass
class Incident:
    id: int
    t: float  # scenario seconds: the fault starts (degrading) or strikes
    cause: str
    kind: str
    u: float  # node draw in [0, 1): the u-th node among those running jobs
    lead_s: float = 0.0  # degrading: seconds from the first sign to the failure
    seed: int = 0
    outcome: dict[str, Any] | None = None


@dataclass(frozen=True)
class FalseAlarm:
    """A benign rise (``[precursors]``): a sign on a node that would not have failed."""

    t: float  # scenario seconds: fleetmedic's rate test finds it
    kind: str  # the degrading kind it looks like
    u: float  # node draw in [0, 1), as for incidents


def draw_false_alarms(fld: fieldmod.Field, nodes: int, days: float, seed: int, per_node_day: float) -> list[FalseAlarm]:
    """One seeded sequence of benign rises at ``per_node_day``, their kinds in the mix of
    the real precursors' kinds (from its own stream: the fault sequence does not move)."""
    rng = np.random.default_rng([seed, 23])
    weights: Counter[str] = Counter()
    for c in fld.causes:
        for k in fld.precursors[c.name].kinds:
            weights[k] += c.count * c.kinds[k]
    if per_node_day <= 0 or not weights:
        return []
    kinds = sorted(weights)
    w = np.array([weights[k] for k in kinds], dtype=float)
    w /= w.sum()
    out: list[FalseAlarm] = []
    t = 0.0
    rate = per_node_day * nodes / DAY
    while True:
        t += float(rng.exponential(1.0 / rate))
        if t >= days * DAY:
            return out
        out.append(FalseAlarm(t=t, kind=kinds[int(rng.choice(len(kinds), p=w))], u=float(rng.random())))


def false_alarm_rate(fld: fieldmod.Field, per_true: float) -> float:
    """Benign rises per node-day: ``per_true`` for every real precursor at the field rate."""
    return per_true * fld.precursor_share() * fld.per_node_day


def draw_incidents(fld: fieldmod.Field, nodes: int, days: float, seed: int) -> list[Incident]:
    """One seeded fault sequence at the Llama 3 rate and cause mix."""
    rng = np.random.default_rng(seed)
    rate = fld.per_node_day * nodes / DAY  # arrivals per second
    causes = list(fld.causes)
    w = np.array([c.count for c in causes], dtype=float)
    w /= w.sum()
    out: list[Incident] = []
    t = 0.0
    horizon = days * DAY
    while True:
        t += float(rng.exponential(1.0 / rate))
        if t >= horizon:
            break
        c = causes[int(rng.choice(len(causes), p=w))]
        kinds = list(c.kinds)
        kind = kinds[int(rng.choice(len(kinds), p=np.array([c.kinds[k] for k in kinds])))]
        inc = Incident(id=len(out), t=t, cause=c.name, kind=kind, u=float(rng.random()),
                       seed=int(seed) * 1_000_003 + len(out))
        if kind in fld.ramps:
            inc.lead_s = fld.ramps[kind] * 60.0 * float(rng.uniform(0.75, 1.25))
        out.append(inc)
    return out


# ------------------------------------------------------------------- micro-simulation

_SETTINGS: dict[int, Settings] = {}


def _settings(fleet: int) -> Settings:
    if fleet not in _SETTINGS:
        # the network track acts (network.enforce), as in the quality run: with the shipped
        # default (advisory only) a failing NIC or cable is escalated to a person, not isolated
        _SETTINGS[fleet] = load_settings(environ={}, overrides={"safety": {"fleet_size": fleet},
                                                                "network": {"enforce": True}})
    return _SETTINGS[fleet]


def micro(kind: str, seed: int, lead_s: float, *, fleet: int, warmup_s: int = 600, gpu_every: int = 5) -> dict[str, Any]:
    """Run one incident through the real pipeline in a small cluster; what it decided."""
    sim_kind = "transient_crash" if kind == "hidden" else kind
    cfg = SimConfig(nodes=MICRO_NODES, speed=1.0, duration=1e9, seed=seed, faults="none", gpu_every=gpu_every)
    c = Cluster(cfg, t0=T0)
    at = float(warmup_s)
    f = Fault(kind=sim_kind, at=at)
    fail = at
    if sim_kind == "sbe_rise":
        f.fail_at = fail = at + round(lead_s)
        f.tau = lead_s / 9.2
    elif sim_kind == "nvlink":
        f.fail_at = fail = at + round(lead_s)
        f.tau = lead_s / 7.6
    elif sim_kind == "thermal":
        f.fail_at = fail = at + round(lead_s)
    elif sim_kind == "nic":
        fail = at + 180.0
    elif sim_kind == "leaf":
        fail = at + 150.0
        f.end_at = at + 1200.0
    c.faults = [f]
    c.pending_faults = [f]
    loop = InProcessLoop(_settings(fleet), c)
    end = fail + 120.0
    iso_t: float | None = None
    job_t: float | None = None
    try:
        while c.now < end:
            loop.step(10)
            if f.node and iso_t is None:
                iso_t = next((v.ts - T0 for v in loop.verdicts if v.scope == "node" and v.subject == f.node
                              and any(a.action.value == "isolate" for a in v.actions)), None)
            if f.job and job_t is None:
                job_t = next((v.ts - T0 for v in loop.verdicts if v.scope == "job" and v.subject == f.job), None)
            # degrading: once isolated and the job moved, the rest is diagnostics
            if sim_kind in DEGRADING_KINDS and iso_t is not None and job_t is not None and c.now > job_t + 70:
                break
        loop.finish()
    finally:
        loop.close()
    verdicts = loop.verdicts
    node_vs = [v for v in verdicts if v.scope == "node" and v.subject == f.node]
    job_vs = [v for v in verdicts if v.scope == "job" and v.subject == f.job]
    isolated = sorted({a.target for v in verdicts for a in v.actions if a.action.value == "isolate"})
    applied = {(a.action.value, a.target): a.outcome.value for a in loop.actions}
    first_job = job_vs[0] if job_vs else None
    return {
        "kind": kind,
        "applied": f.applied_ts is not None,
        "node": f.node,
        "fail_s": fail - at,
        "iso_s": None if iso_t is None else iso_t - at,
        "iso_applied": bool(f.node) and applied.get(("isolate", f.node)) in ("applied", "already_so"),
        "node_class": node_vs[0].fault_class.value if node_vs else None,
        "job_action": first_job.actions[0].action.value if first_job else None,
        "job_class": first_job.fault_class.value if first_job else None,
        "job_final_class": job_vs[-1].fault_class.value if job_vs else None,
        "job_decide_s": None if first_job is None else max(0.0, first_job.ts - T0 - fail),
        "job_actions": [v.actions[0].action.value for v in job_vs],
        "stop_s": next((max(0.0, v.ts - T0 - fail) for v in job_vs if v.actions[0].action.value == "stop"), None),
        "job_exclude": list(first_job.actions[0].params.get("exclude") or []) if first_job else [],
        "false_isolations": [n for n in isolated if n != f.node],
        "switch_escalated": any(v.scope == "switch" for v in verdicts),
        "escalated": [a.target for v in verdicts for a in v.actions if a.action.value == "escalate"],
    }


def _micro_task(args: tuple[str, int, float, int, int, int]) -> dict[str, Any]:
    kind, seed, lead_s, fleet, warmup, every = args
    return micro(kind, seed, lead_s, fleet=fleet, warmup_s=warmup, gpu_every=every)


def run_micros(incidents: list[Incident], fld: fieldmod.Field, fleet: int, say: Callable[..., Any],
               workers: int | None = None) -> None:
    tasks = [(i.kind, i.seed, i.lead_s, fleet, fld.warmup_s, fld.gpu_every_s) for i in incidents]
    workers = workers or max(1, min(os.cpu_count() or 1, 8))
    t = time.perf_counter()
    done = 0
    if workers > 1 and len(tasks) > 4:
        with ProcessPoolExecutor(max_workers=workers) as ex:
            for inc, out in zip(incidents, ex.map(_micro_task, tasks, chunksize=2)):
                inc.outcome = out
                done += 1
                if done % 50 == 0:
                    say(f"  micro-simulations: {done}/{len(tasks)} ({time.perf_counter() - t:.0f} s)")
    else:
        for inc, task in zip(incidents, tasks):
            inc.outcome = _micro_task(task)


# ------------------------------------------------------------------------ fleet model


@dataclass
class Slot:
    id: int
    size: int
    nodes: list[int]
    running: bool = True
    run_start: float = 0.0  # progress (and checkpoints) since
    down_since: float | None = None
    epoch: int = 0
    retries: int = 0
    last_fail: float = -1e18
    waiting_nodes: int = 0  # replacement nodes still needed
    waiting_human: bool = False
    restarts: int = 0
    user_bug: int | None = None  # a deterministic error: the job fails again 20 s into every run
    cause: str = "-"  # the field cause of the job's latest failure (for the loss breakdown)
    kind: str = "-"  # the simulator kind of that failure (or of the sign it was moved for)
    honours: bool = True  # answers a checkpoint-now request by saving ([checkpoint_now])


@dataclass
class FleetNode:
    id: int
    slot: int | None = None
    out: bool = False
    broken: str | None = None  # the persistent fault's kind
    lemon: bool = False
    epoch: int = 0
    returns: list[float] = field(default_factory=list)
    incident: int | None = None
    benign: bool = False  # out on a benign rise: a real sign, no failure to come


class Fleet:
    """One policy's run of the scenario."""

    def __init__(self, name: str, fld: fieldmod.Field, nodes: int, days: float, seed: int,
                 incidents: list[Incident], lemons: set[int], settings: Settings,
                 extra_micro: Callable[[str, int], dict[str, Any]],
                 false_alarms: list[FalseAlarm] | None = None, non_honouring_share: float | None = None) -> None:
        self.name = name
        #: runs the real code's decisions (fleetmedic and its checkpoint-now variant)
        self.fm = name in FLEETMEDIC
        #: asks a job on a node with a sign to save now ([checkpoint_now])
        self.checkpoint_now = name == "fleetmedic_checkpoint_now"
        self.f = fld
        self.T = days * DAY
        self.ps = settings.policy
        #: the node track's state of every node, driven through the correlator
        self.core = Correlator(settings.policy, settings.network)
        self.extra_micro = extra_micro
        self.C = fld.checkpoint_minutes * 60.0
        self.R = fld.restart_minutes * 60.0
        self.seed = seed
        self.rng = np.random.default_rng([seed, STREAM[name], 7])
        self.person_calls: Counter[tuple[int, int]] = Counter()
        # separate streams so that a policy's own choices do not shift the shared sequence
        self.lemon_rng = np.random.default_rng([seed, 11])
        self.origin_rng = np.random.default_rng([seed, 17])
        self.gpus = fld.gpus_per_node
        self.nodes = [FleetNode(i, lemon=i in lemons) for i in range(nodes)]
        self.slots: list[Slot] = []
        allocated = int(fld.utilization * nodes)
        sizes = [min(s, max(1, allocated // 4)) for s in fld.job_sizes]
        nxt = 0
        plan = [(size, int(share * allocated / size)) for size, share in zip(sizes, fld.job_size_shares)]
        plan[-1] = (sizes[-1], plan[-1][1] + (allocated - sum(a * b for a, b in plan)) // sizes[-1])
        for size, count in plan:
            for _ in range(count):
                s = Slot(id=len(self.slots), size=size, nodes=list(range(nxt, nxt + size)))
                for n in s.nodes:
                    self.nodes[n].slot = s.id
                self.slots.append(s)
                nxt += size
        self.spares: list[int] = list(range(nxt, nodes))
        self.slot_ends = list(np.cumsum([s.size for s in self.slots]))
        # which jobs answer a checkpoint-now request: drawn per job from its own stream
        skip = fld.non_honouring_share if non_honouring_share is None else non_honouring_share
        honour_rng = np.random.default_rng([seed, 19])
        for s in self.slots:
            s.honours = bool(honour_rng.random() >= skip)
        self.heap: list[tuple[float, int, str, tuple]] = []
        self.seq = 0
        self.now = 0.0
        self.lost_gpu_s = 0.0
        self.lost_by_what: Counter[str] = Counter()
        self.lost_by_cause: Counter[str] = Counter()
        self.lost_by_kind: Counter[tuple[str, str]] = Counter()
        self.held_gpu_s = 0.0
        self.repair_node_s = 0.0
        self._last = 0.0
        self.waiting: list[int] = []  # slots waiting for nodes (FIFO)
        self.incidents = {i.id: i for i in incidents}
        self.counts: Counter[str] = Counter()
        self.needed_human = 0
        self.healthy_isolated = 0
        self.failures = 0
        self.by_cause: dict[str, Counter[str]] = defaultdict(Counter)
        self.detect_s: list[float] = []
        self.lead_s: list[float] = []
        self.degrade_detect_s: list[float] = []  # degrading: from the first sign to the isolation
        self.missed: list[str] = []
        self.false_alarm_count = 0
        for inc in incidents:
            self.push(inc.t, "fault", (inc.id,))
        for n in self.nodes:
            if n.lemon and n.slot is not None:
                self._schedule_lemon(n)
        self.false_alarms = list(false_alarms or []) if self.fm else []
        for k, fa in enumerate(self.false_alarms):
            self.push(fa.t, "false_alarm", (k,))

    # ------------------------------------------------------------------ event plumbing

    def isolated(self, node: int, t: float, incident: str, fault_class: str | None) -> None:
        """The node track isolated ``node`` (as its micro-simulation showed): its state moves
        to isolated through the lifecycle's transitions, unless it is out of the pool already."""
        h = self.core.node(str(node)) or new_node()
        if h["state"] not in OUT_OF_POOL:
            enter(h, NodeState.isolated, t, incident=incident, fault_class=fault_class)
            self.core.nodes[str(node)] = h

    def push(self, t: float, kind: str, args: tuple) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (t, self.seq, kind, args))

    def _account(self, t: float) -> None:
        t = min(t, self.T)
        dt = t - self._last
        if dt > 0:
            healthy_out = sum(1 for n in self.nodes if n.out and n.broken is None and not n.lemon)
            if not self.waiting:
                self.held_gpu_s += dt * healthy_out * self.gpus
            self.repair_node_s += dt * sum(1 for n in self.nodes if n.out and (n.broken or n.lemon))
            self._last = t

    def lose(self, slot: Slot, seconds: float, start: float, what: str) -> None:
        """Charge ``seconds`` of ``slot``'s GPUs from ``start`` (clipped to the scenario);
        ``what`` (since_checkpoint, down, restart) and the slot's cause break the loss down."""
        lo, hi = max(0.0, start), min(self.T, start + seconds)
        if hi > lo:
            gpu_s = (hi - lo) * slot.size * self.gpus
            self.lost_gpu_s += gpu_s
            self.lost_by_what[what] += gpu_s
            self.lost_by_cause[slot.cause] += gpu_s
            self.lost_by_kind[slot.kind, what] += gpu_s

    def run(self) -> None:
        while self.heap:
            t, _, kind, args = heapq.heappop(self.heap)
            if t >= self.T:
                break
            self._account(t)
            self.now = t
            getattr(self, "ev_" + kind)(*args)
        self._account(self.T)
        for s in self.slots:
            if not s.running and s.down_since is not None:
                self.lose(s, self.T - s.down_since, s.down_since, "down")

    # ------------------------------------------------------------------ job mechanics

    def running_nodes(self) -> list[int]:
        return [n.id for n in self.nodes if n.slot is not None and not n.out and self.slots[n.slot].running]

    def strike(self, running: list[int], u: float) -> int:
        """The node a fault drawn at ``u`` strikes: the job at ``u`` of the allocated nodes (jobs
        by size, in a fixed order) and its node at the same place, if that job is running;
        else the ``u``-th of the nodes at work.  A fault strikes the same job under every
        policy whenever that job is running in both, whatever else is down."""
        x = u * self.slot_ends[-1]
        k = bisect.bisect_right(self.slot_ends, x)
        s = self.slots[min(k, len(self.slots) - 1)]
        if s.running and s.nodes:
            start = self.slot_ends[k - 1] if k else 0
            node = s.nodes[min(len(s.nodes) - 1, int((x - start) / s.size * len(s.nodes)))]
            if not self.nodes[node].out:
                return node
        return running[min(len(running) - 1, int(u * len(running)))]

    def fail_job(self, s: Slot, node: int | None, t: float, *, migrate: bool = False) -> None:
        """The job stops: charge the work since its last checkpoint; it is down from ``t``."""
        if not s.running:
            return
        self.failures += 0 if migrate else 1
        if t < s.run_start:
            pass  # failed while restarting: the restart was charged when it began
        elif not migrate:
            self.lose(s, (t - s.run_start) % self.C, t - (t - s.run_start) % self.C, "since_checkpoint")
        s.running = False
        s.down_since = t
        s.epoch += 1
        if t - s.last_fail > self.ps.repeat_failure_window_s:
            s.retries = 0
        s.last_fail = t

    def resume(self, s: Slot, t: float) -> None:
        """The job restarts at ``t`` (after its wait); the restart itself is lost work."""
        if s.running or s.waiting_nodes:
            return
        if s.down_since is not None:
            self.lose(s, t - s.down_since, s.down_since, "down")
        self.lose(s, self.R, t, "restart")
        s.running = True
        s.down_since = None
        s.waiting_human = False
        s.run_start = t + self.R
        s.restarts += 1
        s.epoch += 1
        if s.user_bug is not None:
            self.push(s.run_start + 20.0, "user_refail", (s.id, s.epoch, s.user_bug))
        # a node with a persistent fault fails the job again once it runs
        for n in s.nodes:
            self._arm(self.nodes[n], s)

    def _arm(self, n: FleetNode, s: Slot) -> None:
        if n.out:
            return
        if n.broken in HARDWARE_KINDS:
            self.push(s.run_start + 60.0, "refail", (s.id, s.epoch, n.id))
        elif n.broken == "hidden":
            # keyed by the fault and the job's run on it: the same for every policy that restarts it
            rng = np.random.default_rng([self.seed, 13, (n.incident or 0) & 0xFFFFFFFF, s.id, s.restarts])
            self.push(s.run_start + float(rng.exponential(self.f.hidden_recurrence_hours * HOUR)),
                      "refail", (s.id, s.epoch, n.id))
        if n.lemon and n.broken is None:
            self._schedule_lemon(n)

    def _schedule_lemon(self, n: FleetNode) -> None:
        n.epoch += 1
        self.push(self.now + float(self.lemon_rng.exponential(self.f.lemon_recurrence_hours * HOUR)),
                  "lemon", (n.id, n.epoch))

    def take_out(self, node: int, t: float, *, by_person: bool) -> None:
        """Isolate/cordon ``node``: it leaves its job (replaced from the spares) and is diagnosed."""
        n = self.nodes[node]
        if n.out:
            return
        if n.broken is None and not n.lemon and not n.benign:
            self.healthy_isolated += 1
        n.out = True
        n.epoch += 1
        if node in self.spares:
            self.spares.remove(node)
        if n.slot is not None:
            s = self.slots[n.slot]
            s.nodes.remove(node)
            n.slot = None
            s.waiting_nodes += 1
        diag = self.f.naive_diag_hours * HOUR
        if n.broken is not None:
            # diagnostics fail; a technician repairs the node
            repair = float(self.rng.lognormal(math.log(self.f.repair_median_hours * HOUR), self.f.repair_sigma))
            self.push(t + diag, "diag_done", (node, n.epoch, False))
            self.push(t + diag + repair, "node_back", (node, n.epoch, True))
        else:
            self.push(t + diag, "diag_done", (node, n.epoch, True))

    def fill(self, s: Slot) -> bool:
        """Give ``s`` the replacement nodes it needs from the spares; False: it must wait."""
        while s.waiting_nodes and self.spares:
            node = self.spares.pop(0)
            s.nodes.append(node)
            self.nodes[node].slot = s.id
            s.waiting_nodes -= 1
        if s.waiting_nodes:
            if s.id not in self.waiting:
                self.waiting.append(s.id)
            return False
        if s.id in self.waiting:
            self.waiting.remove(s.id)
        return True

    def human_delay(self, *key: int) -> float:
        """A person's delay.  Keyed by what the person answers (an incident on a job, a node's
        return), so that two policies calling a person for the same thing wait alike however
        their other events interleave (common random numbers)."""
        rng = np.random.default_rng([self.seed, STREAM[self.name], 29, *(k & 0xFFFFFFFF for k in key)]) if key else self.rng
        return float(rng.lognormal(math.log(self.f.human_median_hours * HOUR), self.f.human_sigma))

    def give_back(self, node: int) -> None:
        n = self.nodes[node]
        n.out = False
        n.epoch += 1
        self.spares.append(node)
        for sid in list(self.waiting):
            s = self.slots[sid]
            if self.fill(s) and not s.waiting_human and not s.running:
                self.resume(s, self.now)
            if not self.spares:
                break

    def person_retires(self, n: FleetNode, t: float) -> bool:
        """A person (or the lemon rule) retires a node returned too often: it is repaired for good."""
        lo = t - self.ps.lemon_window_s
        n.returns = [x for x in n.returns if x >= lo]
        return len(n.returns) + 1 >= self.ps.lemon_returns

    # ------------------------------------------------------------------ events

    def ev_fault(self, iid: int) -> None:
        inc = self.incidents[iid]
        running = self.running_nodes()
        if not running:
            return
        node = self.strike(running, inc.u)
        n = self.nodes[node]
        s = self.slots[n.slot]  # type: ignore[index]
        self.by_cause[inc.cause]["faults"] += 1
        n.incident = iid
        kind = inc.kind
        if kind in PERSISTENT:
            n.broken = kind
        if kind in DEGRADING_KINDS or kind == "nvlink":
            self.push(self.now + inc.lead_s, "degraded_fail", (iid, node, s.id, s.epoch))
            if self.fm:
                o = inc.outcome or {}
                if o.get("iso_s") is not None and o["iso_s"] < o["fail_s"]:
                    self.push(self.now + o["iso_s"], "early_isolate", (iid, node))
            return
        self.failure(inc, node, s, self.now)

    def ev_degraded_fail(self, iid: int, node: int, sid: int, epoch: int) -> None:
        n = self.nodes[node]
        if n.out or n.slot is None:
            return  # isolated before it failed
        self.failure(self.incidents[iid], node, self.slots[n.slot], self.now)

    def ev_early_isolate(self, iid: int, node: int) -> None:
        """fleetmedic isolated a degrading node before it failed: the job moves at its next checkpoint."""
        n = self.nodes[node]
        inc = self.incidents[iid]
        o = inc.outcome or {}
        if n.out or n.slot is None:
            return
        s = self.slots[n.slot]
        self.lead_s.append(o["fail_s"] - o["iso_s"])
        self.degrade_detect_s.append(o["iso_s"])
        self.by_cause[inc.cause]["isolated_before_failure"] += 1
        self.isolated(node, self.now, str(iid), o.get("node_class"))
        self.move_off_sign(s, node)

    def move_off_sign(self, s: Slot, node: int) -> None:
        """``node`` of ``s`` shows a sign and is isolated: move the job off it before it fails.

        fleetmedic (``policy.job_on_notice``): at the job's next checkpoint, or from its last
        one at ``checkpoint_deadline_s``.  With checkpoint-now, a job that honours the
        request saves at once and is moved when its save is done (its ack); one that does
        not is moved as plain fleetmedic moves it."""
        if not s.running:
            self.take_out(node, self.now, by_person=False)
            return
        deadline = self.ps.checkpoint_deadline_s
        save = self.f.checkpoint_save_s
        if self.checkpoint_now and s.honours and self.now >= s.run_start and save <= deadline:
            self.counts["checkpoint_now_requested"] += 1
            self.push(self.now + save, "checkpoint_ack", (s.id, s.epoch, node))
            return
        if self.checkpoint_now and not s.honours:
            self.counts["checkpoint_now_unanswered"] += 1
        to_ckpt = self.C - ((self.now - s.run_start) % self.C) if self.now >= s.run_start else s.run_start - self.now
        migrate_at = self.now + min(to_ckpt, deadline)
        at_ckpt = to_ckpt <= deadline
        self.push(migrate_at, "migrate", (s.id, s.epoch, node, at_ckpt))

    def ev_checkpoint_ack(self, sid: int, epoch: int, node: int) -> None:
        """The job saved on request: its GPUs spent the save; nothing since its last checkpoint
        is lost; it is requeued without the node."""
        s = self.slots[sid]
        if s.epoch != epoch or not s.running or node not in s.nodes:
            self.counts["checkpoint_now_too_late"] += 1  # the failure (or another move) came first
            return
        s.cause, s.kind = self._cause_on(node), self._cause_on(node, kind=True)
        self.lose(s, self.f.checkpoint_save_s, self.now - self.f.checkpoint_save_s, "checkpoint_save")
        self.counts["checkpoint_now_acked"] += 1
        self.fail_job(s, node, self.now, migrate=True)
        self.take_out(node, self.now, by_person=False)
        if self.fill(s):
            self.resume(s, self.now)

    def _cause_on(self, node: int, *, kind: bool = False) -> str:
        """The cause (or kind) of the sign ``node`` was isolated for: its incident's, or a benign rise."""
        n = self.nodes[node]
        if n.benign:
            return "false_alarm"
        if n.incident is None:
            return "-"
        inc = self.incidents[n.incident]
        return inc.kind if kind else inc.cause

    def ev_false_alarm(self, k: int) -> None:
        """A benign rise on a running node: fleetmedic's rate test isolates it as it would a
        real sign, and the job is moved off it; the node would not have failed."""
        fa = self.false_alarms[k]
        running = self.running_nodes()
        if not running:
            return
        node = self.strike(running, fa.u)
        n = self.nodes[node]
        if n.broken is not None or n.lemon:
            return  # a node that is really failing: not a false alarm
        n.benign = True
        self.false_alarm_count += 1
        self.isolated(node, self.now, f"benign-{k}", "node_degrading")
        self.move_off_sign(self.slots[n.slot], node)  # type: ignore[index]

    def ev_migrate(self, sid: int, epoch: int, node: int, at_ckpt: bool) -> None:
        s = self.slots[sid]
        if s.epoch != epoch or not s.running or node not in s.nodes:
            return
        s.cause, s.kind = self._cause_on(node), self._cause_on(node, kind=True)
        if not at_ckpt:
            self.lose(s, (self.now - s.run_start) % self.C, self.now - (self.now - s.run_start) % self.C, "since_checkpoint")
        self.fail_job(s, node, self.now, migrate=True)
        self.take_out(node, self.now, by_person=False)
        if self.fill(s):
            self.resume(s, self.now)

    def ev_refail(self, sid: int, epoch: int, node: int) -> None:
        s = self.slots[sid]
        n = self.nodes[node]
        if s.epoch != epoch or not s.running or n.out or n.slot != sid or n.broken is None:
            return
        inc = self.incidents[n.incident] if n.incident is not None else None
        if inc is not None:
            self.by_cause[inc.cause]["recurrences"] += 1
            self.failure(inc, node, s, self.now, repeat=True)

    def ev_lemon(self, node: int, epoch: int) -> None:
        n = self.nodes[node]
        if n.epoch != epoch or n.out or n.slot is None or not self.slots[n.slot].running:
            return
        self.counts["lemon_failures"] += 1
        key = int(self.lemon_rng.integers(1 << 30))
        inc = Incident(id=-(len(self.incidents) + 1), t=self.now, cause="lemon", kind="xid79", u=0.0, seed=key)
        if self.fm:
            inc.outcome = self.extra_micro("xid79", key)
        self.incidents[inc.id] = inc
        n.incident = inc.id
        self.by_cause["lemon"]["faults"] += 1
        self.failure(inc, node, self.slots[n.slot], self.now, lemon=True)

    def ev_resume(self, sid: int, epoch: int) -> None:
        s = self.slots[sid]
        if s.epoch != epoch:
            return
        if self.fill(s):
            self.resume(s, self.now)

    def ev_person(self, sid: int, epoch: int, node: int, persistent: bool) -> None:
        """A person fixes the failure: takes a faulty node out, then restarts the job."""
        s = self.slots[sid]
        if s.epoch != epoch:
            return
        s.retries = 0
        s.user_bug = None  # the person fixed the code (or the cause)
        if persistent and node in s.nodes:
            self.take_out(node, self.now, by_person=True)
        s.waiting_human = False
        if self.fill(s):
            self.resume(s, self.now)

    def ev_diag_done(self, node: int, epoch: int, passed: bool) -> None:
        n = self.nodes[node]
        if n.epoch != epoch:
            return
        if self.fm:
            h = self.core.node(str(node)) or new_node()
            if h["state"] not in (NodeState.isolated, NodeState.diagnosing):
                enter(h, NodeState.isolated, self.now, incident=str(n.incident), fault_class="unknown")
                self.core.nodes[str(node)] = h
            d = self.core.handle(NodeNotice(ts=T0 + self.now, node=str(node), job=f"diag-{node}",
                                            kind="diag_passed" if passed else "diag_failed"), T0 + self.now)
            acts = [a.action.value for v in d.verdicts for a in v.actions]
            if passed and "return" in acts:
                n.returns.append(self.now)
                self.push(self.now, "node_back", (node, n.epoch, False))
            elif passed:  # the lemon rule: out for good, repaired by a person
                self.retire(n)
            return
        if passed:
            if n.lemon and (self.name == "reactive_oracle" or self.person_retires(n, self.now)):
                self.retire(n)
                return
            # a person returns the node after reviewing the diagnostics
            n.returns.append(self.now)
            self.push(self.now + self.human_delay(1, node, len(n.returns)), "node_back", (node, n.epoch, False))

    def retire(self, n: FleetNode) -> None:
        """A lemon taken out for good: under repair (not a healthy node held out) until it is back."""
        self.counts["lemons_retired"] += 1
        n.lemon = False
        n.broken = "retired"
        self.push(self.now + self.repair(), "node_back", (n.id, n.epoch, True))

    def repair(self) -> float:
        return float(self.rng.lognormal(math.log(self.f.repair_median_hours * HOUR), self.f.repair_sigma))

    def ev_node_back(self, node: int, epoch: int, repaired: bool) -> None:
        n = self.nodes[node]
        if n.epoch != epoch or not n.out:
            return
        if repaired:
            n.broken = None
            n.returns = []
            self.core.nodes[str(node)] = new_node()  # repaired: its history starts again
        elif self.fm:
            pass  # health already returned to service by the real lemon rule
        n.benign = False
        self.give_back(node)

    # ------------------------------------------------------------------ the policies

    def failure(self, inc: Incident, node: int, s: Slot, t: float, *, repeat: bool = False, lemon: bool = False) -> None:
        persistent = self.nodes[node].broken is not None or lemon
        s.cause = "lemon" if lemon else inc.cause
        s.kind = "lemon" if lemon else inc.kind
        self.fail_job(s, node, t)
        self.by_cause[inc.cause]["failures"] += 1
        if inc.kind == "user_bug":
            s.user_bug = inc.id
        getattr(self, "policy_" + self.name)(inc, node, s, t, persistent, repeat, lemon)

    def _call_person(self, s: Slot, node: int, persistent: bool, inc: Incident) -> None:
        self.needed_human += 1
        self.by_cause[inc.cause]["needed_human"] += 1
        s.waiting_human = True
        self.person_calls[inc.id, s.id] += 1
        delay = self.human_delay(0, inc.id, s.id, self.person_calls[inc.id, s.id])
        self.push(self.now + delay, "person", (s.id, s.epoch, node, persistent))

    def _retry(self, s: Slot, delay: float, node: int, persistent: bool, inc: Incident, budget: int) -> None:
        s.retries += 1
        if s.retries > budget:
            self._call_person(s, node, persistent, inc)
        else:
            self.push(self.now + delay, "resume", (s.id, s.epoch))

    def policy_manual(self, inc, node, s, t, persistent, repeat, lemon) -> None:
        self._call_person(s, node, persistent, inc)

    def policy_retry_only(self, inc, node, s, t, persistent, repeat, lemon) -> None:
        self._retry(s, 0.0, node, persistent, inc, self.f.controller_retries)

    def policy_naive_cordon(self, inc, node, s, t, persistent, repeat, lemon) -> None:
        for n in list(s.nodes):
            self.take_out(n, t, by_person=False)
        s.retries += 1
        if inc.kind == "user_bug" and s.retries > self.f.controller_retries:
            self._call_person(s, node, False, inc)
            return
        if not self.fill(s):
            # the job waits for cordoned nodes that a person must return
            self.needed_human += 1
            self.by_cause[inc.cause]["needed_human"] += 1
            return
        self.resume(s, t)

    def policy_reactive_oracle(self, inc, node, s, t, persistent, repeat, lemon) -> None:
        """Right, at once, from the failure on: a user's bug is stopped (its nodes backfilled),
        a failing node (hidden faults and lemons included) isolated and the job requeued
        without it, anything else requeued in place; no detection delay, no retry, no person
        for the fault itself (a stopped job's bug is its user's to fix)."""
        if inc.kind == "user_bug":
            s.user_bug = None
            self.needed_human += 1
            self.by_cause[inc.cause]["needed_human"] += 1
            s.running = True  # the slot is backfilled by the next queued job
            s.down_since = None
            s.run_start = t + self.R
            self.lose(s, self.R, t, "restart")
            s.epoch += 1
            self.counts["stopped"] += 1
            return
        if persistent and node in s.nodes:
            self.by_cause[inc.cause]["isolated"] += 1
            self.take_out(node, t, by_person=False)
        self.push(t, "resume", (s.id, s.epoch))

    def ev_user_refail(self, sid: int, epoch: int, iid: int) -> None:
        s = self.slots[sid]
        if s.epoch != epoch or not s.running:
            return
        self.failure(self.incidents[iid], s.nodes[0], s, self.now, repeat=True)

    def policy_fleetmedic_checkpoint_now(self, inc, node, s, t, persistent, repeat, lemon) -> None:
        """After a failure, fleetmedic's decisions; before one, see :meth:`move_off_sign`."""
        self.policy_fleetmedic(inc, node, s, t, persistent, repeat, lemon)

    def policy_fleetmedic(self, inc, node, s, t, persistent, repeat, lemon) -> None:
        o = inc.outcome or {}
        decide = float(o.get("job_decide_s") or 0.0)
        action = o.get("job_action")
        node_found = o.get("iso_s") is not None and o.get("iso_applied")
        if not repeat:
            if node_found:
                self.detect_s.append(max(0.0, o["iso_s"] - (o["fail_s"] if inc.lead_s else 0.0)))
            elif o.get("job_decide_s") is not None and inc.kind not in PERSISTENT:
                self.detect_s.append(decide)
            if o.get("false_isolations"):
                self.counts["micro_false_isolations"] += len(o["false_isolations"])
            if inc.kind in PERSISTENT and not node_found:
                self.missed.append(f"{inc.kind}@{inc.cause}")
        if node_found and persistent and not repeat:
            # the node is isolated and the job requeued without it
            self.isolated(node, t, str(inc.id), o.get("node_class"))
            self.take_out(node, t, by_person=False)
            self.by_cause[inc.cause]["isolated"] += 1
            self.push(t + decide, "resume", (s.id, s.epoch))
            return
        if "stop" in (o.get("job_actions") or []):
            decide = float(o.get("stop_s") or decide)
            s.user_bug = None
            # a deterministic user error: stop retrying; the nodes go back to the queue's work
            self.lose(s, decide, t, "down")
            self.needed_human += 1
            self.by_cause[inc.cause]["needed_human"] += 1
            s.running = True  # the slot is backfilled by the next queued job
            s.down_since = None
            s.run_start = t + decide + self.R
            self.lose(s, self.R, t + decide, "restart")
            s.epoch += 1
            self.counts["stopped"] += 1
            return
        if action is None:
            self.counts["no_verdict"] += 1
            self._call_person(s, node, persistent, inc)
            return
        # retry, restart or requeue without node evidence: the repeat-failure rules hear of it
        # (as the job track does: not for a Python traceback; each node carries 1/size of the
        # blame, the node the failure began on is told so)
        unattributed = o.get("job_class") in ("transient_software", "unknown") and inc.kind != "user_bug"
        # the node the failure began on (the scheduler's first failed worker): the incident's,
        # but for hidden faults it cannot be traced to (field.toml [hidden] origin_known)
        origin = node
        if unattributed and inc.kind == "hidden" and inc.cause not in self.f.hidden_origin_known:
            origin = s.nodes[int(self.origin_rng.integers(len(s.nodes)))]
        for m in list(s.nodes) if unattributed else []:
            d = self.core.handle(NodeNotice(ts=T0 + t, node=str(m), kind="job_failed", job=f"job-{s.id}",
                                            attempt=s.restarts + 1, job_nodes=len(s.nodes), origin=m == origin),
                                 T0 + t)
            if any(a.action.value == "isolate" for v in d.verdicts for a in v.actions):
                self.counts["repeat_rule_isolations"] += 1
                if self.nodes[m].broken is not None:
                    self.by_cause[inc.cause]["repeat_rule_caught"] += 1
                self.take_out(m, t, by_person=False)
        if any(self.nodes[m].broken is not None for m in s.nodes) or (persistent and node in s.nodes):
            self._retry(s, decide, node, persistent, inc, self.ps.transient_retries)
        else:
            self.push(t + decide, "resume", (s.id, s.epoch))

    # ------------------------------------------------------------------ results

    def result(self) -> dict[str, Any]:
        allocated = sum(s.size for s in self.slots) * self.gpus * self.T
        lost = self.lost_gpu_s
        out = {
            "ettr": round(1.0 - lost / allocated, 5),
            "gpu_hours_lost": round((lost + self.held_gpu_s) / HOUR, 1),
            "job_gpu_hours_lost": round(lost / HOUR, 1),
            "healthy_held_out_gpu_hours": round(self.held_gpu_s / HOUR, 1),
            "healthy_nodes_isolated": self.healthy_isolated,
            # isolations on a real sign that would not have led to a failure ([precursors])
            "precursor_false_alarms": self.false_alarm_count,
            "needed_human": self.needed_human,
            "job_failures": self.failures,
            "allocated_gpu_hours": round(allocated / HOUR, 1),
            "repair_node_hours": round(self.repair_node_s / HOUR, 1),
            "counts": dict(sorted(self.counts.items())),
            # where the jobs' GPU-hours went: work since the last checkpoint, time down (a
            # decision, a person, replacement nodes), restarts and saves on request
            # (checkpoint-now); and by the failure's cause
            "job_gpu_hours_lost_by": {k: round(v / HOUR, 1) for k, v in sorted(self.lost_by_what.items())},
            "job_gpu_hours_lost_by_cause": {k: round(v / HOUR, 1) for k, v in self.lost_by_cause.most_common()},
            "job_gpu_hours_lost_by_kind": _nested(self.lost_by_kind),
        }
        if self.fm:
            out["detection_delay_s"] = _stats(self.detect_s)
            out["degrading_lead_s"] = _stats(self.lead_s)
            out["degrading_first_sign_to_isolation_s"] = _stats(self.degrade_detect_s)
            out["missed"] = dict(Counter(self.missed))
        return out


def _nested(c: Counter[tuple[str, str]]) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    for (kind, what), v in sorted(c.items()):
        out.setdefault(kind, {})[what] = round(v / HOUR, 1)
    return out


def _stats(xs: list[float]) -> dict[str, Any]:
    if not xs:
        return {"n": 0}
    a = np.asarray(xs, dtype=float)
    return {"n": int(a.size), "median": round(float(np.median(a)), 1), "p95": round(float(np.percentile(a, 95)), 1),
            "min": round(float(a.min()), 1), "max": round(float(a.max()), 1)}


def alibaba_cov() -> float | None:
    """Median per-iteration coefficient of variation of worker step times in the PAI trace."""
    path = paths.data_root() / ALIBABA_COV
    if not path.exists():
        return None
    rows = []
    with open(path) as fh:
        next(fh)
        for line in fh:
            vals = [float(x) for x in line.strip().split(",")[1:] if x]
            rows.extend(vals)
    return round(float(np.median(rows)), 4) if rows else None


# ------------------------------------------------------------------------------ run


def run_fleets(fld: fieldmod.Field, nodes: int, days: float, seed: int, incidents: list[Incident], lemons: set[int],
               settings: Settings, extra: Callable[[str, int], dict[str, Any]], *,
               false_alarms: list[FalseAlarm], names: tuple[str, ...] = POLICIES,
               non_honouring_share: float | None = None, say: Callable[..., Any] | None = None) -> dict[str, Any]:
    """Each policy of ``names`` on the same incidents (their micro-simulations run); its result."""
    policies: dict[str, Any] = {}
    for name in names:
        t = time.perf_counter()
        fl = Fleet(name, fld, nodes, days, seed, incidents, lemons, settings, extra, false_alarms=false_alarms,
                   non_honouring_share=non_honouring_share)
        fl.run()
        policies[name] = fl.result()
        policies[name]["by_cause"] = {k: dict(v) for k, v in sorted(fl.by_cause.items())}
        p = policies[name]
        if say is not None:
            say(f"  {name:25s} ettr {p['ettr']:.4f}  GPU-h lost {p['gpu_hours_lost']:>11,.0f}  healthy isolated "
                f"{p['healthy_nodes_isolated']:>5}  needed a person {p['needed_human']:>4}  "
                f"({time.perf_counter() - t:.1f} s)")
    return policies


def _over(a: dict[str, Any], b: dict[str, Any]) -> float:
    return round(float(a["gpu_hours_lost"]) / max(float(b["gpu_hours_lost"]), 1e-9), 4)


def checkpoint_now_floor(oracle: dict[str, Any], save_s: float, restart_s: float) -> float:
    """GPU-hours a policy would lose that is reactive_oracle after every failure and, before
    every failure with a sign, has the job save on request (the save instead of the work since
    its checkpoint): the least any policy acting on these precursors with checkpoint-now can
    lose.  From the oracle's own losses on those failures (a save costs save_s / restart_s of
    a restart on the same job)."""
    by: dict[str, dict[str, float]] = oracle["job_gpu_hours_lost_by_kind"]
    signed = [by.get(k, {}) for k in fieldmod.PRECURSOR_KINDS]
    since = sum(float(x.get("since_checkpoint", 0.0)) for x in signed)
    saves = sum(float(x.get("restart", 0.0)) for x in signed) * save_s / restart_s
    return round(float(oracle["gpu_hours_lost"]) - since + saves, 1)


#: losses that are no fault with a signal: faults without telemetry ([hidden]) and benign rises
NO_SIGNAL = ("hidden", "false_alarm")


def with_signal(p: dict[str, Any]) -> float:
    """A policy's job GPU-hours lost to faults with a telemetry or log signal (all but NO_SIGNAL)."""
    return round(sum(float(v) for k, by in p["job_gpu_hours_lost_by_kind"].items() if k not in NO_SIGNAL
                     for v in by.values()), 1)


def ratios_of(policies: dict[str, Any], fld: fieldmod.Field | None = None) -> dict[str, Any]:
    """GPU-hours lost of fleetmedic (and its checkpoint-now variant) over the other policies'."""
    fm, oracle, manual = policies["fleetmedic"], policies["reactive_oracle"], policies["manual"]
    cn = policies["fleetmedic_checkpoint_now"]
    ratios = {
        "fleetmedic_over_reactive_oracle": _over(fm, oracle),
        "checkpoint_now_over_reactive_oracle": _over(cn, oracle),
        "checkpoint_now_over_fleetmedic": _over(cn, fm),
        "reactive_oracle_over_manual": _over(oracle, manual),
        "fleetmedic_over_naive_cordon": _over(fm, policies["naive_cordon"]),
        "fleetmedic_over_manual": _over(fm, manual),
        "fleetmedic_over_retry_only": _over(fm, policies["retry_only"]),
        # the same on faults with a signal only: where fleetmedic stands once faults without
        # telemetry and benign rises (both reported apart) are set aside
        "fleetmedic_over_reactive_oracle_with_signal": round(with_signal(fm) / max(with_signal(oracle), 1e-9), 4),
        "checkpoint_now_over_reactive_oracle_with_signal": round(with_signal(cn) / max(with_signal(oracle), 1e-9), 4),
    }
    # What manual handling would lose if its person acted the moment a job failed: the work
    # since the last checkpoint and the restart of every failure.  reactive_oracle is that
    # policy run for real (a failing node taken out, so that it fails no job again).
    mb = manual["job_gpu_hours_lost_by"]
    floor = round(mb.get("since_checkpoint", 0.0) + mb.get("restart", 0.0), 1)
    ratios["instant_person_gpu_hours"] = floor
    ratios["instant_person_over_manual"] = round(floor / max(manual["gpu_hours_lost"], 1e-9), 4)
    if fld is not None:
        best = checkpoint_now_floor(oracle, fld.checkpoint_save_s, fld.restart_minutes * 60.0)
        ratios["checkpoint_now_floor_gpu_hours"] = best
        ratios["checkpoint_now_floor_over_reactive_oracle"] = round(best / max(oracle["gpu_hours_lost"], 1e-9), 4)
        ratios["checkpoint_now_over_floor"] = round(cn["gpu_hours_lost"] / max(best, 1e-9), 4)
        # the floor on faults with a signal: the oracle's losses to hidden faults set aside
        best_signal = best - (float(oracle["gpu_hours_lost"]) - with_signal(oracle))
        ratios["checkpoint_now_over_floor_with_signal"] = round(with_signal(cn) / max(best_signal, 1e-9), 4)
    return ratios


def precursor_summary(fld: fieldmod.Field, incidents: list[Incident], false_alarms: list[FalseAlarm],
                      nodes: int, days: float) -> dict[str, Any]:
    """The precursor model of the run: shares and sources, and what the real code made of the
    incidents that carry a sign (found before the failure, with time to save)."""
    signed = [i for i in incidents if i.kind in fieldmod.PRECURSOR_KINDS]
    found = [i for i in signed if (i.outcome or {}).get("iso_s") is not None
             and i.outcome["iso_s"] < i.outcome["fail_s"]]  # type: ignore[index]
    room = [i for i in found if i.outcome["iso_s"] + fld.checkpoint_save_s < i.outcome["fail_s"]]  # type: ignore[index]
    return {
        "share_of_failures": round(fld.precursor_share(), 4),
        "by_cause": {p.cause: {"share": p.share, "kinds": list(p.kinds), "source": p.source,
                               "assumption": p.assumption} for p in fld.precursors.values()},
        "figures": fld.precursor_figures(),
        "faults_with_sign": len(signed),
        "found_before_failure": len(found),
        "found_with_time_to_save": len(room),
        "lead_s": _stats([i.lead_s for i in signed]),
        "found_to_failure_s": _stats([i.outcome["fail_s"] - i.outcome["iso_s"] for i in found]),  # type: ignore[index]
        "false_alarms_per_true": fld.false_alarms_per_true,
        "false_alarms_drawn": len(false_alarms),
        "false_alarms_per_1000_node_days": round(1000 * len(false_alarms) / (nodes * days), 3),
        "checkpoint_save_s": fld.checkpoint_save_s,
        "non_honouring_share": fld.non_honouring_share,
    }


def sensitivity(fld: fieldmod.Field, nodes: int, days: float, seed: int, incidents: list[Incident], lemons: set[int],
                settings: Settings, extra: Callable[[str, int], dict[str, Any]], oracle: dict[str, Any],
                false_alarms: list[FalseAlarm]) -> dict[str, Any]:
    """fleetmedic's two policies again under other precursor assumptions: no benign rises,
    the [DRAM] bound on them, and every job answering checkpoint-now."""
    bound = draw_false_alarms(fld, nodes, days, seed, fld.false_alarms_per_node_year_bound / 365.0)
    both = ("fleetmedic", "fleetmedic_checkpoint_now")
    # case: (benign rises, share of jobs that do not answer, policies)
    cases: dict[str, tuple[list[FalseAlarm], float | None, tuple[str, ...]]] = {
        "no_false_alarms": ([], None, both),
        "false_alarms_at_dram_bound": (bound, None, both),
        "every_job_answers": (false_alarms, 0.0, ("fleetmedic_checkpoint_now",)),
    }
    out: dict[str, Any] = {}
    for case, (alarms, skip, names) in cases.items():
        got = run_fleets(fld, nodes, days, seed, incidents, lemons, settings, extra, false_alarms=alarms, names=names,
                         non_honouring_share=skip)
        row: dict[str, Any] = {name: {"gpu_hours_lost": p["gpu_hours_lost"], "ettr": p["ettr"],
                                      "precursor_false_alarms": p["precursor_false_alarms"],
                                      "over_reactive_oracle": _over(p, oracle)} for name, p in got.items()}
        row["false_alarms_drawn"] = len(alarms)
        out[case] = row
    return out


def run(*, quick: bool = False, seed: int = 1, out: Path | None = None, say: Callable[..., Any] = print,
        scenario: Path | None = None) -> dict[str, Any]:
    """Run the scenario under every policy; the result dict (and ``out`` as JSON)."""
    t_start = time.perf_counter()
    fld = fieldmod.load(scenario)
    nodes = fld.quick_nodes if quick else fld.nodes
    days = fld.quick_days if quick else fld.days
    incidents = draw_incidents(fld, nodes, days, seed)
    lem_rng = np.random.default_rng([seed, 5])
    n_lemons = int(round(fld.lemon_share * nodes))
    lemons = set(int(x) for x in lem_rng.choice(int(fld.utilization * nodes), size=n_lemons, replace=False))
    say(f"closed loop: {nodes} nodes x {fld.gpus_per_node} GPUs, {days:g} days, seed {seed}: "
        f"{len(incidents)} faults drawn at {fld.per_node_day * 1000:.2f} per 1,000 node-days "
        f"(Llama 3; RSC-1 {fld.rsc1_per_1000_node_days}, RSC-2 {fld.rsc2_per_1000_node_days}), {len(lemons)} lemon nodes")
    t_micro = time.perf_counter()
    run_micros(incidents, fld, nodes, say)
    micro_s = time.perf_counter() - t_micro
    say(f"  {len(incidents)} micro-simulations through the real pipeline in {micro_s:.1f} s")
    settings = _settings(nodes)
    memo: dict[tuple[str, int], dict[str, Any]] = {}

    def extra(kind: str, key: int) -> dict[str, Any]:
        if (kind, key) not in memo:  # a lemon's recurrence: the same for every fleetmedic run
            memo[kind, key] = micro(kind, key, 0.0, fleet=nodes, warmup_s=fld.warmup_s, gpu_every=fld.gpu_every_s)
        return memo[kind, key]

    false_alarms = draw_false_alarms(fld, nodes, days, seed, false_alarm_rate(fld, fld.false_alarms_per_true))
    policies = run_fleets(fld, nodes, days, seed, incidents, lemons, settings, extra, false_alarms=false_alarms, say=say)
    ratios = ratios_of(policies, fld)
    sens = sensitivity(fld, nodes, days, seed, incidents, lemons, settings, extra, policies["reactive_oracle"],
                       false_alarms)
    by_cause: dict[str, Any] = {}
    for inc in incidents:
        b = by_cause.setdefault(inc.cause, {"faults": 0, "kinds": Counter(), "fleetmedic": Counter()})
        b["faults"] += 1
        b["kinds"][inc.kind] += 1
        o = inc.outcome or {}
        right = KIND_CLASS.get(inc.kind)
        got = o.get("node_class") or o.get("job_final_class")
        if inc.kind == "hidden":
            b["fleetmedic"]["no_signal"] += 1
        elif got == right:
            b["fleetmedic"]["right_class"] += 1
        else:
            b["fleetmedic"][f"class_{got}"] += 1
        if inc.kind in HARDWARE_KINDS:
            b["fleetmedic"]["node_isolated" if o.get("iso_s") is not None else "node_not_isolated"] += 1
        if o.get("job_action"):
            b["fleetmedic"][f"job_{o['job_action']}"] += 1
    by_cause = {k: {"faults": v["faults"], "kinds": dict(v["kinds"]), "fleetmedic": dict(v["fleetmedic"])}
                for k, v in sorted(by_cause.items())}
    faults = [{"id": i.id, "t_h": round(i.t / HOUR, 3), "cause": i.cause, "kind": i.kind,
               "lead_s": round(i.lead_s, 1) if i.lead_s else None,
               "iso_s": (i.outcome or {}).get("iso_s"), "node_class": (i.outcome or {}).get("node_class"),
               "job_action": (i.outcome or {}).get("job_action"), "job_class": (i.outcome or {}).get("job_class"),
               "job_decide_s": (i.outcome or {}).get("job_decide_s"),
               "false_isolations": len((i.outcome or {}).get("false_isolations") or [])} for i in incidents]
    seconds = round(time.perf_counter() - t_start, 1)
    result = {
        "policies": policies,
        "ratios": ratios,
        "precursors": precursor_summary(fld, incidents, false_alarms, nodes, days),
        "sensitivity": sens,
        "faults": faults,
        "by_cause": by_cause,
        "sources": {
            "scenario": str(fieldmod.PATH.name),
            "llama3": "Grattafiori et al., The Llama 3 Herd of Models, arXiv:2407.21783 (2024), Sec. 3.3.4, Table 5",
            "rsc": "Kokolis et al., Revisiting Reliability in Large-Scale Machine Learning Research Clusters, "
                   "IEEE HPCA 2025, doi:10.1109/HPCA61900.2025.00096",
            "opt": "Zhang et al., OPT: Open Pre-trained Transformer Language Models, arXiv:2205.01068 (2022), Sec. 2.5",
            "alibaba_pai": "Alibaba PAI mini-batch worker times (Xiao et al., AntMan, OSDI 2020)",
            "alibaba_median_cov": alibaba_cov(),
            "simulator_step_sigma": 0.05,
        },
        "scenario": {"nodes": nodes, "days": days, "seed": seed, "quick": quick, "faults": len(incidents),
                     "lemons": len(lemons), "per_1000_node_days": round(fld.per_node_day * 1000, 3),
                     "checkpoint_minutes": fld.checkpoint_minutes, "restart_minutes": fld.restart_minutes,
                     "human_median_hours": fld.human_median_hours, "human_sigma": fld.human_sigma},
        "seconds": seconds,
        "micro_seconds": round(micro_s, 1),
    }
    say(table(result))
    if out is not None:
        out = Path(out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1, default=_json_default) + "\n")
        say(f"wrote {out}")
    return result


def _json_default(o: Any) -> Any:
    if isinstance(o, (np.integer,)):
        return int(o)
    if isinstance(o, (np.floating,)):
        return float(o)
    if isinstance(o, Counter):
        return dict(o)
    raise TypeError(type(o))


def table(r: dict[str, Any]) -> str:
    lines = [f"{'policy':26s} {'ETTR':>7s} {'GPU-h lost':>12s} {'healthy isolated':>17s} {'false alarms':>13s} "
             f"{'needed a person':>16s}"]
    for name, p in r["policies"].items():
        lines.append(f"{name:26s} {p['ettr']:7.4f} {p['gpu_hours_lost']:12,.0f} {p['healthy_nodes_isolated']:17d} "
                     f"{p.get('precursor_false_alarms', 0):13d} {p['needed_human']:16d}")
    ra = r["ratios"]
    lines.append(f"GPU-h lost over reactive_oracle's: fleetmedic {ra['fleetmedic_over_reactive_oracle']:.3f}, "
                 f"with checkpoint-now {ra['checkpoint_now_over_reactive_oracle']:.3f}   "
                 f"(fleetmedic / manual {ra['fleetmedic_over_manual']:.3f}, / naive cordon "
                 f"{ra['fleetmedic_over_naive_cordon']:.3f}; reactive_oracle / manual {ra['reactive_oracle_over_manual']:.3f})")
    if "checkpoint_now_floor_over_reactive_oracle" in ra:
        lines.append(f"the least a policy can lose that acts as reactive_oracle after failures and saves on request "
                     f"before every failure with a sign: {ra['checkpoint_now_floor_over_reactive_oracle']:.3f} of "
                     f"reactive_oracle's (checkpoint-now: {ra['checkpoint_now_over_floor']:.3f} of it, "
                     f"{ra['checkpoint_now_over_floor_with_signal']:.3f} on faults with a signal)")
    lines.append(f"on faults with a signal (without [hidden] faults and benign rises): fleetmedic "
                 f"{ra['fleetmedic_over_reactive_oracle_with_signal']:.3f}, with checkpoint-now "
                 f"{ra['checkpoint_now_over_reactive_oracle_with_signal']:.3f} of reactive_oracle's")
    for name in ("fleetmedic", "fleetmedic_checkpoint_now", "reactive_oracle"):
        p = r["policies"][name]
        lines.append(f"{name}'s loss: " + ", ".join(f"{k} {v:,.0f}" for k, v in p["job_gpu_hours_lost_by"].items())
                     + " GPU-h; by cause: " + ", ".join(f"{k} {v:,.0f}" for k, v in
                                                        list(p["job_gpu_hours_lost_by_cause"].items())[:5]))
    fm = r["policies"]["fleetmedic"]
    pr = r["precursors"]
    lines.append(f"precursors: {pr['share_of_failures']:.3f} of failures ([precursors]); {pr['faults_with_sign']} "
                 f"faults with a sign, {pr['found_before_failure']} found before the failure, "
                 f"{pr['found_with_time_to_save']} with time to save; {pr['false_alarms_drawn']} benign rises "
                 f"({pr['false_alarms_per_true']:g} per real sign); checkpoint save {pr['checkpoint_save_s']:g} s, "
                 f"{pr['non_honouring_share']:.0%} of jobs do not answer")
    for case, v in r["sensitivity"].items():
        lines.append(f"  if {case.replace('_', ' ')}: " + ", ".join(
            f"{k} {x['over_reactive_oracle']:.3f} of reactive_oracle (ETTR {x['ettr']:.4f})"
            for k, x in v.items() if isinstance(x, dict)))
    lines.append(f"fleetmedic detection delay (s): {fm['detection_delay_s']}   degrading lead (s): {fm['degrading_lead_s']}")
    lines.append(f"{r['scenario']['faults']} faults, {r['seconds']} s ({r['micro_seconds']} s in micro-simulations)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m pipeline.eval.closedloop",
        description="Closed loop at field rates: a 2,048-node (16,384-GPU) cluster over 54 simulated days, "
                    "Llama 3's failure rate and cause mix (pipeline/eval/field.toml), run with fleetmedic acting "
                    "(each incident through the real detectors, correlator and actuation in process), fleetmedic "
                    "acting on precursors with checkpoint-now, a reactive oracle (right the instant each failure "
                    "happens) and three baselines (manual handling, naive auto-cordon, retry-only) on the same seeded "
                    "fault sequence. Prints ETTR, GPU-hours lost, healthy nodes isolated, isolations on benign signs, "
                    "failures that needed a person, the ratios to the oracle and their sensitivity to the precursor "
                    "assumptions ([precursors], [checkpoint_now]).")
    ap.add_argument("--quick", action="store_true", help="256 nodes over 7 days: the same code paths in well under a minute")
    ap.add_argument("--seed", type=int, default=1, help="seed of the fault sequence and of every micro-simulation (default 1)")
    ap.add_argument("--out", type=Path, default=None, help="write the result as JSON to this file")
    ap.add_argument("--scenario", type=Path, default=None, help="another scenario file (default: pipeline/eval/field.toml)")
    a = ap.parse_args(argv)
    run(quick=a.quick, seed=a.seed, out=a.out, scenario=a.scenario, say=lambda *x: print(*x, flush=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
