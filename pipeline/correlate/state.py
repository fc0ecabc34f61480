"""The correlator's state records: what it keeps per node, per job and per switch.

The records are plain JSON objects, because they live in Faust tables (changelogged in
Kafka) and in the replay's dicts alike; their shape is declared here as typed dicts, and
each carries its schema version in ``v``.  A record read from a table may be older than
the code (a worker upgraded over a changelog written by the previous release):
:func:`load_node`, :func:`load_job` and :func:`load_switch` bring it to the current
version in place, one step per version, and a record newer than the code is refused
(:class:`StateVersionError`), never half-read.

A node's lifecycle is :class:`NodeState`; every change of state goes through
:func:`enter`, which allows only the moves in :data:`TRANSITIONS` and raises
:class:`IllegalTransition` for any other.
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import StrEnum
from typing import Any, NotRequired, TypedDict


class NodeState(StrEnum):
    """Where a node stands.  The values are the strings kept in the tables and shown by the API."""

    #: in the pool, nothing against it
    healthy = "healthy"
    #: in the pool; degradation findings gather against it
    suspect = "suspect"
    #: out of the pool: cordoned and drained, waiting for diagnostics (or held by a person)
    isolated = "isolated"
    #: out of the pool, diagnostics running on it
    diagnosing = "diagnosing"
    #: out of the pool: diagnostics failed, or it keeps coming back (a lemon); a person repairs it
    failed = "failed"


#: States in which the node takes no work.
OUT_OF_POOL = frozenset({NodeState.isolated, NodeState.diagnosing, NodeState.failed})

#: The allowed moves, and why each exists.  A move to the same state is allowed only where
#: it is listed (a person's hold or return repeated).
TRANSITIONS: Mapping[NodeState, frozenset[NodeState]] = {
    # degradation findings; a hard fault, or a person's hold; a person's return (again)
    NodeState.healthy: frozenset({NodeState.suspect, NodeState.isolated, NodeState.healthy}),
    # confirmed degradation or a hard fault, or a person's hold; a person's return
    NodeState.suspect: frozenset({NodeState.isolated, NodeState.healthy}),
    # diagnostics start, or report (failed; passed: back, or a lemon); a person's return or hold
    NodeState.isolated: frozenset({NodeState.diagnosing, NodeState.failed, NodeState.healthy, NodeState.isolated}),
    # diagnostics report; a person's return or hold
    NodeState.diagnosing: frozenset({NodeState.failed, NodeState.healthy, NodeState.isolated}),
    # repaired and returned by a person, or held by one
    NodeState.failed: frozenset({NodeState.healthy, NodeState.isolated}),
}


class IllegalTransition(ValueError):
    """A node was asked to move between two states the lifecycle does not connect."""

    def __init__(self, frm: NodeState, to: NodeState) -> None:
        super().__init__(f"a node cannot go from {frm.value} to {to.value} "
                         f"(allowed: {', '.join(sorted(s.value for s in TRANSITIONS[frm]))})")
        self.frm, self.to = frm, to


class StateVersionError(ValueError):
    """A stored record is newer than this code understands."""


NODE_VERSION = 2
JOB_VERSION = 2
SWITCH_VERSION = 1


class NodeHealth(TypedDict):
    """A node's history and state (``node_to_health``)."""

    v: int
    state: str
    since: float
    #: the jobs running on the node: job -> event time it was placed
    jobs: dict[str, float]
    #: jobs that left it, newest last: [job, placed, released]
    left: list[list[Any]]
    #: recent findings: [ts, kind, fault class, severity, anomaly id, GPU, score, Xid code or None]
    anomalies: list[list[Any]]
    #: failed jobs with nodes to blame: [ts, job, [share, origin, attempt]]
    failed_jobs: list[list[Any]]
    #: event times of its returns from diagnostics (the lemon rule)
    returns: list[float]
    incident: str | None
    fault_class: str | None
    #: Xids over the Xid window: [ts, gpu, code, job or pid, detector]
    xids: NotRequired[list[list[Any]]]
    #: escalations sent, by key: event time
    escalated: NotRequired[dict[str, float]]
    #: the switch that the fabric track blamed instead of this node
    fabric_switch: NotRequired[Any]
    #: a person's last return or hold
    operator: NotRequired[dict[str, Any]]
    #: the diagnostics job of the node's current isolation (its outcome alone counts)
    diag_job: NotRequired[str | None]
    #: jobs that left this degrading node at their checkpoint (or its deadline): drained
    #: once no other job is left on it
    moved_off: NotRequired[list[str]]


class JobHistory(TypedDict):
    """A job's attempts, failures and the evidence about its nodes (``job_to_history``)."""

    v: int
    job: str
    status: str
    attempt: int
    nodes: list[str]
    scheduler: str
    checkpoint: Any
    failures: list[dict[str, Any]]
    #: faults and degradations on the job's nodes: node -> {kind, fault_class, incident, ts}
    node_faults: dict[str, dict[str, Any]]
    #: a migration waiting for the next checkpoint
    pending: dict[str, Any] | None
    #: failures waiting for node evidence, oldest first: {attempt, ts, deadline_ts, deadline_wall}
    waiting: list[dict[str, Any]]
    retries: dict[str, int]
    #: attempts already judged
    decided: list[int]
    #: the driver's contained or application Xids on the job's nodes
    node_xids: NotRequired[dict[str, dict[str, Any]]]


class SwitchState(TypedDict):
    """A fabric switch's lone-node holds and incident (``switch_to_state``)."""

    v: int
    switch: str
    nodes: dict[str, Any]
    pending: dict[str, Any]
    incident: str | None
    since: float
    last: float


def new_node() -> NodeHealth:
    return {"v": NODE_VERSION, "state": NodeState.healthy.value, "since": 0.0, "jobs": {}, "left": [],
            "anomalies": [], "failed_jobs": [], "returns": [], "incident": None, "fault_class": None}


def new_job(job: str) -> JobHistory:
    return {"v": JOB_VERSION, "job": job, "status": "unknown", "attempt": 0, "nodes": [], "scheduler": "sim",
            "checkpoint": None, "failures": [], "node_faults": {}, "pending": None, "waiting": [],
            "retries": {"transient": 0, "user": 0, "unknown": 0}, "decided": []}


def new_switch(switch: str) -> SwitchState:
    return {"v": SWITCH_VERSION, "switch": switch, "nodes": {}, "pending": {}, "incident": None,
            "since": 0.0, "last": 0.0}


def _check(raw: Mapping[str, Any], current: int, what: str) -> int:
    v = int(raw.get("v", 1))
    if v > current:
        raise StateVersionError(f"{what} state of version {v} is newer than this release reads ({current})")
    return v


def load_node(raw: dict[str, Any]) -> NodeHealth:
    """A stored node record at the current version (upgraded in place)."""
    if _check(raw, NODE_VERSION, "node") < 2:
        # version 1 kept one job (``job``, ``job_since``) and one ``left`` triple
        if "jobs" not in raw:
            job, since = raw.pop("job", None), raw.pop("job_since", None)
            raw["jobs"] = {job: since or 0.0} if job else {}
            left = raw.get("left")
            raw["left"] = [left] if left and not isinstance(left[0], list) else list(left or [])
        for key in ("anomalies", "failed_jobs", "returns"):
            raw.setdefault(key, [])
        raw.setdefault("incident", None)
        raw.setdefault("fault_class", None)
        raw["v"] = 2
    NodeState(raw["state"])  # an unknown state is refused here, not deep in a rule
    return raw  # type: ignore[return-value]


def load_job(raw: dict[str, Any]) -> JobHistory:
    """A stored job record at the current version (upgraded in place)."""
    if _check(raw, JOB_VERSION, "job") < 2:
        # version 1 kept the one failure waiting for evidence in ``pending``
        w = raw.setdefault("waiting", [])
        p = raw.get("pending")
        if p and p.get("kind") == "failure":
            w.append({"attempt": p["attempt"], "ts": p["ts"], "deadline_ts": p.get("deadline_ts", p["ts"]),
                      "deadline_wall": p.get("deadline_wall", 0.0)})
            raw["pending"] = None
        raw.setdefault("decided", [])
        raw.setdefault("retries", {"transient": 0, "user": 0, "unknown": 0})
        raw["v"] = 2
    return raw  # type: ignore[return-value]


def load_switch(raw: dict[str, Any]) -> SwitchState:
    """A stored switch record at the current version."""
    _check(raw, SWITCH_VERSION, "switch")
    raw.setdefault("v", SWITCH_VERSION)
    return raw  # type: ignore[return-value]


def enter(h: NodeHealth, to: NodeState, ts: float, **fields: Any) -> None:
    """Move the node to ``to`` at event time ``ts`` (with other fields of the record set)."""
    frm = NodeState(h["state"])
    if to not in TRANSITIONS[frm]:
        raise IllegalTransition(frm, to)
    h["state"] = to.value
    h["since"] = ts
    for k, val in fields.items():
        h[k] = val  # type: ignore[literal-required]
