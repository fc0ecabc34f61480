"""A watch-fed cache of the cluster's Nodes, as much of each as an isolation compares.

An isolation observes the node before it writes: its taints (the taint list is written
whole, so a foreign taint is kept only if it is known), its cordon, the quarantine
condition and fleetmedic's annotations.  Reading each node from the API server before
each write made a burst of isolations cost a read per node on top of the two writes.
Controllers keep such a cache (client-go's informers); this one is the same idea in the
synchronous client: one list, then one watch from the list's resource version, resumed
from the last version seen (bookmarks included), listed again when the version has
expired (410) or the stream broke.

What a cached node is good for is limited, and :class:`~actuators.kubernetes.KubernetesBackend`
uses it so: the cache may lag the server by the watch's delay, so a write made from it
is conditional on the version it holds (a 409 reads the node from the server and tries
again), and a cached node that shows the work already done is read again from the
server before the action is called done.  Nothing is concluded from the cache alone.

Each node is kept trimmed (name, uid, version, cordon, taints, fleetmedic's annotations
and conditions): about half a kilobyte, 5 MB for 10,000 nodes.  The list and the watch
are read as raw JSON, not as the client's models, which take about a millisecond a node
to build.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable, Collection
from typing import Any

import orjson
from kubernetes.client import V1Node, V1NodeCondition, V1NodeSpec, V1NodeStatus, V1ObjectMeta, V1Taint

log = logging.getLogger(__name__)

Trimmed = dict[str, Any]


def trim(obj: dict[str, Any], *, conditions: Collection[str], annotation_prefix: str) -> Trimmed:
    """What the cache keeps of a Node (the API's JSON)."""
    meta = obj.get("metadata") or {}
    spec = obj.get("spec") or {}
    status = obj.get("status") or {}
    return {
        "name": meta.get("name"),
        "uid": meta.get("uid"),
        "resourceVersion": meta.get("resourceVersion"),
        "annotations": {k: v for k, v in (meta.get("annotations") or {}).items() if k.startswith(annotation_prefix)},
        "unschedulable": bool(spec.get("unschedulable")),
        "taints": list(spec.get("taints") or []),
        "conditions": [c for c in status.get("conditions") or [] if c.get("type") in conditions],
    }


def as_node(t: Trimmed) -> V1Node:
    """A trimmed node as the client's model, with only the fields the cache keeps."""
    taints = [V1Taint(key=x.get("key"), value=x.get("value"), effect=x.get("effect"), time_added=x.get("timeAdded"))
              for x in t["taints"]]
    conditions = [V1NodeCondition(type=c.get("type"), status=c.get("status"), reason=c.get("reason"),
                                  message=c.get("message")) for c in t["conditions"]]
    return V1Node(
        metadata=V1ObjectMeta(name=t["name"], uid=t["uid"], resource_version=t["resourceVersion"],
                              annotations=dict(t["annotations"]) or None),
        spec=V1NodeSpec(unschedulable=t["unschedulable"] or None, taints=taints or None),
        status=V1NodeStatus(conditions=conditions or None),
    )


class NodeCache:
    """Nodes by name, kept current by a list and a watch in a thread of its own.

    ``list_fn`` is ``CoreV1Api.list_node`` (called with ``_preload_content=False``: the
    answer is read as JSON here; bind a label selector to it to keep some nodes only).
    :meth:`apply` is the pure part (an event in, the map changed) and is what the tests
    drive; :meth:`start` runs the list and the watch.  ``on_change(node, listed)``, when
    given, hears every node the list (``listed``) or the watch brings, trimmed, in the
    cache's thread."""

    def __init__(self, list_fn: Callable[..., Any], *, conditions: Collection[str], annotation_prefix: str,
                 timeout_s: int = 300, max_backoff_s: float = 30.0,
                 on_change: Callable[[Trimmed, bool], None] | None = None) -> None:
        self.list_fn = list_fn
        self.on_change = on_change
        self.conditions = frozenset(conditions)
        self.annotation_prefix = annotation_prefix
        self.timeout_s = timeout_s
        self.max_backoff_s = max_backoff_s
        self.nodes: dict[str, Trimmed] = {}
        self.version: str | None = None
        #: set once the first list is in: before it, every lookup misses
        self.synced = threading.Event()
        self.lists = 0
        self.errors = 0
        #: why the cache listed again, the last few times (an expired version, a broken stream)
        self.relisted: deque[str] = deque(maxlen=8)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._resp: Any = None

    # ------------------------------------------------------------------ the map

    def get(self, name: str) -> V1Node | None:
        """The node as last seen, or None (not synced yet, or not known)."""
        if not self.synced.is_set():
            return None
        t = self.nodes.get(name)
        return None if t is None else as_node(t)

    def apply(self, kind: str, obj: dict[str, Any]) -> None:
        """One watch event (``ADDED``, ``MODIFIED``, ``DELETED``, ``BOOKMARK``)."""
        meta = obj.get("metadata") or {}
        if meta.get("resourceVersion"):
            self.version = str(meta["resourceVersion"])
        name = meta.get("name")
        if kind == "BOOKMARK" or not name:
            return
        if kind == "DELETED":
            self.nodes.pop(name, None)
        else:
            t = self.nodes[name] = trim(obj, conditions=self.conditions, annotation_prefix=self.annotation_prefix)
            if self.on_change is not None:
                self.on_change(t, False)

    def replace(self, doc: dict[str, Any]) -> None:
        """A whole list (``NodeList`` JSON): the map becomes what it holds."""
        self.nodes = {t["name"]: t for t in (
            trim(o, conditions=self.conditions, annotation_prefix=self.annotation_prefix)
            for o in doc.get("items") or []) if t["name"]}
        self.version = str((doc.get("metadata") or {}).get("resourceVersion") or "") or None
        self.lists += 1
        self.synced.set()
        if self.on_change is not None:
            for t in self.nodes.values():
                self.on_change(t, True)
        log.info("node cache: %d nodes listed (resource version %s)", len(self.nodes), self.version)

    # ------------------------------------------------------------------ the thread

    def start(self) -> NodeCache:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, daemon=True, name="node-cache")
            self._thread.start()
        return self

    def stop(self, join_s: float = 0.0) -> None:
        """End the watch; wait up to ``join_s`` for its thread."""
        self._stop.set()
        resp = self._resp
        if resp is not None:
            try:
                resp.close()  # ends the blocking read of the watch
            except Exception:  # closing a stream another thread reads may complain; it ends either way
                pass
        if join_s and self._thread is not None:
            self._thread.join(join_s)

    def _list(self) -> None:
        resp = self.list_fn(_preload_content=False, _request_timeout=self.timeout_s)
        self.replace(orjson.loads(resp.data))

    def _watch(self) -> None:
        resp = self._resp = self.list_fn(watch=True, resource_version=self.version, timeout_seconds=self.timeout_s,
                                         allow_watch_bookmarks=True, _preload_content=False,
                                         _request_timeout=self.timeout_s + 30)
        try:
            for line in resp:
                if self._stop.is_set():
                    return
                if not line.strip():
                    continue
                ev = orjson.loads(line)
                kind, obj = ev.get("type"), ev.get("object") or {}
                if kind == "ERROR":
                    if obj.get("code") == 410:  # the version has expired: list again
                        log.info("node cache: resource version %s is gone; listing again", self.version)
                        self.relisted.append(f"410: {str(obj.get('message'))[:200]}")
                        self.version = None
                        return
                    raise RuntimeError(f"watch error {obj.get('code')}: {str(obj.get('message'))[:200]}")
                self.apply(str(kind), obj)
        finally:
            self._resp = None
            resp.release_conn()

    def _run(self) -> None:
        backoff = 0.5
        while not self._stop.is_set():
            try:
                if self.version is None:
                    self._list()
                self._watch()
                backoff = 0.5
            except Exception as exc:  # the API server away: keep what is known, try again later
                if self._stop.is_set():
                    return
                self.errors += 1
                self.relisted.append(f"{type(exc).__name__}: {str(exc)[:200]}")
                log.warning("node cache: %s: %s; listing again in %.1fs", type(exc).__name__, str(exc)[:200], backoff)
                self.version = None
                self._stop.wait(backoff)
                backoff = min(backoff * 2, self.max_backoff_s)
