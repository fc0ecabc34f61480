"""The Kubernetes backend on a real control plane (deploy/k8s.sh), acting as the
deployment's ServiceAccount through impersonation.

Every operation is checked on the live objects it should change, and run twice: the
second run must report ``already_so`` and change nothing.
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid

import pytest
from kubernetes.client import RbacAuthorizationV1Api
from kubernetes.client.exceptions import ApiException

from actuators import ActionRequest, RetryPolicy, call_with_retry
from actuators.kubernetes import CONDITION_QUARANTINE, KubernetesBackend, diagnostics_job_name
from schemas import ActionName, Outcome

from .k8s_helpers import SERVICE_ACCOUNT, Cluster, FakeKubelet, batch_job, wait_pod
from .slurm_helpers import wait_for

pytestmark = pytest.mark.integration

TAINT = "fleetmedic.dev/quarantine"


@pytest.fixture(scope="module")
def admin(k8s_deployed: str) -> Cluster:
    return Cluster(k8s_deployed)


@pytest.fixture
def backend(k8s_deployed: str):
    b = KubernetesBackend.from_config(k8s_deployed, impersonate=SERVICE_ACCOUNT, namespace="fleetmedic-diag",
                                      diag_image="registry.local/dcgm:3", request_timeout=15.0)
    yield b
    asyncio.run(b.close())


@pytest.fixture
def nodes(admin: Cluster):
    """Two fresh nodes of this test (unique names: tests never share node state)."""
    tag = uuid.uuid4().hex[:5]
    names = [f"ka-{tag}-1", f"ka-{tag}-2"]
    for n in names:
        admin.register_node(n, pool=f"ka-{tag}")
    yield names
    for n in names:
        admin.core.delete_node(n)


def act(backend: KubernetesBackend, action: ActionName, target: str, verdict: str = "v-1", **params) -> tuple:
    req = ActionRequest(verdict_id=verdict, action=action, target=target, params=params, reason="gpu_hardware (test)")
    res = asyncio.run(backend.apply(req))
    return res.outcome, res.detail


def bare_pod(name: str, node: str, labels: dict[str, str] | None = None) -> dict:
    return {"metadata": {"name": name, "labels": labels or {}},
            "spec": {"nodeName": node, "restartPolicy": "Never",
                     "containers": [{"name": "main", "image": "registry.local/app:1"}]}}


def test_isolate_drain_diagnose_return_on_real_objects(admin: Cluster, backend, nodes) -> None:
    node, _other = nodes
    ns = admin.namespace("act")
    admin.core.create_namespaced_pod(ns, bare_pod("worker-0", node))
    with FakeKubelet(admin, set(nodes)):
        wait_pod(admin, ns, "", lambda p: p.status.phase == "Running", "pod running", 30)

        # isolate: cordon + taint + condition + event, once
        assert act(backend, ActionName.isolate, node, reason="gpu_hardware")[0] is Outcome.applied
        n = admin.node(node)
        assert n.spec.unschedulable is True
        assert (TAINT, "gpu_hardware", "NoSchedule") in admin.taints(node)
        cond = admin.condition(node, CONDITION_QUARANTINE)
        assert cond is not None and cond.status == "True"
        reasons = {e.reason for e in admin.events_about(node)}
        assert "FleetmedicIsolate" in reasons, reasons
        rv = admin.node(node).metadata.resource_version
        assert act(backend, ActionName.isolate, node, reason="gpu_hardware")[0] is Outcome.already_so
        assert admin.node(node).metadata.resource_version == rv, "a replayed isolate changed the node"

        # drain: the pod goes through the Eviction API
        outcome, detail = act(backend, ActionName.drain, node)
        assert outcome is Outcome.applied, detail
        wait_for("pod evicted", lambda: not admin.pods(ns), 30)
        assert "FleetmedicDrain" in {e.reason for e in admin.events_about(node)}
        assert act(backend, ActionName.drain, node)[0] is Outcome.already_so

        # diagnose: a Job pinned to the node, tolerating the quarantine; the real scheduler binds it there
        outcome, detail = act(backend, ActionName.diagnose, node)
        assert outcome is Outcome.applied, detail
        job = diagnostics_job_name(node, "v-1")
        pod = wait_pod(admin, "fleetmedic-diag", f"job-name={job}", lambda p: bool(p.spec.node_name),
                       "diagnostics pod bound", 30)
        assert pod.spec.node_name == node
        assert "FleetmedicDiagnose" in {e.reason for e in admin.events_about(node)}
        assert pod.metadata.annotations["fleetmedic.dev/node-name"] == node
        assert act(backend, ActionName.diagnose, node)[0] is Outcome.already_so
        assert len(admin.pods("fleetmedic-diag", f"job-name={job}")) == 1

        # return to service: uncordon, taint and condition removed
        outcome, detail = act(backend, ActionName.return_, node, verdict="v-2")
        assert outcome is Outcome.applied, detail
        n = admin.node(node)
        assert not n.spec.unschedulable
        assert not [t for t in admin.taints(node) if t[0] == TAINT]
        assert admin.condition(node, CONDITION_QUARANTINE).status == "False"
        assert act(backend, ActionName.return_, node, verdict="v-2")[0] is Outcome.already_so
        admin.batch.delete_namespaced_job(job, "fleetmedic-diag", propagation_policy="Background")


def test_drain_waits_for_pod_disruption_budget_and_never_forces(admin: Cluster, backend, nodes) -> None:
    node, _other = nodes
    ns = admin.namespace("pdb")
    for i in range(2):
        admin.core.create_namespaced_pod(ns, bare_pod(f"db-{i}", node, {"app": "db"}))
    admin.policy.create_namespaced_pod_disruption_budget(ns, {
        "metadata": {"name": "db"}, "spec": {"minAvailable": 2, "selector": {"matchLabels": {"app": "db"}}}})
    attempts: list[str] = []
    with FakeKubelet(admin, set(nodes)):
        wait_for("pods running", lambda: [p.status.phase for p in admin.pods(ns)] == ["Running", "Running"], 30)
        wait_for("PDB counts both pods healthy", lambda: (admin.policy.read_namespaced_pod_disruption_budget(
            "db", ns).status.current_healthy or 0) == 2, 30)

        def relax_later() -> None:
            # the budget blocks evictions until enough refusals were seen, then is lifted
            wait_for("two refused evictions", lambda: len(attempts) >= 2, 60, every=0.1)
            assert len(admin.pods(ns)) == 2, "a pod was removed while its budget forbade it"
            admin.policy.delete_namespaced_pod_disruption_budget("db", ns)

        t = threading.Thread(target=relax_later)
        t.start()
        req = ActionRequest(verdict_id="v-pdb", action=ActionName.drain, target=node)
        result, n = asyncio.run(call_with_retry(
            lambda: backend.apply(req), RetryPolicy(max_attempts=30, base_delay=0.3, max_delay=1.0),
            on_retry=lambda attempt, exc, delay: attempts.append(str(exc))))
        t.join(5)
        assert result.outcome is Outcome.applied
        assert n >= 3, f"drain succeeded after {n} attempts; expected refused attempts first"
        assert all("refused" in a and "429" in a for a in attempts), attempts
        wait_for("both pods evicted", lambda: not admin.pods(ns), 30)


def test_requeue_moves_a_job_off_an_isolated_node(admin: Cluster, backend, nodes) -> None:
    bad, good = nodes
    ns = admin.namespace("rq")
    admin.batch.create_namespaced_job(ns, batch_job("train", pool=admin.node(bad).metadata.labels["fleetmedic.test/pool"], prefer=bad))
    with FakeKubelet(admin, set(nodes)):
        first = wait_pod(admin, ns, "job-name=train", lambda p: p.status.phase == "Running", "first pod running", 30)
        assert first.spec.node_name == bad
        assert act(backend, ActionName.isolate, bad, reason="gpu_hardware")[0] is Outcome.applied
        outcome, detail = act(backend, ActionName.requeue, f"{ns}/train", exclude=[bad])
        assert outcome is Outcome.applied and "excluded node" in detail, detail
        second = wait_pod(admin, ns, "job-name=train",
                          lambda p: p.metadata.uid != first.metadata.uid and bool(p.spec.node_name),
                          "replacement pod scheduled", 60)
        assert second.spec.node_name == good
        assert "FleetmedicRequeue" in {e.reason for e in admin.events_about("train", ns)}
        # a replay finds nothing left to move
        assert act(backend, ActionName.requeue, f"{ns}/train", exclude=[bad])[0] is Outcome.already_so


def test_stop_suspends_the_job(admin: Cluster, backend, nodes) -> None:
    ns = admin.namespace("stop")
    admin.batch.create_namespaced_job(ns, batch_job("buggy", pool="none"))
    assert act(backend, ActionName.stop, f"{ns}/buggy")[0] is Outcome.applied
    assert admin.batch.read_namespaced_job("buggy", ns).spec.suspend is True
    assert act(backend, ActionName.stop, f"{ns}/buggy")[0] is Outcome.already_so


def test_service_account_can_do_its_work_and_nothing_more(admin: Cluster, k8s_deployed: str) -> None:
    sa = Cluster(k8s_deployed, impersonate=SERVICE_ACCOUNT)
    # what the watcher needs
    sa.core.list_pod_for_all_namespaces(limit=1)
    sa.batch.list_job_for_all_namespaces(limit=1)
    ns = admin.namespace("rbac")
    admin.core.create_namespaced_secret(ns, {"metadata": {"name": "token"}, "stringData": {"k": "v"}})
    forbidden = [
        ("delete a namespace", lambda: sa.core.delete_namespace(ns)),
        ("read a Secret", lambda: sa.core.read_namespaced_secret("token", ns)),
        ("list Secrets", lambda: sa.core.list_secret_for_all_namespaces()),
        ("delete a node", lambda: sa.core.delete_node("anything")),
        ("create a pod", lambda: sa.core.create_namespaced_pod(ns, bare_pod("x", "nowhere"))),
        ("edit RBAC", lambda: RbacAuthorizationV1Api(sa.api).delete_cluster_role("fleetmedic")),
    ]
    for what, call in forbidden:
        with pytest.raises(ApiException) as err:
            call()
        assert err.value.status == 403, f"{what}: HTTP {err.value.status}"
    assert admin.core.read_namespace(ns).status.phase == "Active"


def test_unreachable_api_server_is_a_temporary_error(k8s_deployed: str) -> None:
    import kubernetes.client

    from actuators import TemporaryError

    cfg = kubernetes.client.Configuration()
    cfg.host = "https://127.0.0.1:9"  # nothing listens on the discard port
    cfg.retries = 0
    api = kubernetes.client.ApiClient(cfg)
    b = KubernetesBackend(kubernetes.client.CoreV1Api(api), kubernetes.client.BatchV1Api(api), request_timeout=2)
    started = time.monotonic()
    with pytest.raises(TemporaryError):
        asyncio.run(b.apply(ActionRequest(verdict_id="v", action=ActionName.isolate, target="n1")))
    assert time.monotonic() - started < 10


def test_each_pod_is_drained_in_its_workloads_mode(admin: Cluster, backend, nodes) -> None:
    """Immediate: evicted at the first try; DeleteAfterTimeout (3 s): evicted once the
    drain has waited that long; AllowCompletion: never evicted, the drain waits for it to
    finish. Carried out as the worker does, one try at a time with the work's first-try
    time, on the real API server."""
    from actuators import CircuitBreaker
    from actuators.kubernetes import DRAIN_MODE_KEY, DRAIN_TIMEOUT_KEY
    from pipeline.actuate.core import Actuation
    from schemas import Verdict

    node, _other = nodes
    ns = admin.namespace("modes")
    declared = {"fast": {}, "timed": {DRAIN_MODE_KEY: "DeleteAfterTimeout", DRAIN_TIMEOUT_KEY: "3"},
                "batch": {DRAIN_MODE_KEY: "AllowCompletion"}}
    for name, ann in declared.items():
        pod = bare_pod(name, node)
        pod["metadata"]["annotations"] = ann
        admin.core.create_namespaced_pod(ns, pod)
    gone_at: dict[str, float] = {}
    with FakeKubelet(admin, set(nodes)) as kubelet:
        wait_for("pods running", lambda: sorted(p.status.phase for p in admin.pods(ns)) == ["Running"] * 3, 30)
        t0 = time.monotonic()
        stop = threading.Event()

        def watch() -> None:
            # note when each pod is marked for deletion (evicted); finish the batch pod after 6 s
            finished = False
            while not stop.is_set():
                for p in admin.pods(ns):
                    if p.metadata.deletion_timestamp is not None:
                        gone_at.setdefault(p.metadata.name, time.monotonic() - t0)
                    if p.metadata.name == "batch" and not finished and time.monotonic() - t0 > 6:
                        kubelet.finish(p, failed=False)
                        finished = True
                present = {p.metadata.name for p in admin.pods(ns)}
                for name in declared:
                    if name not in present:
                        gone_at.setdefault(name, time.monotonic() - t0)
                stop.wait(0.1)

        t = threading.Thread(target=watch)
        t.start()
        act_ = Actuation(backend=backend, breaker=CircuitBreaker(max_fraction=1.0), fleet_size=lambda: 2,
                         retry=RetryPolicy(max_attempts=3, base_delay=0.5, max_delay=1.0, jitter=0.0))
        v = Verdict(ts=time.time(), id="v-modes", incident="inc-modes", scope="node", subject=node,
                    fault_class="gpu_hardware", confidence=0.9, nodes=[node],
                    actions=[{"action": "drain", "target": node, "params": {}}])
        [rec] = asyncio.run(act_.carry_out(v))
        took = time.monotonic() - t0
        stop.set()
        t.join(5)
    assert rec.outcome is Outcome.applied, rec
    assert rec.attempts >= 3  # it waited, beyond max_attempts (a drain is patient)
    assert gone_at["fast"] < 2.5
    assert 3.0 <= gone_at["timed"] < took + 1
    [batch] = [p for p in admin.pods(ns) if p.metadata.name == "batch"]
    assert batch.status.phase == "Succeeded" and batch.metadata.deletion_timestamp is None  # never evicted
    assert took >= 6


def test_an_isolation_from_a_lagging_node_cache_meets_a_real_409_and_keeps_a_foreign_taint(admin: Cluster, nodes,
                                                                                          k8s_deployed) -> None:
    """The node cache on the real API server, as the deployment's ServiceAccount (its list
    and watch on nodes): a node the cache has is isolated without a read; then the watch
    is stopped, a person taints the node, and the isolation from the stale cache meets the
    API server's own 409, reads the node and keeps the person's taint."""
    node, other = nodes
    b = KubernetesBackend.from_config(k8s_deployed, impersonate=SERVICE_ACCOUNT, namespace="fleetmedic-diag",
                                      diag_image="registry.local/dcgm:3", request_timeout=15.0, node_cache=True)
    try:
        cache = b.node_cache
        assert cache is not None and cache.synced.wait(30), f"the cache did not list (why: {list(cache.relisted)})"
        wait_for("both nodes in the cache", lambda: cache.get(node) and cache.get(other), 30)
        assert act(b, ActionName.isolate, other, reason="gpu_hardware")[0] is Outcome.applied
        assert (TAINT, "gpu_hardware", "NoSchedule") in admin.taints(other)

        cache.stop(join_s=10)  # the cache lags from here on
        stale = cache.nodes[node]["resourceVersion"]
        admin.core.patch_node(node, {"spec": {"taints": [
            {"key": "example.com/maintenance", "value": "bios", "effect": "NoSchedule"}]}})
        assert admin.node(node).metadata.resource_version != stale
        outcome, detail = act(b, ActionName.isolate, node, reason="gpu_hardware")
        assert outcome is Outcome.applied, detail
        assert set(admin.taints(node)) >= {("example.com/maintenance", "bios", "NoSchedule"),
                                            (TAINT, "gpu_hardware", "NoSchedule")}
        assert admin.node(node).spec.unschedulable is True
        rv = admin.node(node).metadata.resource_version
        # the stale cache still shows the node untouched: "already so" comes from the server
        assert act(b, ActionName.isolate, node, reason="gpu_hardware")[0] is Outcome.already_so
        assert admin.node(node).metadata.resource_version == rv
    finally:
        asyncio.run(b.close())
