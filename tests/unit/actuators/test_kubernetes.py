"""KubernetesBackend against small in-memory fakes of CoreV1Api and BatchV1Api.

The fakes keep objects as the API server does (JSON documents with camelCase fields),
apply patches the way a strategic merge does for the fields the backend touches
(maps merge, ``null`` deletes, lists replace, node conditions merge by ``type``), honour
``metadata.resourceVersion`` and UID preconditions, and raise :class:`ApiException` with
the status the real server would.  Every call is first bound against the real client
method's signature, so a misspelt keyword fails here as it would against the client.
Bodies the client would send are checked to use the API's field names.
"""

from __future__ import annotations

import copy
import inspect
import json
import re
import socket
from collections import defaultdict
from typing import Any

import pytest
import urllib3
from kubernetes.client import (
    CustomObjectsApi,
    ApiClient,
    BatchV1Api,
    CoreV1Api,
    CoreV1Event,
    V1DeleteOptions,
    V1Eviction,
    V1Job,
    V1Node,
    V1Pod,
    V1PodList,
)
from kubernetes.client.exceptions import ApiException

from actuators.base import ActionRequest, Backend, PermanentError, TemporaryError
from actuators.kubernetes import (
    ANNOTATION_CORDONED,
    ANNOTATION_ESCALATED,
    ANNOTATION_VERDICT,
    CONDITION_QUARANTINE,
    JOBSET_NAME_LABEL,
    Conflict,
    KubernetesBackend,
    diagnostics_job_name,
)
from actuators.retry import RetryPolicy, call_with_retry
from schemas import ActionName, Outcome

pytestmark = pytest.mark.asyncio

TAINT = "fleetmedic.dev/quarantine"
_SERIALIZER = ApiClient()


# --------------------------------------------------------------------------- fakes


def api_error(status: int, reason: str = "", *, retry_after: float | None = None) -> ApiException:
    """An ApiException shaped like the client raises it for an HTTP error."""
    exc = ApiException(status=status, reason=reason or "Error")
    exc.body = json.dumps({"kind": "Status", "status": "Failure", "code": status, "message": reason})
    if retry_after is not None:
        exc.headers = {"Retry-After": str(retry_after)}
    return exc


def _key_paths(doc: Any, prefix: str = "") -> set[str]:
    """Every key path of a JSON document, not descending into free-form maps."""
    paths: set[str] = set()
    if isinstance(doc, dict):
        for key, value in doc.items():
            path = f"{prefix}.{key}"
            paths.add(path)
            if key not in ("labels", "annotations", "limits", "requests"):
                paths |= _key_paths(value, path)
    elif isinstance(doc, list):
        for item in doc:
            paths |= _key_paths(item, prefix + "[]")
    return paths


def _checked(doc: dict[str, Any], model: type) -> Any:
    """``doc`` as ``model``; a field the API does not know is a 422, as with strict validation."""
    try:
        obj = model.from_dict(copy.deepcopy(doc))
    except ValueError as exc:
        raise api_error(422, f"invalid {model.__name__}: {exc}") from None
    unknown = _key_paths(doc) - _key_paths(_SERIALIZER.sanitize_for_serialization(obj))
    if unknown:
        raise api_error(422, f"unknown fields in {model.__name__}: {sorted(unknown)}")
    return obj


def _merge(target: dict[str, Any], patch: dict[str, Any], path: tuple[str, ...] = ()) -> None:
    for key, value in patch.items():
        here = (*path, key)
        if value is None:
            target.pop(key, None)
        elif here == ("status", "conditions"):
            conditions = {c["type"]: c for c in target.get(key, [])}
            for cond in value:
                conditions[cond["type"]] = {**conditions.get(cond["type"], {}), **cond}
            target[key] = list(conditions.values())
        elif isinstance(value, dict):
            if not isinstance(target.get(key), dict):
                target[key] = {}
            _merge(target[key], value, here)
        else:
            target[key] = copy.deepcopy(value)


def _selector(text: str) -> dict[str, str]:
    pairs = [p.split("=", 1) for p in text.split(",") if p]
    if any(len(p) != 2 for p in pairs):
        raise api_error(400, f"unsupported selector {text!r}")
    return dict(pairs)  # type: ignore[arg-type]


class _RawAnswer:
    """What the client returns with ``_preload_content=False``: the HTTP response, its body
    unread (urllib3's ``read`` and ``release_conn``), not a model."""

    def __init__(self, obj: Any) -> None:
        self.body = json.dumps(_SERIALIZER.sanitize_for_serialization(obj)).encode()
        self.released = False

    def read(self) -> bytes:
        return self.body

    def release_conn(self) -> None:
        self.released = True


def _answer(obj: Any, kwargs: dict[str, Any]) -> Any:
    return _RawAnswer(obj) if kwargs.get("_preload_content") is False else obj


class _FakeApi:
    """Shared plumbing: signature check, call log, injected failures, resource versions."""

    real: type

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = []
        self.failures: dict[str, list[BaseException]] = defaultdict(list)
        self._rv = 100

    def fail(self, method: str, *errors: BaseException) -> None:
        """Make the next calls of ``method`` raise ``errors``, one each."""
        self.failures[method].extend(errors)

    def calls_to(self, method: str) -> list[tuple[tuple[Any, ...], dict[str, Any]]]:
        return [(a, k) for m, a, k in self.calls if m == method]

    def _enter(self, method: str, *args: Any, **kwargs: Any) -> None:
        inspect.signature(getattr(self.real, method)).bind(self, *args, **kwargs)
        self.calls.append((method, args, kwargs))
        if self.failures[method]:
            raise self.failures[method].pop(0)

    def _created(self, method: str, namespace: str, body: Any, model: type, **kwargs: Any) -> dict[str, Any]:
        """The checked document of a create call's body (the call logged as any other)."""
        self._enter(method, namespace, body, **kwargs)
        assert isinstance(body, model)
        doc = _SERIALIZER.sanitize_for_serialization(body)
        _checked(doc, model)
        return doc

    def _bump(self, doc: dict[str, Any]) -> None:
        self._rv += 1
        doc.setdefault("metadata", {})["resourceVersion"] = str(self._rv)

    @staticmethod
    def _precondition(doc: dict[str, Any], body: Any) -> None:
        uid = getattr(getattr(body, "preconditions", None), "uid", None)
        if uid is not None and uid != doc["metadata"].get("uid"):
            raise api_error(409, "Precondition failed: UID mismatch")

    def _patch(self, doc: dict[str, Any], body: Any, model: type, *, part: str) -> Any:
        assert isinstance(body, dict), "a patch body is a dict"
        want_rv = body.get("metadata", {}).get("resourceVersion")
        if want_rv is not None and want_rv != doc["metadata"]["resourceVersion"]:
            raise api_error(409, "the object has been modified; please apply your changes to the latest version")
        merged = copy.deepcopy(doc)
        if part == "status":
            _merge(merged, {"status": body.get("status", {})})
        else:
            _merge(merged, {k: v for k, v in body.items() if k != "status"})
        _checked(merged, model)
        doc.clear()
        doc.update(merged)
        self._bump(doc)
        return model.from_dict(copy.deepcopy(doc))


class FakeCoreV1Api(_FakeApi):
    """In-memory nodes, pods and events; only the methods the backend calls."""

    real = CoreV1Api

    def __init__(self) -> None:
        super().__init__()
        self.nodes: dict[str, dict[str, Any]] = {}
        self.pods: dict[tuple[str, str], dict[str, Any]] = {}
        self.events: dict[tuple[str, str], dict[str, Any]] = {}
        #: pods whose eviction a PodDisruptionBudget refuses (429)
        self.pdb_blocked: set[tuple[str, str]] = set()
        self.evicted: list[tuple[str, str]] = []
        self.deleted: list[tuple[str, str]] = []

    # -- setup helpers

    def add_node(
        self,
        name: str,
        *,
        taints: list[dict[str, Any]] | None = None,
        unschedulable: bool = False,
        annotations: dict[str, str] | None = None,
    ) -> None:
        doc: dict[str, Any] = {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {"name": name, "uid": f"uid-node-{name}", "annotations": dict(annotations or {})},
            "spec": {"taints": list(taints or [])},
            "status": {"conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady"}]},
        }
        if unschedulable:
            doc["spec"]["unschedulable"] = True
        self._bump(doc)
        self.nodes[name] = doc

    def add_pod(
        self,
        namespace: str,
        name: str,
        node: str,
        *,
        phase: str = "Running",
        labels: dict[str, str] | None = None,
        owner_kind: str | None = None,
        mirror: bool = False,
        terminating: bool = False,
    ) -> None:
        meta: dict[str, Any] = {
            "name": name, "namespace": namespace, "uid": f"uid-{namespace}-{name}", "labels": dict(labels or {})
        }
        if owner_kind:
            meta["ownerReferences"] = [
                {"apiVersion": "apps/v1", "kind": owner_kind, "name": "owner", "uid": "uid-owner", "controller": True}
            ]
        if mirror:
            meta["annotations"] = {"kubernetes.io/config.mirror": "abc"}
        if terminating:
            meta["deletionTimestamp"] = "2024-01-01T00:00:00Z"
        doc = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": meta,
            "spec": {"nodeName": node, "containers": [{"name": "main", "image": "busybox"}]},
            "status": {"phase": phase},
        }
        self._bump(doc)
        self.pods[(namespace, name)] = doc

    def node(self, name: str) -> V1Node:
        return V1Node.from_dict(copy.deepcopy(self.nodes[name]))

    def _node_doc(self, name: str) -> dict[str, Any]:
        if name not in self.nodes:
            raise api_error(404, f'nodes "{name}" not found')
        return self.nodes[name]

    def _pod_doc(self, namespace: str, name: str) -> dict[str, Any]:
        if (namespace, name) not in self.pods:
            raise api_error(404, f'pods "{name}" not found')
        return self.pods[(namespace, name)]

    @staticmethod
    def _pod_list(docs: list[dict[str, Any]]) -> V1PodList:
        listed = {"apiVersion": "v1", "kind": "PodList", "metadata": {}, "items": copy.deepcopy(docs)}
        return V1PodList.from_dict(listed)

    # -- the API

    def read_node(self, name: str, **kwargs: Any) -> V1Node:
        self._enter("read_node", name, **kwargs)
        return V1Node.from_dict(copy.deepcopy(self._node_doc(name)))

    def patch_node(self, name: str, body: Any, **kwargs: Any) -> V1Node:
        self._enter("patch_node", name, body, **kwargs)
        return _answer(self._patch(self._node_doc(name), body, V1Node, part="main"), kwargs)

    def patch_node_status(self, name: str, body: Any, **kwargs: Any) -> V1Node:
        self._enter("patch_node_status", name, body, **kwargs)
        return _answer(self._patch(self._node_doc(name), body, V1Node, part="status"), kwargs)

    def list_pod_for_all_namespaces(self, **kwargs: Any) -> V1PodList:
        self._enter("list_pod_for_all_namespaces", **kwargs)
        fields = _selector(kwargs.get("field_selector") or "")
        if set(fields) - {"spec.nodeName"}:
            raise api_error(400, f"field selector {fields} not supported by this fake")
        node = fields.get("spec.nodeName")
        return self._pod_list([d for d in self.pods.values() if node is None or d["spec"].get("nodeName") == node])

    def list_namespaced_pod(self, namespace: str, **kwargs: Any) -> V1PodList:
        self._enter("list_namespaced_pod", namespace, **kwargs)
        want = _selector(kwargs.get("label_selector") or "")
        docs = [
            d
            for (ns, _), d in self.pods.items()
            if ns == namespace and all(d["metadata"]["labels"].get(k) == v for k, v in want.items())
        ]
        return self._pod_list(docs)

    def create_namespaced_pod_eviction(self, name: str, namespace: str, body: Any, **kwargs: Any) -> V1Eviction:
        self._enter("create_namespaced_pod_eviction", name, namespace, body, **kwargs)
        assert isinstance(body, V1Eviction)
        assert body.metadata.name == name and body.metadata.namespace == namespace
        doc = self._pod_doc(namespace, name)
        self._precondition(doc, body.delete_options)
        if (namespace, name) in self.pdb_blocked:
            raise api_error(429, "Cannot evict pod as it would violate the pod's disruption budget.", retry_after=10)
        del self.pods[(namespace, name)]
        self.evicted.append((namespace, name))
        return body

    def patch_namespaced_pod(self, name: str, namespace: str, body: Any, **kwargs: Any) -> V1Pod:
        self._enter("patch_namespaced_pod", name, namespace, body, **kwargs)
        return _answer(self._patch(self._pod_doc(namespace, name), body, V1Pod, part="main"), kwargs)

    def delete_namespaced_pod(self, name: str, namespace: str, **kwargs: Any) -> V1Pod:
        self._enter("delete_namespaced_pod", name, namespace, **kwargs)
        body = kwargs.get("body")
        assert body is None or isinstance(body, V1DeleteOptions)
        doc = self._pod_doc(namespace, name)
        self._precondition(doc, body)
        del self.pods[(namespace, name)]
        self.deleted.append((namespace, name))
        return V1Pod.from_dict(copy.deepcopy(doc))

    def create_namespaced_event(self, namespace: str, body: Any, **kwargs: Any) -> CoreV1Event:
        doc = self._created("create_namespaced_event", namespace, body, CoreV1Event, **kwargs)
        name = doc["metadata"]["name"]
        if doc["metadata"].get("namespace", namespace) != namespace:
            raise api_error(400, "the namespace of the object does not match the namespace on the request")
        if not doc["involvedObject"].get("namespace") and namespace not in ("", "default"):
            raise api_error(422, "involvedObject.namespace: does not match event.namespace")
        if (namespace, name) in self.events:
            raise api_error(409, f'events "{name}" already exists')
        self.events[(namespace, name)] = doc
        return _answer(body, kwargs)


class FakeBatchV1Api(_FakeApi):
    """In-memory batch Jobs; only the methods the backend calls."""

    real = BatchV1Api

    def __init__(self) -> None:
        super().__init__()
        self.jobs: dict[tuple[str, str], dict[str, Any]] = {}

    def add_job(
        self,
        namespace: str,
        name: str,
        *,
        labels: dict[str, str] | None = None,
        suspend: bool = False,
        conditions: list[dict[str, Any]] | None = None,
    ) -> None:
        doc = {
            "apiVersion": "batch/v1",
            "kind": "Job",
            "metadata": {"name": name, "namespace": namespace, "uid": f"uid-job-{name}", "labels": dict(labels or {})},
            "spec": {
                "suspend": suspend,
                "template": {"spec": {"restartPolicy": "Never", "containers": [{"name": "main", "image": "busybox"}]}},
            },
            "status": {"conditions": list(conditions or [])},
        }
        self._bump(doc)
        self.jobs[(namespace, name)] = doc

    def job(self, namespace: str, name: str) -> V1Job:
        return V1Job.from_dict(copy.deepcopy(self.jobs[(namespace, name)]))

    def _job_doc(self, namespace: str, name: str) -> dict[str, Any]:
        if (namespace, name) not in self.jobs:
            raise api_error(404, f'jobs.batch "{name}" not found')
        return self.jobs[(namespace, name)]

    def read_namespaced_job(self, name: str, namespace: str, **kwargs: Any) -> V1Job:
        self._enter("read_namespaced_job", name, namespace, **kwargs)
        return V1Job.from_dict(copy.deepcopy(self._job_doc(namespace, name)))

    def create_namespaced_job(self, namespace: str, body: Any, **kwargs: Any) -> V1Job:
        doc = self._created("create_namespaced_job", namespace, body, V1Job, **kwargs)
        name = doc["metadata"]["name"]
        if not re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", name) or len(name) > 63:
            raise api_error(422, f"Job.batch {name!r} is invalid: metadata.name")
        if (namespace, name) in self.jobs:
            raise api_error(409, f'jobs.batch "{name}" already exists')
        doc["metadata"].update(namespace=namespace, uid=f"uid-job-{name}")
        self._bump(doc)
        self.jobs[(namespace, name)] = doc
        return V1Job.from_dict(copy.deepcopy(doc))

    def patch_namespaced_job(self, name: str, namespace: str, body: Any, **kwargs: Any) -> V1Job:
        self._enter("patch_namespaced_job", name, namespace, body, **kwargs)
        return self._patch(self._job_doc(namespace, name), body, V1Job, part="main")


class FakeCustomObjectsApi(_FakeApi):
    """Objects served as JSON by group/version/plural: batch Jobs (the batch fake's),
    PyTorchJobs and Kueue Workloads, with JSON merge patches (resourceVersion checked)."""

    real = CustomObjectsApi

    def __init__(self, batch: FakeBatchV1Api) -> None:
        super().__init__()
        self.batch = batch
        self.objects: dict[tuple[str, str, str, str], dict[str, Any]] = {}

    def _store(self, group: str, plural: str) -> Any:
        return None if (group, plural) == ("batch", "jobs") else plural

    def add(self, doc: dict[str, Any], plural: str) -> dict[str, Any]:
        group = doc["apiVersion"].split("/")[0]
        m = doc["metadata"]
        m.setdefault("uid", f"uid-{plural}-{m['name']}")
        self._bump(doc)
        self.objects[(group, plural, m["namespace"], m["name"])] = doc
        return doc

    def _doc(self, group: str, namespace: str, plural: str, name: str) -> dict[str, Any]:
        if (group, plural) == ("batch", "jobs"):
            return self.batch._job_doc(namespace, name)
        if (group, plural, namespace, name) not in self.objects:
            raise api_error(404, f'{plural}.{group} "{name}" not found')
        return self.objects[(group, plural, namespace, name)]

    def get_namespaced_custom_object(self, group: str, version: str, namespace: str, plural: str, name: str,
                                     **kwargs: Any) -> Any:
        self._enter("get_namespaced_custom_object", group, version, namespace, plural, name, **kwargs)
        return copy.deepcopy(self._doc(group, namespace, plural, name))

    def list_namespaced_custom_object(self, group: str, version: str, namespace: str, plural: str,
                                      **kwargs: Any) -> Any:
        self._enter("list_namespaced_custom_object", group, version, namespace, plural, **kwargs)
        want = _selector(kwargs.get("label_selector") or "")
        items = [copy.deepcopy(d) for (g, pl, ns, _), d in self.objects.items()
                 if (g, pl, ns) == (group, plural, namespace)
                 and all((d["metadata"].get("labels") or {}).get(k) == v for k, v in want.items())]
        return {"items": items}

    def patch_namespaced_custom_object(self, group: str, version: str, namespace: str, plural: str, name: str,
                                       body: Any, **kwargs: Any) -> Any:
        self._enter("patch_namespaced_custom_object", group, version, namespace, plural, name, body, **kwargs)
        doc = self._doc(group, namespace, plural, name)
        want_rv = body.get("metadata", {}).get("resourceVersion")
        if want_rv is not None and want_rv != doc["metadata"]["resourceVersion"]:
            raise api_error(409, "the object has been modified; please apply your changes to the latest version")
        body = copy.deepcopy(body)
        body.get("metadata", {}).pop("resourceVersion", None)
        _merge(doc, body)
        self._bump(doc)
        return _answer(copy.deepcopy(doc), kwargs)


# --------------------------------------------------------------------------- helpers


@pytest.fixture
def core() -> FakeCoreV1Api:
    return FakeCoreV1Api()


@pytest.fixture
def batch() -> FakeBatchV1Api:
    return FakeBatchV1Api()


@pytest.fixture
def custom(batch: FakeBatchV1Api) -> FakeCustomObjectsApi:
    return FakeCustomObjectsApi(batch)


@pytest.fixture
def backend(core: FakeCoreV1Api, batch: FakeBatchV1Api, custom: FakeCustomObjectsApi) -> KubernetesBackend:
    return KubernetesBackend(core, batch, custom=custom)  # type: ignore[arg-type]


def req(action: ActionName, target: str, verdict: str = "v-1", reason: str = "xid 79", **params: Any) -> ActionRequest:
    return ActionRequest(verdict_id=verdict, action=action, target=target, params=params, reason=reason)


def taint_keys(node: V1Node) -> list[tuple[str, str | None]]:
    return [(t.key, t.value) for t in node.spec.taints or []]


def condition(node: V1Node, kind: str = CONDITION_QUARANTINE) -> str | None:
    return next((c.status for c in node.status.conditions or [] if c.type == kind), None)


FOREIGN = {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}


# --------------------------------------------------------------------------- protocol


async def test_is_a_backend_that_supports_every_action(backend: KubernetesBackend) -> None:
    assert isinstance(backend, Backend)
    assert backend.name == "kubernetes"
    assert all(backend.supports(a) for a in ActionName)


# --------------------------------------------------------------------------- isolate / return


async def test_isolate_twice_is_applied_then_already_so_and_keeps_foreign_taints(
    backend: KubernetesBackend, core: FakeCoreV1Api
) -> None:
    core.add_node("n1", taints=[FOREIGN])
    first = await backend.apply(req(ActionName.isolate, "n1", reason="gpu_hardware", fault_class="gpu_hardware"))
    assert first.outcome is Outcome.applied
    node = core.node("n1")
    assert node.spec.unschedulable is True
    assert taint_keys(node) == [("nvidia.com/gpu", "present"), (TAINT, "gpu_hardware")]
    assert node.metadata.annotations[ANNOTATION_VERDICT] == "v-1"
    assert node.metadata.annotations[ANNOTATION_CORDONED] == "true"
    assert condition(node) == "True" and condition(node, "Ready") == "True"
    [event] = core.events.values()
    assert event["reason"] == "FleetmedicIsolate" and "v-1" in event["message"]
    assert event["involvedObject"] == {"apiVersion": "v1", "kind": "Node", "name": "n1", "uid": "uid-node-n1"}

    writes = len(core.calls_to("patch_node")) + len(core.calls_to("patch_node_status"))
    second = await backend.apply(req(ActionName.isolate, "n1", fault_class="gpu_hardware"))
    assert second.outcome is Outcome.already_so
    assert len(core.calls_to("patch_node")) + len(core.calls_to("patch_node_status")) == writes
    assert taint_keys(core.node("n1")) == [("nvidia.com/gpu", "present"), (TAINT, "gpu_hardware")]


async def test_isolate_patch_is_conditional_on_the_resource_version_read(
    backend: KubernetesBackend, core: FakeCoreV1Api
) -> None:
    core.add_node("n1")
    rv = core.nodes["n1"]["metadata"]["resourceVersion"]
    await backend.apply(req(ActionName.isolate, "n1"))
    [(args, kwargs)] = core.calls_to("patch_node")
    assert args[1]["metadata"]["resourceVersion"] == rv
    assert kwargs["_content_type"] == "application/strategic-merge-patch+json"
    assert kwargs["field_manager"] == "fleetmedic"


async def test_isolate_taint_value_is_the_fault_class_else_suspect(
    backend: KubernetesBackend, core: FakeCoreV1Api
) -> None:
    core.add_node("n1")
    core.add_node("n2")
    await backend.apply(req(ActionName.isolate, "n1"))
    await backend.apply(ActionRequest("v-2", ActionName.isolate, "n2", {"reason": "nvlink"}))
    assert taint_keys(core.node("n1")) == [(TAINT, "suspect")]
    assert taint_keys(core.node("n2")) == [(TAINT, "nvlink")]
    await backend.apply(ActionRequest("v-3", ActionName.isolate, "n2", {"reason": "gpu_memory"}))
    assert taint_keys(core.node("n2")) == [(TAINT, "nvlink")]  # already isolated: unchanged


async def test_isolate_rereads_a_concurrently_changed_node_and_applies_at_once(
    backend: KubernetesBackend, core: FakeCoreV1Api
) -> None:
    core.add_node("n1")
    core.fail("patch_node", *[api_error(409, "the object has been modified")] * 2)
    assert (await backend.apply(req(ActionName.isolate, "n1"))).outcome is Outcome.applied
    assert len(core.calls_to("read_node")) == 3 and len(core.calls_to("patch_node")) == 3
    assert core.node("n1").spec.unschedulable


async def test_isolate_on_a_node_that_keeps_changing_is_temporary_and_a_later_try_succeeds(
    backend: KubernetesBackend, core: FakeCoreV1Api
) -> None:
    core.add_node("n1")
    core.fail("patch_node", *[api_error(409, "the object has been modified")] * 4)
    with pytest.raises(TemporaryError, match="409") as caught:
        await backend.apply(req(ActionName.isolate, "n1"))
    assert type(caught.value) is Conflict  # a TemporaryError: the runner tries it again later
    assert len(core.calls_to("patch_node")) == 4
    assert (await backend.apply(req(ActionName.isolate, "n1"))).outcome is Outcome.applied


async def test_isolate_sets_the_condition_left_out_by_an_interrupted_attempt(
    backend: KubernetesBackend, core: FakeCoreV1Api
) -> None:
    core.add_node("n1")
    core.fail("patch_node_status", api_error(503, "unavailable"))
    with pytest.raises(TemporaryError):
        await backend.apply(req(ActionName.isolate, "n1"))
    assert core.node("n1").spec.unschedulable is True and condition(core.node("n1")) is None
    result = await backend.apply(req(ActionName.isolate, "n1"))
    assert result.outcome is Outcome.applied and "condition" in result.detail
    assert condition(core.node("n1")) == "True"


async def test_isolate_an_unknown_node_is_permanent(backend: KubernetesBackend) -> None:
    with pytest.raises(PermanentError, match="not found"):
        await backend.apply(req(ActionName.isolate, "ghost"))


async def test_a_failed_event_does_not_fail_the_isolation(backend: KubernetesBackend, core: FakeCoreV1Api) -> None:
    core.add_node("n1")
    core.fail("create_namespaced_event", api_error(403, "events is forbidden"))
    assert (await backend.apply(req(ActionName.isolate, "n1"))).outcome is Outcome.applied
    assert core.node("n1").spec.unschedulable is True


async def test_return_after_isolate_removes_our_marks_only(backend: KubernetesBackend, core: FakeCoreV1Api) -> None:
    core.add_node("n1", taints=[FOREIGN], annotations={"team": "ml"})
    await backend.apply(req(ActionName.isolate, "n1"))
    result = await backend.apply(req(ActionName.return_, "n1", verdict="v-2"))
    assert result.outcome is Outcome.applied
    node = core.node("n1")
    assert not node.spec.unschedulable
    assert taint_keys(node) == [("nvidia.com/gpu", "present")]
    assert node.metadata.annotations == {"team": "ml"}
    assert condition(node) == "False"
    again = await backend.apply(req(ActionName.return_, "n1", verdict="v-2"))
    assert again.outcome is Outcome.already_so


async def test_return_of_a_human_cordoned_node_leaves_the_cordon(
    backend: KubernetesBackend, core: FakeCoreV1Api
) -> None:
    core.add_node("n1", unschedulable=True)
    await backend.apply(req(ActionName.isolate, "n1"))
    assert ANNOTATION_CORDONED not in core.node("n1").metadata.annotations
    result = await backend.apply(req(ActionName.return_, "n1"))
    assert result.outcome is Outcome.applied
    assert "cordon left in place" in result.detail
    node = core.node("n1")
    assert node.spec.unschedulable is True and taint_keys(node) == []


async def test_return_of_a_node_never_isolated_is_already_so_and_keeps_a_human_cordon(
    backend: KubernetesBackend, core: FakeCoreV1Api
) -> None:
    core.add_node("n1", unschedulable=True)
    result = await backend.apply(req(ActionName.return_, "n1"))
    assert result.outcome is Outcome.already_so and "cordon left in place" in result.detail
    assert core.node("n1").spec.unschedulable is True
    assert core.calls_to("patch_node") == []


# --------------------------------------------------------------------------- drain


async def test_drain_evicts_workload_pods_and_skips_node_bound_ones(
    backend: KubernetesBackend, core: FakeCoreV1Api
) -> None:
    core.add_node("n1")
    core.add_pod("ml", "train-0", "n1")
    core.add_pod("ml", "train-1", "n1")
    core.add_pod("kube-system", "dcgm-exporter-x", "n1", owner_kind="DaemonSet")
    core.add_pod("kube-system", "kube-proxy-n1", "n1", mirror=True)
    core.add_pod("ml", "old", "n1", terminating=True)
    core.add_pod("ml", "done", "n1", phase="Succeeded")
    core.add_pod("ml", "elsewhere", "n2")
    result = await backend.apply(req(ActionName.drain, "n1", not_before_checkpoint=True))
    assert result.outcome is Outcome.applied
    assert sorted(core.evicted) == [("ml", "train-0"), ("ml", "train-1")]
    assert core.node("n1").spec.unschedulable is True
    assert core.node("n1").metadata.annotations[ANNOTATION_CORDONED] == "true"
    assert core.calls_to("list_pod_for_all_namespaces")[0][1]["field_selector"] == "spec.nodeName=n1"
    assert (await backend.apply(req(ActionName.drain, "n1"))).outcome is Outcome.already_so


async def test_drain_refused_by_a_disruption_budget_is_temporary(
    backend: KubernetesBackend, core: FakeCoreV1Api
) -> None:
    core.add_node("n1", unschedulable=True)
    core.add_pod("ml", "guarded", "n1")
    core.add_pod("ml", "free", "n1")
    core.pdb_blocked.add(("ml", "guarded"))
    with pytest.raises(TemporaryError, match="disruption budget") as caught:
        await backend.apply(req(ActionName.drain, "n1"))
    assert caught.value.delay == 10.0
    assert core.evicted == [("ml", "free")]
    core.pdb_blocked.clear()
    assert (await backend.apply(req(ActionName.drain, "n1"))).outcome is Outcome.applied
    assert (await backend.apply(req(ActionName.drain, "n1"))).outcome is Outcome.already_so


async def test_drain_counts_a_pod_gone_meanwhile_as_evicted(backend: KubernetesBackend, core: FakeCoreV1Api) -> None:
    core.add_node("n1", unschedulable=True)
    core.add_pod("ml", "p", "n1")
    core.fail("create_namespaced_pod_eviction", api_error(404, 'pods "p" not found'))
    assert (await backend.apply(req(ActionName.drain, "n1"))).outcome is Outcome.applied


# --------------------------------------------------------------------------- job actions


def _job_pods(core: FakeCoreV1Api, job: str = "train", ns: str = "ml", key: str = "job-name") -> None:
    core.add_pod(ns, f"{job}-a", "n2", phase="Failed", labels={key: job})
    core.add_pod(ns, f"{job}-b", "n1", labels={key: job})
    core.add_pod(ns, f"{job}-c", "n3", labels={key: job})
    core.add_pod(ns, f"{job}-d", "n1", phase="Succeeded", labels={key: job})
    core.add_pod(ns, "other-x", "n1", labels={key: "other"})


async def test_requeue_deletes_only_failed_and_excluded_pods_then_is_already_so(
    backend: KubernetesBackend, core: FakeCoreV1Api
) -> None:
    _job_pods(core)
    result = await backend.apply(req(ActionName.requeue, "ml/train", exclude=["n1"]))
    assert result.outcome is Outcome.applied
    assert sorted(core.deleted) == [("ml", "train-a"), ("ml", "train-b")]
    [(_, kwargs)] = core.calls_to("list_namespaced_pod")
    assert kwargs["label_selector"] == "job-name=train"
    again = await backend.apply(req(ActionName.requeue, "ml/train", exclude=["n1"]))
    assert again.outcome is Outcome.already_so


async def test_requeue_a_jobset_in_the_default_job_namespace(core: FakeCoreV1Api, batch: FakeBatchV1Api) -> None:
    backend = KubernetesBackend(
        core, batch, job_namespace="ml", job_label_key=JOBSET_NAME_LABEL,  # type: ignore[arg-type]
        custom=FakeCustomObjectsApi(batch),  # type: ignore[arg-type]
    )
    _job_pods(core, key=JOBSET_NAME_LABEL)
    assert (await backend.apply(req(ActionName.requeue, "train", exclude=["n3"]))).outcome is Outcome.applied
    assert sorted(core.deleted) == [("ml", "train-a"), ("ml", "train-c")]


async def test_requeue_with_a_bad_job_id_or_exclude_list_is_permanent(
    backend: KubernetesBackend, core: FakeCoreV1Api
) -> None:
    with pytest.raises(PermanentError, match="job id"):
        await backend.apply(req(ActionName.requeue, "a/b/c"))
    with pytest.raises(PermanentError, match="exclude"):
        await backend.apply(req(ActionName.requeue, "ml/train", exclude="n1"))


async def test_retry_and_restart_delete_failed_pods_only(backend: KubernetesBackend, core: FakeCoreV1Api) -> None:
    _job_pods(core)
    assert (await backend.apply(req(ActionName.retry, "ml/train", exclude=["n1"]))).outcome is Outcome.applied
    assert core.deleted == [("ml", "train-a")]
    assert (await backend.apply(req(ActionName.restart, "ml/train"))).outcome is Outcome.already_so


async def test_stop_suspends_the_job_once(backend: KubernetesBackend, batch: FakeBatchV1Api,
                                          custom: FakeCustomObjectsApi) -> None:
    batch.add_job("ml", "train")
    assert (await backend.apply(req(ActionName.stop, "ml/train"))).outcome is Outcome.applied
    assert batch.job("ml", "train").spec.suspend is True
    assert (await backend.apply(req(ActionName.stop, "ml/train"))).outcome is Outcome.already_so
    assert len(custom.calls_to("patch_namespaced_custom_object")) == 1


async def test_stop_a_finished_job_is_already_so_and_an_unknown_one_permanent(
    backend: KubernetesBackend, batch: FakeBatchV1Api
) -> None:
    batch.add_job("ml", "done", conditions=[{"type": "Failed", "status": "True"}])
    assert (await backend.apply(req(ActionName.stop, "ml/done"))).outcome is Outcome.already_so
    with pytest.raises(PermanentError, match="not found"):
        await backend.apply(req(ActionName.stop, "ml/ghost"))


# --------------------------------------------------------------------------- diagnose / escalate


async def test_diagnose_creates_one_pinned_job_then_is_already_so(
    backend: KubernetesBackend, core: FakeCoreV1Api, batch: FakeBatchV1Api
) -> None:
    core.add_node("gpu-node-1")
    first = await backend.apply(req(ActionName.diagnose, "gpu-node-1", verdict="v-7"))
    assert first.outcome is Outcome.applied
    [(namespace, name)] = batch.jobs
    assert namespace == "fleetmedic" and name == diagnostics_job_name("gpu-node-1", "v-7")
    assert name.startswith("fleetmedic-diag-gpu-node-1-")
    job = batch.job(namespace, name)
    assert job.metadata.labels["fleetmedic.dev/node"] == "gpu-node-1"
    assert job.metadata.labels["fleetmedic.dev/verdict"] == "v-7"
    assert job.spec.backoff_limit == 0
    pod = job.spec.template.spec
    assert pod.restart_policy == "Never"
    [term] = pod.affinity.node_affinity.required_during_scheduling_ignored_during_execution.node_selector_terms
    assert [(r.key, r.operator, r.values) for r in term.match_fields] == [("metadata.name", "In", ["gpu-node-1"])]
    assert {(t.key, t.effect) for t in pod.tolerations} == {
        (TAINT, "NoSchedule"),
        ("node.kubernetes.io/unschedulable", "NoSchedule"),
    }
    [container] = pod.containers
    assert container.command == ["dcgmi", "diag", "-r", "2"]
    assert container.resources.limits == {"nvidia.com/gpu": "8"}

    second = await backend.apply(req(ActionName.diagnose, "gpu-node-1", verdict="v-7"))
    assert second.outcome is Outcome.already_so
    assert len(batch.jobs) == 1


async def test_diagnose_loses_a_create_race_to_itself_as_already_so(
    backend: KubernetesBackend, core: FakeCoreV1Api, batch: FakeBatchV1Api
) -> None:
    core.add_node("n1")
    await backend.apply(req(ActionName.diagnose, "n1"))
    batch.fail("read_namespaced_job", api_error(404, "not found"))
    assert (await backend.apply(req(ActionName.diagnose, "n1"))).outcome is Outcome.already_so


async def test_diagnose_refuses_a_foreign_job_with_the_same_name(
    backend: KubernetesBackend, core: FakeCoreV1Api, batch: FakeBatchV1Api
) -> None:
    core.add_node("n1")
    batch.add_job("fleetmedic", diagnostics_job_name("n1", "v-1"), labels={"app": "someone-else"})
    with pytest.raises(PermanentError, match="not ours"):
        await backend.apply(req(ActionName.diagnose, "n1"))


async def test_diagnose_job_name_is_a_short_dns_label_for_long_node_names(
    backend: KubernetesBackend, core: FakeCoreV1Api, batch: FakeBatchV1Api
) -> None:
    long = "ip-10-0-12-34.us-west-2.compute.internal.a-very-long-cluster-domain.example.com"
    core.add_node(long)
    assert (await backend.apply(req(ActionName.diagnose, long, gpus=4))).outcome is Outcome.applied
    [(_, name)] = batch.jobs
    assert len(name) <= 63 and re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", name)
    assert diagnostics_job_name(long, "v-1") != diagnostics_job_name(long + "x", "v-1")
    assert batch.job("fleetmedic", name).spec.template.spec.containers[0].resources.limits == {"nvidia.com/gpu": "4"}


async def test_diagnose_an_unknown_node_is_permanent(backend: KubernetesBackend, batch: FakeBatchV1Api) -> None:
    with pytest.raises(PermanentError, match="not found"):
        await backend.apply(req(ActionName.diagnose, "ghost"))
    assert batch.jobs == {}


async def test_escalate_annotates_and_emits_an_event_once(backend: KubernetesBackend, core: FakeCoreV1Api) -> None:
    core.add_node("n1")
    assert (await backend.apply(req(ActionName.escalate, "n1", reason="lemon"))).outcome is Outcome.applied
    assert core.node("n1").metadata.annotations[ANNOTATION_ESCALATED] == "v-1"
    [event] = core.events.values()
    assert event["reason"] == "FleetmedicEscalate" and event["type"] == "Warning"
    assert (await backend.apply(req(ActionName.escalate, "n1"))).outcome is Outcome.already_so
    assert (await backend.apply(req(ActionName.escalate, "n1", verdict="v-9"))).outcome is Outcome.applied


# --------------------------------------------------------------------------- error mapping and retry


@pytest.mark.parametrize(
    ("status", "error"),
    [(503, TemporaryError), (500, TemporaryError), (429, TemporaryError),
     (403, PermanentError), (401, PermanentError), (400, PermanentError), (422, PermanentError)],
)
async def test_api_statuses_map_to_typed_errors(
    backend: KubernetesBackend, core: FakeCoreV1Api, status: int, error: type[Exception]
) -> None:
    core.add_node("n1")
    core.fail("read_node", api_error(status, "boom"))
    with pytest.raises(error) as caught:
        await backend.apply(req(ActionName.isolate, "n1"))
    assert type(caught.value) is error


async def test_retry_after_becomes_the_delay(backend: KubernetesBackend, core: FakeCoreV1Api) -> None:
    core.add_node("n1")
    core.fail("read_node", api_error(503, "busy", retry_after=7))
    with pytest.raises(TemporaryError) as caught:
        await backend.apply(req(ActionName.isolate, "n1"))
    assert caught.value.delay == 7.0


async def test_connection_failures_are_temporary(backend: KubernetesBackend, core: FakeCoreV1Api) -> None:
    core.add_node("n1")
    refused = urllib3.exceptions.NewConnectionError(None, "Connection refused")  # type: ignore[arg-type]
    gave_up = urllib3.exceptions.MaxRetryError(None, "/api/v1/nodes/n1", refused)  # type: ignore[arg-type]
    core.fail("read_node", gave_up)
    with pytest.raises(TemporaryError, match="MaxRetryError"):
        await backend.apply(req(ActionName.isolate, "n1"))


async def test_call_with_retry_rides_out_two_503s(backend: KubernetesBackend, core: FakeCoreV1Api) -> None:
    core.add_node("n1")
    core.fail("read_node", api_error(503, "unavailable"), api_error(503, "unavailable"))
    slept: list[float] = []

    async def no_sleep(delay: float) -> None:
        slept.append(delay)

    request = req(ActionName.isolate, "n1")
    result, attempts = await call_with_retry(lambda: backend.apply(request), RetryPolicy(), sleep=no_sleep)
    assert result.outcome is Outcome.applied and attempts == 3 and len(slept) == 2


# --------------------------------------------------------------------------- real client configuration


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def test_from_config_sets_client_retries_and_maps_a_refused_connection(tmp_path: Any) -> None:
    port = _closed_port()
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "c", "cluster": {"server": f"http://127.0.0.1:{port}"}}],
                "users": [{"name": "u", "user": {"token": "t"}}],
                "contexts": [{"name": "x", "context": {"cluster": "c", "user": "u"}}],
                "current-context": "x",
            }
        )
    )
    backend = KubernetesBackend.from_config(str(kubeconfig), retries=0, namespace="diag")
    try:
        assert backend.namespace == "diag"
        retries = backend.core.api_client.configuration.retries
        assert isinstance(retries, urllib3.util.Retry) and retries.total == 0 and retries.status == 0
        with pytest.raises(TemporaryError):
            await backend.apply(req(ActionName.isolate, "n1"))
    finally:
        await backend.close()


# --------------------------------------------------------------------------- workloads by owner kind

from pathlib import Path  # noqa: E402

import yaml  # noqa: E402

from actuators.base import Waiting  # noqa: E402

#: upstream's own PyTorchJob example (tests/fixtures/kubeflow/README.md)
PYTORCH_SIMPLE = yaml.safe_load(
    (Path(__file__).parents[2] / "fixtures" / "kubeflow" / "pytorch-simple.yaml").read_text())


def _pytorchjob(custom: FakeCustomObjectsApi, core: FakeCoreV1Api, *, ns: str = "ml", name: str = "llama",
                labels: dict[str, str] | None = None, nodes: tuple[str, ...] = ("n1", "n2")) -> dict[str, Any]:
    doc = copy.deepcopy(PYTORCH_SIMPLE)
    doc["metadata"] = {"name": name, "namespace": ns, "labels": dict(labels or {})}
    custom.add(doc, "pytorchjobs")
    for i, (rtype, node) in enumerate(zip(("master", "worker"), nodes)):
        core.add_pod(ns, f"{name}-{rtype}-0", node, labels={"training.kubeflow.org/job-name": name,
                                                            "training.kubeflow.org/replica-type": rtype})
        core.pods[(ns, f"{name}-{rtype}-0")]["metadata"]["ownerReferences"] = [
            {"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob", "name": name, "uid": doc["metadata"]["uid"],
             "controller": True, "blockOwnerDeletion": True}]
    return doc


async def test_a_pytorchjob_is_requeued_by_suspending_it_with_the_nodes_excluded_then_resuming(
    backend: KubernetesBackend, core: FakeCoreV1Api, custom: FakeCustomObjectsApi
) -> None:
    doc = _pytorchjob(custom, core)
    with pytest.raises(Waiting, match="suspended"):
        await backend.apply(req(ActionName.requeue, "ml/llama", exclude=["n2"]))
    assert doc["spec"]["runPolicy"]["suspend"] is True
    for rtype in ("Master", "Worker"):
        terms = doc["spec"]["pytorchReplicaSpecs"][rtype]["template"]["spec"]["affinity"]["nodeAffinity"][
            "requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
        assert terms == [{"matchExpressions": [{"key": "kubernetes.io/hostname", "operator": "NotIn",
                                                "values": ["n2"]}]}]
        assert doc["spec"]["pytorchReplicaSpecs"][rtype]["restartPolicy"] == "OnFailure"  # kept
    assert core.deleted == []  # fleetmedic deletes none of the operator's pods
    # the operator has not stopped its pods yet: still waiting, nothing resumed
    with pytest.raises(Waiting, match="2 of its pods"):
        await backend.apply(req(ActionName.requeue, "ml/llama", exclude=["n2"]))
    assert doc["spec"]["runPolicy"]["suspend"] is True
    for rtype in ("master", "worker"):  # the training operator deletes a suspended job's pods
        del core.pods[("ml", f"llama-{rtype}-0")]
    done = await backend.apply(req(ActionName.requeue, "ml/llama", exclude=["n2"]))
    assert done.outcome is Outcome.applied and "n2" in done.detail
    assert doc["spec"]["runPolicy"]["suspend"] is False
    assert doc["metadata"]["annotations"]["fleetmedic.io/requeue"] == "v-1:resumed"
    again = await backend.apply(req(ActionName.requeue, "ml/llama", exclude=["n2"]))
    assert again.outcome is Outcome.already_so
    assert any(e["reason"] == "FleetmedicRequeue" and e["involvedObject"]["kind"] == "PyTorchJob"
               for e in core.events.values())


async def test_a_failed_pytorchjob_is_not_resurrected(
    backend: KubernetesBackend, core: FakeCoreV1Api, custom: FakeCustomObjectsApi
) -> None:
    doc = _pytorchjob(custom, core)
    for rtype in ("Master", "Worker"):
        doc["spec"]["pytorchReplicaSpecs"][rtype]["restartPolicy"] = "Never"
    doc["status"] = {"conditions": [{"type": "Failed", "status": "True", "reason": "PyTorchJobFailed"}]}
    with pytest.raises(PermanentError, match=r"restart policy \(Master: Never, Worker: Never\).*resubmit"):
        await backend.apply(req(ActionName.requeue, "ml/llama", exclude=["n2"]))
    assert "runPolicy" not in doc["spec"]


async def test_an_owner_of_an_unknown_kind_is_named_and_nothing_changes(
    backend: KubernetesBackend, core: FakeCoreV1Api, batch: FakeBatchV1Api
) -> None:
    # a batch Job that a JobSet owns: fleetmedic does not requeue JobSets by owner
    batch.add_job("ml", "train-workers-0")
    batch.jobs[("ml", "train-workers-0")]["metadata"]["ownerReferences"] = [
        {"apiVersion": "jobset.x-k8s.io/v1alpha2", "kind": "JobSet", "name": "train", "uid": "u-js",
         "controller": True}]
    core.add_pod("ml", "train-workers-0-0", "n1", phase="Failed", labels={"job-name": "train-workers-0"})
    core.pods[("ml", "train-workers-0-0")]["metadata"]["ownerReferences"] = [
        {"apiVersion": "batch/v1", "kind": "Job", "name": "train-workers-0", "uid": "uid-job-train-workers-0",
         "controller": True}]
    with pytest.raises(PermanentError, match=r"owned by JobSet train \(jobset.x-k8s.io/v1alpha2\).*nothing"):
        await backend.apply(req(ActionName.requeue, "ml/train-workers-0", exclude=["n1"]))
    assert core.deleted == []


async def test_a_kueue_job_is_requeued_through_its_workload(
    backend: KubernetesBackend, core: FakeCoreV1Api, batch: FakeBatchV1Api, custom: FakeCustomObjectsApi
) -> None:
    batch.add_job("ml", "train", labels={"kueue.x-k8s.io/queue-name": "team-a"})
    job = batch.jobs[("ml", "train")]
    job["status"]["startTime"] = "2026-12-01T00:00:00Z"
    wl = custom.add({"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "Workload", "metadata": {
        "name": "job-train-abcde", "namespace": "ml", "labels": {"kueue.x-k8s.io/job-uid": "uid-job-train"},
        "ownerReferences": [{"apiVersion": "batch/v1", "kind": "Job", "name": "train", "uid": "uid-job-train",
                             "controller": True}]}, "spec": {"active": True}}, "workloads")
    with pytest.raises(Waiting, match="Workload deactivated"):
        await backend.apply(req(ActionName.requeue, "ml/train", exclude=["n1"]))
    assert wl["spec"]["active"] is False
    assert "affinity" not in job["spec"]["template"]["spec"]  # not while Kueue has not suspended it
    with pytest.raises(Waiting, match="suspend"):
        await backend.apply(req(ActionName.requeue, "ml/train", exclude=["n1"]))
    job["spec"]["suspend"] = True  # Kueue suspends it; the Job controller stops its pods
    with pytest.raises(Waiting, match="pods still to stop"):  # startTime still set: template not mutable yet
        await backend.apply(req(ActionName.requeue, "ml/train", exclude=["n1"]))
    del job["status"]["startTime"]
    with pytest.raises(Waiting, match="excluded"):
        await backend.apply(req(ActionName.requeue, "ml/train", exclude=["n1"]))
    expr = job["spec"]["template"]["spec"]["affinity"]["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"][0]["matchExpressions"]
    assert expr == [{"key": "kubernetes.io/hostname", "operator": "NotIn", "values": ["n1"]}]
    done = await backend.apply(req(ActionName.requeue, "ml/train", exclude=["n1"]))
    assert done.outcome is Outcome.applied and "Kueue" in done.detail
    assert wl["spec"]["active"] is True
    assert job["spec"]["suspend"] is True  # Kueue, not fleetmedic, lets it run again on admission
    assert (await backend.apply(req(ActionName.requeue, "ml/train", exclude=["n1"]))).outcome is Outcome.already_so


async def test_checkpoint_annotates_the_live_pods_and_the_owner_once(
    backend: KubernetesBackend, core: FakeCoreV1Api, custom: FakeCustomObjectsApi
) -> None:
    doc = _pytorchjob(custom, core)
    core.add_pod("ml", "llama-worker-old", "n3", phase="Failed",
                 labels={"training.kubeflow.org/job-name": "llama"})
    got = await backend.apply(req(ActionName.checkpoint, "ml/llama", deadline=1796601723.0, node="n2"))
    assert got.outcome is Outcome.applied
    want = "2026-12-07T00:02:03Z"
    assert doc["metadata"]["annotations"]["fleetmedic.io/checkpoint-requested"] == want
    annotated = {n for (_, n), p in core.pods.items()
                 if (p["metadata"].get("annotations") or {}).get("fleetmedic.io/checkpoint-requested") == want}
    assert annotated == {"llama-master-0", "llama-worker-0"}
    again = await backend.apply(req(ActionName.checkpoint, "ml/llama", deadline=1796601723.0, node="n2"))
    assert again.outcome is Outcome.already_so
    later = await backend.apply(req(ActionName.checkpoint, "ml/llama", verdict="v-2", deadline=1796602000.0))
    assert later.outcome is Outcome.applied  # a new deadline is a new request
    with pytest.raises(PermanentError, match="deadline"):
        await backend.apply(req(ActionName.checkpoint, "ml/llama", deadline="soon"))
    gone = await backend.apply(req(ActionName.checkpoint, "ml/ghost", deadline=1796601723.0))
    assert gone.outcome is Outcome.already_so and "nothing runs" in gone.detail
