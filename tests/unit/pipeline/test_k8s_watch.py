"""The Kubernetes watcher's state machine and watch loop, with client model objects and a
small fake list/watch function (the real API server is in tests/integration)."""

from __future__ import annotations

import json
import threading
from datetime import datetime, timezone

from kubernetes.client import (
    V1ContainerState,
    V1ContainerStateTerminated,
    V1ContainerStatus,
    V1Job,
    V1JobCondition,
    V1JobStatus,
    V1ObjectMeta,
    V1Pod,
    V1PodList,
    V1PodSpec,
    V1PodStatus,
)
from kubernetes.client.exceptions import ApiException

from pipeline.watch.k8s import PodJobTracker, WatchLoop, job_of_pod
from schemas import JobEventKind


def pod(uid: str, phase: str, node: str | None = "n1", job: str = "train", ns: str = "ml", *,
        exit_code: int | None = None, message: str | None = None, diag: str | None = None,
        deleting: bool = False, legacy_label: bool = False) -> V1Pod:
    statuses = None
    if exit_code is not None:
        term = V1ContainerStateTerminated(exit_code=exit_code, reason="Error", message=message)
        statuses = [V1ContainerStatus(name="c", image="i", image_id="", ready=False, restart_count=0,
                                      state=V1ContainerState(terminated=term))]
    label = "job-name" if legacy_label else "batch.kubernetes.io/job-name"
    return V1Pod(
        metadata=V1ObjectMeta(name=f"{job}-{uid}", namespace=ns, uid=uid, labels={label: job},
                              annotations={"fleetmedic.dev/node-name": diag} if diag else None,
                              deletion_timestamp=datetime.now(timezone.utc) if deleting else None),
        spec=V1PodSpec(containers=[], node_name=node),
        status=V1PodStatus(phase=phase, container_statuses=statuses),
    )


def kinds(events) -> list[tuple[str, int]]:
    return [(e.event.value, e.attempt) for e in events]


def test_pods_without_a_job_are_ignored() -> None:
    p = pod("u1", "Running")
    p.metadata.labels = {"app": "web"}
    assert job_of_pod(p) is None
    assert PodJobTracker().on_pod("ADDED", p) == []


def test_a_jobs_life_start_failure_restart() -> None:
    t = PodJobTracker(clock=lambda: 100.0)
    assert t.on_pod("ADDED", pod("u1", "Pending", node=None)) == []
    ev = t.on_pod("MODIFIED", pod("u1", "Running"))
    assert kinds(ev) == [("started", 1)] and ev[0].nodes == ["n1"] and ev[0].job == "ml/train"
    assert ev[0].scheduler == "kubernetes"
    # the same state again (a re-list, a status heartbeat) emits nothing
    assert t.on_pod("MODIFIED", pod("u1", "Running")) == []
    ev = t.on_pod("MODIFIED", pod("u1", "Failed", exit_code=137, message="OOM? no: Xid 79"))
    assert kinds(ev) == [("failed", 1)]
    assert ev[0].exit_code == 137 and ev[0].log_tail == "OOM? no: Xid 79" and ev[0].nodes == ["n1"]
    assert "Error" in ev[0].reason
    assert t.on_pod("MODIFIED", pod("u1", "Failed", exit_code=137)) == []  # reported once
    assert t.on_pod("DELETED", pod("u1", "Failed", exit_code=137)) == []
    ev = t.on_pod("MODIFIED", pod("u2", "Running", node="n2"))
    assert kinds(ev) == [("started", 2)] and ev[0].nodes == ["n2"]


def test_multi_pod_job_reports_the_set_of_nodes_as_it_grows() -> None:
    t = PodJobTracker()
    assert t.on_pod("MODIFIED", pod("a", "Running", node="n1"))[0].nodes == ["n1"]
    assert t.on_pod("MODIFIED", pod("b", "Running", node="n2"))[0].nodes == ["n1", "n2"]
    assert t.on_pod("MODIFIED", pod("a", "Running", node="n1")) == []


def test_a_pod_that_failed_before_it_was_seen_running_gets_a_start_first() -> None:
    ev = PodJobTracker().on_pod("ADDED", pod("u1", "Failed", node="n4", exit_code=1, legacy_label=True))
    assert kinds(ev) == [("started", 1), ("failed", 1)]
    assert ev[0].nodes == ev[1].nodes == ["n4"]


def test_evicted_pod_is_not_a_failure() -> None:
    t = PodJobTracker()
    t.on_pod("MODIFIED", pod("u1", "Running"))
    assert t.on_pod("MODIFIED", pod("u1", "Running", deleting=True)) == []
    assert t.on_pod("DELETED", pod("u1", "Running", deleting=True)) == []
    assert t.jobs["ml/train"].running == {}


def test_exit_codes_beyond_a_byte_are_clamped_not_rejected() -> None:
    ev = PodJobTracker().on_pod("MODIFIED", pod("u1", "Failed", exit_code=4096))
    assert ev[-1].exit_code == 255


def test_diagnostics_pods_report_the_node_under_test() -> None:
    t = PodJobTracker()
    started = t.on_pod("MODIFIED", pod("d1", "Running", node="n3", job="fleetmedic-diag-n3-1", diag="n3"))
    assert kinds(started) == [("started", 1)] and started[0].diagnostics_for == "n3"
    done = t.on_pod("MODIFIED", pod("d1", "Succeeded", node="n3", job="fleetmedic-diag-n3-1", diag="n3"))
    assert kinds(done) == [("completed", 1)] and done[0].diagnostics_for == "n3"
    failed = PodJobTracker().on_pod("MODIFIED", pod("d2", "Failed", node="n3", job="d", diag="n3", exit_code=1))
    assert failed[-1].event is JobEventKind.failed and failed[-1].diagnostics_for == "n3"


def test_job_complete_condition_is_reported_once() -> None:
    t = PodJobTracker()
    t.on_pod("MODIFIED", pod("u1", "Running"))
    job = V1Job(metadata=V1ObjectMeta(name="train", namespace="ml"),
                status=V1JobStatus(conditions=[V1JobCondition(type="Complete", status="True")]))
    ev = t.on_job("MODIFIED", job)
    assert kinds(ev) == [("completed", 1)] and ev[0].nodes == ["n1"]
    assert t.on_job("MODIFIED", job) == []
    assert t.on_job("DELETED", job) == [] and "ml/train" not in t.jobs


# ------------------------------------------------------------------------------ watch loop


class _Items:
    def __init__(self, items, rv):
        self.items = items
        self.metadata = V1ObjectMeta(resource_version=rv)


class FakeListWatch:
    """``list_namespaced_pod`` with ``watch=True`` support, as the client calls it.

    Lists return ``listing``; each watch call pops the next scripted response:
    a list of (type, pod, rv) lines, or an int status to fail with.
    """

    def __init__(self, listing, script):
        self.listing = listing
        self.script = list(script)
        self.calls: list[dict] = []
        self.done = threading.Event()

    def __call__(self, **kwargs) -> V1PodList:  # the watch reads its item type from this
        self.calls.append(kwargs)
        if not kwargs.get("watch"):
            return self.listing
        if not self.script:
            self.done.set()
            raise ConnectionError("no more script")
        step = self.script.pop(0)
        if isinstance(step, int):
            raise ApiException(status=step, reason="scripted")
        return _Resp([json.dumps({"type": kind, "object": {
            "kind": "Pod", "apiVersion": "v1",
            "metadata": {"name": p.metadata.name, "namespace": "ml", "uid": p.metadata.uid,
                         "resourceVersion": rv, "labels": p.metadata.labels},
            "spec": {"containers": [], "nodeName": p.spec.node_name},
            "status": {"phase": p.status.phase}}}) for kind, p, rv in step])


class _Resp:
    status = 200

    def __init__(self, lines):
        self.lines = lines

    def stream(self, *args, **kwargs):
        for line in self.lines:
            yield (line + "\n").encode()

    def close(self):
        pass

    def release_conn(self):
        pass


def test_watch_resumes_from_the_last_resource_version_and_relists_only_on_410() -> None:
    fake = FakeListWatch(
        _Items([pod("u1", "Running")], "10"),
        [
            [("MODIFIED", pod("u1", "Failed", exit_code=1), "11")],  # then the stream ends (server timeout)
            500,                                                        # API server error: back off, same version
            [("ADDED", pod("u2", "Running", node="n2"), "12")],
            410,                                                        # version gone: list again
        ],
    )
    seen: list[tuple[str, str]] = []
    loop = WatchLoop(fake, lambda kind, obj: seen.append((kind, obj.metadata.uid)), timeout_s=1,
                     max_backoff_s=0.01, name="pods")
    t = threading.Thread(target=loop.run, daemon=True)
    t.start()
    assert fake.done.wait(10)
    loop.stop()
    t.join(5)
    watch_versions = [c.get("resource_version") for c in fake.calls if c.get("watch")]
    # 10 (after the list), 11 (resume), 11 (after the 500), 12 (resume), then a re-list
    assert watch_versions[:4] == ["10", "11", "11", "12"], watch_versions
    lists = [c for c in fake.calls if not c.get("watch")]
    assert len(lists) == 2 and loop.lists == 2
    assert seen[:3] == [("ADDED", "u1"), ("MODIFIED", "u1"), ("ADDED", "u2")]
    assert loop.errors >= 1


def test_a_pytorchjob_pod_is_its_jobs_by_the_training_operator_label() -> None:
    # the labels training-operator v1.8 puts on a PyTorchJob's pods (pkg/controller.v1/common)
    p = pod("u1", "Running")
    p.metadata.labels = {"training.kubeflow.org/job-name": "llama", "training.kubeflow.org/replica-type": "worker",
                         "training.kubeflow.org/replica-index": "0",
                         "training.kubeflow.org/operator-name": "pytorchjob-controller"}
    assert job_of_pod(p) == "ml/llama"
