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
