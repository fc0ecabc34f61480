"""What the backend did, judged from its own request log: the chaos run's ground truth.

The pipeline's own topics say what it meant to do; only the backend knows what happened.
:func:`check` reads the backend's log (every request it answered, its idempotency key and
whether the cluster's state changed: :attr:`pipeline.sim.cluster.Cluster.requests`) and
the faults the scenario injected, and reports:

* ``faulty_nodes_not_isolated``: nodes with an injected hardware fault that no request
  cordoned (nor had cordoned already), each with the pipeline's own explanation where
  there is one (the breaker held the isolation, or dry-run was on), taken from the
  ``actions`` records; ``effects_lost`` counts those without one;
* ``duplicate_effects``: a second change of the same kind to the same target for the
  same incident, whatever the key: a node cordoned again under the same fault without a
  return in between; a job moved (retried, restarted, requeued) or stopped twice from
  the same attempt;
* ``healthy_nodes_touched``: nodes cordoned with no hardware fault on them;
* ``job_moves``: per job, how many times it was moved, and from which attempts.

:func:`blocked_drains` reads the same log for the drains a PodDisruptionBudget refused
(HTTP 429) and reports those never done afterwards.

Nothing here reads the pipeline's verdicts; the checker is pure (lists in, a report
out), so it is tested on logs with planted faults.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

NODE_ACTIONS = frozenset({"isolate", "drain", "diagnose", "return", "escalate"})
#: job actions that start the job again; a second one from the same attempt is a duplicate
MOVES = frozenset({"retry", "restart", "requeue"})


@dataclass(frozen=True)
class InjectedFault:
    """One fault the scenario injected: its kind, the node it struck (None for a job's own
    failure or a switch), when (sim seconds), and whether it is the node's hardware."""

    kind: str
    node: str | None
    at: float
    hardware: bool


def faults_of(cluster: Any, hardware_kinds: Iterable[str]) -> list[InjectedFault]:
    """The injected faults of a :class:`pipeline.sim.cluster.Cluster` that struck."""
    hw = set(hardware_kinds)
    t0 = cluster.t0
    return [InjectedFault(f.kind, f.node, float(f.applied_ts - t0), f.kind in hw)
            for f in cluster.faults if f.applied_ts is not None]


def _incident(faults_by_node: dict[str, list[InjectedFault]], node: str, t: float) -> int | None:
    """The index (in the node's list) of the latest hardware fault on ``node`` by ``t``."""
    idx = None
    for i, f in enumerate(faults_by_node.get(node, [])):
        if f.at <= t:
            idx = i
    return idx


def check(requests: Sequence[dict[str, Any]], faults: Sequence[InjectedFault],
          actions: Sequence[dict[str, Any]] = ()) -> dict[str, Any]:
    """Judge the backend's log.  ``requests``: the backend's entries in the order it
    answered them (``t``, ``key``, ``action``, ``target``, ``params``, ``changed``,
    ``before``); ``faults``: what was injected; ``actions``: the pipeline's ``actions``
    records, read only to explain an isolation that did not happen."""
    hw_by_node: dict[str, list[InjectedFault]] = defaultdict(list)
    for f in sorted(faults, key=lambda f: f.at):
        if f.hardware and f.node:
            hw_by_node[f.node].append(f)

    duplicates: list[dict[str, Any]] = []
    healthy: list[dict[str, Any]] = []
    cordoned_by: dict[str, set[int]] = defaultdict(set)  # node -> incidents it was cordoned under
    seen_node: dict[tuple[str, str, int | None], str] = {}  # (action, node, incident) -> first key
    seen_job: dict[tuple[str, str, int], str] = {}  # (kind, job, attempt) -> first key
    job_moves: dict[str, list[int]] = defaultdict(list)
    for r in requests:
        action, target, key = r.get("action"), r.get("target"), r.get("key")
        if not r.get("changed") or not action or not target:
            continue
        before = r.get("before") or {}
        if action in NODE_ACTIONS:
            inc = _incident(hw_by_node, target, float(r.get("t", 0.0)))
            if action == "return":
                # back in service: a later cordon is a new isolation, not a repeat
                for a in ("isolate", "drain", "diagnose"):
                    seen_node.pop((a, target, inc), None)
                continue
            if action == "isolate":
                if inc is None:
                    healthy.append({"node": target, "key": key, "t": r.get("t")})
                else:
                    cordoned_by[target].add(inc)
            k = (action, target, inc)
            if k in seen_node:
                duplicates.append({"action": action, "target": target, "incident": inc, "keys": [seen_node[k], key]})
            else:
                seen_node[k] = key
        else:
            attempt = int(before.get("attempt", (r.get("params") or {}).get("attempt", 0)) or 0)
            kind = "move" if action in MOVES else action
            if kind == "move":
                job_moves[target].append(attempt)
            jk = (kind, target, attempt)
            if jk in seen_job:
                duplicates.append({"action": action, "target": target, "attempt": attempt,
                                   "keys": [seen_job[jk], key]})
            else:
                seen_job[jk] = key

    # every node with a hardware fault is cordoned by a request made after the fault, or
    # was cordoned already (a second fault on a node already out)
    explained = _explanations(actions)
    missing = []
    for node, fs in hw_by_node.items():
        if not cordoned_by.get(node):
            why = explained.get(node)
            missing.append({"node": node, "fault": fs[0].kind, "at": fs[0].at, "explained_by": why})
    return {
        "requests": len(requests),
        "effects": sum(1 for r in requests if r.get("changed")),
        "faulty_nodes": len(hw_by_node),
        "faulty_nodes_not_isolated": missing,
        "effects_lost": sum(1 for m in missing if m["explained_by"] is None),
        "duplicate_effects": len(duplicates),
        "duplicates": duplicates[:20],
        "healthy_nodes_touched": healthy,
        "job_moves": {j: a for j, a in sorted(job_moves.items())},
    }


def _explanations(actions: Sequence[dict[str, Any]]) -> dict[str, str]:
    """node -> why the pipeline did not cordon it, from its own isolate records."""
    out: dict[str, str] = {}
    for a in actions:
        if a.get("action") != "isolate":
            continue
        outcome = a.get("outcome")
        if outcome == "held_by_budget":
            out[a.get("target", "")] = f"breaker: {a.get('detail', '')}"[:200]
        elif outcome == "dry_run":
            out[a.get("target", "")] = "dry-run"
    return out


def blocked_drains(requests: Sequence[dict[str, Any]], windows: Sequence[tuple[float, float | None]] = ()) -> dict[str, Any]:
    """Drains the budget refused (status 429), and which of their targets never got a later
    drain answered with success (applied, or already so because the work had left).
    ``windows``: (wall start, wall end) of the blocks, to report only refusals inside them
    (all refusals when empty)."""
    refused: dict[str, float] = {}
    done_after: dict[str, float] = {}
    for r in requests:
        if r.get("action") != "drain" or not r.get("target"):
            continue
        wall = float(r.get("wall", 0.0))
        if r.get("status") == 429:
            inside = not windows or any(a <= wall and (b is None or wall <= b) for a, b in windows)
            if inside:
                refused.setdefault(r["target"], wall)
        elif r.get("status") == 200:
            done_after[r["target"]] = wall
    not_done = sorted(t for t, first in refused.items() if done_after.get(t, -1.0) < first)
    return {"blocked": sorted(refused), "not_done": not_done}
