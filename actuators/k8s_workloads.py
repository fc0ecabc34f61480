"""What fleetmedic knows of the workloads that own pods on Kubernetes: plain data, no I/O.

A training job's pods are owned by a controller (the batch Job controller, the Kubeflow
training operator), whose object may in turn be admitted by Kueue.  Requeueing the job
means telling that controller, in its own terms, never deleting behind its back:

* a **batch Job** replaces the pods that are deleted (its own restart); the excluded
  nodes are kept off by the isolate action's taint;
* a **PyTorchJob** (``kubeflow.org/v1``) is suspended (``spec.runPolicy.suspend``: the
  training operator deletes its pods) with the suspect nodes excluded through a
  node-affinity ``NotIn`` on every replica's template, then resumed: every worker
  restarts together from the last checkpoint;
* a job **admitted by Kueue** (``kueue.x-k8s.io/queue-name``) is evicted through its
  Workload (``spec.active: false``: Kueue suspends the job), gets the same ``NotIn`` on
  its templates while suspended, and is activated again: Kueue admits it anew.

Objects are handled as the API server's JSON (dicts with camelCase keys), read and
patched through the ``CustomObjectsApi``, which serves built-in groups as well.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

#: label naming the Kueue LocalQueue a job is submitted to (set by the user)
KUEUE_QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
#: label Kueue puts on a job's Workload: the job's UID
KUEUE_JOB_UID_LABEL = "kueue.x-k8s.io/job-uid"
#: pod label naming a training-operator job (PyTorchJob, TFJob, ...)
TRAINING_JOB_LABEL = "training.kubeflow.org/job-name"
#: the node label the exclusion matches on (set by the kubelet on every node)
HOSTNAME_LABEL = "kubernetes.io/hostname"


@dataclass(frozen=True, slots=True)
class Kind:
    """A workload kind: where its objects are served and where its pod templates are."""

    group: str
    version: str
    plural: str
    kind: str

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version


JOB = Kind("batch", "v1", "jobs", "Job")
PYTORCH_JOB = Kind("kubeflow.org", "v1", "pytorchjobs", "PyTorchJob")
WORKLOAD = Kind("kueue.x-k8s.io", "v1beta2", "workloads", "Workload")

#: the owners fleetmedic can requeue, by (API group, kind)
KNOWN: dict[tuple[str, str], Kind] = {(k.group, k.kind): k for k in (JOB, PYTORCH_JOB)}


def group_of(api_version: str) -> str:
    """``batch/v1`` -> ``batch``; ``v1`` (the core group) -> ``""``."""
    return api_version.split("/", 1)[0] if "/" in api_version else ""


def controller_of(obj: dict[str, Any]) -> dict[str, Any] | None:
    """The ownerReference with ``controller: true`` (the object's managing controller)."""
    for ref in (obj.get("metadata") or {}).get("ownerReferences") or []:
        if ref.get("controller"):
            return dict(ref)
    return None


def meta(obj: dict[str, Any]) -> dict[str, Any]:
    m = obj.get("metadata")
    return m if isinstance(m, dict) else {}


def kueue_managed(obj: dict[str, Any]) -> bool:
    """Whether Kueue admits this job (it names a LocalQueue)."""
    return bool((meta(obj).get("labels") or {}).get(KUEUE_QUEUE_LABEL))


def template_paths(kind: Kind, obj: dict[str, Any]) -> list[tuple[str, ...]]:
    """Paths (from the object's root) of the pod templates its controller creates pods from."""
    if kind == JOB:
        return [("spec", "template")]
    if kind == PYTORCH_JOB:
        specs = (obj.get("spec") or {}).get("pytorchReplicaSpecs") or {}
        return [("spec", "pytorchReplicaSpecs", name, "template") for name in sorted(specs)]
    raise ValueError(f"no pod templates known for {kind.kind}")


def get_path(obj: dict[str, Any], path: tuple[str, ...]) -> Any:
    cur: Any = obj
    for p in path:
        if not isinstance(cur, dict):
            return None
        cur = cur.get(p)
    return cur


def suspended(kind: Kind, obj: dict[str, Any]) -> bool:
    spec = obj.get("spec") or {}
    if kind == JOB:
        return bool(spec.get("suspend"))
    if kind == PYTORCH_JOB:
        return bool((spec.get("runPolicy") or {}).get("suspend"))
    raise ValueError(f"{kind.kind} cannot be suspended")


def suspend_patch(kind: Kind, value: bool) -> dict[str, Any]:
    """A JSON merge patch that sets the kind's suspend field."""
    if kind == JOB:
        return {"spec": {"suspend": value}}
    if kind == PYTORCH_JOB:
        return {"spec": {"runPolicy": {"suspend": value}}}
    raise ValueError(f"{kind.kind} cannot be suspended")


def finished(obj: dict[str, Any]) -> str | None:
    """``Complete``/``Succeeded`` or ``Failed`` when the job's condition says it ended."""
    for c in (obj.get("status") or {}).get("conditions") or []:
        if c.get("status") == "True" and c.get("type") in ("Complete", "Succeeded", "Failed"):
            return str(c["type"])
    return None


def restart_policies(kind: Kind, obj: dict[str, Any]) -> dict[str, str]:
    """Replica type -> restartPolicy (a PyTorchJob's; a batch Job's pod template's)."""
    if kind == PYTORCH_JOB:
        specs = (obj.get("spec") or {}).get("pytorchReplicaSpecs") or {}
        return {name: str((s or {}).get("restartPolicy") or "Never") for name, s in sorted(specs.items())}
    policy = get_path(obj, ("spec", "template", "spec", "restartPolicy"))
    return {"Job": str(policy or "Never")}


def excluded_by(affinity: dict[str, Any] | None) -> set[str]:
    """Nodes a pod template's required node affinity already keeps it off: those that
    every term excludes by ``kubernetes.io/hostname NotIn``."""
    terms = (((affinity or {}).get("nodeAffinity") or {})
             .get("requiredDuringSchedulingIgnoredDuringExecution") or {}).get("nodeSelectorTerms") or []
    if not terms:
        return set()
    per_term = []
    for t in terms:
        out: set[str] = set()
        for e in t.get("matchExpressions") or []:
            if e.get("key") == HOSTNAME_LABEL and e.get("operator") == "NotIn":
                out |= set(e.get("values") or [])
        per_term.append(out)
    return set.intersection(*per_term)


def exclude_nodes(affinity: dict[str, Any] | None, nodes: list[str]) -> dict[str, Any]:
    """``affinity`` that also keeps pods off ``nodes``: a ``kubernetes.io/hostname NotIn``
    expression in every required node-selector term (terms are ORed, so each needs it),
    merged into an existing ``NotIn`` on that key.  Everything else is kept as it was."""
    out = copy.deepcopy(affinity) if affinity else {}
    node_aff = out.setdefault("nodeAffinity", {})
    required = node_aff.setdefault("requiredDuringSchedulingIgnoredDuringExecution", {})
    terms = required.get("nodeSelectorTerms") or [{}]
    for term in terms:
        exprs = term.setdefault("matchExpressions", [])
        mine = next((e for e in exprs if e.get("key") == HOSTNAME_LABEL and e.get("operator") == "NotIn"), None)
        if mine is None:
            exprs.append({"key": HOSTNAME_LABEL, "operator": "NotIn", "values": sorted(set(nodes))})
        else:
            mine["values"] = sorted(set(mine.get("values") or []) | set(nodes))
    required["nodeSelectorTerms"] = terms
    return out


def exclusion_patch(kind: Kind, obj: dict[str, Any], nodes: list[str]) -> dict[str, Any] | None:
    """A JSON merge patch adding the exclusion of ``nodes`` to every pod template of
    ``obj``; None when every template excludes them already."""
    patch: dict[str, Any] = {}
    for path in template_paths(kind, obj):
        affinity = get_path(obj, (*path, "spec", "affinity"))
        if set(nodes) <= excluded_by(affinity):
            continue
        cur = patch
        for p in path:
            cur = cur.setdefault(p, {})
        cur.setdefault("spec", {})["affinity"] = exclude_nodes(affinity, nodes)
    return patch or None


def requeue_mark(obj: dict[str, Any], annotation: str) -> tuple[str, str]:
    """(verdict id, phase) of the requeue recorded on the object, or ("", "")."""
    raw = str((meta(obj).get("annotations") or {}).get(annotation) or "")
    verdict, _, phase = raw.rpartition(":")
    return (verdict, phase) if verdict else ("", "")
