"""The correlator's decisions, as plain functions over plain state.

Two owners, each keyed as its records are:

* the **node track** (key: node) keeps ``NodeHealth`` and turns anomalies and job notices
  into node verdicts (isolate, drain, diagnose, return, escalate);
* the **job track** (key: job) keeps ``JobHistory`` and turns job events and node
  notices into job verdicts (retry, restart, requeue, stop).

They meet only through keyed notices (``NodeNotice`` to a node's owner, ``JobNotice`` to a
job's owner), so one worker owns each node and each job.  Nothing here does I/O: the
Faust agents in :mod:`pipeline.worker.app` receive, call these functions, store the returned
state and send the returned records.  State is a JSON-able dict so that it can live in a
Faust table as is.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from schemas import (
    NODE_FAULT_CLASSES,
    ActionName,
    Anomaly,
    FaultClass,
    JobEvent,
    JobEventKind,
    JobNotice,
    NodeNotice,
    PlannedAction,
    Severity,
    SwitchNotice,
    Verdict,
)
from schemas.ids import stable_id

from pipeline.config import NetworkSettings, PolicySettings
from pipeline.correlate.state import (
    OUT_OF_POOL,
    JobHistory,
    NodeHealth,
    NodeState,
    SwitchState,
    enter,
)
from pipeline.correlate.triage import signature_basis, triage


#: Fault classes whose warnings are degradation evidence that needs confirming.
DEGRADE_CLASSES = frozenset(
    {FaultClass.node_degrading, FaultClass.nvlink, FaultClass.gpu_memory, FaultClass.node_network}
)

MAX_KEPT = 64

#: detectors of driver-reported errors: decided by the catalog's action (see _node_on_xid)
XID_DETECTORS = frozenset({"xid", "sxid"})
#: detectors of fabric ports: their anomalies are attributed by the switch track
FABRIC_DETECTORS = frozenset({"link_rules", "fabric_rate", "fabric_model"})


#: jobs that left a node kept to tell a fault found late to the job it struck
LEFT_KEPT = 8


@dataclass
class Decision:
    verdicts: list[Verdict] = field(default_factory=list)
    node_notices: list[NodeNotice] = field(default_factory=list)
    job_notices: list[JobNotice] = field(default_factory=list)
    switch_notices: list[SwitchNotice] = field(default_factory=list)
    #: wall-clock time at which the job track wants a ``tick`` for this job at the latest
    tick_at: float | None = None
    #: event time (telemetry watermark) from which the job track wants that ``tick``
    tick_ts: float | None = None


def _verdict(
    *,
    ts: float,
    incident: str,
    scope: str,
    subject: str,
    fault_class: FaultClass | str,
    confidence: float,
    actions: list[tuple[ActionName, str, dict[str, Any]]],
    evidence: dict[str, Any],
    job: str | None = None,
    nodes: list[str] | None = None,
) -> Verdict:
    fc = FaultClass(fault_class)
    names = ",".join(a.value for a, _, _ in actions)
    return Verdict(
        ts=ts,
        id=stable_id(scope, subject, incident, fc.value, names),
        incident=incident,
        scope=scope,
        subject=subject,
        fault_class=fc,
        confidence=confidence,
        evidence=evidence,
        actions=[PlannedAction(action=a, target=t, params=p) for a, t, p in actions],
        job=job,
        nodes=nodes or [],
    )


# ----------------------------------------------------------------------------- node track


def _anomaly_brief(a: Anomaly) -> list[Any]:
    """What the node keeps of an anomaly: ts, kind, class, severity, id, GPU, score, and
    the Xid code of an Xid event (None otherwise)."""
    xid = a.evidence.get("xid") if a.kind == "xid" else None
    return [a.ts, a.kind, a.fault_class.value, a.severity.value, a.id, a.gpu, round(float(a.score), 4),
            int(xid) if isinstance(xid, int | float) else None]


def _kept_failures(h: NodeHealth) -> list[tuple[float, str, tuple[float, bool, int]]]:
    """A node's kept job failures as (ts, job, (blame share, began here, attempt)); entries
    kept before a field existed read as the whole blame, not begun here."""
    out = []
    for t, j, *rest in h["failed_jobs"]:
        _sig, share, origin, attempt = rest + [None, 1.0, False, 0][len(rest):]
        out.append((t, j, (share, bool(origin), attempt)))
    return out


def _jobs_at(h: NodeHealth, ts: float) -> list[str]:
    """The jobs that ran on the node at event time ``ts``: those placed by then and still
    there, and those released since whose stay covers ``ts``; when none, the jobs there now
    (a fault found before their placement reached this track).  Placements and findings
    reach the node track on different topics, in either order; judged by event time, a
    fault is told to every job it struck whichever came first."""
    jobs = h["jobs"]
    found = [j for j, since in jobs.items() if (since or 0.0) <= ts]
    found += [j for j, since, until in h["left"] if (since or 0.0) <= ts <= until and j not in found]
    return sorted(found) if found else sorted(jobs)


def _job_at(h: NodeHealth, ts: float) -> str | None:
    """One job that ran on the node at ``ts`` (the first by name), for a verdict's ``job``."""
    jobs = _jobs_at(h, ts)
    return jobs[0] if jobs else None


def _isolate_node(
    h: NodeHealth, node: str, ts: float, fault_class: FaultClass, evidence: dict[str, Any], *,
    confidence: float, incident: str, hard: bool, remedy: str | None = None, failed_job: str | None = None,
) -> Decision:
    """Take the node out, and tell every job that ran on it at ``ts`` (and ``failed_job``,
    whose failure led here) so each is moved off it."""
    d = Decision()
    jobs = _jobs_at(h, ts)
    if failed_job and failed_job not in jobs:
        jobs.append(failed_job)
    job = jobs[0] if jobs else None
    if hard or not jobs:
        actions = [
            (ActionName.isolate, node, {"reason": fault_class.value}),
            (ActionName.drain, node, {}),
            (ActionName.diagnose, node, {"remedy": remedy} if remedy else {}),
        ]
    else:
        # Degrading under a running job: cordon now, let the job reach its next
        # checkpoint (the job track requeues it then), diagnose once the node is free.
        actions = [
            (ActionName.isolate, node, {"reason": fault_class.value}),
            (ActionName.diagnose, node, {"when": "free"}),
        ]
    if len(jobs) > 1:
        evidence = {**evidence, "jobs": jobs}
    d.verdicts.append(
        _verdict(
            ts=ts, incident=incident, scope="node", subject=node, fault_class=fault_class,
            confidence=confidence, actions=actions, evidence=evidence, job=job, nodes=[node],
        )
    )
    for j in jobs:
        d.job_notices.append(
            JobNotice(
                ts=ts, job=j, node=node, kind="node_fault" if hard else "node_degrading",
                fault_class=fault_class, incident=incident,
                anomalies=[str(x) for x in evidence.get("anomalies", [])], evidence=evidence,
            )
        )
    enter(h, NodeState.isolated, ts, incident=incident, fault_class=fault_class.value)
    return d


def _degrading(h: NodeHealth, node: str, a: Anomaly, cfg: PolicySettings) -> Decision:
    """A warning of a degradation class: isolate once enough of them gather in the window."""
    lo = a.ts - cfg.degrade_window_s
    degrade = {c.value for c in DEGRADE_CLASSES}
    recent = [x for x in h["anomalies"] if x[0] >= lo and x[2] in degrade and x[3] != "info"]
    if len(recent) >= cfg.degrade_confirmations:
        kinds = sorted({x[1] for x in recent})
        incident = stable_id("node", node, "degrading", recent[0][4])
        evidence = {
            "anomalies": [x[4] for x in recent],
            "kinds": kinds,
            "confirmations": len(recent),
            "rule": "degradation findings in the window (degrade_confirmations)",
            "window_s": cfg.degrade_window_s,
            "last": a.evidence,
        }
        fc = FaultClass.node_degrading if a.fault_class is FaultClass.node_degrading else a.fault_class
        return _isolate_node(h, node, a.ts, fc, evidence, confidence=0.8, incident=incident, hard=False)
    if h["state"] == NodeState.healthy:
        enter(h, NodeState.suspect, a.ts)
    return Decision()


def _escalate_node(h: NodeHealth, node: str, a: Anomaly, key: str, reason: str, evidence: dict[str, Any],
                   cfg: PolicySettings) -> Decision:
    """An alert for a person about ``node``, once per ``key`` per Xid window; the node stays."""
    sent = {k: t for k, t in (h.get("escalated") or {}).items() if t >= a.ts - cfg.xid_window_s}
    if key in sent:
        h["escalated"] = sent
        return Decision()
    h["escalated"] = {**sent, key: a.ts}
    incident = stable_id("node", node, "escalate", key, a.id)
    v = _verdict(ts=a.ts, incident=incident, scope="node", subject=node, fault_class=a.fault_class, confidence=0.6,
                 actions=[(ActionName.escalate, node, {"reason": reason, "gpu": a.gpu})],
                 evidence={"anomalies": [a.id], **evidence}, job=_job_at(h, a.ts), nodes=[node])
    return Decision(verdicts=[v])


def _node_on_xid(h: NodeHealth, node: str, a: Anomaly, cfg: PolicySettings) -> Decision:
    """An Xid or SXid finding, by the action NVIDIA's catalog gives it (``detectors.xid``),
    and by the node's Xid history over ``xid_window_s`` of event time:

    * ``isolate``: the node is taken out now, its diagnosis given the catalog's remedy;
    * ``app_unless_repeated`` (13, 31, 43): the application's fault, unless the same code
      struck the same GPU in ``xid_app_repeat_jobs`` distinct jobs: then the GPU's;
    * ``restart_app`` and ``app_unless_repeated``: the job on the node is told, so that its
      failure is judged as the driver saw it (restarted, not blamed on the node);
    * ``degrade``: a degradation finding like any other;
    * ``escalate``, and any code ``xid_repeat_escalate`` times on one GPU: a person is
      alerted, the node stays.
    """
    ev = a.evidence
    code = ev.get("xid", ev.get("sxid"))
    action = ev.get("action", "record")
    job = _job_at(h, a.ts)
    who = job or (f"pid:{ev['pid']}" if ev.get("pid") is not None else None)
    lo = a.ts - cfg.xid_window_s
    kept = [x for x in h.get("xids") or [] if x[0] >= lo]
    times = max(1, min(int(ev.get("count") or 1), 16))  # a windowed count stands for several events
    h["xids"] = (kept + [[a.ts, a.gpu, code, who, a.detector]] * times)[-4 * MAX_KEPT:]
    if h["state"] in OUT_OF_POOL:
        return Decision()
    same = [x for x in h["xids"] if x[1] == a.gpu and x[2] == code and x[4] == a.detector]
    d = Decision()
    if action == "isolate":
        incident = stable_id("node", node, a.id)
        evidence = {"anomalies": [a.id], "kind": a.kind, "gpu": a.gpu, "detector": a.detector, **ev}
        return _isolate_node(h, node, a.ts, a.fault_class, evidence, confidence=0.95, incident=incident, hard=True,
                             remedy=ev.get("remedy") or None)
    if action == "app_unless_repeated":
        jobs = sorted({x[3] for x in same if x[3]})
        if len(jobs) >= cfg.xid_app_repeat_jobs:
            incident = stable_id("node", node, "xid-repeat", a.gpu, code, *jobs)
            evidence = {"anomalies": [a.id], "kind": a.kind, "gpu": a.gpu, "detector": a.detector, **ev,
                        "rule": f"Xid {code} on GPU {a.gpu} in {len(jobs)} jobs within {cfg.xid_window_s:.0f} s: "
                                f"the GPU, not the application (NVIDIA's WORKFLOW_XID_13/31: run diagnostics)",
                        "jobs": jobs}
            return _isolate_node(h, node, a.ts, FaultClass.gpu_hardware, evidence, confidence=0.8,
                                 incident=incident, hard=True, remedy="field_diagnostics")
    if action in ("restart_app", "app_unless_repeated"):
        # which of the node's jobs the Xid struck is not known here: each is told, and only
        # one that fails reads it (as the driver's word on its failure)
        d.job_notices.extend(JobNotice(
            ts=a.ts, job=j, node=node, kind="xid", fault_class=a.fault_class, incident=stable_id("xid", a.id),
            anomalies=[a.id], evidence={"xid": code, "action": action, "gpu": a.gpu, "rule": ev.get("rule")})
            for j in _jobs_at(h, a.ts))
    if ev.get("degrade") and a.severity is not Severity.info:
        d2 = _degrading(h, node, a, cfg)
        if d2.verdicts:
            return d2
    if len(same) >= cfg.xid_repeat_escalate:
        d.verdicts.extend(_escalate_node(
            h, node, a, f"repeat:{a.detector}:{a.gpu}:{code}",
            f"{a.kind} {code} seen {len(same)} times on GPU {a.gpu} within {cfg.xid_window_s:.0f} s",
            {"xid": code, "times": len(same), "rule": "any code 5 or more times on one GPU within 24 h"}, cfg).verdicts)
    elif action == "escalate":
        d.verdicts.extend(_escalate_node(h, node, a, f"code:{a.detector}:{a.gpu}:{code}",
                                         f"{a.kind} {code}: {ev.get('rule', 'a person decides')}", {**ev}, cfg).verdicts)
    return d


def node_on_anomaly(h: NodeHealth, a: Anomaly, cfg: PolicySettings) -> Decision:
    """A finding about ``a.node`` (or the node itself): record it, maybe isolate."""
    node = a.node or a.subject
    h["anomalies"] = (h["anomalies"] + [_anomaly_brief(a)])[-MAX_KEPT:]
    if h["state"] in OUT_OF_POOL:
        return Decision()
    if a.detector in XID_DETECTORS:
        return _node_on_xid(h, node, a, cfg)
    if a.detector in FABRIC_DETECTORS:
        # one node's port or its switch? the switch's owner decides (see switch_on_notice)
        if a.severity is Severity.info:
            return Decision()
        switch = str(a.evidence.get("switch") or "unknown")
        return Decision(switch_notices=[SwitchNotice(
            ts=a.ts, switch=switch, node=node, kind="port_anomaly", port=a.evidence.get("port"), anomaly=a.id,
            anomaly_kind=a.kind, evidence={k: v for k, v in a.evidence.items() if k in ("features", "score", "state")},
        )])
    if a.severity is Severity.critical and a.fault_class in NODE_FAULT_CLASSES:
        incident = stable_id("node", node, a.id)
        evidence = {"anomalies": [a.id], "kind": a.kind, "gpu": a.gpu, "detector": a.detector, **a.evidence}
        return _isolate_node(h, node, a.ts, a.fault_class, evidence, confidence=0.95, incident=incident, hard=True)
    if a.severity in (Severity.warning, Severity.critical) and a.fault_class in DEGRADE_CLASSES:
        return _degrading(h, node, a, cfg)
    return Decision()


def node_on_notice(h: NodeHealth, n: NodeNotice, cfg: PolicySettings,
                   net: NetworkSettings | None = None) -> Decision:
    """What the job track, the switch track or diagnostics say about this node."""
    node = n.node
    if n.kind == "network_fault":
        if h["state"] in OUT_OF_POOL:
            return Decision()
        evidence: dict[str, Any] = {"switch_track": n.reason, "anomalies": [n.signature] if n.signature else [], "detail": n.job,
                    "rule": "a port anomaly of this node alone under its switch"}
        incident = stable_id("node", node, "network", n.signature or n.ts)
        if net is not None and net.enforce:
            return _isolate_node(h, node, n.ts, FaultClass.node_network, evidence, confidence=0.85,
                                 incident=incident, hard=True)
        # beta: advisory only, the node stays in the pool
        v = _verdict(ts=n.ts, incident=incident, scope="node", subject=node, fault_class=FaultClass.node_network,
                     confidence=0.85, actions=[(ActionName.escalate, node, {"reason": "network fault (advisory)",
                                                                           "advisory": True})],
                     evidence={**evidence, "advisory": True}, job=_job_at(h, n.ts), nodes=[node])
        return Decision(verdicts=[v])
    if n.kind == "fabric_switch":
        h["fabric_switch"] = {"switch": n.reason, "ts": n.ts, "incident": n.signature}
        return Decision(job_notices=[JobNotice(
            ts=n.ts, job=j, node=node, kind="fabric", fault_class=FaultClass.fabric_switch,
            incident=n.signature or stable_id("switch", n.reason), evidence={"switch": n.reason},
        ) for j in _jobs_at(h, n.ts)])
    if n.kind == "placed":
        h["jobs"][n.job] = n.ts
        h["left"] = [x for x in h["left"] if x[0] != n.job]
        if h["state"] in OUT_OF_POOL and h.get("incident"):
            # The fault was seen before the placement was known here (the two arrive on
            # different topics): tell the job now, so it is not blamed on its code; stamped
            # with the later of the two, so a fault that came after the placement (its
            # telemetry ran ahead) is judged at its own time, not at the placement's.
            fc = FaultClass(h.get("fault_class") or FaultClass.unknown.value)
            return Decision(job_notices=[JobNotice(
                ts=max(n.ts, h.get("since") or 0.0), job=n.job, node=node, kind="node_fault", fault_class=fc,
                incident=h["incident"],
                evidence={"state": h["state"], "since": h["since"]},
            )])
        return Decision()
    if n.kind == "released":
        if n.job in h["jobs"]:
            since = h["jobs"].pop(n.job)
            h["left"] = (h["left"] + [[n.job, since, n.ts]])[-LEFT_KEPT:]
        return Decision()
    if n.kind == "job_failed":
        share = 1.0 / n.job_nodes if n.job_nodes else 1.0
        h["failed_jobs"] = (h["failed_jobs"] + [[n.ts, n.job, n.signature, share, n.origin, n.attempt]])[-MAX_KEPT:]
        if h["state"] in OUT_OF_POOL:
            return Decision()
        failed = _kept_failures(h)
        # distinct jobs whose failure began here: the node where failures of different jobs keep
        # beginning is suspect, and a job's size does not dilute that; one job's attempts count
        # once, or a user's bug retried on its rank-0 node would blame that node
        lo = n.ts - cfg.repeat_origin_window_s
        began_here: dict[str, list[int]] = {}
        for t, j, (_, origin, attempt) in failed:
            if t >= lo and origin:
                began_here.setdefault(j, []).append(attempt)
        if len(began_here) >= cfg.repeat_origin_failures:
            began = sorted((j, a) for j, attempts in began_here.items() for a in sorted(set(attempts)))
            incident = stable_id("node", node, "origin", *sorted(began_here))
            evidence = {"rule": "failures of different jobs keep beginning on this node (repeat_origin_failures)",
                        "failures_began_here": [list(x) for x in began], "window_s": cfg.repeat_origin_window_s,
                        "failed_jobs": sorted(began_here), "anomalies": []}
            return _isolate_node(h, node, n.ts, FaultClass.unknown, evidence, confidence=0.7, incident=incident,
                                 hard=True, failed_job=n.job)
        lo = n.ts - cfg.repeat_failure_window_s
        blame: dict[str, float] = {}
        for t, j, (job_share, _, _) in failed:
            if t >= lo:
                blame[j] = max(blame.get(j, 0.0), job_share)
        jobs = sorted(blame)
        # a node in many failed jobs is suspect only if it carries enough of their blame: the
        # failures of big jobs fall on hundreds of nodes at once and say little about one
        if len(jobs) >= cfg.repeat_failure_jobs and sum(blame.values()) >= cfg.repeat_failure_share - 1e-9:
            incident = stable_id("node", node, "repeat", *jobs)
            evidence = {"rule": "in the failures of several jobs, carrying their blame (repeat_failure_jobs)",
                        "failed_jobs": jobs, "window_s": cfg.repeat_failure_window_s, "anomalies": [],
                        "blame": round(sum(blame.values()), 3)}
            return _isolate_node(h, node, n.ts, FaultClass.unknown, evidence, confidence=0.6, incident=incident,
                                 hard=True, failed_job=n.job)
        return Decision()
    if n.kind == "hardware_failure":
        # a job's own output named a hardware fault on this node (an Xid line, an
        # uncorrectable ECC error, a GPU off the bus) and no telemetry had shown it yet
        if h["state"] in OUT_OF_POOL:
            return Decision()
        fc = n.fault_class or FaultClass.gpu_hardware
        evidence = {"anomalies": [], "job_output": n.evidence, "detail": n.reason,
                    "rule": "a job's output named a hardware fault on this node"}
        return _isolate_node(h, node, n.ts, fc, evidence, confidence=0.85,
                             incident=n.signature or stable_id("node", node, "job-output", n.job, n.attempt), hard=True,
                             failed_job=n.job)
    if n.kind == "job_moved":
        # a job left this degrading node from a checkpoint (asked for, or its last one at
        # the deadline): once no other job is left on it, what remains is drained
        if h["state"] not in OUT_OF_POOL or (n.signature and n.signature != h.get("incident")):
            return Decision()
        moved = sorted({*(h.get("moved_off") or []), n.job})[-MAX_KEPT:]
        h["moved_off"] = moved
        left = sorted(j for j in h["jobs"] if j not in moved)
        if left:
            return Decision()
        v = _verdict(
            ts=n.ts, incident=h.get("incident") or stable_id("node", node, "moved", n.job), scope="node",
            subject=node, fault_class=h.get("fault_class") or FaultClass.node_degrading, confidence=0.8,
            actions=[(ActionName.drain, node, {"after": n.reason or "the jobs moved off"})],
            evidence={"rule": "its jobs moved off it at their checkpoints (checkpoint-now)", "jobs": moved,
                      "detail": n.reason},
            job=n.job, nodes=[node],
        )
        return Decision(verdicts=[v])
    if n.kind == "operator_return":
        # a person returned the node to service: its history starts again
        enter(h, NodeState.healthy, n.ts, incident=None, fault_class=None, anomalies=[], failed_jobs=[], moved_off=[],
                 operator={"return": n.reason, "ts": n.ts})
        return Decision()
    if n.kind == "operator_hold":
        # a person holds the node out (or approved a held isolation): out of the pool until returned
        enter(h, NodeState.isolated, n.ts, incident=n.signature, fault_class=FaultClass.unknown.value,
                 operator={"hold": n.reason, "ts": n.ts})
        return Decision()
    if n.kind == "diag_started":
        if h["state"] == NodeState.isolated and n.ts >= h["since"]:
            enter(h, NodeState.diagnosing, n.ts, diag_job=n.job)
        return Decision()
    if n.kind in ("diag_passed", "diag_failed"):
        if h["state"] not in (NodeState.isolated, NodeState.diagnosing):
            return Decision()
        # only the diagnostics of this isolation count: an outcome from before it (a run of
        # an earlier isolation, a watcher re-reporting a finished job) must not return a
        # node just taken out, nor fail it
        mine = h.get("diag_job")
        if n.ts < h["since"] or (h["state"] == NodeState.diagnosing and mine and n.job != mine):
            return Decision()
        incident = h.get("incident") or stable_id("node", node, n.job)
        fc = FaultClass(h.get("fault_class") or FaultClass.unknown.value)
        if n.kind == "diag_failed":
            enter(h, NodeState.failed, n.ts)
            v = _verdict(
                ts=n.ts, incident=incident, scope="node", subject=node, fault_class=fc, confidence=0.99,
                actions=[(ActionName.escalate, node, {"reason": "diagnostics failed", "diagnostics": n.job})],
                evidence={"diagnostics": n.job, "result": "failed", "detail": n.reason}, nodes=[node],
            )
            return Decision(verdicts=[v])
        lo = n.ts - cfg.lemon_window_s
        returns = [t for t in h["returns"] if t >= lo]
        if len(returns) + 1 >= cfg.lemon_returns:
            enter(h, NodeState.failed, n.ts)
            v = _verdict(
                ts=n.ts, incident=incident, scope="node", subject=node, fault_class=fc, confidence=0.9,
                actions=[(ActionName.escalate, node, {"reason": "lemon", "returns": len(returns) + 1})],
                evidence={"diagnostics": n.job, "result": "passed", "lemon": True, "returns_in_window": len(returns)},
                nodes=[node],
            )
            return Decision(verdicts=[v])
        enter(h, NodeState.healthy, n.ts, incident=None, fault_class=None, anomalies=[], failed_jobs=[], moved_off=[])
        h["returns"] = (returns + [n.ts])[-MAX_KEPT:]
        v = _verdict(
            ts=n.ts, incident=incident, scope="node", subject=node, fault_class=fc, confidence=0.9,
            actions=[(ActionName.return_, node, {"diagnostics": n.job})],
            evidence={"diagnostics": n.job, "result": "passed"}, nodes=[node],
        )
        return Decision(verdicts=[v])
    return Decision()


# ------------------------------------------------------------------------------ job track

def failure_record(e: JobEvent, nodes: list[str]) -> dict[str, Any]:
    """A failure as the job track keeps it: what the triage read in it, and where it ran."""
    reading, t = triage(e.exit_code, e.reason, e.log_tail, nodes)
    return {
        "attempt": e.attempt, "ts": e.ts, "signature": stable_id("sig", signature_basis(reading, t, nodes), n=12),
        "triage": {"kind": t.kind, "fault_class": t.fault_class.value, "strong": t.strong,
                   "blames_nodes": t.blames_nodes, "evidence": _bounded(t.evidence())},
        "reason": (e.reason or "")[:300], "exit_code": e.exit_code, "nodes": nodes,
        "origin": e.origin_node if e.origin_node in nodes else None, "named": t.node,
    }


def _bounded(ev: dict[str, Any]) -> dict[str, Any]:
    """Evidence small enough for a table value: lists cut to 5 items, strings to 300 characters."""
    out: dict[str, Any] = {}
    for k, v in ev.items():
        if isinstance(v, list):
            v = [x[:300] if isinstance(x, str) else x for x in v[:5]]
        elif isinstance(v, str):
            v = v[:300]
        out[k] = v
    return out


def _triage_of(failure: dict[str, Any]) -> dict[str, Any]:
    """The failure's triage; failures kept before triage existed read as unknown."""
    return failure.get("triage") or {"kind": "unknown", "fault_class": "unknown", "strong": False,
                                     "blames_nodes": True, "evidence": {"rule": "no_evidence"}}


def _job_verdict(
    hist: JobHistory, ts: float, incident: str, fc: FaultClass, action: ActionName, confidence: float,
    evidence: dict[str, Any], params: dict[str, Any] | None = None, failure: dict[str, Any] | None = None,
) -> Verdict:
    """A verdict on the job; on ``failure``'s attempt and nodes when given (a failure judged
    after the job's next attempt started is still about its own)."""
    job = hist["job"]
    attempt, nodes = (failure["attempt"], failure["nodes"]) if failure else (hist["attempt"], hist["nodes"])
    p = {"attempt": attempt, "scheduler": hist.get("scheduler", "sim"), **(params or {})}
    return _verdict(
        ts=ts, incident=incident, scope="job", subject=job, fault_class=fc, confidence=confidence,
        actions=[(action, job, p)], evidence=evidence, job=job, nodes=list(nodes),
    )


def _waiting(hist: JobHistory) -> list[dict[str, Any]]:
    """The job's failures waiting for node evidence, oldest first."""
    return hist["waiting"]


def waiting_failures(hist: JobHistory) -> list[dict[str, Any]]:
    """The job's failures waiting for node evidence (read-only view), oldest first."""
    return list(hist["waiting"])


def _failure_of(hist: JobHistory, attempt: int) -> dict[str, Any] | None:
    return next((f for f in reversed(hist["failures"]) if f["attempt"] == attempt), None)


def _settle(hist: JobHistory, attempt: int) -> None:
    """The failure of ``attempt`` is judged: it waits no more, and its duplicates are ignored."""
    hist["waiting"] = [w for w in _waiting(hist) if w["attempt"] != attempt]
    hist["decided"] = (hist["decided"] + [attempt])[-MAX_KEPT:]


def job_due(hist: JobHistory) -> tuple[float, float] | None:
    """When the job wants its next tick, in event time and at the latest in wall time:
    the oldest failure waiting for evidence, or a move waiting for a checkpoint; None when
    nothing waits."""
    waiting = _waiting(hist)
    due = [(w["deadline_ts"], w["deadline_wall"]) for w in waiting[:1]]
    pend = hist["pending"]
    if pend and pend.get("kind") == "migrate" and pend.get("deadline_wall") is not None:
        due.append((pend["deadline_ts"], pend["deadline_wall"]))
    if not due:
        return None
    return min(t for t, _ in due), min([w for _, w in due] + [x["deadline_wall"] for x in waiting])


def _next_tick(d: Decision, hist: JobHistory) -> Decision:
    """``d`` asking for a tick when the job is next due (if anything of it waits)."""
    due = job_due(hist)
    if due is not None:
        d.tick_ts, d.tick_at = due
    return d


def _recent_node_faults(hist: JobHistory, nodes: list[str], ts: float, horizon: float,
                        until: float = float("inf")) -> dict[str, dict[str, Any]]:
    """Faults and degradations reported on ``nodes`` within ``horizon`` seconds before ``ts``
    and no later than ``until`` (event time: evidence after a failure's grace is not its)."""
    return {
        n: f for n, f in hist["node_faults"].items()
        if n in nodes and ts - horizon <= f["ts"] <= until
    }


def _decide_hardware(hist: JobHistory, ts: float, faults: dict[str, dict[str, Any]],
                     failure: dict[str, Any] | None) -> Decision:
    """Requeue the job without the nodes at fault; when only a shared switch failed under
    it (fabric notices alone), requeue it as a fabric fault with no node excluded."""
    blamed = {n: f for n, f in faults.items() if f["kind"] != "fabric"}
    first = min((blamed or faults).values(), key=lambda f: f["ts"])
    fc = FaultClass(first["fault_class"]) if blamed else FaultClass.fabric_switch
    v = _job_verdict(
        hist, ts, first["incident"], fc, ActionName.requeue, 0.95 if blamed else 0.8,
        {"node_faults": blamed or faults, "failure": failure},
        {"exclude": sorted(blamed), "from_checkpoint": True}, failure,
    )
    attempt = failure["attempt"] if failure else hist["attempt"]
    _settle(hist, attempt)
    if attempt == hist["attempt"]:
        hist["status"] = "requeued"
    return _next_tick(Decision(verdicts=[v]), hist)


def _other_placement(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Whether two failures ran on different placements: at most half of the smaller
    one's nodes in common."""
    na, nb = set(a["nodes"]), set(b["nodes"])
    if not na or not nb:
        return False
    return len(na & nb) <= min(len(na), len(nb)) / 2


def _suspect(failure: dict[str, Any]) -> str | None:
    """The node a failure points at: the host its own output names, the scheduler's first
    failed worker, or the job's only node."""
    if failure.get("named"):
        return str(failure["named"])
    if failure.get("origin"):
        return str(failure["origin"])
    return failure["nodes"][0] if len(failure["nodes"]) == 1 else None


def _decide_without_node_evidence(hist: JobHistory, ts: float, cfg: PolicySettings,
                                  failure: dict[str, Any] | None = None) -> Decision:
    """Judge a failure that no node evidence explained, from what its own output says
    (:mod:`pipeline.correlate.triage`) and from the job's history:

    * **hardware** (an Xid line, an uncorrectable ECC error, a GPU off the bus): requeue
      without the node it names, and tell that node's owner, which isolates it;
    * **user** (the code, its inputs or its environment): retry ``user_error_retries``
      times, then stop;
    * **transient** (preemption, a failing service): retry ``transient_retries`` times,
      then requeue;
    * **contained** (an Xid the driver contained to the application): restart in place;
    * **suspect** and **network** (errors a failing GPU or NIC raises as often as a
      faulty program or setup), **elsewhere** and **unknown** (a watchdog timeout, a lost
      peer, a bare signal: weak evidence, answered ``unknown`` with the reason): run it
      once more, on new nodes (requeue, without the node the failure points at), which
      tells the nodes' fault from the job's.

    Whatever the kind but hardware, user and transient: the same failure (signature) on
    other nodes follows the job, not the nodes, and stops it; ``unknown_repeats`` of them
    on the same nodes stop it for a person.

    Failures whose output could be the node's fault are reported to each node of the job
    (``job_failed``, with the node where it began), for the node track's repeat rules.
    """
    failure = failure or hist["failures"][-1]
    tri = _triage_of(failure)
    kind = tri["kind"]
    rule = tri["evidence"].get("rule", "?")
    # what the driver said about the job's GPUs around the failure outranks the job's own words
    said = [x for n, x in (hist.get("node_xids") or {}).items()
            if n in failure["nodes"] and abs(x["ts"] - failure["ts"]) <= cfg.degrade_window_s]
    contained = next((x for x in said if x["action"] == "restart_app"), None)
    app = next((x for x in said if x["action"] == "app_unless_repeated"), None)
    if contained is not None and kind in ("hardware", "suspect", "unknown", "elsewhere", "contained"):
        kind, rule = "contained", "driver_contained_xid"
        tri = {**tri, "fault_class": contained["fault_class"]}
    elif app is not None and kind in ("suspect", "unknown", "elsewhere"):
        kind, rule = "user", "driver_application_xid"
    incident = stable_id("job", hist["job"], failure["attempt"])
    d = Decision()
    before = next((k for k, f in enumerate(hist["failures"]) if f is failure), len(hist["failures"]) - 1)
    previous = [f for f in hist["failures"][:before] if f["signature"] == failure["signature"]]
    suspect = _suspect(failure)
    ev = {"triage": tri["evidence"], "signature": failure["signature"], "reason": failure["reason"],
          "exit_code": failure["exit_code"], "node_anomalies": "none", "repeats": len(previous) + 1}
    if said:
        ev["driver"] = said

    def verdict(fc: FaultClass | str, action: ActionName, confidence: float, decided_by: str,
                params: dict[str, Any] | None = None) -> None:
        d.verdicts.append(_job_verdict(hist, ts, incident, FaultClass(fc), action, confidence,
                                       {**ev, "decided_by": decided_by}, params, failure))

    elsewhere = [f for f in previous if _other_placement(f, failure)]
    move = {"exclude": [suspect] if suspect else [], "from_checkpoint": True}
    if kind == "hardware":
        verdict(tri["fault_class"], ActionName.requeue, 0.9, rule, move)
        if suspect:
            d.node_notices.append(NodeNotice(
                ts=ts, node=suspect, kind="hardware_failure", job=hist["job"], attempt=failure["attempt"],
                reason=tri["evidence"].get("why"), signature=incident, fault_class=FaultClass(tri["fault_class"]),
                evidence={"triage": tri["evidence"], "job": hist["job"], "attempt": failure["attempt"]}))
    elif kind == "user":
        if hist["retries"]["user"] >= cfg.user_error_retries:
            verdict(FaultClass.user_error, ActionName.stop, 0.9 if tri["strong"] else 0.75, rule)
            hist["status"] = "stopped"
        else:
            hist["retries"]["user"] += 1
            verdict(FaultClass.user_error, ActionName.retry, 0.6, rule)
    elif kind == "transient":
        if hist["retries"]["transient"] >= cfg.transient_retries:
            verdict(FaultClass.transient_software, ActionName.requeue, 0.7, rule, {"exclude": []})
        else:
            hist["retries"]["transient"] += 1
            verdict(FaultClass.transient_software, ActionName.retry, 0.7, rule)
    elif elsewhere:
        # the same failure on other nodes follows the job, not the nodes
        ev["other_placements"] = [f["nodes"][:8] for f in elsewhere[-2:]]
        verdict(FaultClass.user_error, ActionName.stop, 0.8, "same_failure_on_other_nodes")
        hist["status"] = "stopped"
    elif len(previous) + 1 >= cfg.unknown_repeats:
        verdict(FaultClass.unknown, ActionName.stop, 0.5, "same_failure_repeats",
                {"escalate": True, "reason": f"failed {len(previous) + 1} times the same way; no cause found"})
        hist["status"] = "stopped"
    elif kind == "contained" and not previous:
        verdict(tri["fault_class"], ActionName.restart, 0.8, rule, {"from_checkpoint": True})
    else:
        # suspect, network, elsewhere, unknown: the GPU, the NIC, another rank or the program?
        # Running it once more on new nodes tells the nodes' fault from the job's
        fc = FaultClass.unknown if kind in ("elsewhere", "unknown") else tri["fault_class"]
        verdict(fc, ActionName.requeue, {"suspect": 0.5, "network": 0.7}.get(kind, 0.5),
                "same_failure_same_nodes" if previous else rule, move)
    if tri["blames_nodes"] and kind != "hardware" or (kind == "hardware" and not suspect):
        origin = failure.get("named") or failure.get("origin")
        for n in failure["nodes"]:
            d.node_notices.append(
                NodeNotice(ts=ts, node=n, kind="job_failed", job=hist["job"], attempt=failure["attempt"],
                           reason=failure["reason"], signature=failure["signature"],
                           job_nodes=max(1, len(failure["nodes"])), origin=n == origin)
            )
    _settle(hist, failure["attempt"])
    if hist["status"] != "stopped" and failure["attempt"] == hist["attempt"]:
        hist["status"] = "decided"
    return d


def job_on_event(hist: JobHistory, e: JobEvent, cfg: PolicySettings, wall_now: float) -> Decision:
    """A job lifecycle event from a scheduler watcher or the simulator."""
    d = Decision()
    if e.diagnostics_for:
        if e.event in (JobEventKind.started,):
            d.node_notices.append(NodeNotice(ts=e.ts, node=e.diagnostics_for, kind="diag_started", job=e.job))
        elif e.event in (JobEventKind.completed, JobEventKind.failed):
            kind = "diag_passed" if e.event is JobEventKind.completed else "diag_failed"
            d.node_notices.append(
                NodeNotice(ts=e.ts, node=e.diagnostics_for, kind=kind, job=e.job, reason=e.reason)
            )
        hist["status"] = e.event.value
        return d

    waiting = _waiting(hist)
    pend = hist["pending"]
    if (e.event is JobEventKind.checkpoint and e.attempt < hist["attempt"] and pend and pend["kind"] == "migrate"
            and pend["attempt"] == hist["attempt"] and e.ts >= pend.get("asked_ts", float("inf"))):
        # the answer to a checkpoint request: a job cannot always know which attempt it is
        # (a replaced pod), so one saved after the request counts whatever attempt it names
        hist["checkpoint"] = {"step": e.checkpoint_step if e.checkpoint_step is not None else e.step, "ts": e.ts}
        return _migrate(hist, e.ts, pend, reason="checkpoint reached")
    if e.attempt < hist["attempt"] and not (e.event is JobEventKind.failed and e.attempt not in hist["decided"]
                                            and not any(w["attempt"] == e.attempt for w in waiting)):
        return d  # a late event of an older attempt (but a failure not judged yet counts)
    hist["scheduler"] = e.scheduler
    if e.event is JobEventKind.started:
        old = set(hist["nodes"])
        hist["status"], hist["attempt"], hist["nodes"] = "running", e.attempt, list(e.nodes)
        if hist["pending"] and hist["pending"].get("attempt", 0) < e.attempt:
            hist["pending"] = None
        for n in e.nodes:
            d.node_notices.append(NodeNotice(ts=e.ts, node=n, kind="placed", job=e.job, attempt=e.attempt))
        for n in sorted(old - set(e.nodes)):
            d.node_notices.append(NodeNotice(ts=e.ts, node=n, kind="released", job=e.job, attempt=e.attempt))
        return d
    if e.nodes and e.attempt >= hist["attempt"]:
        hist["nodes"] = list(e.nodes)
    hist["attempt"] = max(hist["attempt"], e.attempt)
    pend = hist["pending"]
    if e.event is JobEventKind.checkpoint:
        hist["checkpoint"] = {"step": e.checkpoint_step if e.checkpoint_step is not None else e.step, "ts": e.ts}
        if pend and pend["kind"] == "migrate" and pend["attempt"] == e.attempt:
            return _migrate(hist, e.ts, pend, reason="checkpoint reached")
        return d
    if e.event is JobEventKind.checkpoint_requested:
        return d  # fleetmedic's own request, published for the job: its answer is a checkpoint
    if e.event is JobEventKind.progress:
        hist["status"] = "running"
        if pend and pend["kind"] == "migrate" and e.ts >= pend["deadline_ts"]:
            return _migrate(hist, e.ts, pend, reason="checkpoint deadline passed")
        return d
    if e.event is JobEventKind.completed:
        hist["status"] = "completed"
        hist["pending"] = None
        for n in hist["nodes"]:
            d.node_notices.append(NodeNotice(ts=e.ts, node=n, kind="released", job=e.job, attempt=e.attempt))
        return d
    # failed
    moving = next((w for w in waiting if w["attempt"] == e.attempt and w.get("moving")), None)
    if e.attempt in hist["decided"] or (moving is None and any(w["attempt"] == e.attempt for w in waiting)):
        return d  # a duplicate of a failure already judged or being judged
    nodes = list(e.nodes or hist["nodes"])
    failure = failure_record(e, nodes)
    hist["failures"] = (hist["failures"] + [failure])[-MAX_KEPT:]
    if e.attempt == hist["attempt"]:
        hist["status"] = "failed"
    # wait for node evidence up to the end of the grace, in event time: judged once the
    # telemetry watermark passes it, or after correlation_wait_max_s of wall time at most,
    # even when evidence is here already (a second node's may still be on its way).
    # Failures of later attempts wait behind it (a fast replay or a quick restart can
    # bring them before it is judged) and are judged in order.  A job about to be moved
    # off a faulty node that fails first is judged as a failure, no later than the move.
    if moving is not None:
        waiting.remove(moving)
    deadline = e.ts + cfg.correlation_grace_s
    waiting.append({"attempt": e.attempt, "ts": e.ts,
                    "deadline_ts": min(deadline, moving["deadline_ts"]) if moving else deadline,
                    "deadline_wall": wall_now + cfg.correlation_wait_max_s})
    waiting.sort(key=lambda w: w["attempt"])
    return _next_tick(d, hist)


def _move_off_faulty_nodes(hist: JobHistory, w: dict[str, Any], cfg: PolicySettings) -> Decision:
    """A running job whose node took a hard fault, once the grace for faults on its other
    nodes has passed: requeued without every node at fault, from its last checkpoint,
    before it fails (the node is being drained under it).  Stamped with the grace's end."""
    attempt = w["attempt"]
    # the nodes it ran on when the fault came: a drain of the faulty node may have had one
    # of its pods replaced elsewhere since, but a gang still restarts as a whole
    nodes = sorted(set(hist["nodes"]) | set(w.get("nodes") or []))
    faults = {n: f for n, f in _recent_node_faults(hist, nodes, w["ts"], cfg.degrade_window_s,
                                                   until=w["deadline_ts"]).items() if f["kind"] == "node_fault"}
    _settle(hist, attempt)
    if not faults or attempt != hist["attempt"] or hist["status"] != "running":
        return Decision()  # it moved, ended or failed meanwhile: nothing to move
    first = min(faults.values(), key=lambda f: f["ts"])
    v = _job_verdict(
        hist, w["deadline_ts"], first["incident"], FaultClass(first["fault_class"]), ActionName.requeue, 0.9,
        {"node_faults": faults, "reason": "a node it runs on took a hard fault: moved before it fails",
         "checkpoint": hist["checkpoint"]},
        {"exclude": sorted(faults), "from_checkpoint": True},
    )
    hist["pending"] = None  # a move at the next checkpoint is overtaken
    hist["status"] = "requeued"
    return Decision(verdicts=[v])


def _migrate(hist: JobHistory, ts: float, pend: dict[str, Any], *, reason: str) -> Decision:
    """Move the job off its degrading node, from its last checkpoint, and tell the node's
    owner that the job is leaving (it drains the node then)."""
    v = _job_verdict(
        hist, ts, pend["incident"], FaultClass(pend["fault_class"]), ActionName.requeue, 0.8,
        {"node": pend["node"], "reason": reason, "checkpoint": hist["checkpoint"]},
        {"exclude": [pend["node"]], "from_checkpoint": True},
    )
    hist["pending"] = None
    moved = NodeNotice(ts=ts, node=pend["node"], kind="job_moved", job=hist["job"], attempt=pend["attempt"],
                       reason=reason, signature=pend["incident"])
    return Decision(verdicts=[v], node_notices=[moved])


def _ask_checkpoint(hist: JobHistory, n: JobNotice, pend: dict[str, Any]) -> Verdict:
    """Checkpoint-now: ask the job to save its state before its degrading node is taken
    (``docs/checkpoint-now.md``); the answer is its next ``checkpoint`` record."""
    return _job_verdict(
        hist, n.ts, n.incident, n.fault_class, ActionName.checkpoint, 0.8,
        {"node": n.node, "reason": "a node it runs on is degrading: asked to save its state now",
         "anomalies": n.anomalies[:10], "checkpoint": hist["checkpoint"]},
        {"deadline": pend["deadline_ts"], "node": n.node},
    )


def job_on_notice(hist: JobHistory, n: JobNotice, cfg: PolicySettings, wall_now: float) -> Decision:
    """A node's owner reports a fault or degradation on a node of this job, or a tick."""
    if n.kind == "tick":
        return job_on_tick(hist, cfg, wall_now, n.ts)
    if n.kind == "xid":
        # the driver's word on a node of this job (an Xid it contained to the application, or
        # one that is the application's): kept for judging this job's failure, not a fault
        hist["node_xids"] = {**(hist.get("node_xids") or {}), n.node: {
            "ts": n.ts, "xid": n.evidence.get("xid"), "action": n.evidence.get("action"), "gpu": n.evidence.get("gpu"),
            "fault_class": n.fault_class.value, "incident": n.incident}}
        return Decision()
    hist["node_faults"][n.node] = {
        "kind": n.kind, "fault_class": n.fault_class.value, "incident": n.incident, "ts": n.ts,
    }
    pend = hist["pending"]
    if n.kind == "fabric":
        return Decision()  # evidence for a failure, judged when its grace ends
    waiting = _waiting(hist)
    if n.kind == "node_fault":
        # Evidence for a failure waiting, judged when its grace ends (another node's may be
        # on its way).  A job still running on the node is moved off it before it fails:
        # it waits the same grace for faults of its other nodes, then is requeued without
        # them all, from its last checkpoint.
        attempt = hist["attempt"]
        if (hist["status"] == "running" and n.node in hist["nodes"] and attempt not in hist["decided"]
                and not any(w["attempt"] == attempt for w in waiting)):
            waiting.append({"attempt": attempt, "ts": n.ts, "deadline_ts": n.ts + cfg.correlation_grace_s,
                            "deadline_wall": wall_now + cfg.correlation_wait_max_s, "moving": True,
                            "nodes": list(hist["nodes"])})
            waiting.sort(key=lambda w: w["attempt"])
            return _next_tick(Decision(), hist)
        return Decision()
    # node_degrading: move the job off the node at its next checkpoint, asked for now
    # (checkpoint_now), or at the deadline from the last one
    if hist["status"] == "running" and n.node in hist["nodes"] and not pend:
        pend = hist["pending"] = {
            "kind": "migrate", "attempt": hist["attempt"], "node": n.node, "incident": n.incident,
            "fault_class": n.fault_class.value, "deadline_ts": n.ts + cfg.checkpoint_deadline_s,
            "deadline_wall": wall_now + cfg.checkpoint_deadline_s, "asked_ts": n.ts,
        }
        d = Decision(verdicts=[_ask_checkpoint(hist, n, pend)] if cfg.checkpoint_now else [])
        ck = hist["checkpoint"]
        if ck and ck.get("ts") is not None and ck["ts"] >= n.ts:
            # it saved after the node degraded (in event time), and its record came here
            # first (the notice travels through the node's owner): it moves now, as it
            # would have had the two come in event-time order
            got = _migrate(hist, ck["ts"], pend, reason="checkpoint reached")
            d.verdicts += got.verdicts
            d.node_notices += got.node_notices
        return _next_tick(d, hist)
    if hist["status"] != "running" or n.node not in hist["nodes"]:
        # not running there (it ended, failed or moved meanwhile): the node need not wait
        # for it before it is drained
        return Decision(node_notices=[NodeNotice(ts=n.ts, node=n.node, kind="job_moved", job=hist["job"],
                                                 attempt=hist["attempt"], reason="not running on it",
                                                 signature=n.incident)])
    return Decision()


def job_on_tick(hist: JobHistory, cfg: PolicySettings, wall_now: float, ts: float) -> Decision:
    """Time passed for the job: ``ts`` is the telemetry watermark (event time every
    telemetry partition has reached), ``wall_now`` the wall clock.  A failure waiting for
    node evidence is judged when the watermark has passed the end of its grace, or when
    it has waited its longest in wall time; its verdicts are stamped with the grace's end
    (event time), so a replay at any speed stamps them alike."""
    d = Decision()
    waiting = _waiting(hist)
    while waiting:
        w = waiting[0]
        if ts < w["deadline_ts"] and wall_now < w["deadline_wall"]:
            break
        failure = _failure_of(hist, w["attempt"])
        if w.get("moving"):
            got = _move_off_faulty_nodes(hist, w, cfg)
            d.verdicts += got.verdicts
        elif failure is None:  # forgotten (beyond MAX_KEPT): nothing to judge
            _settle(hist, w["attempt"])
        else:
            faults = _recent_node_faults(hist, failure["nodes"], w["ts"], cfg.degrade_window_s, until=w["deadline_ts"])
            got = (_decide_hardware(hist, w["ts"], faults, failure) if faults
                   else _decide_without_node_evidence(hist, w["deadline_ts"], cfg, failure))
            d.verdicts += got.verdicts
            d.node_notices += got.node_notices
        waiting = _waiting(hist)
    pend = hist["pending"]
    if (pend and pend.get("kind") == "migrate" and pend.get("deadline_wall") is not None
            and (ts >= pend["deadline_ts"] or wall_now >= pend["deadline_wall"])):
        if pend["attempt"] == hist["attempt"] and hist["status"] == "running":
            # stamped with the deadline, whichever clock woke it (a replay stamps it alike)
            got = _migrate(hist, pend["deadline_ts"], pend,
                           reason="no checkpoint by the deadline: moved from its last checkpoint")
            d.verdicts += got.verdicts
            d.node_notices += got.node_notices
        else:
            hist["pending"] = None  # it ended, failed or moved meanwhile
    return _next_tick(d, hist)


# ---------------------------------------------------------------------------- switch track


def switch_on_notice(st: SwitchState, n: SwitchNotice, net: NetworkSettings) -> Decision:
    """Port anomalies under one switch: the switch's fault or one node's?

    Several nodes (``switch_min_nodes``) with port anomalies within ``window_s`` blame the
    switch: one ``fabric_switch`` verdict that escalates the switch, and every affected
    node is told (so that its job is not blamed and the node is not isolated).  A node
    alone for ``hold_s`` is the node's own fault: its owner is told ``network_fault``, on
    the ``tick`` that ends its hold (sent once the fabric's watermark has passed it).
    """
    d = Decision()
    now = max(n.ts, st.get("last", 0.0))
    st["last"] = now
    nodes: dict[str, Any] = st["nodes"]
    for node in [x for x, e in nodes.items() if e["last"] < now - net.window_s]:
        del nodes[node]
    if st["incident"] and not nodes:
        st["incident"] = None  # the switch has been quiet for a window: a new fault is a new incident
    if n.kind == "port_anomaly":
        e = nodes.setdefault(n.node, {"first": n.ts, "last": n.ts, "ports": [], "anomalies": [], "kinds": []})
        e["last"] = max(e["last"], n.ts)
        if n.port and n.port not in e["ports"]:
            e["ports"] = (e["ports"] + [n.port])[-8:]
        if n.anomaly:
            e["anomalies"] = (e["anomalies"] + [n.anomaly])[-8:]
        if n.anomaly_kind and n.anomaly_kind not in e["kinds"]:
            e["kinds"].append(n.anomaly_kind)
        if st["incident"]:
            if n.node not in st["pending"] and not e.get("told"):
                e["told"] = True
                d.node_notices.append(_fabric_notice(st, n.node, n.ts))
            return d
        if len(nodes) >= net.switch_min_nodes:
            return _blame_switch(st, now, net)
        if n.node not in st["pending"] and not e.get("decided"):
            st["pending"][n.node] = n.ts + net.hold_s
        return d
    # a tick: decide held nodes whose hold ran out with the switch still below the bar.
    # Only a tick does: it follows the fabric's watermark, so every neighbour's anomaly up
    # to its time has arrived; a notice's time is one node's, and the node track's
    # partitions run apart (a notice from a node far ahead would end the holds while the
    # anomalies of nodes behind it are still on their way)
    for node, due in sorted(st["pending"].items()):
        if due <= n.ts and node in nodes:
            del st["pending"][node]
            e = nodes[node]
            e["decided"] = True
            d.node_notices.append(NodeNotice(
                ts=n.ts, node=node, kind="network_fault", job=",".join(e["kinds"]) or "port_anomaly",
                reason=f"port anomalies on {', '.join(e['ports']) or 'ports'} of {node} only, under switch "
                       f"{st['switch']} ({len(nodes)} of {net.switch_min_nodes} nodes needed to blame it)",
                signature=e["anomalies"][0] if e["anomalies"] else None,
            ))
        elif node not in nodes:
            del st["pending"][node]
    return d


def switch_due(st: SwitchState) -> float | None:
    """Event time at which the switch track wants a ``tick`` (the earliest hold to end)."""
    pending = st.get("pending") or {}
    return min(pending.values()) if pending else None


def _fabric_notice(st: SwitchState, node: str, ts: float) -> NodeNotice:
    return NodeNotice(ts=ts, node=node, kind="fabric_switch", job="-", reason=st["switch"], signature=st["incident"])


def _blame_switch(st: SwitchState, ts: float, net: NetworkSettings) -> Decision:
    nodes = st["nodes"]
    incident = st["incident"] = stable_id("switch", st["switch"], min(e["first"] for e in nodes.values()))
    st["since"] = ts
    st["pending"] = {}
    affected = sorted(nodes)
    for e in nodes.values():
        e["told"] = True
    v = _verdict(
        ts=ts, incident=incident, scope="switch", subject=st["switch"], fault_class=FaultClass.fabric_switch,
        confidence=min(0.99, 0.6 + 0.1 * len(affected)),
        actions=[(ActionName.escalate, st["switch"], {"reason": "degrading switch", "nodes": affected,
                                                      "alert_only": True})],
        evidence={"nodes": {n: {"ports": e["ports"], "kinds": e["kinds"], "first": e["first"]}
                            for n, e in nodes.items()},
                  "min_nodes": net.switch_min_nodes, "window_s": net.window_s},
        nodes=affected,
    )
    return Decision(verdicts=[v], node_notices=[_fabric_notice(st, n, ts) for n in affected])
