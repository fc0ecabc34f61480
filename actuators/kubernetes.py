"""Carry verdicts out on Kubernetes with the official ``kubernetes`` client.

Every operation is one reconcile pass: observe the live objects, compare them with what
the action wants, act only on the difference, report ``applied`` or ``already_so``.  A
replayed verdict therefore changes nothing twice.

Node actions
    ``isolate``  cordon + taint ``<taint_key>=<fault class>:NoSchedule`` + condition
                 ``FleetmedicQuarantine=True`` + an Event.
    ``drain``    evict every pod that is not a DaemonSet pod, a mirror pod, finished or
                 already terminating (eviction honours PodDisruptionBudgets).
    ``diagnose`` get-or-create a batch Job that runs the DCGM diagnostics on the node.
    ``return``   remove our taint, uncordon when we cordoned, condition ``False``.
    ``escalate`` annotate the node and emit a Warning Event for a human.

Job actions (target ``"<namespace>/<name>"`` or ``"<name>"`` in the job namespace).  The
workload is found by walking its pods' controller ownerReferences to the top owner
(:mod:`actuators.k8s_workloads`); each kind is requeued in its controller's own terms:
    ``requeue``  a batch Job: delete its failed pods and its pods on excluded nodes, so
                 that the Job controller recreates them elsewhere.  A PyTorchJob: exclude
                 the nodes by node affinity on every replica template, suspend it (the
                 training operator stops its pods), resume it.  A job admitted by Kueue:
                 deactivate its Workload (Kueue suspends the job), exclude the nodes on its
                 templates, activate it again (Kueue admits it anew).  Any other owner kind:
                 ``failed``, with the kind named, and nothing changed.
    ``retry`` / ``restart``  the same without excluding nodes (a batch Job: its failed
                 pods deleted, same placement allowed).
    ``stop``     suspend the batch Job or PyTorchJob; deactivate a Kueue Workload.
    ``checkpoint``  annotate the job's live pods and its top owner with
                 ``fleetmedic.io/checkpoint-requested: <deadline>`` (checkpoint-now).

Every action that changes something also writes a Kubernetes Event (``Fleetmedic<Action>``)
on the node, or on the batch Job for job actions, naming the verdict.

What fleetmedic changed on a node is written on the node itself (annotations), so a
restarted worker knows whether a cordon is its own: a node that a human cordoned keeps
its cordon when fleetmedic returns it.

The client is synchronous; every API call runs in a worker thread
(a pool of ``max_requests`` threads) with a request timeout.  :class:`ApiException` statuses are
mapped to typed errors: 409 (a concurrent writer), 429 and 5xx are
:class:`~actuators.base.TemporaryError` (with ``Retry-After`` as the delay), other 4xx are
:class:`~actuators.base.PermanentError`; connection failures are temporary.
"""

from __future__ import annotations

import asyncio
import email.utils
import functools
import hashlib
import json
import logging
import os
import re
import time
from concurrent.futures import ThreadPoolExecutor
from collections.abc import Awaitable, Callable, Collection, Mapping
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, TypeVar, cast

import kubernetes.client
import kubernetes.config
import pydantic
import urllib3
from kubernetes.client import (
    BatchV1Api,
    CoreV1Api,
    CustomObjectsApi,
    CoreV1Event,
    V1Container,
    V1DeleteOptions,
    V1Eviction,
    V1Job,
    V1JobSpec,
    V1Node,
    V1NodeCondition,
    V1ObjectMeta,
    V1ObjectReference,
    V1Pod,
    V1PodSpec,
    V1PodTemplateSpec,
    V1Preconditions,
    V1ResourceRequirements,
    V1Taint,
    V1Toleration,
)
from kubernetes.client.exceptions import ApiException, ApiTypeError, ApiValueError

from schemas import ActionName, Outcome

from . import k8s_workloads as wk
from .k8s_nodes import NodeCache
from .base import ActionRequest, ActionResult, ActuatorError, PermanentError, TemporaryError, Waiting

log = logging.getLogger(__name__)

T = TypeVar("T")

#: what fleetmedic's node annotations begin with (the node cache keeps these alone)
ANNOTATION_PREFIX = "fleetmedic."
#: annotation: id of the verdict that isolated the node
ANNOTATION_VERDICT = "fleetmedic.dev/verdict"
#: annotation: "true" when fleetmedic (not a human) set ``spec.unschedulable``
ANNOTATION_CORDONED = "fleetmedic.dev/cordoned"
#: annotation: id of the verdict that escalated the node
ANNOTATION_ESCALATED = "fleetmedic.dev/escalated"
#: annotation on a job's pods and its top owner asking it to save its state by the
#: deadline it holds (RFC 3339, UTC): checkpoint-now, docs/checkpoint-now.md
ANNOTATION_CHECKPOINT = "fleetmedic.io/checkpoint-requested"
#: annotation on a requeued workload: ``<verdict id>:<phase>`` of its requeue
ANNOTATION_REQUEUE = "fleetmedic.io/requeue"
#: how soon a requeue waiting on a controller looks again (seconds)
CONTROLLER_POLL_S = 1.0
#: node condition type set while a node is quarantined
CONDITION_QUARANTINE = "FleetmedicQuarantine"
#: how long an isolation's Event waits for the burst it came in to end, at most (seconds)
EVENT_DEFER_MAX_S = 30.0
#: how long closing the backend waits for the Events of a burst still on their way (seconds)
EVENT_CLOSE_WAIT_S = 10.0

#: labels on the diagnostics Job (ownership check)
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
LABEL_NODE = "fleetmedic.dev/node"
LABEL_VERDICT = "fleetmedic.dev/verdict"

#: pod label that names a batch Job's pods (set by the Job controller)
JOB_NAME_LABEL = "job-name"
#: pod label that names a JobSet's pods (set by the JobSet controller)
JOBSET_NAME_LABEL = "jobset.sigs.k8s.io/jobset-name"

#: taint the node controller keeps on a cordoned node; diagnostics must tolerate it
UNSCHEDULABLE_TAINT = "node.kubernetes.io/unschedulable"
#: annotation the kubelet puts on mirror pods of static pods (not evictable)
MIRROR_POD_ANNOTATION = "kubernetes.io/config.mirror"

#: a workload's drain mode, as a pod annotation or label (else the backend's default):
#: ``Immediate`` (evict at once), ``AllowCompletion`` (never evicted: the drain waits for
#: the pod to finish) or ``DeleteAfterTimeout`` (evicted once the drain has waited
#: ``DRAIN_TIMEOUT_KEY`` seconds, else the backend's default timeout)
DRAIN_MODE_KEY = "fleetmedic.dev/drain-mode"
DRAIN_TIMEOUT_KEY = "fleetmedic.dev/drain-timeout-s"
DRAIN_MODES = ("Immediate", "AllowCompletion", "DeleteAfterTimeout")

DEFAULT_DIAG_IMAGE = "nvcr.io/nvidia/cloud-native/dcgm:3.3.5-1-ubuntu22.04"
DEFAULT_DIAG_COMMAND = ("dcgmi", "diag", "-r", "2")

_NAME_MAX = 63
_LABEL_VALUE = re.compile(r"^(?:[A-Za-z0-9](?:[-A-Za-z0-9_.]*[A-Za-z0-9])?)?$")
_TEMPORARY_STATUSES = frozenset({408, 409, 429})
_CONNECTION_ERRORS: tuple[type[BaseException], ...] = (urllib3.exceptions.HTTPError, OSError)
_CLIENT_SIDE_ERRORS: tuple[type[BaseException], ...] = (ApiTypeError, ApiValueError, pydantic.ValidationError)


def _utcnow() -> datetime:
    return datetime.now(timezone.utc)


def _digest(text: str, n: int) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:n]


def label_value(text: str) -> str:
    """``text`` as a valid label value (<= 63 chars); long or odd values get a hash suffix."""
    if len(text) <= _NAME_MAX and _LABEL_VALUE.match(text):
        return text
    stem = re.sub(r"[^A-Za-z0-9_.-]+", "-", text)[: _NAME_MAX - 11].strip("-_.")
    h = _digest(text, 10)
    return f"{stem}-{h}" if stem else h


def diagnostics_job_name(node: str, verdict_id: str) -> str:
    """The deterministic name of the diagnostics Job for ``node`` under ``verdict_id``.

    ``fleetmedic-diag-<node>-<hash>``: a DNS-1123 label of at most 63 characters.  The
    hash covers node and verdict, so two long node names that share a truncated prefix
    still get different Jobs.
    """
    prefix = "fleetmedic-diag-"
    h = _digest(f"{verdict_id}\x00{node}", 8)
    room = _NAME_MAX - len(prefix) - 1 - len(h)
    stem = re.sub(r"[^a-z0-9-]+", "-", node.lower())[:room].strip("-") or "node"
    return f"{prefix}{stem}-{h}"


@functools.cache
def _serializer() -> kubernetes.client.ApiClient:
    """A client used only to turn models into API JSON (it never connects)."""
    return kubernetes.client.ApiClient(kubernetes.client.Configuration())


def _unread(fn: Callable[..., Any]) -> Callable[..., bool]:
    """``fn``, an API write whose answer is not needed, with the answer's body read and
    dropped instead of turned into client models: a Node comes back whole from every
    patch, and its deserialisation was most of the client's CPU time in a burst of
    isolations. A status other than 2xx still raises ``ApiException``."""

    def call(*args: Any, **kwargs: Any) -> bool:
        resp = fn(*args, _preload_content=False, **kwargs)
        try:
            resp.read()
        finally:
            resp.release_conn()
        return True

    return call


def _rfc3339(ts: datetime) -> str:
    return ts.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _retry_after(exc: ApiException, now: datetime) -> float | None:
    """Seconds from a ``Retry-After`` header (delta seconds or HTTP date), if any."""
    headers = exc.headers or {}
    value: Any = None
    try:
        value = headers.get("Retry-After")
        if value is None:
            value = next((v for k, v in headers.items() if str(k).lower() == "retry-after"), None)
    except AttributeError:
        return None
    if value is None:
        return None
    try:
        return max(0.0, float(value))
    except (TypeError, ValueError):
        pass
    try:
        when = email.utils.parsedate_to_datetime(str(value))
    except (TypeError, ValueError):
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=timezone.utc)
    return max(0.0, (when - now).total_seconds())


def _status_message(exc: ApiException) -> str:
    """The ``message`` of the ``Status`` object the API server sent, else the reason."""
    if exc.body:
        try:
            message = json.loads(exc.body).get("message")
        except (ValueError, AttributeError):
            message = None
        if message:
            return str(message)
    return str(exc.reason or "")


class Conflict(TemporaryError):
    """HTTP 409 on a conditional write: the object changed since it was read."""


#: immediate re-reads after a conflict before the action is tried again later (a node's
#: resourceVersion also moves with every status update, so conflicts are routine)
CONFLICT_RETRIES = 3


def map_api_error(exc: ApiException, what: str, now: datetime | None = None) -> ActuatorError:
    """The typed error for a failed call; ``what`` says which call on which object."""
    status = exc.status or 0
    text = f"{what}: HTTP {status} {_status_message(exc)}".rstrip()
    if status == 409:
        return Conflict(text + " (changed concurrently; re-read and retry)", delay=_retry_after(exc, now or _utcnow()))
    if status == 0 or status in _TEMPORARY_STATUSES or status >= 500:
        return TemporaryError(text, delay=_retry_after(exc, now or _utcnow()))
    if status == 404:
        return PermanentError(f"{what}: not found")
    return PermanentError(text)


def _meta(obj: V1Node | V1Pod | V1Job) -> V1ObjectMeta:
    """``obj.metadata``, which the API server sets on every object it returns."""
    return cast(V1ObjectMeta, obj.metadata)


def _annotations(obj: Any) -> dict[str, str]:
    return dict(obj.metadata.annotations or {}) if obj.metadata is not None else {}


def _labels(obj: Any) -> dict[str, str]:
    return dict(obj.metadata.labels or {}) if obj.metadata is not None else {}


def _condition(node: V1Node, kind: str) -> V1NodeCondition | None:
    for cond in (node.status.conditions if node.status is not None else None) or []:
        if cond.type == kind:
            return cond
    return None


def _is_daemonset_pod(pod: V1Pod) -> bool:
    owners = (pod.metadata.owner_references if pod.metadata is not None else None) or []
    return any(ref.kind == "DaemonSet" for ref in owners)


def _is_mirror_pod(pod: V1Pod) -> bool:
    return MIRROR_POD_ANNOTATION in _annotations(pod)


def _is_terminating(pod: V1Pod) -> bool:
    return pod.metadata is not None and pod.metadata.deletion_timestamp is not None


def _phase(pod: V1Pod) -> str:
    return (pod.status.phase if pod.status is not None else None) or ""


def _pod_ref(pod: V1Pod) -> str:
    return f"{_meta(pod).namespace}/{_meta(pod).name}"


@dataclass(frozen=True, slots=True)
class _NodeView:
    """What isolate/return need to know about a node, read once."""

    node: V1Node
    #: every taint on the node, in order
    taints: list[V1Taint]
    #: our NoSchedule taint(s)
    ours: list[V1Taint]
    #: every other taint, in order
    others: list[V1Taint]
    cordoned: bool
    #: the cordon was set by fleetmedic (annotation)
    cordon_ours: bool
    #: the quarantine condition is True
    quarantined: bool


class WorkloadGone(PermanentError):
    """No Job, PyTorchJob or pod of that name: nothing of the workload is left (a stop
    fails on it; a move or a checkpoint has nothing to do)."""


@dataclass(frozen=True)
class _Workload:
    """A job's top owner as the API server serves it, and the pods found for it."""

    kind: wk.Kind
    namespace: str
    name: str
    obj: dict[str, Any]
    pods: list[V1Pod]


def _requeue_mark(wl: _Workload, request: ActionRequest, phase: str) -> dict[str, Any]:
    """A merge patch recording ``phase`` of this verdict's requeue on the workload,
    conditional on the version read (``fleetmedic.io/requeue: <verdict>:<phase>``)."""
    return {"metadata": {"resourceVersion": wk.meta(wl.obj).get("resourceVersion"),
                         "annotations": {ANNOTATION_REQUEUE: f"{request.verdict_id}:{phase}"}}}


def _merge(*patches: dict[str, Any] | None) -> dict[str, Any]:
    """JSON merge patches combined into one (later ones win on the same leaf)."""
    out: dict[str, Any] = {}

    def into(dst: dict[str, Any], src: dict[str, Any]) -> None:
        for k, v in src.items():
            if isinstance(v, dict) and isinstance(dst.get(k), dict):
                into(dst[k], v)
            else:
                dst[k] = v

    for p in patches:
        if p:
            into(out, p)
    return out


class KubernetesBackend:
    """Node and job actions against one Kubernetes cluster.

    ``core`` and ``batch`` are ready API objects (their ``ApiClient`` carries the
    cluster's address, credentials and urllib3 retry policy); use :meth:`from_config`
    to build them from a kubeconfig or the in-cluster service account.  ``clock``
    gives the time written on conditions and events.
    """

    name = "kubernetes"

    def __init__(
        self,
        core: CoreV1Api,
        batch: BatchV1Api,
        *,
        namespace: str = "fleetmedic",
        job_namespace: str = "default",
        event_namespace: str = "default",
        taint_key: str = "fleetmedic.dev/quarantine",
        diag_image: str = DEFAULT_DIAG_IMAGE,
        diag_command: Collection[str] = DEFAULT_DIAG_COMMAND,
        diag_gpus: int = 8,
        diag_deadline_s: int | None = 3600,
        job_label_key: str = JOB_NAME_LABEL,
        field_manager: str = "fleetmedic",
        request_timeout: float | tuple[float, float] = 30.0,
        clock: Callable[[], datetime] = _utcnow,
        drain_mode: str = "Immediate",
        drain_timeout_s: float = 600.0,
        max_requests: int = 32,
        custom: CustomObjectsApi | None = None,
        node_cache: NodeCache | None = None,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_requests < 1:
            raise ValueError(f"max_requests must be >= 1, got {max_requests}")
        if diag_gpus < 0:
            raise ValueError(f"diag_gpus must be >= 0, got {diag_gpus}")
        if drain_mode not in DRAIN_MODES:
            raise ValueError(f"drain_mode must be one of {', '.join(DRAIN_MODES)}, got {drain_mode!r}")
        if drain_timeout_s < 0:
            raise ValueError(f"drain_timeout_s must be >= 0, got {drain_timeout_s}")
        #: drain mode of pods that declare none, and DeleteAfterTimeout's default timeout
        self.drain_mode = drain_mode
        self.drain_timeout_s = drain_timeout_s
        self.core = core
        self.batch = batch
        self._custom = custom
        #: namespace of the diagnostics Jobs
        self.namespace = namespace
        #: namespace of workloads named without one
        self.job_namespace = job_namespace
        #: namespace of Events about nodes (cluster-scoped objects: "default")
        self.event_namespace = event_namespace
        self.taint_key = taint_key
        self.diag_image = diag_image
        self.diag_command = list(diag_command)
        self.diag_gpus = diag_gpus
        self.diag_deadline_s = diag_deadline_s
        #: pod label naming the workload; JOBSET_NAME_LABEL for JobSets
        self.job_label_key = job_label_key
        self.field_manager = field_manager
        self.request_timeout = request_timeout
        self.clock = clock
        self._owned_client: kubernetes.client.ApiClient | None = None
        #: the API calls in flight at once: the client is blocking, so each runs in a thread
        #: of this pool (the event loop's default pool has min(32, cores + 4) threads, 6 on
        #: two cores, which capped a burst of isolations far below what the server takes)
        self.max_requests = max_requests
        self._executor = ThreadPoolExecutor(max_workers=max_requests, thread_name_prefix="kube-api")
        #: Nodes as a watch last saw them (None: every isolation reads its node first)
        self.node_cache = node_cache
        self._monotonic = monotonic
        #: isolations in flight, and the Events held back until none is (when queued, what sends each)
        self._isolating = 0
        self._deferred_events: list[tuple[float, Callable[[], Awaitable[None]]]] = []
        self._event_tasks: set[asyncio.Future[None]] = set()

    @property
    def custom(self) -> CustomObjectsApi:
        """Reads and patches workloads of any kind (built-in groups as well) as JSON; made
        on first use from the core API's client unless one was given."""
        if self._custom is None:
            self._custom = CustomObjectsApi(self.core.api_client)
        return self._custom

    @classmethod
    def from_config(
        cls,
        kubeconfig: str | None = None,
        context: str | None = None,
        *,
        retries: int = 3,
        backoff_factor: float = 0.5,
        impersonate: str | None = None,
        max_requests: int = 32,
        node_cache: bool = False,
        **options: Any,
    ) -> KubernetesBackend:
        """Build a backend from a kubeconfig file or, inside a pod, the service account.

        With neither ``kubeconfig`` nor ``context`` given and ``KUBERNETES_SERVICE_HOST``
        set, the in-cluster configuration is used.  The client's own urllib3 retries
        cover connection and read failures only (``retries`` attempts, exponential
        ``backoff_factor``; reads are retried for idempotent methods only); HTTP status
        codes are left to :mod:`actuators.retry` through the typed errors.
        ``impersonate`` acts as that user (``Impersonate-User``, like ``kubectl --as``),
        for example the service account whose RBAC the deployment grants.
        ``max_requests`` bounds the calls in flight, and the client's connection pool
        holds as many connections.
        """
        config = kubernetes.client.Configuration()
        if kubeconfig is None and context is None and os.environ.get("KUBERNETES_SERVICE_HOST"):
            kubernetes.config.load_incluster_config(client_configuration=config)
        else:
            kubernetes.config.load_kube_config(
                config_file=kubeconfig, context=context, client_configuration=config, persist_config=False
            )
        config.retries = urllib3.util.Retry(
            total=retries, connect=retries, read=retries, status=0, other=0, backoff_factor=backoff_factor
        )
        config.connection_pool_maxsize = max_requests
        api = kubernetes.client.ApiClient(config)
        if impersonate:
            api.set_default_header("Impersonate-User", impersonate)
        core = kubernetes.client.CoreV1Api(api)
        cache = None
        if node_cache:
            cache = NodeCache(core.list_node, conditions=(CONDITION_QUARANTINE,),
                              annotation_prefix=ANNOTATION_PREFIX).start()
        backend = cls(core, kubernetes.client.BatchV1Api(api), max_requests=max_requests, node_cache=cache,
                      **options)
        backend._owned_client = api
        return backend

    # ------------------------------------------------------------------ protocol

    def supports(self, action: ActionName) -> bool:
        return action in _HANDLERS

    async def apply(self, request: ActionRequest) -> ActionResult:
        handler = _HANDLERS.get(request.action)
        if handler is None:
            raise PermanentError(f"kubernetes: unsupported action {request.action.value}")
        return await handler(self, request)

    async def close(self) -> None:
        self._send_deferred_events(force=True)
        if self._event_tasks:  # the Events of a burst still on their way
            await asyncio.wait(set(self._event_tasks), timeout=EVENT_CLOSE_WAIT_S)
        if self.node_cache is not None:
            self.node_cache.stop()
        if self._owned_client is not None:
            client, self._owned_client = self._owned_client, None
            await asyncio.to_thread(client.close)
        self._executor.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------------ plumbing

    async def _call(
        self,
        what: str,
        fn: Callable[..., T],
        /,
        *args: Any,
        tolerate: Collection[int] = (),
        **kwargs: Any,
    ) -> T | None:
        """Run one API call in a thread; map failures to typed errors.

        A status in ``tolerate`` returns ``None`` instead of raising (for example 404
        where "absent" already is the wanted state).
        """
        kwargs.setdefault("_request_timeout", self.request_timeout)
        try:
            return await asyncio.get_running_loop().run_in_executor(
                self._executor, functools.partial(fn, *args, **kwargs))
        except ApiException as exc:
            if exc.status in tolerate:
                log.debug("%s: HTTP %s tolerated", what, exc.status)
                return None
            raise map_api_error(exc, what, self.clock()) from exc
        except _CLIENT_SIDE_ERRORS as exc:
            raise PermanentError(f"{what}: invalid request: {exc}") from exc
        except _CONNECTION_ERRORS as exc:
            raise TemporaryError(f"{what}: {type(exc).__name__}: {exc}") from exc

    async def _read_node(self, node: str) -> V1Node:
        found = await self._call(f"read node {node}", self.core.read_node, node)
        assert found is not None
        return found

    def _view(self, node: V1Node) -> _NodeView:
        taints = list((node.spec.taints if node.spec is not None else None) or [])
        mine = [t.key == self.taint_key and t.effect == "NoSchedule" for t in taints]
        cond = _condition(node, CONDITION_QUARANTINE)
        return _NodeView(
            node=node,
            taints=taints,
            ours=[t for t, m in zip(taints, mine) if m],
            others=[t for t, m in zip(taints, mine) if not m],
            cordoned=bool(node.spec is not None and node.spec.unschedulable),
            cordon_ours=_annotations(node).get(ANNOTATION_CORDONED) == "true",
            quarantined=cond is not None and cond.status == "True",
        )

    @staticmethod
    def _taints_body(taints: list[V1Taint]) -> list[dict[str, Any]]:
        """Taints as the API spells them (``timeAdded``, RFC 3339 times)."""
        return [_serializer().sanitize_for_serialization(t) for t in taints]

    async def _patch_node(self, name: str, body: dict[str, Any]) -> None:
        """Strategic-merge patch of a node; a ``metadata.resourceVersion`` in ``body``
        makes it conditional (409 when the node changed since it was read)."""
        await self._call(
            f"patch node {name}",
            _unread(self.core.patch_node),
            name,
            body,
            field_manager=self.field_manager,
            _content_type="application/strategic-merge-patch+json",
        )

    async def _set_condition(self, name: str, status: bool, reason: str, message: str) -> None:
        """Set the quarantine condition (conditions merge by ``type``: others are kept)."""
        now = _rfc3339(self.clock())
        body = {
            "status": {
                "conditions": [
                    {
                        "type": CONDITION_QUARANTINE,
                        "status": "True" if status else "False",
                        "reason": reason,
                        "message": message[:1024],
                        "lastHeartbeatTime": now,
                        "lastTransitionTime": now,
                    }
                ]
            }
        }
        await self._call(
            f"patch status of node {name}",
            _unread(self.core.patch_node_status),
            name,
            body,
            field_manager=self.field_manager,
            _content_type="application/strategic-merge-patch+json",
        )

    async def _node_event(
        self, node: V1Node, request: ActionRequest, reason: str, message: str, kind: str = "Warning"
    ) -> None:
        """Record an Event on the node (see :meth:`_event`)."""
        ref = V1ObjectReference(api_version="v1", kind="Node", name=_meta(node).name, uid=_meta(node).uid)
        await self._event(ref, self.event_namespace, request, reason, message, kind)

    async def _job_event(self, namespace: str, name: str, request: ActionRequest, reason: str, message: str) -> None:
        """Record an Event on a workload's batch Job (see :meth:`_event`)."""
        ref = V1ObjectReference(api_version="batch/v1", kind="Job", name=name, namespace=namespace)
        await self._event(ref, namespace, request, reason, message, "Normal")

    async def _event(
        self, ref: V1ObjectReference, namespace: str, request: ActionRequest, reason: str, message: str, kind: str
    ) -> None:
        """Record an Event about ``ref``; a failure is logged, never raised.

        The Event's name derives from the idempotency key, so a replay finds it
        already there (409, ignored).
        """
        # both callers set the reference's name and kind
        name, subject = cast(str, ref.name), cast(str, ref.kind).lower()
        now = self.clock().astimezone(timezone.utc).replace(microsecond=0)
        event = CoreV1Event(
            metadata=V1ObjectMeta(name=f"{name[:200]}.{_digest(request.key, 16)}", namespace=namespace),
            involved_object=ref,
            reason=reason,
            message=message[:1024],
            type=kind,
            source=kubernetes.client.V1EventSource(component=self.field_manager),
            first_timestamp=now,
            last_timestamp=now,
            count=1,
        )
        try:
            await self._call(
                f"create event {reason} for {subject} {name}",
                _unread(self.core.create_namespaced_event),
                namespace,
                event,
                field_manager=self.field_manager,
                tolerate=(409,),
            )
        except ActuatorError as exc:
            log.warning("event %s for %s %s not recorded: %s", reason, subject, name, exc)

    def _taint_value(self, request: ActionRequest) -> str:
        raw = request.params.get("fault_class") or request.params.get("reason") or "suspect"
        return label_value(str(raw)) or "suspect"

    def _job_ref(self, target: str) -> tuple[str, str]:
        parts = target.split("/")
        if len(parts) == 1 and parts[0]:
            return self.job_namespace, parts[0]
        if len(parts) == 2 and all(parts):
            return parts[0], parts[1]
        raise PermanentError(f"job id {target!r} is not '<namespace>/<name>' or '<name>'")

    # ------------------------------------------------------------------ node actions

    async def isolate(self, request: ActionRequest) -> ActionResult:
        """Keep new work off a node.

        Observes the node's ``spec.unschedulable``, taints and conditions.  Already so
        when it is cordoned, carries our NoSchedule taint and the quarantine condition
        is ``True``.  Otherwise adds what is missing: one conditional patch (taint list
        re-sent whole, foreign taints preserved; ``fleetmedic.dev/cordoned`` only when
        it was not cordoned before), then the condition, then an Event.

        With a node cache (:mod:`actuators.k8s_nodes`) the first observation is the
        cached node: the conditional patch fails (409) if the cache lagged, and the node
        is then read from the server; "already so" is never concluded from the cache.
        While other isolations are in flight (a burst), the Event waits until none is,
        so that containment has the API server first (decision 0032).
        """
        self._isolating += 1
        fresh = False

        async def once(r: ActionRequest) -> ActionResult:
            nonlocal fresh
            try:
                return await self._isolate_once(r, fresh=fresh)
            finally:
                fresh = True  # a conflict means the cache lagged: the next look is at the server

        try:
            return await self._reread_on_conflict(once, request)
        finally:
            self._isolating -= 1
            self._send_deferred_events()

    async def _observe_node(self, name: str, *, fresh: bool) -> tuple[V1Node, bool]:
        """The node from the cache (unless ``fresh``, or not cached), else from the server;
        and whether it came from the cache."""
        if not fresh and self.node_cache is not None:
            cached = self.node_cache.get(name)
            if cached is not None:
                return cached, True
        return await self._read_node(name), False

    def _send_deferred_events(self, *, force: bool = False) -> None:
        """Send the Events held back during a burst once no isolation is in flight (or
        when the oldest has waited :data:`EVENT_DEFER_MAX_S`), in the background."""
        if not self._deferred_events:
            return
        oldest = self._deferred_events[0][0]
        if not force and self._isolating > 0 and self._monotonic() - oldest < EVENT_DEFER_MAX_S:
            return
        batch, self._deferred_events = [send for _, send in self._deferred_events], []

        async def send_all() -> None:
            await asyncio.gather(*(send() for send in batch))

        task = asyncio.ensure_future(send_all())
        self._event_tasks.add(task)
        task.add_done_callback(self._event_tasks.discard)

    async def _reread_on_conflict(self, once: Callable[[ActionRequest], Awaitable[ActionResult]],
                                  request: ActionRequest) -> ActionResult:
        """``once`` (observe, compare, act with a conditional write), again at once after
        a conflict, up to :data:`CONFLICT_RETRIES` times."""
        for left in range(CONFLICT_RETRIES, -1, -1):
            try:
                return await once(request)
            except Conflict:
                if not left:
                    raise
                log.debug("%s %s: the node changed since it was read; reading it again",
                          request.action.value, request.target)
        raise AssertionError("unreachable")

    async def _isolate_once(self, request: ActionRequest, *, fresh: bool = True) -> ActionResult:
        name = request.target
        node, cached = await self._observe_node(name, fresh=fresh)
        view = self._view(node)
        if view.ours and view.cordoned and view.quarantined:
            if cached:  # the cache says done: the server has the last word
                return await self._isolate_once(request, fresh=True)
            by = _annotations(view.node).get(ANNOTATION_VERDICT, "?")
            return ActionResult(Outcome.already_so, f"node {name} already cordoned and tainted (verdict {by})")
        done: list[str] = []
        if not view.ours or not view.cordoned:
            annotations: dict[str, str] = {ANNOTATION_VERDICT: request.verdict_id}
            body: dict[str, Any] = {"metadata": {"annotations": annotations}, "spec": {}}
            if not view.ours:
                value = self._taint_value(request)
                taint = V1Taint(key=self.taint_key, value=value, effect="NoSchedule")
                body["metadata"]["resourceVersion"] = _meta(view.node).resource_version
                body["spec"]["taints"] = self._taints_body([*view.taints, taint])
                done.append(f"tainted {self.taint_key}={value}:NoSchedule")
            if not view.cordoned:
                body["spec"]["unschedulable"] = True
                annotations[ANNOTATION_CORDONED] = "true"
                done.append("cordoned")
            await self._patch_node(name, body)
        if not view.quarantined:
            message = f"isolated by fleetmedic, verdict {request.verdict_id}: {request.reason}"
            await self._set_condition(name, True, "FleetmedicIsolated", message)
            done.append(f"condition {CONDITION_QUARANTINE}=True")
        event = functools.partial(
            self._node_event, view.node, request, "FleetmedicIsolate",
            f"verdict {request.verdict_id}: {request.reason or 'isolate'}")
        if self._isolating > 1:  # others in flight: the Event follows the burst
            self._deferred_events.append((self._monotonic(), event))
            done.append("Event after the burst")
        else:
            await event()
        return ActionResult(Outcome.applied, f"node {name}: " + ", ".join(done))

    async def return_(self, request: ActionRequest) -> ActionResult:
        """Give a node back to the scheduler.

        Observes our taint, the cordon and who set it (``fleetmedic.dev/cordoned``), and
        the quarantine condition.  Already so when none of our marks is left.  Otherwise
        removes our taint (other taints kept), uncordons only a cordon fleetmedic set,
        clears our annotations and sets the condition ``False``.  A cordon someone else
        set stays, and the detail says so.
        """
        return await self._reread_on_conflict(self._return_once, request)

    async def _return_once(self, request: ActionRequest) -> ActionResult:
        name = request.target
        view = self._view(await self._read_node(name))
        annotations = _annotations(view.node)
        marked = [k for k in (ANNOTATION_VERDICT, ANNOTATION_CORDONED) if k in annotations]
        uncordon = view.cordoned and view.cordon_ours
        foreign_cordon = view.cordoned and not view.cordon_ours
        note = "; cordon left in place: not set by fleetmedic" if foreign_cordon else ""
        if not view.ours and not uncordon and not view.quarantined and not marked:
            return ActionResult(Outcome.already_so, f"node {name} carries no fleetmedic isolation{note}")
        done: list[str] = []
        if view.ours or uncordon or marked:
            body: dict[str, Any] = {"metadata": {"annotations": {k: None for k in marked}}, "spec": {}}
            if view.ours:
                body["metadata"]["resourceVersion"] = _meta(view.node).resource_version
                body["spec"]["taints"] = self._taints_body(view.others)
                done.append(f"removed taint {self.taint_key}")
            if uncordon:
                body["spec"]["unschedulable"] = None
                done.append("uncordoned")
            await self._patch_node(name, body)
        if view.quarantined:
            await self._set_condition(
                name, False, "FleetmedicReturned", f"returned by fleetmedic, verdict {request.verdict_id}"
            )
            done.append(f"condition {CONDITION_QUARANTINE}=False")
        await self._node_event(
            view.node, request, "FleetmedicReturn", f"verdict {request.verdict_id}: returned to service", "Normal"
        )
        return ActionResult(Outcome.applied, f"node {name}: " + (", ".join(done) or "cleared marks") + note)

    def _drain_mode(self, pod: V1Pod) -> tuple[str, float]:
        """A pod's drain mode and timeout: its annotation, else its label, else the default
        (an unknown mode reads as the default)."""
        meta = _meta(pod)
        declared = (meta.annotations or {}).get(DRAIN_MODE_KEY) or (meta.labels or {}).get(DRAIN_MODE_KEY)
        mode = declared if declared in DRAIN_MODES else self.drain_mode
        if declared and declared not in DRAIN_MODES:
            log.warning("pod %s: unknown drain mode %r, using %s", _pod_ref(pod), declared, mode)
        raw = (meta.annotations or {}).get(DRAIN_TIMEOUT_KEY) or (meta.labels or {}).get(DRAIN_TIMEOUT_KEY)
        try:
            timeout = float(raw) if raw is not None else self.drain_timeout_s
        except ValueError:
            timeout = self.drain_timeout_s
        return str(mode), max(0.0, timeout)

    async def drain(self, request: ActionRequest) -> ActionResult:
        """Move the workload off a node through the Eviction API.

        Observes the node and its pods (``spec.nodeName=<node>``).  Skips DaemonSet and
        mirror pods (they belong to the node), finished pods (they hold nothing) and
        pods already terminating.  Already so when no other pod is left and the node is
        cordoned.  Otherwise cordons it first if needed (as ``kubectl drain`` does,
        marked as our cordon), then evicts each pod with a UID precondition; a pod gone
        meanwhile counts as evicted.  An eviction refused by a PodDisruptionBudget (429)
        is a :class:`TemporaryError` once every other pod has been tried.  Waiting for a
        checkpoint (``not_before_checkpoint``) is the pipeline's job, not this one's.

        Each pod is drained in its workload's mode (:data:`DRAIN_MODE_KEY`): an
        ``AllowCompletion`` pod is never evicted, and a ``DeleteAfterTimeout`` pod only once
        the drain has waited its timeout since ``params["drain_since"]`` (the wall time of
        the drain's first try); while such pods remain the drain is a
        :class:`TemporaryError` (tried again later), and its detail names the modes.
        """
        name = request.target
        view = self._view(await self._read_node(name))
        pods = await self._call(
            f"list pods on node {name}",
            self.core.list_pod_for_all_namespaces,
            field_selector=f"spec.nodeName={name}",
        )
        assert pods is not None
        skipped = 0
        evictable: list[V1Pod] = []
        for pod in pods.items or []:
            finished = _phase(pod) in ("Succeeded", "Failed")
            if finished or _is_daemonset_pod(pod) or _is_mirror_pod(pod) or _is_terminating(pod):
                skipped += 1
            else:
                evictable.append(pod)
        now = self.clock().timestamp()
        since = float(request.params.get("drain_since") or now)
        if not evictable and view.cordoned:
            if since < now:  # earlier tries of this drain evicted or waited out the rest
                return ActionResult(Outcome.applied, f"node {name}: drained, its last pods gone since the drain's "
                                                     f"first try {now - since:.0f} s ago ({skipped} pods skipped)")
            return ActionResult(Outcome.already_so, f"node {name}: nothing left to evict ({skipped} pods skipped)")
        done: list[str] = []
        if not view.cordoned:
            await self._patch_node(
                name, {"metadata": {"annotations": {ANNOTATION_CORDONED: "true"}}, "spec": {"unschedulable": True}}
            )
            done.append("cordoned")
        grace = request.params.get("grace_period_s")
        waited = now - since
        blocked: list[tuple[str, TemporaryError]] = []
        evicted = 0
        modes: dict[str, int] = {}
        waiting: list[tuple[str, str, float]] = []  # (pod, mode, seconds left)
        for pod in evictable:
            mode, timeout = self._drain_mode(pod)
            if mode == "AllowCompletion" or (mode == "DeleteAfterTimeout" and waited < timeout):
                waiting.append((_pod_ref(pod), mode, timeout - waited if mode == "DeleteAfterTimeout" else 10.0))
                continue
            modes[mode] = modes.get(mode, 0) + 1
            eviction = V1Eviction(
                api_version="policy/v1",
                kind="Eviction",
                metadata=V1ObjectMeta(name=_meta(pod).name, namespace=_meta(pod).namespace),
                delete_options=V1DeleteOptions(
                    preconditions=V1Preconditions(uid=_meta(pod).uid),
                    grace_period_seconds=int(grace) if grace is not None else None,
                ),
            )
            try:
                await self._call(
                    f"evict pod {_pod_ref(pod)}",
                    self.core.create_namespaced_pod_eviction,
                    _meta(pod).name,
                    _meta(pod).namespace,
                    eviction,
                    tolerate=(404,),
                )
            except TemporaryError as exc:
                blocked.append((_pod_ref(pod), exc))
                continue
            evicted += 1
        if evicted:
            done.append(f"evicted {evicted} pods (" + ", ".join(f"{m} {k}" for m, k in sorted(modes.items())) + ")")
        if waiting:
            refs = ", ".join(f"{ref} ({mode})" for ref, mode, _ in waiting[:5])
            raise TemporaryError(
                f"node {name}: waiting for {len(waiting)} pods by their drain mode: {refs}"
                + (f"; done so far: {', '.join(done)}" if done else ""),
                delay=max(1.0, min(30.0, min(left for _, _, left in waiting))),
            )
        if blocked:
            refs = ", ".join(ref for ref, _ in blocked[:5])
            delays = [exc.delay for _, exc in blocked if exc.delay is not None]
            raise TemporaryError(
                f"node {name}: {len(blocked)} evictions refused for now ({refs}): {blocked[0][1]}"
                + (f"; done so far: {', '.join(done)}" if done else ""),
                delay=max(delays) if delays else None,
            )
        detail = f"node {name}: {', '.join(done)} ({skipped} pods skipped)"
        await self._node_event(view.node, request, "FleetmedicDrain", f"verdict {request.verdict_id}: {detail}", "Normal")
        return ActionResult(Outcome.applied, detail)

    def _diagnostics_job(self, node: str, request: ActionRequest, job_name: str) -> V1Job:
        gpus = int(request.params.get("gpus", self.diag_gpus))
        labels = {
            LABEL_MANAGED_BY: self.field_manager,
            LABEL_NODE: label_value(node),
            LABEL_VERDICT: label_value(request.verdict_id),
        }
        annotations = {ANNOTATION_VERDICT: request.verdict_id, "fleetmedic.dev/node-name": node}
        resources = V1ResourceRequirements(limits={"nvidia.com/gpu": str(gpus)}) if gpus > 0 else None
        pin = kubernetes.client.V1NodeSelectorTerm(
            match_fields=[
                kubernetes.client.V1NodeSelectorRequirement(key="metadata.name", operator="In", values=[node])
            ]
        )
        pod_spec = V1PodSpec(
            restart_policy="Never",
            affinity=kubernetes.client.V1Affinity(
                node_affinity=kubernetes.client.V1NodeAffinity(
                    required_during_scheduling_ignored_during_execution=kubernetes.client.V1NodeSelector(
                        node_selector_terms=[pin]
                    )
                )
            ),
            tolerations=[
                V1Toleration(key=self.taint_key, operator="Exists", effect="NoSchedule"),
                V1Toleration(key=UNSCHEDULABLE_TAINT, operator="Exists", effect="NoSchedule"),
            ],
            containers=[
                V1Container(
                    name="dcgm-diag", image=self.diag_image, command=list(self.diag_command), resources=resources
                )
            ],
        )
        return V1Job(
            api_version="batch/v1",
            kind="Job",
            metadata=V1ObjectMeta(name=job_name, namespace=self.namespace, labels=labels, annotations=annotations),
            spec=V1JobSpec(
                backoff_limit=0,
                active_deadline_seconds=self.diag_deadline_s,
                template=V1PodTemplateSpec(
                    metadata=V1ObjectMeta(labels=dict(labels), annotations=dict(annotations)), spec=pod_spec
                ),
            ),
        )

    def _check_owned(self, job: V1Job, node: str, request: ActionRequest) -> None:
        labels = _labels(job)
        want = {
            LABEL_MANAGED_BY: self.field_manager,
            LABEL_NODE: label_value(node),
            LABEL_VERDICT: label_value(request.verdict_id),
        }
        wrong = {k: labels.get(k) for k, v in want.items() if labels.get(k) != v}
        if wrong:
            raise PermanentError(
                f"job {self.namespace}/{_meta(job).name} exists but is not ours for node {node}, "
                f"verdict {request.verdict_id} (labels {wrong})"
            )

    async def diagnose(self, request: ActionRequest) -> ActionResult:
        """Run the GPU diagnostics on a node as a batch Job (get-or-create).

        Observes the node (it must exist) and the Job named by
        :func:`diagnostics_job_name`.  Already so when that Job exists and its labels
        say it is ours for this node and verdict; a foreign object of that name is a
        :class:`PermanentError`.  Otherwise creates it: pinned to the node by node
        affinity on ``metadata.name``, tolerating our taint and the cordon, asking for
        all GPUs (``params["gpus"]``, default ``diag_gpus``) so it starts only once the
        node is free, ``backoffLimit: 0``.  A 409 on create (a concurrent creator)
        re-reads and checks ownership.
        """
        node = request.target
        node_obj = await self._read_node(node)
        job_name = diagnostics_job_name(node, request.verdict_id)
        what = f"job {self.namespace}/{job_name}"
        existing = await self._call(
            f"read {what}", self.batch.read_namespaced_job, job_name, self.namespace, tolerate=(404,)
        )
        if existing is None:
            body = self._diagnostics_job(node, request, job_name)
            created = await self._call(
                f"create {what}",
                self.batch.create_namespaced_job,
                self.namespace,
                body,
                field_manager=self.field_manager,
                tolerate=(409,),
            )
            if created is not None:
                detail = f"created diagnostics {what} on node {node}"
                await self._node_event(node_obj, request, "FleetmedicDiagnose", f"verdict {request.verdict_id}: {detail}",
                                       "Normal")
                return ActionResult(Outcome.applied, detail)
            existing = await self._call(f"read {what}", self.batch.read_namespaced_job, job_name, self.namespace)
            assert existing is not None
        self._check_owned(existing, node, request)
        return ActionResult(Outcome.already_so, f"diagnostics {what} for node {node} already exists")

    async def escalate(self, request: ActionRequest) -> ActionResult:
        """Hand a node to a human.

        Observes ``fleetmedic.dev/escalated`` on the node.  Already so when it names
        this verdict.  Otherwise sets it and emits a Warning Event
        ``FleetmedicEscalate`` carrying the verdict and reason.
        """
        name = request.target
        node = await self._read_node(name)
        if _annotations(node).get(ANNOTATION_ESCALATED) == request.verdict_id:
            return ActionResult(Outcome.already_so, f"node {name} already escalated for verdict {request.verdict_id}")
        await self._patch_node(name, {"metadata": {"annotations": {ANNOTATION_ESCALATED: request.verdict_id}}})
        await self._node_event(
            node, request, "FleetmedicEscalate", f"verdict {request.verdict_id}: {request.reason or 'needs a human'}"
        )
        return ActionResult(Outcome.applied, f"node {name} escalated (annotation {ANNOTATION_ESCALATED})")

    # ------------------------------------------------------------------ job actions

    async def _delete_pods(self, request: ActionRequest, exclude: frozenset[str],
                           listed: list[V1Pod] | None = None) -> ActionResult:
        """Delete a workload's failed pods and its live pods on ``exclude`` nodes.

        Observes the pods labelled ``<job label key>=<name>`` (``params["label_key"]``
        overrides the backend's key, e.g. for a JobSet).  Pods already terminating and
        pods that succeeded are left alone.  Already so when nothing is left to delete.
        Each delete carries a UID precondition so a replacement pod of the same name is
        never hit; a pod gone meanwhile counts as deleted.
        """
        namespace, name = self._job_ref(request.target)
        if listed is None:
            key = str(request.params.get("label_key") or self.job_label_key)
            pods = await self._call(
                f"list pods of {namespace}/{name}",
                self.core.list_namespaced_pod,
                namespace,
                label_selector=f"{key}={name}",
            )
            assert pods is not None
            listed = list(pods.items or [])
        doomed: list[tuple[V1Pod, str]] = []
        for pod in listed:
            if _is_terminating(pod) or _phase(pod) == "Succeeded":
                continue
            node = pod.spec.node_name if pod.spec is not None else None
            if _phase(pod) == "Failed":
                doomed.append((pod, "failed"))
            elif node in exclude:
                doomed.append((pod, f"on excluded node {node}"))
        if not doomed:
            return ActionResult(
                Outcome.already_so, f"job {namespace}/{name}: no failed pods and none on excluded nodes"
            )
        for pod, _why in doomed:
            await self._call(
                f"delete pod {_pod_ref(pod)}",
                self.core.delete_namespaced_pod,
                _meta(pod).name,
                _meta(pod).namespace,
                body=V1DeleteOptions(preconditions=V1Preconditions(uid=_meta(pod).uid)),
                tolerate=(404,),
            )
        names = ", ".join(f"{_meta(pod).name} ({why})" for pod, why in doomed[:10])
        more = f" and {len(doomed) - 10} more" if len(doomed) > 10 else ""
        detail = f"job {namespace}/{name}: deleted {len(doomed)} pods: {names}{more}"
        reason = "FleetmedicRequeue" if request.action is ActionName.requeue else "FleetmedicRetry"
        await self._job_event(namespace, name, request, reason, f"verdict {request.verdict_id}: {detail}")
        return ActionResult(Outcome.applied, detail)

    # ------------------------------------------------------------------ workloads

    async def _get(self, kind: wk.Kind, namespace: str, name: str) -> dict[str, Any] | None:
        """The object as JSON, or None when it (or its kind) is not there."""
        got = await self._call(
            f"read {kind.kind} {namespace}/{name}", self.custom.get_namespaced_custom_object,
            kind.group, kind.version, namespace, kind.plural, name, tolerate=(404,),
        )
        return cast("dict[str, Any] | None", got)

    async def _patch(self, kind: wk.Kind, namespace: str, name: str, body: dict[str, Any]) -> None:
        """A JSON merge patch (with ``metadata.resourceVersion`` it is conditional: 409)."""
        await self._call(
            f"patch {kind.kind} {namespace}/{name}", _unread(self.custom.patch_namespaced_custom_object),
            kind.group, kind.version, namespace, kind.plural, name, body, field_manager=self.field_manager,
        )

    async def _pods_of(self, namespace: str, name: str, label_key: str | None = None) -> list[V1Pod]:
        """The pods a workload's controller labels with its name: a batch Job's, else a
        training operator job's (or those of ``label_key`` when given)."""
        for key in ([label_key] if label_key else [self.job_label_key, wk.TRAINING_JOB_LABEL]):
            pods = await self._call(f"list pods of {namespace}/{name}", self.core.list_namespaced_pod,
                                    namespace, label_selector=f"{key}={name}")
            assert pods is not None
            if pods.items:
                return list(pods.items)
        return []

    async def _resolve(self, target: str) -> tuple[_Workload | None, list[V1Pod]]:
        """The workload's top owner: from its pods' controller ownerReferences up, else
        (no pod yet or any more) a batch Job or a PyTorchJob of that name; None for pods
        that name the workload by label alone, with no owner object.

        An owner of a kind fleetmedic does not know is a :class:`PermanentError` naming it.
        """
        namespace, name = self._job_ref(target)
        pods = await self._pods_of(namespace, name)
        ref: dict[str, Any] | None = None
        for pod in pods:
            owners = [o for o in (_meta(pod).owner_references or []) if o.controller]
            if owners:
                o = owners[0]
                ref = {"apiVersion": o.api_version, "kind": o.kind, "name": o.name}
                break
        obj: dict[str, Any] | None = None
        kind: wk.Kind | None = None
        if ref is None:
            for k in (wk.JOB, wk.PYTORCH_JOB):
                obj = await self._get(k, namespace, name)
                if obj is not None:
                    kind = k
                    break
            if obj is None or kind is None:
                if pods:
                    return None, pods
                raise WorkloadGone(f"job {namespace}/{name} not found: no Job, PyTorchJob or pods of that name")
            ref = wk.controller_of(obj)
        for _ in range(8):  # owner chains are short; a cycle is not followed for ever
            if ref is None:
                break
            known = wk.KNOWN.get((wk.group_of(str(ref["apiVersion"])), str(ref["kind"])))
            if known is None:
                raise PermanentError(
                    f"job {namespace}/{name} is owned by {ref['kind']} {ref['name']} ({ref['apiVersion']}), a kind "
                    f"fleetmedic cannot requeue (it knows {', '.join(sorted(k.kind for k in wk.KNOWN.values()))}); "
                    "nothing was changed")
            obj = await self._get(known, namespace, str(ref["name"]))
            if obj is None:
                raise PermanentError(f"job {namespace}/{name}: its owner {ref['kind']} {ref['name']} is gone")
            kind, ref = known, wk.controller_of(obj)
        assert obj is not None and kind is not None
        return _Workload(kind, namespace, str(wk.meta(obj).get("name")), obj, pods), pods

    async def _job_event_on(self, wl: _Workload, request: ActionRequest, reason: str, message: str) -> None:
        m = wk.meta(wl.obj)
        ref = V1ObjectReference(api_version=wl.kind.api_version, kind=wl.kind.kind, name=str(m.get("name")),
                                namespace=wl.namespace, uid=m.get("uid"))
        await self._event(ref, wl.namespace, request, reason, message, "Normal")

    def _exclude_param(self, request: ActionRequest) -> list[str]:
        exclude = request.params.get("exclude") or []
        if isinstance(exclude, str) or not isinstance(exclude, (list, tuple, set, frozenset)):
            raise PermanentError(f"{request.action.value} {request.target}: params.exclude must be a list of node names")
        return sorted({str(n) for n in exclude})

    async def _move(self, request: ActionRequest, exclude: list[str]) -> ActionResult:
        """Requeue (or restart) a workload in its controller's terms (see the module doc)."""
        if request.params.get("label_key"):  # a workload named by its pods' label alone
            return await self._delete_pods(request, frozenset(exclude))
        try:
            wl, pods = await self._resolve(request.target)
        except WorkloadGone as exc:
            return ActionResult(Outcome.already_so, f"{exc}: nothing of it is left to move")
        if wl is None:
            return await self._delete_pods(request, frozenset(exclude), pods)
        kueue = wk.kueue_managed(wl.obj)
        if wl.kind == wk.JOB and not kueue:
            return await self._delete_pods(request, frozenset(exclude), wl.pods)
        # a requeue that suspends and resumes records its steps on the job: the phase this
        # verdict reached ("" when it has not begun)
        verdict, phase = wk.requeue_mark(wl.obj, ANNOTATION_REQUEUE)
        phase = phase if verdict == request.verdict_id else ""
        if phase == "resumed":
            return ActionResult(Outcome.already_so, f"{wl.kind.kind} {wl.namespace}/{wl.name} already requeued "
                                                    f"for verdict {request.verdict_id}")
        done = self._ended(wl, exclude)
        if done is not None:
            return done
        if kueue:
            return await self._requeue_through_kueue(request, wl, exclude, phase)
        return await self._requeue_by_suspending(request, wl, exclude, phase)

    def _ended(self, wl: _Workload, exclude: list[str]) -> ActionResult | None:
        """``already_so`` for a workload that succeeded; a :class:`PermanentError` for one
        that failed (its controller let it fail for good: its restart policy is kept)."""
        ended = wk.finished(wl.obj)
        ref = f"{wl.kind.kind} {wl.namespace}/{wl.name}"
        if ended in ("Complete", "Succeeded"):
            return ActionResult(Outcome.already_so, f"{ref} already finished ({ended})")
        if ended == "Failed":
            policies = ", ".join(f"{k}: {v}" for k, v in wk.restart_policies(wl.kind, wl.obj).items())
            raise PermanentError(
                f"{ref} has failed for good under its restart policy ({policies}); fleetmedic does not "
                f"resubmit a failed job: resubmit it{' without ' + ', '.join(exclude) if exclude else ''}")
        return None

    async def _requeue_by_suspending(self, request: ActionRequest, wl: _Workload, exclude: list[str],
                                     phase: str) -> ActionResult:
        """A PyTorchJob: the suspect nodes excluded on every replica template and the job
        suspended in one conditional patch; once the training operator has stopped its pods,
        resumed.  Its progress is kept on the job (``fleetmedic.io/requeue``), so a retried
        or replayed action carries on where it was."""
        ref = f"{wl.kind.kind} {wl.namespace}/{wl.name}"
        if not phase:
            body = _merge(wk.exclusion_patch(wl.kind, wl.obj, exclude) if exclude else None,
                          wk.suspend_patch(wl.kind, True), _requeue_mark(wl, request, "suspended"))
            await self._patch(wl.kind, wl.namespace, wl.name, body)
            await self._job_event_on(wl, request, "FleetmedicRequeue",
                                     f"verdict {request.verdict_id}: suspended to restart"
                                     + (f" without {', '.join(exclude)}" if exclude else ""))
            raise Waiting(f"{ref} suspended{' with ' + ', '.join(exclude) + ' excluded' if exclude else ''}; "
                          "resumed once its controller has stopped its pods", delay=CONTROLLER_POLL_S)
        left = [p for p in await self._pods_of(wl.namespace, wl.name) if _phase(p) not in ("Succeeded", "Failed")]
        if left:
            raise Waiting(f"{ref} suspended; {len(left)} of its pods still to stop", delay=CONTROLLER_POLL_S)
        await self._patch(wl.kind, wl.namespace, wl.name,
                          _merge(wk.suspend_patch(wl.kind, False), _requeue_mark(wl, request, "resumed")))
        detail = (f"{ref} restarted from its last checkpoint"
                  + (f", kept off {', '.join(exclude)} by node affinity" if exclude else ""))
        await self._job_event_on(wl, request, "FleetmedicRequeue", f"verdict {request.verdict_id}: {detail}")
        return ActionResult(Outcome.applied, detail)

    async def _workloads_of(self, wl: _Workload) -> list[dict[str, Any]]:
        """Kueue's Workloads for the job (by the job-UID label Kueue sets)."""
        uid = wk.meta(wl.obj).get("uid")
        got = await self._call(
            f"list Workloads of {wl.namespace}/{wl.name}", self.custom.list_namespaced_custom_object,
            wk.WORKLOAD.group, wk.WORKLOAD.version, wl.namespace, wk.WORKLOAD.plural,
            label_selector=f"{wk.KUEUE_JOB_UID_LABEL}={uid}", tolerate=(404,),
        )
        items = cast("list[dict[str, Any]]", cast("dict[str, Any]", got or {}).get("items") or [])
        return [w for w in items if any(r.get("uid") == uid for r in wk.meta(w).get("ownerReferences") or [])]

    async def _set_active(self, workloads: list[dict[str, Any]], active: bool, ns: str) -> None:
        for w in workloads:
            if bool((w.get("spec") or {}).get("active", True)) != active:
                await self._patch(wk.WORKLOAD, ns, str(wk.meta(w).get("name")), {"spec": {"active": active}})

    async def _requeue_through_kueue(self, request: ActionRequest, wl: _Workload, exclude: list[str],
                                     phase: str) -> ActionResult:
        """A job Kueue admits: its Workload deactivated (Kueue evicts it and suspends the
        job); once suspended with its pods stopped, the suspect nodes excluded on its pod
        templates; the Workload activated again, so Kueue admits it anew.  Each step is
        recorded on the job (``fleetmedic.io/requeue``) and observed before the next."""
        ref = f"{wl.kind.kind} {wl.namespace}/{wl.name} (Kueue)"
        workloads = await self._workloads_of(wl)

        if not phase:
            if not workloads:
                raise Waiting(f"{ref}: Kueue has no Workload for it yet", delay=CONTROLLER_POLL_S)
            await self._patch(wl.kind, wl.namespace, wl.name, _requeue_mark(wl, request, "deactivated"))
            await self._set_active(workloads, False, wl.namespace)
            await self._job_event_on(wl, request, "FleetmedicRequeue",
                                     f"verdict {request.verdict_id}: Workload deactivated to requeue it")
            raise Waiting(f"{ref}: Workload deactivated; waiting for Kueue to suspend the job",
                          delay=CONTROLLER_POLL_S)
        if phase == "deactivated":
            if not wk.suspended(wl.kind, wl.obj):
                raise Waiting(f"{ref}: waiting for Kueue to suspend the job", delay=CONTROLLER_POLL_S)
            live = [p for p in await self._pods_of(wl.namespace, wl.name) if _phase(p) not in ("Succeeded", "Failed")]
            if live or (wl.kind == wk.JOB and (wl.obj.get("status") or {}).get("startTime")):
                raise Waiting(f"{ref}: suspended; {len(live)} of its pods still to stop", delay=CONTROLLER_POLL_S)
            body = _merge(wk.exclusion_patch(wl.kind, wl.obj, exclude) if exclude else None,
                          _requeue_mark(wl, request, "excluded"))
            await self._patch(wl.kind, wl.namespace, wl.name, body)
            raise Waiting(f"{ref}: nodes excluded; activating its Workload", delay=0.0)
        # excluded: Kueue may have replaced the Workload after the template changed
        await self._set_active(workloads, True, wl.namespace)
        await self._patch(wl.kind, wl.namespace, wl.name, _requeue_mark(wl, request, "resumed"))
        detail = (f"{ref} requeued through Kueue" + (f", kept off {', '.join(exclude)} by node affinity"
                                                        if exclude else ""))
        await self._job_event_on(wl, request, "FleetmedicRequeue", f"verdict {request.verdict_id}: {detail}")
        return ActionResult(Outcome.applied, detail)

    async def requeue(self, request: ActionRequest) -> ActionResult:
        """Move a workload off suspect nodes (``params["exclude"]``), in its controller's
        terms (see the module doc)."""
        return await self._reread_on_conflict(lambda r: self._move(r, self._exclude_param(r)), request)

    async def retry(self, request: ActionRequest) -> ActionResult:
        """Run a workload again, same placement allowed: a batch Job's failed pods deleted;
        a PyTorchJob or a Kueue job restarted as a whole."""
        return await self._reread_on_conflict(lambda r: self._move(r, []), request)

    async def checkpoint(self, request: ActionRequest) -> ActionResult:
        """Checkpoint-now: ask a workload to save its state by ``params["deadline"]``.

        Observes its live pods and its top owner.  Already so when each carries
        ``fleetmedic.io/checkpoint-requested`` with this deadline, or when nothing of it
        runs.  Otherwise annotates what lacks it (a pod reads it through the downward API,
        ``docs/checkpoint-now.md``) and records an Event on the owner.
        """
        try:
            deadline = datetime.fromtimestamp(float(request.params["deadline"]), tz=timezone.utc)
        except (KeyError, TypeError, ValueError, OverflowError, OSError) as exc:
            raise PermanentError(f"checkpoint {request.target}: params.deadline must be Unix seconds ({exc})") from exc
        value = _rfc3339(deadline)
        label_key = request.params.get("label_key")
        try:
            wl, pods = (None, []) if label_key else await self._resolve(request.target)
        except WorkloadGone as exc:
            return ActionResult(Outcome.already_so, f"{exc}: nothing runs to save its state")
        namespace, name = (wl.namespace, wl.name) if wl else self._job_ref(request.target)
        pods = pods or await self._pods_of(namespace, name, label_key)
        live = [p for p in pods if _phase(p) in ("Pending", "Running") and not _is_terminating(p)]
        if not live:
            return ActionResult(Outcome.already_so, f"job {namespace}/{name}: no running pod to save its state")
        todo = [p for p in live if (_meta(p).annotations or {}).get(ANNOTATION_CHECKPOINT) != value]
        owner_todo = wl is not None and (wk.meta(wl.obj).get("annotations") or {}).get(ANNOTATION_CHECKPOINT) != value
        if not todo and not owner_todo:
            return ActionResult(Outcome.already_so, f"job {namespace}/{name} already asked to checkpoint by {value}")
        body = {"metadata": {"annotations": {ANNOTATION_CHECKPOINT: value}}}
        if wl is not None and owner_todo:
            await self._patch(wl.kind, wl.namespace, wl.name, body)
        for pod in todo:
            await self._call(f"annotate pod {_pod_ref(pod)}", _unread(self.core.patch_namespaced_pod),
                             _meta(pod).name, namespace, body, field_manager=self.field_manager, tolerate=(404,))
        detail = (f"job {namespace}/{name} asked to save its state by {value} "
                  f"({ANNOTATION_CHECKPOINT} on {len(live)} pods{' and its ' + wl.kind.kind if wl else ''})")
        if wl is not None:
            await self._job_event_on(wl, request, "FleetmedicCheckpoint", f"verdict {request.verdict_id}: {detail}")
        return ActionResult(Outcome.applied, detail)

    async def stop(self, request: ActionRequest) -> ActionResult:
        """Stop retrying a workload.

        Observes it (none: :class:`PermanentError`).  Already so when it is suspended (or
        its Kueue Workload inactive) or has finished.  Otherwise suspends a batch Job or a
        PyTorchJob (its controller then stops its pods), or deactivates the Workload of a
        job that Kueue admits.
        """
        wl, _ = await self._resolve(request.target)
        if wl is None:
            raise PermanentError(f"job {request.target}: its pods have no owner that could be suspended")
        ref = f"{wl.kind.kind} {wl.namespace}/{wl.name}"
        ended = wk.finished(wl.obj)
        if ended:
            return ActionResult(Outcome.already_so, f"{ref} already finished ({ended})")
        if wk.kueue_managed(wl.obj):
            workloads = await self._workloads_of(wl)
            if workloads and all(not (w.get("spec") or {}).get("active", True) for w in workloads):
                return ActionResult(Outcome.already_so, f"{ref}: its Workload is already inactive")
            if not workloads:
                raise Waiting(f"{ref}: Kueue has no Workload for it yet", delay=CONTROLLER_POLL_S)
            await self._set_active(workloads, False, wl.namespace)
            what = "Workload deactivated (Kueue suspends the job)"
        else:
            if wk.suspended(wl.kind, wl.obj):
                return ActionResult(Outcome.already_so, f"{ref} already suspended")
            await self._patch(wl.kind, wl.namespace, wl.name, wk.suspend_patch(wl.kind, True))
            what = "suspended"
        await self._job_event_on(wl, request, "FleetmedicStop",
                                 f"verdict {request.verdict_id}: {what} ({request.reason or 'repeating failure'})")
        return ActionResult(Outcome.applied, f"{ref} {what}")


_Handler = Callable[[KubernetesBackend, ActionRequest], Awaitable[ActionResult]]

_HANDLERS: Mapping[ActionName, _Handler] = {
    ActionName.isolate: KubernetesBackend.isolate,
    ActionName.return_: KubernetesBackend.return_,
    ActionName.drain: KubernetesBackend.drain,
    ActionName.diagnose: KubernetesBackend.diagnose,
    ActionName.escalate: KubernetesBackend.escalate,
    ActionName.requeue: KubernetesBackend.requeue,
    ActionName.retry: KubernetesBackend.retry,
    ActionName.restart: KubernetesBackend.retry,
    ActionName.stop: KubernetesBackend.stop,
    ActionName.checkpoint: KubernetesBackend.checkpoint,
}
