"""Talking to the local Kubernetes control plane from tests (deploy/k8s.sh).

There is no kubelet: tests register Node objects with GPU capacity and play the kubelet
with :class:`FakeKubelet`, which marks bound pods running (ready), finishes pods
that are being deleted, and fails or succeeds a pod when a test says so.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import kubernetes.client
import kubernetes.config
import yaml
from kubernetes.client import ApiClient, AppsV1Api, BatchV1Api, CoreV1Api, PolicyV1Api
from kubernetes.client.exceptions import ApiException

from .slurm_helpers import wait_for

DEPLOY_K8S = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes"
SERVICE_ACCOUNT = "system:serviceaccount:fleetmedic:fleetmedic"


def kube_worker_env(kubeconfig: str, **settings: str) -> dict[str, str]:
    """A worker's environment for the Kubernetes backend, acting as the deployment's
    ServiceAccount, diagnostics in ``fleetmedic-diag``; ``settings`` add or override
    ``FLEETMEDIC_*`` variables by their short name (``SAFETY__FLEET_SIZE="4"``)."""
    return {
        "FLEETMEDIC_ACTUATORS__BACKEND": "kubernetes",
        "FLEETMEDIC_ACTUATORS__KUBECONFIG": kubeconfig,
        "FLEETMEDIC_ACTUATORS__KUBE_AS": SERVICE_ACCOUNT,
        "FLEETMEDIC_ACTUATORS__KUBE_DIAG_NAMESPACE": "fleetmedic-diag",
        **{f"FLEETMEDIC_{k}": v for k, v in settings.items()},
    }


def now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


class Cluster:
    """API objects for one kubeconfig (optionally impersonating a user)."""

    def __init__(self, kubeconfig: str, *, impersonate: str | None = None) -> None:
        cfg = kubernetes.client.Configuration()
        kubernetes.config.load_kube_config(config_file=kubeconfig, client_configuration=cfg, persist_config=False)
        self.api = ApiClient(cfg)
        if impersonate:
            self.api.set_default_header("Impersonate-User", impersonate)
        self.core = CoreV1Api(self.api)
        self.batch = BatchV1Api(self.api)
        self.apps = AppsV1Api(self.api)
        self.policy = PolicyV1Api(self.api)

    # ------------------------------------------------------------------ setup

    def register_node(self, name: str, gpus: int = 8, pool: str = "default") -> None:
        """A Node as a kubelet would register it: GPU capacity, Ready, schedulable, no
        taints, labelled ``fleetmedic.test/pool=<pool>`` so a test's Jobs stay on its nodes."""
        cap = {"cpu": "64", "memory": "512Gi", "pods": "110", "nvidia.com/gpu": str(gpus)}
        body = {
            "apiVersion": "v1", "kind": "Node",
            "metadata": {"name": name, "labels": {"kubernetes.io/hostname": name, "nvidia.com/gpu.present": "true",
                                                 "fleetmedic.test/pool": pool}},
            "spec": {},
        }
        try:
            self.core.create_node(body)
        except ApiException as exc:
            if exc.status != 409:
                raise
        # back to a clean, schedulable node (a previous test may have cordoned it)
        self.core.patch_node(name, {"spec": {"unschedulable": None, "taints": None},
                                    "metadata": {"labels": {"fleetmedic.test/pool": pool}, "annotations": {"fleetmedic.dev/cordoned": None,
                                                                 "fleetmedic.dev/verdict": None,
                                                                 "fleetmedic.dev/escalated": None}}})
        self.core.patch_node_status(name, {"status": {
            "capacity": cap, "allocatable": cap,
            "conditions": [
                {"type": "Ready", "status": "True", "reason": "KubeletReady", "message": "fake kubelet",
                 "lastHeartbeatTime": now(), "lastTransitionTime": now()},
                {"type": "FleetmedicQuarantine", "status": "False", "reason": "TestSetup", "message": "clean",
                 "lastHeartbeatTime": now(), "lastTransitionTime": now()},
            ],
        }})

    def namespace(self, prefix: str, labels: dict[str, str] | None = None) -> str:
        name = f"{prefix}-{uuid.uuid4().hex[:6]}"
        self.core.create_namespace({"metadata": {"name": name, "labels": labels or {}}})
        wait_for(f"default ServiceAccount in {name}",
                 lambda: _exists(lambda: self.core.read_namespaced_service_account("default", name)), 30)
        return name

    def apply_manifest(self, path: Path, *, dry_run: bool = False, kinds: set[str] | None = None) -> list[dict[str, Any]]:
        """Server-side apply of every object of a YAML file (``kubectl apply --server-side``),
        or its server-side dry-run (``--dry-run=server``): validated and admitted, not stored.
        ``kinds``: only the objects of these kinds."""
        import kubernetes.utils

        docs = [d for d in yaml.safe_load_all(path.read_text()) if d and (kinds is None or d.get("kind") in kinds)]
        for doc in docs:
            ns = doc.get("metadata", {}).get("namespace", "default")
            kubernetes.utils.create_from_dict(self.api, doc, namespace=ns, apply=True,
                                              **({"dry_run": "All"} if dry_run else {}))
        return docs

    # ------------------------------------------------------------------ reading

    def pods(self, namespace: str, selector: str = "") -> list[Any]:
        return self.core.list_namespaced_pod(namespace, label_selector=selector).items

    def node(self, name: str) -> Any:
        return self.core.read_node(name)

    def taints(self, name: str) -> list[tuple[str, str, str]]:
        return [(t.key, t.value or "", t.effect) for t in (self.node(name).spec.taints or [])]

    def condition(self, name: str, kind: str) -> Any | None:
        for c in self.node(name).status.conditions or []:
            if c.type == kind:
                return c
        return None

    def events_about(self, name: str, namespace: str = "default") -> list[Any]:
        return [e for e in self.core.list_namespaced_event(namespace).items
                if e.involved_object is not None and e.involved_object.name == name]


def _exists(fn: Callable[[], Any]) -> bool:
    try:
        fn()
        return True
    except ApiException as exc:
        if exc.status == 404:
            return False
        raise


def batch_job(name: str, *, pool: str, gpus: int = 8, backoff_limit: int = 4, prefer: str | None = None,
              labels: dict[str, str] | None = None) -> dict[str, Any]:
    """A one-pod training Job asking for a whole node's GPUs on the nodes of ``pool``,
    optionally preferring one node."""
    affinity = None
    if prefer:
        affinity = {"nodeAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [{
            "weight": 100,
            "preference": {"matchFields": [{"key": "metadata.name", "operator": "In", "values": [prefer]}]},
        }]}}
    spec: dict[str, Any] = {
        "restartPolicy": "Never",
        "nodeSelector": {"fleetmedic.test/pool": pool},
        "containers": [{"name": "train", "image": "registry.local/train:1",
                        "resources": {"limits": {"nvidia.com/gpu": str(gpus)}}}],
    }
    if affinity:
        spec["affinity"] = affinity
    return {
        "apiVersion": "batch/v1", "kind": "Job",
        "metadata": {"name": name, "labels": labels or {}},
        "spec": {"backoffLimit": backoff_limit, "template": {"metadata": {"labels": labels or {}}, "spec": spec}},
    }


class FakeKubelet:
    """Plays the kubelet of the registered nodes.

    Every ``interval`` it marks pods bound to ``nodes`` that are Pending as Running and
    Ready (unless held with :meth:`hold`), and removes pods that are being deleted
    (grace 0), as a kubelet does once their containers stopped.  :meth:`finish` ends a
    pod as Failed or Succeeded with a container exit code and termination message.
    """

    def __init__(self, cluster: Cluster, nodes: set[str], interval: float = 0.2) -> None:
        self.c = cluster
        self.nodes = set(nodes)
        self.interval = interval
        self.held: set[str] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="fake-kubelet")
        self.errors: list[str] = []

    def __enter__(self) -> FakeKubelet:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join(5)

    def hold(self, pod_name: str) -> None:
        self.held.add(pod_name)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.tick()
            except Exception as exc:  # the API server restarting, a pod gone meanwhile
                self.errors.append(repr(exc))
            self._stop.wait(self.interval)

    def tick(self) -> None:
        for pod in self.c.core.list_pod_for_all_namespaces().items:
            node = pod.spec.node_name
            if node not in self.nodes:
                continue
            meta = pod.metadata
            if meta.deletion_timestamp is not None:
                try:
                    self.c.core.delete_namespaced_pod(meta.name, meta.namespace, grace_period_seconds=0)
                except ApiException as exc:
                    if exc.status != 404:
                        raise
                continue
            if pod.status.phase == "Pending" and meta.name not in self.held:
                self._status(pod, "Running", running=True)

    def _status(self, pod: Any, phase: str, *, running: bool = False, exit_code: int | None = None,
                reason: str | None = None, message: str | None = None) -> None:
        t = now()
        containers = []
        for ctr in pod.spec.containers:
            if running:
                state = {"running": {"startedAt": t}}
            else:
                state = {"terminated": {"exitCode": exit_code or 0, "reason": reason or "Completed",
                                        "message": message, "startedAt": t, "finishedAt": t}}
            containers.append({"name": ctr.name, "image": ctr.image, "imageID": "", "ready": running,
                               "restartCount": 0, "started": running, "state": state})
        ready = "True" if running else "False"
        body = {"status": {
            "phase": phase, "hostIP": "127.0.0.1", "podIP": "10.1.0.1", "startTime": t,
            "conditions": [{"type": "PodScheduled", "status": "True", "lastTransitionTime": t},
                           {"type": "Initialized", "status": "True", "lastTransitionTime": t},
                           {"type": "ContainersReady", "status": ready, "lastTransitionTime": t},
                           {"type": "Ready", "status": ready, "lastTransitionTime": t}],
            "containerStatuses": containers,
        }}
        self.c.core.patch_namespaced_pod_status(pod.metadata.name, pod.metadata.namespace, body)

    def finish(self, pod: Any, *, failed: bool, exit_code: int = 1, reason: str = "Error",
               message: str | None = None) -> None:
        self._status(pod, "Failed" if failed else "Succeeded", exit_code=exit_code if failed else 0,
                     reason=reason if failed else "Completed", message=message)


def wait_pod(cluster: Cluster, namespace: str, selector: str, pred: Callable[[Any], bool], what: str,
             timeout: float = 60) -> Any:
    def probe() -> Any:
        return next((p for p in cluster.pods(namespace, selector) if pred(p)), None)
    return wait_for(what, probe, timeout)
