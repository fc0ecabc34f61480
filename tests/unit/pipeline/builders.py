"""Small builders for records used across the pipeline unit tests.

Each builder gives a valid record with quiet, healthy defaults; a test passes only the
fields its behaviour depends on.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from schemas import (
    Anomaly,
    FaultClass,
    GpuSample,
    JobEvent,
    JobEventKind,
    JobNotice,
    NodeNotice,
    PlannedAction,
    Severity,
    Verdict,
)

T0 = 1_700_000_000.0
GPUS = 8


def gpu_fields(n: int = GPUS) -> dict[str, Any]:
    """The per-GPU fields of a healthy, busy node with ``n`` GPUs (counters at zero)."""
    return {
        "util": [95.0] * n,
        "temp": [65.0] * n,
        "power": [650.0] * n,
        "sm_clock": [1980.0] * n,
        "mem_clock": [2619.0] * n,
        "throttle": [0] * n,
        "ecc_sbe": [0] * n,
        "ecc_dbe": [0] * n,
        "remap_pending": [False] * n,
        "remap_failure": [False] * n,
        "nvlink_crc": [0] * n,
        "nvlink_replay": [0] * n,
        "nvlink_recovery": [0] * n,
        "pcie_replay": [0] * n,
        "lost": [False] * n,
    }


def gpu_wire(node: str = "node-0001", ts: float = T0, n: int = GPUS, **over: Any) -> dict[str, Any]:
    """A GpuSample as a wire dict (with ``schema``)."""
    return {"schema": "gpu/1", "ts": ts, "node": node, **gpu_fields(n), **over}


def gpu_sample(node: str = "node-0001", ts: float = T0, n: int = GPUS, **over: Any) -> GpuSample:
    return GpuSample.model_validate(gpu_wire(node, ts, n, **over))


def anomaly(
    node: str = "node-0001",
    ts: float = T0,
    *,
    kind: str = "ecc_sbe_rate",
    fault_class: FaultClass = FaultClass.node_degrading,
    severity: Severity = Severity.warning,
    gpu: int | None = 0,
    id: str | None = None,
) -> Anomaly:
    return Anomaly(
        ts=ts,
        id=id or f"a-{node}-{kind}-{ts}",
        detector="test",
        subject_type="gpu" if gpu is not None else "node",
        subject=f"{node}/gpu{gpu}" if gpu is not None else node,
        node=node,
        gpu=gpu,
        kind=kind,
        fault_class=fault_class,
        score=10.0,
        severity=severity,
    )


def critical_gpu_lost(node: str = "node-0001", ts: float = T0) -> Anomaly:
    return anomaly(node, ts, kind="gpu_lost", fault_class=FaultClass.gpu_hardware, severity=Severity.critical)


def job_event(
    job: str = "train-0001",
    event: JobEventKind | str = JobEventKind.started,
    ts: float = T0,
    *,
    nodes: list[str] | None = None,
    attempt: int = 1,
    **over: Any,
) -> JobEvent:
    return JobEvent(ts=ts, job=job, event=JobEventKind(event), nodes=nodes or [], attempt=attempt, **over)


def node_notice(node: str, kind: str, job: str = "train-0001", ts: float = T0, **over: Any) -> NodeNotice:
    return NodeNotice(ts=ts, node=node, kind=kind, job=job, **over)  # type: ignore[arg-type]


def job_notice(
    job: str,
    node: str,
    kind: str = "node_fault",
    ts: float = T0,
    *,
    incident: str = "inc-1",
    fault_class: FaultClass = FaultClass.gpu_hardware,
) -> JobNotice:
    return JobNotice(ts=ts, job=job, node=node, kind=kind, fault_class=fault_class, incident=incident)  # type: ignore[arg-type]


def verdict(
    actions: list[tuple[str, str]] | list[tuple[str, str, dict[str, Any]]],
    *,
    id: str = "v-1",
    ts: float = T0,
    scope: str = "node",
    subject: str = "node-0001",
    fault_class: FaultClass = FaultClass.gpu_hardware,
) -> Verdict:
    planned = []
    for a in actions:
        name, target, *rest = a
        planned.append(PlannedAction(action=name, target=target, params=rest[0] if rest else {}))
    return Verdict(
        ts=ts, id=id, incident=f"inc-{id}", scope=scope, subject=subject,  # type: ignore[arg-type]
        fault_class=fault_class, confidence=0.9, actions=planned,
    )


def sbe_ramp(n: int = 400, *, node: str = "node-0001", gpu: int = 5, start: int = 200, seed: int = 0,
             t0: float = T0, every: float = 10.0) -> list[GpuSample]:
    """A node whose GPU ``gpu`` develops a single-bit ECC error storm, as the simulator's
    ``sbe_rise`` fault does: rare background errors on every GPU, then from sample
    ``start`` a Poisson rate that grows exponentially (capped at 5 per sample) on one GPU.
    A sample every ``every`` seconds (the agent's default interval)."""
    rng = np.random.default_rng(seed)
    sbe = np.zeros(GPUS, dtype=np.int64)
    out = []
    for i in range(n):
        sbe += rng.poisson(2e-3, GPUS)
        if i >= start:
            sbe[gpu] += rng.poisson(min(5.0, 0.01 * math.exp((i - start) / 30.0)))
        out.append(gpu_sample(node, t0 + i * every, ecc_sbe=sbe.tolist()))
    return out
