"""The Kubernetes job watcher on a real control plane: a Job's life as job records, across
watch disconnects that resume from the last resource version."""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest

from pipeline.watch.k8s import KubernetesJobWatcher
from schemas import JobEventKind

from .harness import BackgroundLoop
from .k8s_helpers import Cluster, FakeKubelet, batch_job, wait_pod
from .slurm_helpers import wait_for

pytestmark = pytest.mark.integration


def test_job_life_becomes_job_records_across_watch_reconnects(kubeconfig: str) -> None:
    c = Cluster(kubeconfig)
    pool = f"kw-{uuid.uuid4().hex[:5]}"
    nodes = [f"{pool}-1", f"{pool}-2"]
    for n in nodes:
        c.register_node(n, pool=pool)
    ns = c.namespace("watch")
    watcher = KubernetesJobWatcher(c.core, c.batch, namespace=ns, timeout_s=2)
    events: list = []
    stop = asyncio.Event()
    bg = BackgroundLoop()

    async def emit(ev) -> None:
        events.append(ev)

    fut = asyncio.run_coroutine_threadsafe(watcher.run(emit, stop=stop), bg.loop)
    try:
        c.batch.create_namespaced_job(ns, batch_job("train", pool=pool, prefer=nodes[0]))
        with FakeKubelet(c, set(nodes)) as kubelet:
            first = wait_pod(c, ns, "job-name=train", lambda p: p.status.phase == "Running", "first pod", 30)
            wait_for("started", lambda: [e for e in events if e.event is JobEventKind.started], 15)
            time.sleep(3)  # the server ends the 2 s watches; they resume from their resource version
            kubelet.finish(first, failed=True, exit_code=3, reason="Error",
                           message="RuntimeError: CUDA error: unspecified launch failure")
            wait_for("failed", lambda: [e for e in events if e.event is JobEventKind.failed], 15)
            time.sleep(3)
            second = wait_pod(c, ns, "job-name=train",
                              lambda p: p.metadata.uid != first.metadata.uid and p.status.phase == "Running",
                              "replacement running", 60)
            wait_for("second start", lambda: len([e for e in events if e.event is JobEventKind.started]) >= 2, 15)
            kubelet.finish(second, failed=False)
            wait_for("completed", lambda: [e for e in events if e.event is JobEventKind.completed], 30)
            time.sleep(1)
    finally:
        bg.loop.call_soon_threadsafe(stop.set)
        fut.result(10)
        bg.stop()

    job = f"{ns}/train"
    assert all(e.job == job and e.scheduler == "kubernetes" for e in events)
    kinds = [(e.event.value, e.attempt) for e in events]
    assert kinds == [("started", 1), ("failed", 1), ("started", 2), ("completed", 2)], kinds
    started1, failed, started2, _done = events
    assert started1.nodes == [first.spec.node_name]
    assert failed.exit_code == 3 and failed.nodes == [first.spec.node_name]
    assert failed.origin_node == first.spec.node_name  # the pod that failed ran there
    assert "unspecified launch failure" in (failed.log_tail or "")
    assert started2.nodes == [second.spec.node_name]
    stats = watcher.stats
    assert stats["resumes"] >= 2, stats       # reconnected after the server ended the watches
    assert stats["lists"] == 2, stats         # ... from their resource version: no re-list
