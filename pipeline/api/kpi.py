"""The dashboard's header: what is out of service and why, what automation saved, and
the circuit breaker's budget left. Plain functions of the API's lists.

**GPU-hours saved against manual handling** uses the model of ``make eval``'s manual
baseline (``pipeline/eval/field.toml``, ``[people]``): a person notices a failed job,
finds its cause and acts after a delay drawn from a log-normal distribution (median
``human_median_hours``, shape ``human_sigma``), and the job holds its nodes meanwhile.
For each job recovery fleetmedic carried out (a retry, restart or requeue applied, or a
user's bug stopped), the saving is the expected human delay less fleetmedic's own time
from the job's failure to the action, times the GPUs the job held; never negative.
This is the live counterpart of the evaluation's ``job_gpu_hours_lost`` difference for
the wait alone; the checkpoint loss is the same under both and is not counted.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable
from typing import Any

#: actions that end a job's wait for a decision
RECOVERIES = frozenset({"retry", "restart", "requeue", "stop"})
OUT = ("isolated", "diagnosing", "failed")


def expected_human_hours(median_hours: float, sigma: float) -> float:
    """The mean of the log-normal human delay."""
    return median_hours * math.exp(sigma * sigma / 2.0)


def saved_vs_manual(verdicts: Iterable[dict[str, Any]], actions: Iterable[dict[str, Any]], *,
                    human_hours: float, gpus_per_node: int) -> dict[str, Any]:
    """GPU-hours the job recoveries carried out saved against the manual model."""
    by_id = {v.get("id"): v for v in verdicts}
    saved = 0.0
    recoveries = 0
    seen: set[tuple[str, str]] = set()
    for a in actions:
        if a.get("action") not in RECOVERIES or a.get("outcome") != "applied":
            continue
        v = by_id.get(a.get("verdict_id"))
        if v is None or (a.get("verdict_id"), a.get("target")) in seen:
            continue
        seen.add((a["verdict_id"], a.get("target")))
        delay_h = max(0.0, float(a.get("ts", v["ts"])) - float(v["ts"])) / 3600.0
        nodes = len(v.get("nodes") or []) or 1
        saved += max(0.0, human_hours - delay_h) * nodes * gpus_per_node
        recoveries += 1
    return {"gpu_hours": round(saved, 1), "recoveries": recoveries, "human_hours": round(human_hours, 2),
            "model": "expected human delay (log-normal, make eval's manual baseline) less fleetmedic's time "
                     "to act, times the job's GPUs, per job recovery carried out"}


def fleet_counts(nodes: Iterable[dict[str, Any]], held: Iterable[str] = ()) -> dict[str, Any]:
    """Nodes by state, and the nodes out of service by fault class.  A node whose isolation
    the breaker ``held`` for a person is still in service: counted apart, not as out."""
    waiting = set(held)
    by_state: Counter[str] = Counter()
    out_by_class: Counter[str] = Counter()
    held_count = 0
    for n in nodes:
        st = n.get("state") or "healthy"
        by_state[st] += 1
        if n.get("node") in waiting:
            held_count += 1
        elif st in OUT:
            out_by_class[n.get("fault_class") or "unknown"] += 1
    return {"total": sum(by_state.values()), "by_state": dict(by_state),
            "out": sum(out_by_class.values()), "out_by_class": dict(out_by_class.most_common()),
            "held_in_service": held_count}
