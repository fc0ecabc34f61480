"""The kube-apiserver's audit log read as the backend's request log.

Against the real API server, the ground truth of a chaos run is what the server itself
recorded: ``deploy/k8s.sh`` starts it with an audit policy that logs every create,
update, patch and delete of nodes, pods, evictions and Jobs with its request body and
answer (``deploy/k8s.sh audit`` prints the file).  :func:`requests_from_audit` turns those
events into the entries that :func:`pipeline.eval.groundtruth.check` and
:func:`~pipeline.eval.groundtruth.blocked_drains` judge, so the simulator's log and the
API server's log are judged by one checker.

What each event becomes (only requests made as ``actor``, fleetmedic's identity, are
entries; everyone's writes are followed to know each node's state and each pod's node):

* a node patch or update that turns ``spec.unschedulable`` on is an ``isolate`` that
  changed the node; one that turns it off is a ``return``; one that carries
  fleetmedic's verdict annotation on a node already cordoned is an ``isolate`` that
  changed nothing.  The node's state is followed through the log from every writer (a
  person's uncordon counts), starting schedulable.
* an eviction (``pods/eviction`` create) is a ``drain`` of the pod's node, the node taken
  from the pod's create or binding in the same log.  Granted (201) is ``status`` 200, and
  changes the node only for the first pod evicted since the node was last cordoned (one
  drain evicts every pod; the checker counts drains, not pods); refused by a disruption
  budget (429) is ``status`` 429; a pod already gone (404) is ``status`` 200 with no
  change.
* a Job created in the diagnostics namespace, labelled with its node, is a
  ``diagnose`` of that node (a second one for the same incident is a duplicate).

Job moves on Kubernetes are pod deletions that a workload's controller answers by making
new pods; they are not read here (the simulator's log covers the job rules).  The reader
is pure: events in, entries out; a line that is not JSON is counted, not fatal.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from actuators.kubernetes import ANNOTATION_VERDICT

#: fleetmedic's identity on the API server (the ClusterRole of deploy/helm/fleetmedic)
FLEETMEDIC_SERVICE_ACCOUNT = "system:serviceaccount:fleetmedic:fleetmedic"
#: the annotation naming the node a diagnostics Job runs on
NODE_ANNOTATION = "fleetmedic.dev/node-name"


@dataclass
class AuditLog:
    """The events of one audit log file (and its rotated backups), oldest first."""

    events: list[dict[str, Any]] = field(default_factory=list)
    bad_lines: int = 0

    @classmethod
    def read(cls, path: str | Path, *, since: float | None = None) -> AuditLog:
        """Every completed event in ``path`` (and ``path``'s rotated backups, which the
        API server names ``<stem>-<time><suffix>``), ordered by completion time; with
        ``since``, only those received at or after that wall time."""
        p = Path(path)
        files = sorted(p.parent.glob(f"{p.stem}-*{p.suffix}")) + ([p] if p.exists() else [])
        if not files:
            raise FileNotFoundError(f"no audit log at {p} (is the API server started by deploy/k8s.sh?)")
        log = cls()
        for f in files:
            with f.open("rb") as fh:
                for line in fh:
                    if not line.strip():
                        continue
                    try:
                        event = json.loads(line)
                    except ValueError:
                        log.bad_lines += 1
                        continue
                    if not isinstance(event, dict) or event.get("stage") != "ResponseComplete":
                        continue
                    if since is not None and wall_of(event, "requestReceivedTimestamp") < since:
                        continue
                    log.events.append(event)
        log.events.sort(key=lambda e: wall_of(e, "stageTimestamp"))
        return log


def wall_of(event: dict[str, Any], field_name: str) -> float:
    """An audit timestamp (RFC 3339 with microseconds) as seconds since the epoch."""
    raw = str(event.get(field_name) or "")
    try:
        return datetime.fromisoformat(raw.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return 0.0


def _actor(event: dict[str, Any]) -> str:
    """Who the request acted as: the impersonated user where there is one."""
    who = event.get("impersonatedUser") or event.get("user") or {}
    return str(who.get("username") or "")


def requests_from_audit(events: Iterable[dict[str, Any]], *,
                        actor: str = FLEETMEDIC_SERVICE_ACCOUNT) -> list[dict[str, Any]]:
    """The backend-log entries (``t``, ``wall``, ``key``, ``action``, ``target``,
    ``changed``, ``before``, ``status``) of ``actor``'s effects in ``events``; ``t`` is
    the wall time the request was received."""
    return list(_entries(events, actor))


def _entries(events: Iterable[dict[str, Any]], actor: str) -> Iterator[dict[str, Any]]:
    cordoned: dict[str, bool] = {}
    pod_node: dict[tuple[str, str], str] = {}
    drained: set[str] = set()  # nodes with a pod evicted since their last cordon
    for e in events:
        ref = e.get("objectRef") or {}
        resource, sub = ref.get("resource"), ref.get("subresource")
        verb, code = e.get("verb"), int((e.get("responseStatus") or {}).get("code") or 0)
        ok = 200 <= code < 300
        ns, name = str(ref.get("namespace") or ""), str(ref.get("name") or "")
        body = e.get("requestObject") if isinstance(e.get("requestObject"), dict) else {}
        meta = body.get("metadata") if isinstance(body.get("metadata"), dict) else {}
        ours = _actor(e) == actor
        wall = wall_of(e, "requestReceivedTimestamp")
        base = {"t": wall, "wall": wall, "status": code}

        if resource == "nodes" and not sub:
            if verb == "delete" and ok:
                cordoned.pop(name, None)
                drained.discard(name)
                continue
            if verb not in ("patch", "update", "create"):
                continue
            spec = body.get("spec") if isinstance(body.get("spec"), dict) else {}
            before = cordoned.get(name, False)
            after = before
            if ok and "unschedulable" in spec:
                after = bool(spec["unschedulable"])
            elif ok and verb in ("update", "create"):
                after = bool(spec.get("unschedulable"))  # a whole object: absent is schedulable
            cordoned[name] = after
            if after and not before:
                drained.discard(name)
            if not ours or verb == "create":
                continue
            key = (meta.get("annotations") or {}).get(ANNOTATION_VERDICT)
            if after and not before:
                yield {**base, "key": key, "action": "isolate", "target": name, "changed": True,
                       "before": {"cordoned": False}}
            elif before and not after:
                yield {**base, "key": key, "action": "return", "target": name, "changed": True,
                       "before": {"cordoned": True}}
            elif key:
                yield {**base, "key": key, "action": "isolate", "target": name, "changed": False,
                       "before": {"cordoned": before}}

        elif resource == "pods" and sub == "eviction" and verb == "create":
            if ours:
                yield from _eviction(base, ns, name, code, pod_node, drained)

        elif resource == "pods" and verb == "create" and ok:
            if sub == "binding":
                target = (body.get("target") or {}).get("name")
                if target:
                    pod_node[(ns, name or str(meta.get("name") or ""))] = str(target)
            elif not sub:
                resp = e.get("responseObject") if isinstance(e.get("responseObject"), dict) else {}
                pod = str(name or meta.get("name") or (resp.get("metadata") or {}).get("name") or "")
                node = (body.get("spec") or {}).get("nodeName")
                if pod and node:
                    pod_node[(ns, pod)] = str(node)

        elif resource == "jobs" and verb == "create" and ours:
            ann = meta.get("annotations") or {}
            node = ann.get(NODE_ANNOTATION)
            if node:
                yield {**base, "key": ann.get(ANNOTATION_VERDICT), "action": "diagnose", "target": str(node),
                       "changed": ok, "before": {}}


def _eviction(base: dict[str, Any], ns: str, pod: str, code: int, pod_node: dict[tuple[str, str], str],
              drained: set[str]) -> Iterator[dict[str, Any]]:
    node = pod_node.get((ns, pod))
    if node is None:
        return  # a pod whose placement the log does not show: not one this run placed
    if code == 429:
        yield {**base, "key": f"{ns}/{pod}", "action": "drain", "target": node, "changed": False,
               "status": 429, "before": {}}
    elif 200 <= code < 300 or code == 404:
        first = 200 <= code < 300 and node not in drained
        if first:
            drained.add(node)
        yield {**base, "key": f"{ns}/{pod}", "action": "drain", "target": node, "changed": first,
               "status": 200, "before": {}}
