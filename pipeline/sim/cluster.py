"""A simulated GPU cluster: telemetry into Kafka, a cluster API that reacts to actions.

* ``N`` nodes x 8 GPUs (H100-like baselines with noise), 4 fabric ports per node cabled
  to leaf switches; multi-node training jobs that progress, checkpoint and finish; a
  scheduler that places jobs on free, schedulable nodes.
* Telemetry at 1 Hz of simulated time (network every ``network_every`` s), sped up by
  ``speed`` against the wall clock.
* A catalogue of injectable faults, each with ground truth: transient crash, NCCL
  timeout, deterministic user bug, Xid 79 (fallen off the bus), Xid 119 (GSP timeout),
  ECC DBE, Xid 95 (uncontained SRAM/HBM error), a slow ECC SBE rise that ends in a
  failure at a set time, NVLink errors, thermal throttling, a failing NIC, a degrading
  leaf switch (every node under it sees errors; no node is at fault).
* Every job failure prints what a real job printed, and every Xid the text a real driver
  printed: output drawn from the failure corpus's tune split (``tests/data/failures``,
  each excerpt with its public source) and the kernel-log fixtures (:class:`RealText`).
* A loopback HTTP API (``POST /actions``) through which :class:`actuators.sim.SimBackend`
  acts: isolated nodes get no new jobs, requeued jobs restart elsewhere from their last
  checkpoint, diagnostics run on free isolated nodes and report through ``telemetry.job``.

Per-node step-time noise is lognormal with sigma 0.05, the typical cross-worker
coefficient of variation in Alibaba PAI's mini-batch traces (shared/data/alibaba-minibatch).
"""

from __future__ import annotations

import json
import logging
import math
import random
import time
from collections import Counter as Tally
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from pipeline import paths

log = logging.getLogger("fleetmedic.sim")

GPUS = 8
PORTS = 4
HW_THERMAL, SW_THERMAL = 0x40, 0x20

FAULT_KINDS = ("transient_crash", "nccl_timeout", "user_bug", "xid79", "ecc_dbe", "sbe_rise", "nvlink", "thermal",
               "xid_gsp", "xid_sram", "nic", "leaf")
#: faults that break a GPU at once: (Xid, GPU lost, DBE count); the job's failure output and
#: the driver's line come from real text (:class:`RealText`)
SUDDEN_GPU_FAULTS = {
    "xid79": (79, True, 0),
    "xid_gsp": (119, True, 0),
    "ecc_dbe": (48, False, 1),
    "xid_sram": (95, False, 0),
}
#: the demo's and make chaos's plan: one fault of each of these (the network faults need
#: network.enforce and a fitted fabric model, see make eval / make eval-network)
DEMO_KINDS = ("transient_crash", "nccl_timeout", "user_bug", "xid79", "ecc_dbe", "sbe_rise", "nvlink", "thermal")
#: make chaos's plan (``faults="chaos:N"``): N faults, every node and job kind in turn, in
#: a shuffled order over the run (the network kinds need network.enforce and a fitted
#: fabric model: make eval-network judges them)
CHAOS_KINDS = DEMO_KINDS + ("xid_gsp", "xid_sram")
#: faults of a node's own hardware: the node must be isolated
HARDWARE_KINDS = frozenset({"xid79", "ecc_dbe", "sbe_rise", "nvlink", "thermal", "xid_gsp", "xid_sram", "nic"})
TRANSIENT_KINDS = frozenset({"transient_crash", "nccl_timeout"})
DEGRADING_KINDS = frozenset({"sbe_rise", "thermal"})
#: shared components: their nodes are not at fault
SWITCH_KINDS = frozenset({"leaf"})
#: the right verdict's fault class for every kind (design.md, "Fault classes and actions")
KIND_CLASS = {
    "transient_crash": "transient_software", "nccl_timeout": "transient_software", "user_bug": "user_error",
    "xid79": "gpu_hardware", "xid_gsp": "gpu_hardware", "ecc_dbe": "gpu_memory", "xid_sram": "gpu_memory",
    "nvlink": "nvlink", "nic": "node_network", "leaf": "fabric_switch", "sbe_rise": "node_degrading",
    "thermal": "node_degrading",
}


def gpu_record(node: str, ts: float, *, util: Any, temp: Any, power: Any, sm_clock: Any = 1980.0,
               throttle: Any = 0, ecc_sbe: Any = 0, ecc_dbe: Any = 0, remap_failure: Any = False,
               nvlink: tuple[Any, Any, Any] = (0, 0, 0), pcie_replay: Any = 0, lost: Any = False,
               xids: list[tuple] | tuple = (), gpus: int = GPUS) -> dict[str, Any]:
    """One ``telemetry.gpu`` record as JSON-ready data: every field, per-GPU lists.

    A per-GPU field is a sequence (list or array) or one value for every GPU.
    """

    def per_gpu(v: Any) -> list:
        if isinstance(v, np.ndarray):
            return v.tolist()
        return list(v) if isinstance(v, (list, tuple)) else [v] * gpus

    return {
        "schema": "gpu/1", "ts": ts, "node": node,
        "util": per_gpu(util), "temp": per_gpu(temp), "power": per_gpu(power), "sm_clock": per_gpu(sm_clock),
        "mem_clock": [2619.0] * gpus, "throttle": per_gpu(throttle), "ecc_sbe": per_gpu(ecc_sbe),
        "ecc_dbe": per_gpu(ecc_dbe), "remap_pending": [False] * gpus, "remap_failure": per_gpu(remap_failure),
        "nvlink_crc": per_gpu(nvlink[0]), "nvlink_replay": per_gpu(nvlink[1]), "nvlink_recovery": per_gpu(nvlink[2]),
        "pcie_replay": per_gpu(pcie_replay), "lost": per_gpu(lost),
        "xids": [{"gpu": x[0], "code": x[1], **({"detail": x[2], "source": "sim"} if len(x) > 2 and x[2] else {})}
                 for x in xids],
    }


@dataclass
class Fault:
    kind: str
    at: float  # sim seconds from start
    node: str | None = None
    gpu: int = 0
    job: str | None = None
    fail_at: float | None = None  # sbe_rise / nvlink / thermal: when the hardware finally fails
    applied_ts: float | None = None
    #: sbe_rise / nvlink: e-folding time (s) of the error rate's rise; None: the demo's fast ramp
    tau: float | None = None
    leaf: str | None = None  # leaf: the switch at fault
    end_at: float | None = None  # leaf / nic: when the component is replaced (None: never)
    #: the fault waits for something to strike (a running job, a busy node) until then;
    #: None: 120 s after ``at``
    give_up_at: float | None = None


@dataclass
class Node:
    name: str
    leaf: str
    rng: np.random.Generator
    sbe: np.ndarray = field(default_factory=lambda: np.zeros(GPUS, dtype=np.int64))
    dbe: np.ndarray = field(default_factory=lambda: np.zeros(GPUS, dtype=np.int64))
    nvl: np.ndarray = field(default_factory=lambda: np.zeros((3, GPUS), dtype=np.int64))
    pcie: np.ndarray = field(default_factory=lambda: np.zeros(GPUS, dtype=np.int64))
    lost: np.ndarray = field(default_factory=lambda: np.zeros(GPUS, dtype=bool))
    remap_failure: np.ndarray = field(default_factory=lambda: np.zeros(GPUS, dtype=bool))
    port_counters: np.ndarray = field(default_factory=lambda: np.zeros((7, PORTS), dtype=np.int64))
    xids: list[tuple] = field(default_factory=list)  # (gpu, code[, the driver's text])
    cordoned: bool = False
    broken: bool = False  # ground truth: hardware is faulty
    fault: Fault | None = None
    thermal_gpu: int | None = None
    nvlink_gpu: int | None = None
    sbe_gpu: int | None = None
    job: str | None = None
    diag_wanted: bool = False
    diag_started: float | None = None
    diag_runs: int = 0
    escalated: bool = False
    #: a PodDisruptionBudget covers its pods and allows no disruption: drains are refused
    drain_blocked: bool = False


@dataclass
class Job:
    id: str
    size: int
    steps_total: int
    step_time: float
    attempt: int = 1
    nodes: list[str] = field(default_factory=list)
    step: float = 0.0
    checkpoint_step: int = 0
    status: str = "pending"  # pending, running, failed, completed, stopped
    user_bug_after: float | None = None
    #: a deterministic bug fails every run the same way: its output, drawn once
    user_bug_text: tuple[str | None, int | None, str] | None = None
    started_at: float = 0.0
    failed_at: float | None = None
    exclude: set[str] = field(default_factory=set)
    from_checkpoint: bool = False
    #: when fleetmedic asked it to save its state now (checkpoint-now); it has saved
    #: ``SimConfig.checkpoint_save_s`` later
    checkpoint_asked: float | None = None


@dataclass
class SimConfig:
    nodes: int = 32
    speed: float = 10.0
    duration: float = 120.0  # wall seconds of simulated running
    seed: int = 1
    utilization: float = 0.7
    checkpoint_every: float = 60.0
    #: seconds a job takes to save its state when asked to now (checkpoint-now)
    checkpoint_save_s: float = 30.0
    progress_every: float = 10.0
    network_every: float = 5.0
    diag_duration: float = 60.0
    auto_retry_after: float = 300.0  # a failed job nobody acted on is retried by its controller
    nodes_per_leaf: int = 16
    faults: str = "demo"  # "demo", "none", "chaos:N" (N faults of CHAOS_KINDS) or a comma list of kinds
    quiet_tail: float = 250.0  # sim seconds at the end without new faults
    gpu_every: int = 1  # GPU telemetry period, sim seconds (DCGM's default collection period is 1-30 s)


def demo_faults(cfg: SimConfig, rng: random.Random) -> list[Fault]:
    """The demo's fault plan: every kind in the catalogue, spread over the run."""
    total = cfg.duration * cfg.speed
    last = max(200.0, total - cfg.quiet_tail)
    plan: list[Fault] = []
    if cfg.faults == "none":
        return plan
    if cfg.faults.startswith("chaos"):
        return _chaos_faults(cfg.faults, last, rng)
    kinds = list(DEMO_KINDS) if cfg.faults == "demo" else [k.strip() for k in cfg.faults.split(",") if k.strip()]
    for k in kinds:
        if k not in FAULT_KINDS:
            raise ValueError(f"faults: unknown fault kind {k!r}; known: {', '.join(FAULT_KINDS)}")
    # degradation first: it needs a full detection window and time to ramp
    slots: list[tuple[str, float]] = []
    for k in kinds:
        if k == "sbe_rise":
            slots.append((k, 130.0))
        elif k == "nvlink":
            slots.append((k, 160.0))
        elif k == "thermal":
            slots.append((k, 180.0))
    others = [k for k in kinds if k not in ("sbe_rise", "nvlink", "thermal")]
    for i, k in enumerate(others):
        lo = 150.0 + i * (last - 150.0) / max(len(others), 1)
        slots.append((k, lo + rng.random() * 30.0))
    if cfg.faults == "demo" and total >= 1000:
        slots.append(("xid79", min(last, 150.0 + rng.random() * (last - 150.0))))
        slots.append(("nccl_timeout", min(last, 200.0 + rng.random() * (last - 200.0))))
    return [_fault(k, at) for k, at in sorted(slots, key=lambda x: x[1])]


def _fault(kind: str, at: float) -> Fault:
    f = Fault(kind=kind, at=at)
    if kind == "sbe_rise":
        f.fail_at = at + 360.0
    if kind == "nvlink":
        f.fail_at = at + 150.0
    return f


def _chaos_faults(spec: str, last: float, rng: random.Random) -> list[Fault]:
    """``chaos:N``: N faults, each kind of :data:`CHAOS_KINDS` in turn, shuffled, one in each
    of N equal slots from 130 s (a full detection window for the degrading kinds) to ``last``."""
    count = spec.partition(":")[2]
    if not count.isdigit() or int(count) < 1:
        raise ValueError(f"faults: 'chaos:N' needs a positive number of faults, not {spec!r}")
    n = int(count)
    kinds = [CHAOS_KINDS[i % len(CHAOS_KINDS)] for i in range(n)]
    rng.shuffle(kinds)
    start = 130.0
    slot = max(1.0, last - start) / n
    return [_fault(k, start + (i + rng.random()) * slot) for i, k in enumerate(kinds)]


#: each fault kind's failure output: the corpus excerpts of this class (watchdog: the NCCL
#: watchdog timeouts whose cause lies elsewhere)
TEXT_POOL = {
    "transient_crash": "transient_software", "nccl_timeout": "watchdog", "user_bug": "user_error",
    "xid79": "gpu_hardware", "xid_gsp": "gpu_hardware", "thermal": "gpu_hardware", "ecc_dbe": "gpu_memory",
    "xid_sram": "gpu_memory", "sbe_rise": "gpu_memory", "nvlink": "nvlink", "nic": "node_network",
    "leaf": "watchdog",
}


class RealText:
    """What real jobs and drivers printed, drawn at random: a job's failure output (exit
    code, reason, log tail) from the failure corpus's tune split, an Xid's text from the
    kernel-log fixtures.  Both live in the repository (``tests/data/failures/tune``,
    ``tests/fixtures/kernel-log/lines.toml``, each excerpt with its public source), and an
    installed package carries them (:mod:`pipeline.paths`); ``FLEETMEDIC_FAILURE_CORPUS``
    points elsewhere."""

    def __init__(self, rng: random.Random, corpus: Path | None = None, lines: Path | None = None) -> None:
        import tomllib

        self.rng = rng
        corpus = corpus or paths.failure_corpus()
        folder = corpus / "tune"
        if not folder.is_dir():
            raise FileNotFoundError(f"the simulator draws failure output from the failure corpus; {folder} is missing "
                                    "(set FLEETMEDIC_FAILURE_CORPUS to a corpus with a tune/ split)")
        self.pools: dict[str, list[dict[str, Any]]] = {}
        for path in sorted(folder.glob("*.toml")):
            raw = tomllib.loads(path.read_text(encoding="utf-8"))
            key = "watchdog" if raw.get("watchdog_elsewhere") else raw["fault_class"]
            self.pools.setdefault(key, []).append(raw)
        lines = lines or paths.kernel_log_lines()
        self.xid_lines: dict[int, list[str]] = {}
        if lines.is_file():
            from detectors.nvrm import parse_xid

            for ln in tomllib.loads(lines.read_text(encoding="utf-8"))["line"]:
                x = parse_xid(ln["text"]) if "xid" in ln else None
                if x is not None and x.detail:
                    self.xid_lines.setdefault(x.code, []).append(x.detail)

    def failure(self, kind: str) -> tuple[str | None, int | None, str]:
        """(reason, exit code, log tail) of a real failure of ``kind``'s class."""
        pool = self.pools.get(TEXT_POOL.get(kind, "unknown")) or self.pools.get("gpu_hardware") or []
        if not pool:
            return None, None, ""
        raw = self.rng.choice(pool)
        code = raw.get("exit_code")
        if code is None and raw.get("signal") in _SIGNAL_NUMBERS:
            code = 128 + _SIGNAL_NUMBERS[raw["signal"]]
        return raw.get("reason"), None if code is None else max(-255, min(255, int(code))), raw["log"].strip()[-8192:]

    def xid_detail(self, code: int) -> str | None:
        """The text a real driver printed after Xid ``code``, if the fixtures have one."""
        pool = self.xid_lines.get(code)
        return self.rng.choice(pool) if pool else None


_SIGNAL_NUMBERS = {"SIGHUP": 1, "SIGINT": 2, "SIGABRT": 6, "SIGBUS": 7, "SIGKILL": 9, "SIGSEGV": 11, "SIGTERM": 15}


class Cluster:
    """The simulated cluster's state and its reaction to actions."""

    def __init__(self, cfg: SimConfig, t0: float | None = None) -> None:
        self.cfg = cfg
        self.rng = random.Random(cfg.seed)
        self.origin_rng = random.Random(cfg.seed + 7919)  # its own stream: the rest of a seeded run is unchanged
        self.text = RealText(random.Random(cfg.seed + 104729))  # real failure output, its own stream too
        self.np_rng = np.random.default_rng(cfg.seed)
        self.t0 = t0 if t0 is not None else time.time()
        self.now = 0.0
        self.nodes: dict[str, Node] = {}
        for i in range(cfg.nodes):
            name = f"node-{i:04d}"
            self.nodes[name] = Node(name=name, leaf=f"leaf-{i // cfg.nodes_per_leaf:02d}",
                                    rng=np.random.default_rng(cfg.seed * 100003 + i))
        self.jobs: dict[str, Job] = {}
        self.job_seq = 0
        self.faults = demo_faults(cfg, self.rng)
        self.pending_faults = list(self.faults)
        self.out: list[tuple[str, str, bytes]] = []  # (topic short name, key, value)
        self.events: list[dict[str, Any]] = []  # ground-truth event log
        self.applied_keys: dict[str, dict[str, Any]] = {}
        #: the backend's own log of every request it answered, with its effect (ground truth
        #: for the chaos run's checker, :mod:`pipeline.eval.groundtruth`): wall time, sim time,
        #: key, verdict, action, target, params, status, outcome, whether state changed, and
        #: the target's state before (a node cordoned or not; a job's attempt and status)
        self.requests: list[dict[str, Any]] = []
        self.counts = Tally()

    # -------------------------------------------------------------------------- helpers

    def ts(self) -> float:
        return self.t0 + self.now

    def emit(self, topic: str, key: str, record: dict[str, Any]) -> None:
        record.setdefault("ts", self.ts())
        self.out.append((topic, key, orjson.dumps(record)))

    def job_event(self, job: Job, event: str, **extra: Any) -> None:
        rec = {"schema": "job/1", "job": job.id, "event": event, "scheduler": "sim", "nodes": list(job.nodes),
               "attempt": job.attempt, **extra}
        self.emit("telemetry.job", job.id, rec)

    def free_nodes(self, exclude: set[str]) -> list[str]:
        return [n.name for n in self.nodes.values()
                if n.job is None and not n.cordoned and not n.diag_wanted and n.diag_started is None
                and n.name not in exclude and not n.lost.any()]  # a node with a GPU off the bus runs nothing

    def new_job(self) -> Job:
        self.job_seq += 1
        size = self.rng.choice([2, 4, 4, 4, 8])
        size = min(size, max(2, self.cfg.nodes // 4))
        j = Job(id=f"train-{self.job_seq:04d}", size=size, steps_total=self.rng.randint(2000, 6000),
                step_time=self.rng.uniform(0.8, 1.6))
        self.jobs[j.id] = j
        return j

    # -------------------------------------------------------------------------- scheduling

    def schedule(self) -> None:
        busy = sum(1 for n in self.nodes.values() if n.job)
        target = int(self.cfg.utilization * len(self.nodes))
        pending = [j for j in self.jobs.values() if j.status == "pending"]
        if not pending and busy < target - 1:
            pending = [self.new_job()]
        for j in pending:
            free = self.free_nodes(j.exclude)
            if len(free) < j.size:
                continue
            self.rng.shuffle(free)
            self.start(j, sorted(free[: j.size]))

    def start(self, j: Job, nodes: list[str]) -> None:
        for n in j.nodes:
            if self.nodes[n].job == j.id:
                self.nodes[n].job = None
        j.nodes = nodes
        for n in nodes:
            self.nodes[n].job = j.id
        j.status = "running"
        j.started_at = self.now
        j.failed_at = None
        if j.from_checkpoint or j.attempt > 1:
            j.step = float(j.checkpoint_step)
        self.job_event(j, "started", step=int(j.step))

    def release(self, j: Job) -> None:
        for n in j.nodes:
            if self.nodes[n].job == j.id:
                self.nodes[n].job = None

    def fail_job(self, j: Job, reason: str | None, exit_code: int | None, log_tail: str,
                 origin: str | None = None) -> None:
        """``origin``: the node whose worker failed first (a node fault's node); else one of the
        job's nodes at random, as for a crash or a timeout that any rank may report first."""
        if j.status != "running":
            return
        if origin is None and j.nodes:
            origin = self.origin_rng.choice(sorted(j.nodes))
        # A failed gang-scheduled job keeps its allocation until someone decides: its
        # controller restarts it in place (retry) or it is requeued elsewhere.
        j.status = "failed"
        j.failed_at = self.now
        self.job_event(j, "failed", step=int(j.step), exit_code=exit_code, reason=reason, log_tail=log_tail,
                       origin_node=origin)
        self.counts["job_failures"] += 1

    # -------------------------------------------------------------------------- faults

    def _bad_leaves(self) -> set[str]:
        """Leaves with a switch fault or a failing NIC now: a new network fault there would blur the truth."""
        out = {f.leaf for f in self.faults if f.kind == "leaf" and f.applied_ts is not None
               and (f.end_at is None or self.now < f.end_at)}
        out |= {self.nodes[f.node].leaf for f in self.faults if f.kind == "nic" and f.node and f.applied_ts is not None
                and (f.end_at is None or self.now < f.end_at)}
        return {x for x in out if x}

    def _pick_busy_node(self) -> Node | None:
        bad = self._bad_leaves()
        busy = [n for n in self.nodes.values() if n.job and self.jobs[n.job].status == "running"
                and not n.fault and not n.cordoned and n.leaf not in bad]
        if not busy:
            busy = [n for n in self.nodes.values() if not n.fault and not n.cordoned and n.leaf not in bad]
        return self.rng.choice(busy) if busy else None

    def _pick_running_job(self) -> Job | None:
        bad = self._bad_leaves()
        running = [j for j in self.jobs.values() if j.status == "running"
                   and not any(self.nodes[n].fault or self.nodes[n].leaf in bad for n in j.nodes)]
        return self.rng.choice(running) if running else None

    def apply_fault(self, f: Fault) -> bool:
        if f.kind == "leaf":
            bad = self._bad_leaves()
            leaves = sorted({n.leaf for n in self.nodes.values()} - bad)
            # a leaf with running work: its jobs see the errors
            busy = [lf for lf in leaves if any(n.job and n.leaf == lf for n in self.nodes.values())]
            if not (busy or leaves):
                return False
            f.leaf = self.rng.choice(busy or leaves)
            f.applied_ts = self.ts()
            under = [n.name for n in self.nodes.values() if n.leaf == f.leaf]
            f.job = next((self.nodes[n].job for n in under if self.nodes[n].job), None)
            self.events.append({"t": self.now, "fault": f.kind, "leaf": f.leaf, "node": None, "job": f.job})
            log.info("inject %-15s leaf=%s job=%s", f.kind, f.leaf, f.job)
            return True
        if f.kind in ("transient_crash", "nccl_timeout", "user_bug"):
            j = self._pick_running_job()
            if j is None:
                return False
            f.job = j.id
            if f.kind in ("transient_crash", "nccl_timeout"):
                self.fail_job(j, *self.text.failure(f.kind))
            else:
                j.user_bug_after = 20.0
                j.user_bug_text = self.text.failure("user_bug")
                self._user_bug(j)
        else:
            node = self._pick_busy_node()
            if node is None:
                return False
            f.node, f.gpu = node.name, self.rng.randrange(GPUS)
            f.job = node.job
            node.fault = f
            g = f.gpu
            node.broken = True
            sudden = SUDDEN_GPU_FAULTS.get(f.kind)
            if sudden is not None:
                xid, lost, dbe = sudden
                node.lost[g] |= lost
                node.dbe[g] += dbe
                node.xids.append((g, xid, self.text.xid_detail(xid)))
                self._fail_jobs_on(node, f.kind)
            elif f.kind == "sbe_rise":
                node.sbe_gpu = g
            elif f.kind == "nvlink":
                node.nvlink_gpu = g
            elif f.kind == "thermal":
                node.thermal_gpu = g
            # nic: the job fails once the errors break a collective (see tick)
        f.applied_ts = self.ts()
        self.events.append({"t": self.now, "fault": f.kind, "node": f.node, "leaf": None, "gpu": f.gpu, "job": f.job})
        log.info("inject %-15s node=%s gpu=%s job=%s", f.kind, f.node, f.gpu if f.node else "-", f.job)
        return True

    def _user_bug(self, j: Job) -> None:
        if j.user_bug_text is None:
            j.user_bug_text = self.text.failure("user_bug")
        self.fail_job(j, *j.user_bug_text)

    def _fail_jobs_on(self, node: Node, kind: str) -> None:
        """The job on ``node`` fails with real output of a ``kind`` fault, first on that node."""
        if node.job:
            self.fail_job(self.jobs[node.job], *self.text.failure(kind), origin=node.name)

    # -------------------------------------------------------------------------- time

    def tick(self) -> None:
        """Advance one simulated second and emit its telemetry."""
        self.now += 1.0
        for f in list(self.pending_faults):
            if f.at <= self.now:
                if self.apply_fault(f) or self.now > (f.at + 120 if f.give_up_at is None else f.give_up_at):
                    self.pending_faults.remove(f)
        for f in self.faults:
            if f.fail_at is not None and f.node and f.applied_ts is not None and abs(self.now - f.fail_at) < 0.5:
                node = self.nodes[f.node]
                if f.kind == "sbe_rise":
                    node.dbe[f.gpu] += 1
                    node.remap_failure[f.gpu] = True
                    node.xids.append((f.gpu, 48, self.text.xid_detail(48)))
                    self.events.append({"t": self.now, "failure": f.kind, "node": f.node, "job": node.job})
                    self._fail_jobs_on(node, f.kind)
                elif f.kind == "nvlink":
                    node.xids.append((f.gpu, 74, self.text.xid_detail(74)))
                    self.events.append({"t": self.now, "failure": f.kind, "node": f.node, "job": node.job})
                    self._fail_jobs_on(node, f.kind)
                elif f.kind == "thermal":
                    # the GPU shuts itself down to protect itself: it is gone from the bus
                    node.lost[f.gpu] = True
                    node.thermal_gpu = None
                    node.xids.append((f.gpu, 79, self.text.xid_detail(79)))
                    self.events.append({"t": self.now, "failure": f.kind, "node": f.node, "job": node.job})
                    self._fail_jobs_on(node, f.kind)
            if f.kind == "nic" and f.node and f.applied_ts is not None and abs(self.now - f.at - 180.0) < 0.5:
                node = self.nodes[f.node]
                self._fail_jobs_on(node, f.kind)
            if f.kind == "leaf" and f.applied_ts is not None and abs(self.now - f.at - 150.0) < 0.5 and f.job:
                j = self.jobs.get(f.job)
                if j is not None and j.status == "running":
                    self.fail_job(j, *self.text.failure(f.kind))
        self.schedule()
        self.advance_jobs()
        self.run_diagnostics()
        if int(self.now) % max(1, int(self.cfg.gpu_every)) == 0:
            for node in self.nodes.values():
                self.emit_gpu(node)
        if int(self.now) % int(self.cfg.network_every) == 0:
            for node in self.nodes.values():
                self.emit_network(node)

    def advance_jobs(self) -> None:
        for j in list(self.jobs.values()):
            if j.status == "failed" and j.failed_at is not None and self.now - j.failed_at > self.cfg.auto_retry_after:
                self.counts["auto_retries"] += 1
                self._restart(j, same_nodes=False)
                continue
            if j.status != "running":
                continue
            slow = 1.0
            for n in j.nodes:
                if self.nodes[n].thermal_gpu is not None:
                    slow = max(slow, 1.45)
            j.step += 1.0 / (j.step_time * slow)
            elapsed = self.now - j.started_at
            if j.user_bug_after is not None and elapsed >= j.user_bug_after:
                self._user_bug(j)
                continue
            asked_done = j.checkpoint_asked is not None and self.now - j.checkpoint_asked >= self.cfg.checkpoint_save_s
            if asked_done or (elapsed > 0 and int(elapsed) % int(self.cfg.checkpoint_every) == 0):
                j.checkpoint_asked = None
                j.checkpoint_step = int(j.step)
                self.job_event(j, "checkpoint", step=int(j.step), checkpoint_step=j.checkpoint_step)
            if elapsed > 0 and int(elapsed) % int(self.cfg.progress_every) == 0:
                times, power = {}, {}
                for n in j.nodes:
                    node = self.nodes[n]
                    factor = 1.45 if node.thermal_gpu is not None else 1.0
                    times[n] = round(j.step_time * factor * float(np.exp(node.rng.normal(0, 0.05))), 4)
                    p = 650.0 + node.rng.normal(0, 12.0)
                    if node.thermal_gpu is not None:
                        p -= 110.0
                    power[n] = round(p, 1)
                self.job_event(j, "progress", step=int(j.step), step_time=round(max(times.values()), 4),
                               node_step_times=times, node_power=power)
            if j.step >= j.steps_total:
                j.status = "completed"
                self.release(j)
                self.job_event(j, "completed", step=int(j.step))

    def run_diagnostics(self) -> None:
        for node in self.nodes.values():
            if node.diag_wanted and node.job is None and node.diag_started is None:
                node.diag_started = self.now
                node.diag_wanted = False
                node.diag_runs += 1
                rec = {"schema": "job/1", "job": f"diag-{node.name}-{node.diag_runs}", "event": "started",
                       "scheduler": "sim", "nodes": [node.name], "attempt": 1, "diagnostics_for": node.name}
                self.emit("telemetry.job", rec["job"], rec)
            elif node.diag_started is not None and self.now - node.diag_started >= self.cfg.diag_duration:
                passed = not node.broken
                rec = {"schema": "job/1", "job": f"diag-{node.name}-{node.diag_runs}",
                       "event": "completed" if passed else "failed", "scheduler": "sim", "nodes": [node.name],
                       "attempt": 1, "diagnostics_for": node.name,
                       "reason": "dcgmi diag -r 2: pass" if passed else "dcgmi diag -r 2: fail (GPU memory/PCIe/NVLink test)",
                       **({} if passed else {"exit_code": 1})}
                node.diag_started = None
                self.emit("telemetry.job", rec["job"], rec)
                self.counts["diagnostics_passed" if passed else "diagnostics_failed"] += 1

    # -------------------------------------------------------------------------- telemetry

    def _count_gpu(self, node: Node, dt: float) -> None:
        """``dt`` seconds of the GPUs' error counters: healthy baselines and the node's fault."""
        r = node.rng
        # healthy baselines: rare single-bit ECC, NVLink and PCIe replays
        node.sbe += r.poisson(2e-4 * dt, GPUS)
        node.nvl += r.poisson(1e-4 * dt, (3, GPUS))
        node.pcie += r.poisson(5e-5 * dt, GPUS)
        f = node.fault
        if f is not None and f.kind == "sbe_rise" and f.applied_ts is not None:
            rate = min(5.0, 0.0005 * math.exp((self.now - f.at) / (f.tau or 30.0)))
            node.sbe[f.gpu] += r.poisson(rate * dt)
        if f is not None and f.kind == "nvlink" and f.applied_ts is not None:
            scale = 1.0 if f.tau is None else min(1.0, 0.0005 * math.exp((self.now - f.at) / f.tau))
            node.nvl[0, f.gpu] += r.poisson(2.0 * scale * dt)
            node.nvl[1, f.gpu] += r.poisson(1.0 * scale * dt)

    def emit_gpu(self, node: Node) -> None:
        r = node.rng
        busy = node.job is not None
        util = np.clip(r.normal(96 if busy else 0.5, 2 if busy else 0.3, GPUS), 0, 100)
        temp = r.normal(66 if busy else 34, 1.5, GPUS)
        power = np.clip(r.normal(650 if busy else 72, 12 if busy else 3, GPUS), 0, None)
        sm = np.full(GPUS, 1980.0 if busy else 345.0)
        throttle = np.zeros(GPUS, dtype=np.int64)
        if node.thermal_gpu is not None:
            g = node.thermal_gpu
            temp[g] = r.normal(93, 1.0)
            throttle[g] = HW_THERMAL | SW_THERMAL
            sm[g] = 1410.0
            power[g] = max(0.0, power[g] - 220.0)
        self._count_gpu(node, float(max(1, int(self.cfg.gpu_every))))
        lost = node.lost
        for arr in (util, power, temp):
            arr[lost] = 0.0
        rec = gpu_record(
            node.name, self.ts(), util=np.round(util, 1), temp=np.round(temp, 1), power=np.round(power, 1),
            sm_clock=sm, throttle=throttle, ecc_sbe=node.sbe, ecc_dbe=node.dbe, remap_failure=node.remap_failure,
            nvlink=(node.nvl[0], node.nvl[1], node.nvl[2]), pcie_replay=node.pcie, lost=lost, xids=node.xids,
        )
        node.xids = []
        self.emit("telemetry.gpu", node.name, rec)

    def emit_network(self, node: Node) -> None:
        r = node.rng
        busy = node.job is not None
        pc = node.port_counters
        dt = self.cfg.network_every
        pc[0] += r.poisson(1e-4 * dt, PORTS)  # symbol errors
        pc[5] += (r.normal(2.5e10 if busy else 1e6, 1e8 if busy else 1e4, PORTS) * dt).clip(0).astype(np.int64)
        pc[6] += (r.normal(2.5e10 if busy else 1e6, 1e8 if busy else 1e4, PORTS) * dt).clip(0).astype(np.int64)
        pc[4] += (r.poisson(2e3 if busy else 1, PORTS) * dt).astype(np.int64)  # xmit wait
        f = node.fault
        if f is not None and f.kind == "nic" and f.applied_ts is not None and (f.end_at is None or self.now < f.end_at):
            pc[2] += r.poisson(15 * dt, PORTS)  # receive errors
            pc[3] += r.poisson(8 * dt, PORTS)  # transmit discards
        for lf in self.faults:
            if lf.kind == "leaf" and lf.leaf == node.leaf and lf.applied_ts is not None \
                    and (lf.end_at is None or self.now < lf.end_at):
                # every port under a degrading switch: errors start within 30 s of each other
                if self.now - lf.at >= (int(node.name.rsplit("-", 1)[-1]) * 7) % 30:
                    pc[0] += r.poisson(3 * dt, PORTS)
                    pc[2] += r.poisson(1 * dt, PORTS)
        ports = []
        for p in range(PORTS):
            ports.append({
                "port": f"mlx5_{p}", "switch": node.leaf, "state": "up",
                "symbol_errors": int(pc[0, p]), "link_error_recovery": 0, "link_downed": int(pc[1, p]),
                "rcv_errors": int(pc[2, p]), "xmit_discards": int(pc[3, p]), "xmit_wait": int(pc[4, p]),
                "xmit_bytes": int(pc[5, p]), "rcv_bytes": int(pc[6, p]),
            })
        self.emit("telemetry.network", node.name, {"schema": "network/1", "node": node.name, "ports": ports})

    # -------------------------------------------------------------------------- actions

    def _restart(self, j: Job, *, same_nodes: bool, exclude: list[str] | None = None) -> None:
        j.attempt += 1
        j.from_checkpoint = True
        j.checkpoint_asked = None
        j.exclude |= set(exclude or [])
        prev = list(j.nodes)
        j.status = "pending"
        if same_nodes and all(self.nodes[n].job in (None, j.id) for n in prev):
            self.start(j, prev)
        else:
            self.release(j)

    def act(self, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        """Observe, compare, act, answer: the cluster API behind ``POST /actions``.
        Every request is kept in :attr:`requests` with its effect."""
        target = body.get("target")
        node, job = self.nodes.get(target or ""), self.jobs.get(target or "")
        before: dict[str, Any] = ({"cordoned": node.cordoned} if node is not None else
                                  {"attempt": job.attempt, "status": job.status} if job is not None else {})
        status, data = self._act(body)
        self.requests.append({
            "wall": time.time(), "t": self.now, "key": body.get("key"), "verdict_id": body.get("verdict_id"),
            "action": body.get("action"), "target": target, "params": body.get("params") or {}, "status": status,
            "outcome": data.get("outcome"), "changed": data.get("outcome") == "applied", "before": before})
        return status, data

    def _act(self, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        key, action, target = body.get("key"), body.get("action"), body.get("target")
        params = body.get("params") or {}
        if not key or not action or not target:
            return 400, {"error": "key, action and target are required"}
        if key in self.applied_keys:
            return 200, {"outcome": "already_so", "detail": "this key was applied before"}
        if action in ("isolate", "drain", "diagnose", "return", "escalate"):
            node = self.nodes.get(target)
            if node is None:
                return 404, {"error": f"no node {target}"}
            if action == "drain" and node.drain_blocked:
                # the Eviction API's answer while a budget allows no disruption (HTTP 429)
                return 429, {"error": "Cannot evict pod as it would violate the pod's disruption budget."}
            outcome, detail = self._node_action(node, action)
        elif action in ("retry", "restart", "requeue", "stop", "checkpoint"):
            job = self.jobs.get(target)
            if job is None:
                return 404, {"error": f"no job {target}"}
            outcome, detail = self._job_action(job, action, params)
        else:
            return 400, {"error": f"unknown action {action}"}
        self.applied_keys[key] = {"t": self.now, "action": action, "target": target, "outcome": outcome}
        self.counts[f"action_{action}_{outcome}"] += 1
        return 200, {"outcome": outcome, "detail": detail}

    def _node_action(self, node: Node, action: str) -> tuple[str, str]:
        if action == "isolate":
            if node.cordoned:
                return "already_so", "node already cordoned and tainted"
            node.cordoned = True
            self.events.append({"t": self.now, "isolated": node.name})
            return "applied", "cordoned and tainted"
        if action == "drain":
            if node.job is None:
                return "already_so", "no workload on the node"
            j = self.jobs[node.job]
            if j.status != "running":
                # a failed job's pods are evicted; the job waits for its own verdict
                node.job = None
                return "applied", f"evicted the pods of failed job {j.id}"
            self._restart(j, same_nodes=False, exclude=[node.name])
            return "applied", f"evicted {j.id}; it restarts elsewhere from step {j.checkpoint_step}"
        if action == "diagnose":
            if node.diag_wanted or node.diag_started is not None:
                return "already_so", "diagnostics already scheduled"
            node.diag_wanted = True
            return "applied", "diagnostics scheduled for when the node is free"
        if action == "return":
            if not node.cordoned:
                return "already_so", "node already in service"
            node.cordoned = False
            self.events.append({"t": self.now, "returned": node.name})
            return "applied", "uncordoned"
        if action == "escalate":
            if node.escalated:
                return "already_so", "repair ticket already open"
            node.escalated = True
            return "applied", "repair ticket opened"
        raise AssertionError(action)

    def _job_action(self, j: Job, action: str, params: dict[str, Any]) -> tuple[str, str]:
        attempt = params.get("attempt")
        if attempt is not None and attempt != j.attempt:
            return "already_so", f"attempt {attempt} is over; the job is on attempt {j.attempt}"
        if action == "stop":
            if j.status == "stopped":
                return "already_so", "job already stopped"
            self.release(j)
            j.status = "stopped"
            self.counts["stopped"] += 1
            return "applied", "job stopped"
        if j.status in ("completed", "stopped"):
            return "already_so", f"job is {j.status}"
        if action == "checkpoint":
            if j.status != "running":
                return "already_so", f"job is {j.status}: nothing to save"
            if j.checkpoint_asked is not None:
                return "already_so", "the job was asked already"
            j.checkpoint_asked = self.now
            return "applied", f"asked to save its state now (saved {self.cfg.checkpoint_save_s:g} s later)"
        if action in ("retry", "restart"):
            self._restart(j, same_nodes=True)
            return "applied", f"attempt {j.attempt} on the same nodes"
        exclude = list(params.get("exclude") or [])
        self._restart(j, same_nodes=False, exclude=exclude)
        self.counts["requeues"] += 1
        return "applied", f"attempt {j.attempt} excluding {', '.join(exclude) or 'no node'} from step {j.checkpoint_step}"


# ------------------------------------------------------------------------------ scoring


def score(cluster: Cluster, verdicts: list[dict[str, Any]], actions: list[dict[str, Any]]) -> dict[str, Any]:
    """Compare what fleetmedic decided with the ground truth of the injected faults."""
    faults = [f for f in cluster.faults if f.applied_ts is not None]
    t0 = cluster.t0
    isolate_verdicts: dict[str, float] = {}
    for v in verdicts:
        for a in v.get("actions", []):
            if a.get("action") == "isolate":
                isolate_verdicts.setdefault(a["target"], v["ts"] - t0)
    isolations = {}  # node -> first sim time it was really isolated
    for e in cluster.events:
        if "isolated" in e:
            isolations.setdefault(e["isolated"], e["t"])
    faulty = {f.node: f for f in faults if f.node}
    hw = [f for f in faults if f.kind in HARDWARE_KINDS]
    detected = [f for f in hw if f.node in isolate_verdicts and isolate_verdicts[f.node] >= f.at - 1]
    false_iso = sorted(n for n in isolations if n not in faulty)
    degrading = [f for f in faults if f.kind in DEGRADING_KINDS]
    before = [f for f in faults if f.fail_at is not None and f.node in isolations and isolations[f.node] < f.fail_at]
    transient = [f for f in faults if f.kind in TRANSIENT_KINDS]
    applied = [a for a in actions if a.get("outcome") in ("applied", "already_so", "dry_run")]
    requeued = {a["target"] for a in actions if a.get("action") == "requeue" and a.get("outcome") == "applied"}
    retried_ok = 0
    def first_job_verdict(f: Fault) -> dict[str, Any] | None:
        vs = sorted((v for v in verdicts if v.get("scope") == "job" and v.get("subject") == f.job
                     and v["ts"] - t0 >= f.at - 1), key=lambda v: v["ts"])
        return vs[0] if vs else None

    not_retried = []
    for f in transient:
        # run again (retry in place, or on new nodes when the output names no cause), never
        # stopped, and no node of the job isolated for it (a node isolated later for a
        # fault injected on it is not isolated for this one)
        v = first_job_verdict(f)
        if v is not None and v["actions"][0]["action"] in ("retry", "restart", "requeue") \
                and not any(n in isolations and isolations[n] >= f.at - 1 and n not in faulty
                            for n in v.get("nodes", [])):
            retried_ok += 1
        else:
            why = "no verdict" if v is None else f"first verdict {v['actions'][0]['action']} ({v.get('fault_class')})"
            not_retried.append(f"{f.kind}@{f.job} t={f.at:.0f}: {why}")
    user = [f for f in faults if f.kind == "user_bug"]
    stopped = sum(1 for f in user if any(v.get("subject") == f.job and v["actions"][0]["action"] == "stop" for v in verdicts))
    not_stopped = [f"{f.kind}@{f.job} t={f.at:.0f}" for f in user
                   if not any(v.get("subject") == f.job and v["actions"][0]["action"] == "stop" for v in verdicts)]
    lead = [round(f.fail_at - isolations[f.node], 1) for f in before]
    return {
        "faults_injected": len(faults),
        "hardware_faults": len(hw),
        "hardware_faults_detected": len(detected),
        "transient_faults": len(transient),
        "transient_faults_retried": retried_ok,
        "user_errors": len(user),
        "user_errors_stopped": stopped,
        "false_isolations": len(false_iso),
        "false_isolated_nodes": false_iso,
        "degrading_nodes": len(degrading),
        "isolated_before_failure": len(before),
        "lead_time_s": lead,
        "jobs_requeued": len(requeued),
        "verdicts": len(verdicts),
        "actions": len(actions),
        "actions_settled": len(applied),
        "missed": sorted(f"{f.kind}@{f.node}" for f in hw if f not in detected),
        "transient_not_retried": not_retried,
        "user_errors_not_stopped": not_stopped,
    }


def summary_line(result: dict[str, Any]) -> str:
    return json.dumps(result, sort_keys=False)
