"""Kubernetes job watcher: pod and Job changes become ``telemetry.job`` records.

Two watches (pods of batch Jobs, and the Jobs themselves), each a list followed by a
watch that resumes from the last resource version it saw (bookmarks included) after a
disconnect, and lists again only when the server says that version is gone (410).

What is emitted, per workload ``<namespace>/<job name>`` (``scheduler="kubernetes"``):

* ``started`` when the set of nodes its running pods sit on changes, with those nodes;
* ``failed`` once per failed pod (by UID), with the container's exit code, the
  termination reason and message (``log_tail``) and the pod's node; each failure starts
  the next attempt, as the Job controller's replacement pod is a new attempt;
* ``completed`` when the Job's ``Complete`` condition turns true.

Diagnostics pods created by the Kubernetes backend carry the node under test in the
``fleetmedic.dev/node-name`` annotation; their records carry ``diagnostics_for``, and a
diagnostics pod that succeeds is ``completed`` (the node passed) and one that fails is
``failed`` (it did not).

:class:`PodJobTracker` is the pure state machine (no I/O); :class:`WatchLoop` runs one
list+watch in a thread; :class:`KubernetesJobWatcher` ties them to an emitter.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from schemas import JobEvent, JobEventKind

log = logging.getLogger(__name__)

#: pod labels naming the workload that owns a pod: a batch Job (new and legacy spelling),
#: a training-operator job (PyTorchJob and its kin); the job id is ``<namespace>/<name>``
JOB_LABELS = ("batch.kubernetes.io/job-name", "job-name", "training.kubeflow.org/job-name")
#: pod annotation naming the node a diagnostics pod tests
DIAG_NODE_ANNOTATION = "fleetmedic.dev/node-name"
MAX_TEXT = 4000


def _meta(obj: Any) -> Any:
    return getattr(obj, "metadata", None)


def job_of_pod(pod: Any) -> str | None:
    """``<namespace>/<job>`` for a pod owned by a batch Job, else ``None``."""
    meta = _meta(pod)
    labels = (meta.labels if meta is not None else None) or {}
    for key in JOB_LABELS:
        if labels.get(key):
            return f"{meta.namespace}/{labels[key]}"
    return None


def _terminated(pod: Any) -> Any | None:
    """The terminated state of the container that failed (first non-zero exit), if any."""
    statuses = (getattr(pod.status, "container_statuses", None) if pod.status is not None else None) or []
    found = None
    for cs in statuses:
        state = getattr(cs, "state", None)
        term = getattr(state, "terminated", None) if state is not None else None
        if term is None:
            continue
        if found is None or (term.exit_code or 0) != 0 and (found.exit_code or 0) == 0:
            found = term
    return found


def _clamp_exit(code: Any) -> int | None:
    if code is None:
        return None
    try:
        value = int(code)
    except (TypeError, ValueError):
        return None
    # exit statuses beyond a byte (e.g. 137 fits; a runtime's 1000+ codes do not)
    return max(-255, min(255, value))


@dataclass
class _JobState:
    attempt: int = 1
    #: pod uid -> node of its running pods
    running: dict[str, str] = field(default_factory=dict)
    #: pod uids whose failure was reported
    failed: set[str] = field(default_factory=set)
    #: nodes of the last ``started`` record
    started_nodes: tuple[str, ...] = ()
    completed: bool = False
    last_nodes: tuple[str, ...] = ()


class PodJobTracker:
    """Pure: pod and Job objects in, job events out.  Idempotent per object state, so a
    re-list after a lost watch emits only what was missed."""

    def __init__(self, *, clock: Callable[[], float] = time.time) -> None:
        self.clock = clock
        self.jobs: dict[str, _JobState] = {}

    def _state(self, job: str) -> _JobState:
        st = self.jobs.get(job)
        if st is None:
            st = self.jobs[job] = _JobState()
        return st

    def on_pod(self, kind: str, pod: Any) -> list[JobEvent]:
        job = job_of_pod(pod)
        if job is None:
            return []
        meta = pod.metadata
        uid = meta.uid or f"{meta.namespace}/{meta.name}"
        st = self._state(job)
        phase = (pod.status.phase if pod.status is not None else None) or "Pending"
        node = (pod.spec.node_name if pod.spec is not None else None) or ""
        diag = (meta.annotations or {}).get(DIAG_NODE_ANNOTATION)
        now = self.clock()
        base: dict[str, Any] = dict(ts=now, job=job, scheduler="kubernetes", diagnostics_for=diag or None)
        events: list[JobEvent] = []
        if kind == "DELETED" or meta.deletion_timestamp is not None:
            # evicted or requeued: its replacement will report its own start
            st.running.pop(uid, None)
            if kind == "DELETED" or phase not in ("Failed",):
                return events
        if phase == "Running" and node:
            st.running[uid] = node
            nodes = tuple(sorted(set(st.running.values())))
            if nodes != st.started_nodes:
                st.started_nodes = nodes
                st.last_nodes = nodes
                events.append(JobEvent(event=JobEventKind.started, nodes=list(nodes), attempt=st.attempt, **base))
        elif phase == "Failed" and uid not in st.failed:
            st.failed.add(uid)
            st.running.pop(uid, None)
            term = _terminated(pod)
            parts = [p for p in (
                getattr(term, "reason", None), pod.status.reason, pod.status.message,
            ) if p]
            reason = ": ".join(parts) or "pod failed"
            nodes = [node] if node else list(st.last_nodes)
            if nodes and not st.started_nodes:
                # a pod that failed before we saw it run still gets its start (placement history)
                events.append(JobEvent(event=JobEventKind.started, nodes=nodes, attempt=st.attempt, **base))
            events.append(JobEvent(
                event=JobEventKind.failed, nodes=nodes, attempt=st.attempt,
                exit_code=_clamp_exit(getattr(term, "exit_code", None)), reason=reason[:MAX_TEXT],
                log_tail=(getattr(term, "message", None) or None) and term.message[-MAX_TEXT:],
                origin_node=node or None, **base,  # the job's first pod to fail ran there
            ))
            st.attempt += 1
            st.started_nodes = ()
        elif phase == "Succeeded" and diag and uid not in st.failed:
            st.failed.add(uid)  # reported once
            st.running.pop(uid, None)
            events.append(JobEvent(event=JobEventKind.completed, nodes=[node] if node else [],
                                   attempt=st.attempt, **base))
        elif phase in ("Succeeded", "Pending"):
            st.running.pop(uid, None)
        return events

    def on_job(self, kind: str, job: Any) -> list[JobEvent]:
        meta = _meta(job)
        if meta is None:
            return []
        key = f"{meta.namespace}/{meta.name}"
        if kind == "DELETED":
            self.jobs.pop(key, None)
            return []
        if (meta.annotations or {}).get(DIAG_NODE_ANNOTATION):
            return []  # diagnostics outcomes come from their pod
        conditions = (job.status.conditions if job.status is not None else None) or []
        complete = any(c.type == "Complete" and c.status == "True" for c in conditions)
        st = self._state(key)
        if complete and not st.completed:
            st.completed = True
            return [JobEvent(ts=self.clock(), job=key, scheduler="kubernetes", event=JobEventKind.completed,
                             nodes=list(st.last_nodes), attempt=st.attempt)]
        return []


class WatchLoop:
    """List, then watch from the listed resource version; resume after a disconnect.

    ``list_fn`` is a list call of the ``kubernetes`` client (for example
    ``CoreV1Api.list_pod_for_all_namespaces``); ``handle(kind, obj)`` gets ``ADDED`` for
    every listed object and then each watch event.  A watch that ends (server timeout,
    dropped connection) resumes from the last resource version seen; only a 410 Gone
    lists again.  Runs in the calling thread until :meth:`stop`.
    """

    def __init__(self, list_fn: Callable[..., Any], handle: Callable[[str, Any], None], *,
                 timeout_s: int = 300, kwargs: dict[str, Any] | None = None,
                 max_backoff_s: float = 30.0, name: str = "watch") -> None:
        self.list_fn = list_fn
        self.handle = handle
        self.timeout_s = timeout_s
        self.kwargs = kwargs or {}
        self.max_backoff_s = max_backoff_s
        self.name = name
        self.resource_version: str | None = None
        self.lists = 0
        self.resumes = 0
        self.errors = 0
        self._stop = threading.Event()
        self._watch: Any = None

    def stop(self) -> None:
        self._stop.set()
        w = self._watch
        if w is not None:
            w.stop()

    def _relist(self) -> None:
        res = self.list_fn(**self.kwargs)
        self.lists += 1
        for obj in res.items or []:
            self.handle("ADDED", obj)
        self.resource_version = res.metadata.resource_version

    def run(self) -> None:
        import kubernetes.watch
        from kubernetes.client.exceptions import ApiException

        backoff = 0.5
        while not self._stop.is_set():
            try:
                if self.resource_version is None:
                    self._relist()
                else:
                    self.resumes += 1
                w = self._watch = kubernetes.watch.Watch()
                for ev in w.stream(self.list_fn, resource_version=self.resource_version,
                                   timeout_seconds=self.timeout_s, allow_watch_bookmarks=True,
                                   _request_timeout=self.timeout_s + 30, **self.kwargs):
                    kind = ev["type"]
                    if kind != "BOOKMARK":
                        self.handle(kind, ev["object"])
                    rv = w.resource_version
                    if rv:
                        self.resource_version = rv
                    if self._stop.is_set():
                        break
                backoff = 0.5
            except ApiException as exc:
                if exc.status == 410:
                    log.info("%s: resource version %s is gone; listing again", self.name, self.resource_version)
                    self.resource_version = None
                    continue
                self._failed(exc, backoff)
                backoff = min(backoff * 2, self.max_backoff_s)
            except Exception as exc:  # API server away: keep the version, retry with backoff
                self._failed(exc, backoff)
                backoff = min(backoff * 2, self.max_backoff_s)

    def _failed(self, exc: BaseException, delay: float) -> None:
        self.errors += 1
        if not self._stop.is_set():
            log.warning("%s: %s: %s; retrying in %.1fs (resume from %s)",
                        self.name, type(exc).__name__, str(exc)[:200], delay, self.resource_version)
            self._stop.wait(delay)


class KubernetesJobWatcher:
    """Pods and Jobs of one cluster (or one namespace) -> job events through ``emit``."""

    def __init__(self, core: Any, batch: Any, *, namespace: str | None = None,
                 timeout_s: int = 300, clock: Callable[[], float] = time.time) -> None:
        self.tracker = PodJobTracker(clock=clock)
        self._lock = threading.Lock()
        self._out: list[JobEvent] = []
        self._wake: Callable[[], None] = lambda: None
        if namespace:
            pods_fn, jobs_fn = core.list_namespaced_pod, batch.list_namespaced_job
            kw: dict[str, Any] = {"namespace": namespace}
        else:
            pods_fn, jobs_fn = core.list_pod_for_all_namespaces, batch.list_job_for_all_namespaces
            kw = {}
        self.loops = [
            WatchLoop(pods_fn, self._on("pod"), timeout_s=timeout_s, kwargs=kw, name="pods watch"),
            WatchLoop(jobs_fn, self._on("job"), timeout_s=timeout_s, kwargs=kw, name="jobs watch"),
        ]

    def _on(self, what: str) -> Callable[[str, Any], None]:
        fn = self.tracker.on_pod if what == "pod" else self.tracker.on_job

        def handle(kind: str, obj: Any) -> None:
            with self._lock:
                events = fn(kind, obj)
                if events:
                    self._out.extend(events)
            if events:
                self._wake()
        return handle

    def drain(self) -> list[JobEvent]:
        with self._lock:
            out, self._out = self._out, []
        return out

    async def run(self, emit: Callable[[JobEvent], Awaitable[None]], *,
                  stop: asyncio.Event | None = None) -> None:
        """Watch until ``stop`` is set, sending every event through ``emit`` in order."""
        stop = stop or asyncio.Event()
        loop = asyncio.get_running_loop()
        wake = asyncio.Event()
        self._wake = lambda: loop.call_soon_threadsafe(wake.set)
        threads = [threading.Thread(target=w.run, name=w.name, daemon=True) for w in self.loops]
        for t in threads:
            t.start()
        try:
            while not stop.is_set():
                for ev in self.drain():
                    await emit(ev)
                wake.clear()
                if self._out:
                    continue
                stopper = asyncio.ensure_future(stop.wait())
                waker = asyncio.ensure_future(wake.wait())
                await asyncio.wait({stopper, waker}, timeout=1.0, return_when=asyncio.FIRST_COMPLETED)
                stopper.cancel()
                waker.cancel()
            for ev in self.drain():
                await emit(ev)
        finally:
            for w in self.loops:
                w.stop()

    @property
    def stats(self) -> dict[str, int]:
        return {
            "lists": sum(w.lists for w in self.loops),
            "resumes": sum(w.resumes for w in self.loops),
            "errors": sum(w.errors for w in self.loops),
        }


def api_clients(kubeconfig: str | None = None, context: str | None = None, *,
                impersonate: str | None = None) -> tuple[Any, Any]:
    """The watcher's own ``CoreV1Api`` and ``BatchV1Api``: from a kubeconfig file, or inside
    a pod from its service account (neither ``kubeconfig`` nor ``context`` given and
    ``KUBERNETES_SERVICE_HOST`` set).  ``impersonate`` watches as that user, like
    ``kubectl --as``.  The watch streams are long requests, so the client's own retries are
    off: :class:`WatchLoop` resumes them itself."""
    import os

    import kubernetes.client
    import kubernetes.config

    config = kubernetes.client.Configuration()
    if kubeconfig is None and context is None and os.environ.get("KUBERNETES_SERVICE_HOST"):
        kubernetes.config.load_incluster_config(client_configuration=config)
    else:
        kubernetes.config.load_kube_config(config_file=kubeconfig, context=context, client_configuration=config,
                                           persist_config=False)
    api = kubernetes.client.ApiClient(config)
    if impersonate:
        api.set_default_header("Impersonate-User", impersonate)
    return kubernetes.client.CoreV1Api(api), kubernetes.client.BatchV1Api(api)
