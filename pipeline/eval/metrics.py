"""Scoring verdicts against the simulator's ground truth, per fault class.

The right verdict for an injected fault (its class from
:data:`pipeline.sim.cluster.KIND_CLASS`, its target from the fault):

* a node fault (``gpu_hardware``, ``gpu_memory``, ``nvlink``, ``node_network``,
  ``node_degrading``): the first node verdict that isolates the faulty node after the
  onset; right when its class is the fault's class;
* a switch fault (``fabric_switch``): a switch verdict on the faulty leaf while the fault
  lasts (plus ``slack_s``); no node under it isolated;
* a job fault (``transient_software``, ``user_error``): the job's last verdict about that
  failure (the settled decision: a user bug is retried within its retry budget first,
  then stopped), within ``slack_s`` of the onset.  A job fault that strikes while a real
  node or switch fault is live on the job's nodes is *confounded*: a verdict that blames
  that real fault (a hardware class, and a node it names has a node fault; or the switch
  class, and the switch above a node it names has a fault) is right too, since
  requeueing off the faulty part is what an operator would do; so is a ``user_error``
  verdict on a crash of a job whose earlier user bug was not stopped yet (a user bug's
  own window ends only at the next user bug of its job).  Such cases are listed under
  ``confounded``.  Any hardware class is accepted there: the node's own isolation
  is scored against its own class.  A crash whose output names no cause is answered
  ``unknown`` and run again (``pipeline.correlate.triage``): right for a transient fault, listed
  under ``weak_evidence``.

Precision of a class counts, among the verdicts of that class (the isolating node
verdicts, the switch verdicts, the jobs' settled verdicts), those that match a fault of
that class on that target.  ``hw_*`` counts isolations alone, whatever their class:
recall is the share of node faults whose node was isolated after the onset, precision
the share of isolated nodes that had a node fault.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import numpy as np

from schemas import HARDWARE_CLASSES, FaultClass

from pipeline.sim.cluster import HARDWARE_KINDS, KIND_CLASS, SWITCH_KINDS, Cluster, Fault

#: the classes that blame a node (schemas.HARDWARE_CLASSES), in the order of the report
NODE_CLASSES = tuple(c.value for c in FaultClass if c in HARDWARE_CLASSES)
JOB_CLASSES = ("transient_software", "user_error")
CLASSES = (*JOB_CLASSES, *NODE_CLASSES, "fabric_switch")


def _pct(xs: list[float], q: float) -> float | None:
    return float(np.percentile(xs, q)) if xs else None


def _prf(tp: int, fp: int, n: int) -> dict[str, float | None]:
    p = tp / (tp + fp) if tp + fp else None
    r = tp / n if n else None
    f1 = 2 * p * r / (p + r) if p and r else (0.0 if p is not None and r is not None else None)
    return {"precision": p, "recall": r, "f1": f1}


def _isolates(v: dict[str, Any]) -> bool:
    return v.get("scope") == "node" and any(a.get("action") == "isolate" for a in v.get("actions", []))


def score(cluster: Cluster, verdicts: list[dict[str, Any]], actions: list[dict[str, Any]], *,
          slack_s: float = 900.0) -> dict[str, Any]:
    """Per-class quality, delays, lead times and the safety counts of one run (sim seconds)."""
    t0 = cluster.t0
    faults: list[Fault] = [f for f in cluster.faults if f.applied_ts is not None]
    # copies with their sim time: the caller's verdicts stay as they were recorded
    vs = sorted(({**v, "_t": v["ts"] - t0} for v in verdicts), key=lambda v: v["ts"])
    node_faults = {f.node: f for f in faults if f.kind in HARDWARE_KINDS and f.node}
    isolated: dict[str, float] = {}  # node -> sim time it was really cordoned
    for e in cluster.events:
        if "isolated" in e:
            isolated.setdefault(e["isolated"], e["t"])
    iso_verdicts: dict[str, dict[str, Any]] = {}
    for v in vs:
        if _isolates(v):
            iso_verdicts.setdefault(v["subject"], v)

    matched: set[int] = set()  # id() of verdicts that match a fault of their class
    per_class: dict[str, dict[str, Any]] = {c: {"faults": 0, "tp": 0, "delays": []} for c in CLASSES}
    kinds: dict[str, dict[str, Any]] = defaultdict(lambda: {"faults": 0, "right": 0, "delays": []})
    missed: list[str] = []
    wrong_class: list[str] = []
    confounded: list[str] = []
    weak: list[str] = []

    job_faults = sorted((f for f in faults if KIND_CLASS[f.kind] in JOB_CLASSES and f.job), key=lambda f: f.at)
    next_on_job: dict[int, float] = {}
    for i, f in enumerate(job_faults):
        # a user bug stays in the code until the job is stopped: only another user bug ends its
        # window; a crash's window ends at the next fault of its job
        later = [g.at for g in job_faults[i + 1:] if g.job == f.job and (f.kind != "user_bug" or g.kind == "user_bug")]
        next_on_job[id(f)] = min(later) if later else float("inf")

    for f in faults:
        fc = KIND_CLASS[f.kind]
        pc, kc = per_class[fc], kinds[f.kind]
        pc["faults"] += 1
        kc["faults"] += 1
        hit: dict[str, Any] | None = None
        if fc in NODE_CLASSES:
            v = iso_verdicts.get(f.node or "")
            if v is not None and v["_t"] >= f.at - 1:
                if v["fault_class"] == fc:
                    hit = v
                else:
                    wrong_class.append(f"{f.kind}@{f.node}: {v['fault_class']}")
        elif fc == "fabric_switch":
            end = (f.end_at if f.end_at is not None else f.at) + slack_s
            for v in vs:
                if v.get("scope") == "switch" and v["subject"] == f.leaf and f.at - 1 <= v["_t"] <= end \
                        and v["fault_class"] == fc:
                    hit = v
                    break
        else:
            end = min(f.at + slack_s, next_on_job[id(f)])
            mine = [v for v in vs if v.get("scope") == "job" and v["subject"] == f.job and f.at - 1 <= v["_t"] < end]
            if mine:
                last = mine[-1]
                if last["fault_class"] == fc:
                    hit = last
                elif fc == "transient_software" and last["fault_class"] == "unknown" \
                        and last["actions"][0]["action"] != "stop":
                    # output that names no cause is answered unknown and run again: right for a crash
                    hit = last
                    weak.append(f"{f.kind}@{f.job}: unknown ({last['actions'][0]['action']})")
                elif (real := _explained_by(last, faults, cluster, slack_s)) is not None:
                    hit = last
                    confounded.append(f"{f.kind}@{f.job}: {last['fault_class']} ({real.kind}@{real.node or real.leaf})")
                elif last["fault_class"] == "user_error" and (bug := _live_user_bug(f, job_faults, vs)) is not None:
                    hit = last
                    confounded.append(f"{f.kind}@{f.job}: user_error ({bug.kind}@{bug.job} since {bug.at:.0f} s)")
                else:
                    wrong_class.append(f"{f.kind}@{f.job}: {last['fault_class']} ({last['actions'][0]['action']})")
        if hit is not None:
            matched.add(id(hit))
            pc["tp"] += 1
            kc["right"] += 1
            d = hit["_t"] - f.at
            pc["delays"].append(d)
            kc["delays"].append(d)
        else:
            missed.append(f"{f.kind}@{f.node or f.leaf or f.job}")

    # false positives per class: isolating node verdicts, switch verdicts, settled job verdicts
    fp: dict[str, int] = defaultdict(int)
    for v in iso_verdicts.values():
        if id(v) not in matched and v["fault_class"] in per_class:
            fp[v["fault_class"]] += 1
    for v in vs:
        if v.get("scope") == "switch" and id(v) not in matched and v["fault_class"] == "fabric_switch":
            fp["fabric_switch"] += 1
    settled: dict[str, dict[str, Any]] = {}
    for v in vs:
        if v.get("scope") == "job":
            settled[v["subject"]] = v  # each job's last decision
    for v in settled.values():
        if id(v) not in matched and v["fault_class"] in JOB_CLASSES:
            f_job = [f for f in job_faults if f.job == v["subject"]]
            if not f_job:
                fp[v["fault_class"]] += 1

    classes = {}
    for c, pc in per_class.items():
        q = _prf(pc["tp"], fp[c], pc["faults"])
        classes[c] = {"faults": pc["faults"], "right": pc["tp"], "false_verdicts": fp[c], **q,
                      "median_delay_s": _pct(pc["delays"], 50), "p95_delay_s": _pct(pc["delays"], 95)}
    all_tp = sum(pc["tp"] for pc in per_class.values())
    overall = _prf(all_tp, sum(fp.values()), sum(pc["faults"] for pc in per_class.values()))
    all_delays = [d for pc in per_class.values() for d in pc["delays"]]

    # isolations, whatever their class
    hw = [f for f in faults if f.kind in HARDWARE_KINDS and f.node]
    hw_hit = [f for f in hw if f.node in iso_verdicts and iso_verdicts[f.node]["_t"] >= f.at - 1]
    false_iso = []
    for node, v in iso_verdicts.items():
        if node not in node_faults or v["_t"] < node_faults[node].at - 1:
            false_iso.append({"node": node, "t": round(v["_t"], 1), "fault_class": v["fault_class"],
                              "cause": _cause(v, cluster, faults)})
    hw_precision = (len(iso_verdicts) - len(false_iso)) / len(iso_verdicts) if iso_verdicts else None

    # user errors: stopped after the budget, never blamed on hardware
    user = [f for f in faults if f.kind == "user_bug"]
    user_stopped, user_blamed = 0, []
    for f in user:
        mine = [v for v in vs if v.get("scope") == "job" and v["subject"] == f.job and v["_t"] >= f.at - 1]
        if any(v["actions"][0]["action"] == "stop" for v in mine):
            user_stopped += 1
        end = min(f.at + slack_s, next_on_job[id(f)])
        hwv = [v for v in mine if v["fault_class"] in HARDWARE_CLASSES and v["_t"] < end
               and _explained_by(v, faults, cluster, slack_s) is None]
        # a node isolated because this job's failures were counted against it
        iso_nodes = [n for n, v in iso_verdicts.items() if n not in node_faults
                     and f.job in ((v.get("evidence") or {}).get("failed_jobs") or [])]
        if hwv or iso_nodes:
            user_blamed.append(f"{f.job}: {[v['fault_class'] for v in hwv]} {iso_nodes}")

    # switch faults blamed on the nodes under the switch
    switch_blamed = []
    for f in faults:
        if f.kind in SWITCH_KINDS:
            under = {n.name for n in cluster.nodes.values() if n.leaf == f.leaf}
            end = (f.end_at if f.end_at is not None else f.at) + slack_s
            for n in under:
                v = iso_verdicts.get(n)
                if v is not None and f.at - 1 <= v["_t"] <= end and n not in node_faults \
                        and v["fault_class"] in ("node_network", "unknown"):
                    switch_blamed.append(f"{f.leaf}: {n} ({v['fault_class']})")

    # degrading nodes: isolated before their hardware failed, and how long before
    degrading = [f for f in faults if f.fail_at is not None and f.node]
    before = [f for f in degrading if f.node in isolated and isolated[f.node] < f.fail_at]
    leads = [f.fail_at - isolated[f.node] for f in before]

    transient = [f for f in faults if KIND_CLASS[f.kind] == "transient_software"]
    kept = sum(1 for f in transient if not any(n in iso_verdicts and iso_verdicts[n]["_t"] >= f.at - 1
                                                and n not in node_faults for n in _job_nodes(vs, f.job)))
    return {
        "faults": len(faults),
        "by_class": classes,
        "by_kind": {k: {"faults": v["faults"], "right": v["right"], "median_delay_s": _pct(v["delays"], 50)}
                    for k, v in sorted(kinds.items())},
        "overall": {**overall, "median_delay_s": _pct(all_delays, 50), "p95_delay_s": _pct(all_delays, 95)},
        "hw_recall": len(hw_hit) / len(hw) if hw else None,
        "hw_precision": hw_precision,
        "hardware_faults": len(hw),
        "isolations": len(iso_verdicts),
        "false_isolations": len(false_iso),
        "false_isolation_detail": false_iso,
        "user_errors": len(user),
        "user_errors_stopped": user_stopped,
        "user_errors_blamed_on_hardware": len(user_blamed),
        "user_errors_blamed_detail": user_blamed,
        "switch_faults_blamed_on_nodes": len(switch_blamed),
        "switch_blamed_detail": switch_blamed,
        "transient_faults": len(transient),
        "transient_faults_kept_every_node": kept,
        "degrading_nodes": len(degrading),
        "degrading_isolated_before_failure": len(before) / len(degrading) if degrading else None,
        "lead_s": sorted(round(x, 1) for x in leads),
        "median_lead_s": _pct(leads, 50),
        "delays_s": {c: sorted(round(d, 1) for d in pc["delays"]) for c, pc in per_class.items()},
        "missed": sorted(missed),
        "wrong_class": sorted(wrong_class),
        "confounded": sorted(confounded),
        "weak_evidence": sorted(weak),
        "held_by_budget": sum(1 for a in actions if a.get("outcome") == "held_by_budget"),
        "unknown_verdicts": sum(1 for v in vs if v["fault_class"] == "unknown"),
    }


def _job_nodes(vs: list[dict[str, Any]], job: str | None) -> set[str]:
    out: set[str] = set()
    for v in vs:
        if v.get("scope") == "job" and v["subject"] == job:
            out |= set(v.get("nodes") or [])
    return out


def _blamed_nodes(v: dict[str, Any]) -> list[str]:
    """The nodes a job verdict holds at fault: those it excludes, else those whose notices it cites."""
    acts = v.get("actions") or [{}]
    exclude = list((acts[0].get("params") or {}).get("exclude") or [])
    ev = v.get("evidence") or {}
    return exclude or list(ev.get("node_faults") or {}) or ([ev["node"]] if ev.get("node") else [])


def _explained_by(v: dict[str, Any], faults: list[Fault], cluster: Cluster, slack_s: float) -> Fault | None:
    """The real node or switch fault a job verdict of a hardware or switch class rightly blames."""
    fc = v["fault_class"]
    if fc not in HARDWARE_CLASSES and fc != "fabric_switch":
        return None
    nodes = _blamed_nodes(v)
    leaves = {cluster.nodes[n].leaf for n in nodes if n in cluster.nodes}
    for f in faults:
        if f.at - 1 > v["_t"] or (f.end_at is not None and v["_t"] > f.end_at + slack_s):
            continue
        if fc == "fabric_switch":
            if f.kind in SWITCH_KINDS and f.leaf in leaves:
                return f
        elif f.kind in HARDWARE_KINDS and f.node in nodes:
            return f  # the node was faulty; its own verdict is scored against its own class
    return None


def _live_user_bug(f: Fault, job_faults: list[Fault], vs: list[dict[str, Any]]) -> Fault | None:
    """An earlier user bug of ``f``'s job that no verdict had stopped yet when ``f`` struck."""
    for g in job_faults:
        if g.kind == "user_bug" and g.job == f.job and g.at < f.at and not any(
                v.get("scope") == "job" and v["subject"] == f.job and g.at - 1 <= v["_t"] < f.at
                and v["actions"][0]["action"] == "stop" for v in vs):
            return g
    return None


def _cause(v: dict[str, Any], cluster: Cluster, faults: list[Fault]) -> str:
    """Why a healthy node was isolated, as far as the run can tell."""
    ev = v.get("evidence") or {}
    node = cluster.nodes.get(v["subject"])
    leaf = node.leaf if node is not None else None
    for f in faults:
        if f.kind in SWITCH_KINDS and f.leaf == leaf and f.at - 1 <= v["_t"] <= (f.end_at or f.at) + 900:
            return f"during a fault of its switch {leaf}"
    for f in faults:
        if f.job and node is not None and f.job == node.job:
            return f"on the job of a {f.kind} fault"
    return str(ev.get("kind") or ev.get("kinds") or ev.get("detector") or "no fault nearby")
