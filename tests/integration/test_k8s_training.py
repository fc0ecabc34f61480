"""Training workloads as they run: PyTorchJobs of the Kubeflow training operator, jobs
admitted by Kueue, and checkpoint-now, on the real control plane (deploy/k8s.sh with
``FLEETMEDIC_K8S_ADDONS=kueue,training-operator``) and a real broker.

Real parts: Kafka, the worker (backend ``kubernetes``, as the deployment's
ServiceAccount), the ``watch-k8s`` process, the API server, the Job controller, the
scheduler, Kueue v0.17.0 and the training operator v1.8.1 (built from the Go module
proxy; their CRDs and Kueue's webhooks as they ship).  The test plays the kubelet
(:class:`FakeKubelet`: pods bound to a node run; deleted pods go), the GPU collector (an
Xid 79 sample) and, for checkpoint-now, a detector's degradation findings on the
``anomalies`` topic and the kubelet's downward-API file that the job's client reads.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes.client import ApisApi, CustomObjectsApi

from .harness import ROOT, Worker, collect, gpu_sample, produce
from .k8s_helpers import Cluster, FakeKubelet, batch_job, kube_worker_env
from .slurm_helpers import wait_for

pytestmark = pytest.mark.integration

#: each test has a pool of three nodes of its own: jobs deleted by an earlier test are never
#: "released" (the watcher follows pods, not deletions), and would hold a drain back
POOLS = {"pj": ["pj1", "pj2", "pj3"], "kq": ["kq1", "kq2", "kq3"], "ck": ["ck1", "ck2", "ck3"],
         "dl": ["dl1", "dl2", "dl3"]}
NODES = [n for nodes in POOLS.values() for n in nodes]
CHECKPOINT = "fleetmedic.io/checkpoint-requested"
DEADLINE_S = 40.0
#: upstream's own PyTorchJob example (tests/fixtures/kubeflow/README.md)
PYTORCH_SIMPLE = yaml.safe_load((ROOT / "tests" / "fixtures" / "kubeflow" / "pytorch-simple.yaml").read_text())


def _groups(c: Cluster) -> set[str]:
    return {g.name for g in ApisApi(c.api).get_api_versions().groups}


@pytest.fixture(scope="module")
def training(kafka_bootstrap, k8s_deployed, tmp_path_factory):
    c = Cluster(k8s_deployed)
    if not {"kubeflow.org", "kueue.x-k8s.io"} <= _groups(c):
        pytest.fail("the control plane runs without its add-ons: start it with "
                    "FLEETMEDIC_K8S_ADDONS=kueue,training-operator bash deploy/k8s.sh start (tests/run.sh does)")
    work = tmp_path_factory.mktemp("training")
    for pool, nodes in POOLS.items():
        for n in nodes:
            c.register_node(n, pool=pool)
    ns = c.namespace("train")
    custom = CustomObjectsApi(c.api)
    _kueue_queues(custom, ns)
    # each test isolates a node of its pool: the breaker allows all of them
    env = kube_worker_env(k8s_deployed, ACTUATORS__KUBE_JOB_NAMESPACE=ns, SAFETY__FLEET_SIZE=str(len(NODES)),
                          SAFETY__MAX_FRACTION="1.0", POLICY__CHECKPOINT_DEADLINE_S=str(DEADLINE_S))
    worker = Worker(kafka_bootstrap, sim_url="http://127.0.0.1:9", env=env).start()
    log = open(work / "watcher.log", "w")
    watcher = subprocess.Popen([sys.executable, "-m", "pipeline", "watch-k8s", "--watch-timeout", "30"], cwd=ROOT,
                               env=worker.env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    with FakeKubelet(c, set(NODES)) as kubelet:
        yield kafka_bootstrap, worker, c, custom, ns, kubelet, work
    watcher.terminate()
    watcher.wait(10)
    log.close()
    worker.stop()
    # everything of this module goes: its jobs and pods with the namespace, the
    # diagnostics Jobs of its nodes, its queues, its nodes
    c.core.delete_namespace(ns)
    for j in c.batch.list_namespaced_job("fleetmedic-diag").items:
        if (j.metadata.labels or {}).get("fleetmedic.dev/node") in NODES:
            c.batch.delete_namespaced_job(j.metadata.name, "fleetmedic-diag", propagation_policy="Background")
    tag = ns.rsplit("-", 1)[-1]
    for plural, name in (("clusterqueues", f"cq-{tag}"), ("resourceflavors", f"gpu-{tag}")):
        custom.delete_cluster_custom_object("kueue.x-k8s.io", "v1beta2", plural, name)
    for n in NODES:
        c.core.delete_node(n)


def _kueue_queues(custom: CustomObjectsApi, ns: str) -> None:
    """One flavor, a ClusterQueue with room for two 8-GPU jobs, a LocalQueue in ``ns``."""
    g, v = "kueue.x-k8s.io", "v1beta2"
    tag = ns.rsplit("-", 1)[-1]
    custom.create_cluster_custom_object(g, v, "resourceflavors", {
        "apiVersion": f"{g}/{v}", "kind": "ResourceFlavor", "metadata": {"name": f"gpu-{tag}"}})
    custom.create_cluster_custom_object(g, v, "clusterqueues", {
        "apiVersion": f"{g}/{v}", "kind": "ClusterQueue", "metadata": {"name": f"cq-{tag}"},
        "spec": {"namespaceSelector": {}, "resourceGroups": [{
            "coveredResources": ["nvidia.com/gpu"],
            "flavors": [{"name": f"gpu-{tag}", "resources": [{"name": "nvidia.com/gpu", "nominalQuota": 16}]}]}]}})
    custom.create_namespaced_custom_object(g, v, ns, "localqueues", {
        "apiVersion": f"{g}/{v}", "kind": "LocalQueue", "metadata": {"name": "team", "namespace": ns},
        "spec": {"clusterQueue": f"cq-{tag}"}})


def _pytorchjob(name: str, *, pool: str, prefer: str, queue: str | None = None) -> dict[str, Any]:
    """Upstream's example, on this test's nodes: each replica takes a whole node's GPUs,
    preferring ``prefer``, with the downward-API volume of docs/checkpoint-now.md."""
    doc = copy.deepcopy(PYTORCH_SIMPLE)
    doc["metadata"] = {"name": name, "labels": {"kueue.x-k8s.io/queue-name": queue} if queue else {}}
    for spec in doc["spec"]["pytorchReplicaSpecs"].values():
        pod = spec["template"]["spec"]
        pod["nodeSelector"] = {"fleetmedic.test/pool": pool}
        pod["affinity"] = {"nodeAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [{
            "weight": 100, "preference": {"matchFields": [{"key": "metadata.name", "operator": "In",
                                                           "values": [prefer]}]}}]}}
        pod["containers"][0]["resources"] = {"limits": {"nvidia.com/gpu": "8"}}
        pod["containers"][0]["volumeMounts"] = [{"name": "podinfo", "mountPath": "/etc/podinfo"}]
        pod["volumes"] = [{"name": "podinfo", "downwardAPI": {"items": [
            {"path": "annotations", "fieldRef": {"fieldPath": "metadata.annotations"}}]}}]
    return doc


def _job_pods(c: Cluster, ns: str, name: str) -> list[Any]:
    return [p for p in c.pods(ns, f"training.kubeflow.org/job-name={name}") if p.metadata.deletion_timestamp is None]


def _running(c: Cluster, ns: str, name: str, n: int) -> list[Any]:
    return wait_for(f"{n} pods of {name} running",
                    lambda: (ps if len(ps := [p for p in _job_pods(c, ns, name) if p.status.phase == "Running"]) == n
                             else None), 90)


def _placement_known() -> None:
    """The job's placement reaches the node's owner as a notice after its start record: a
    fault seen before that is the node's alone (a real one comes long after the start)."""
    time.sleep(2)


def _xid79(bootstrap: str, worker: Worker, node: str) -> None:
    _placement_known()
    lost = [False] * 8
    lost[2] = True
    produce(bootstrap, [(worker.topic("telemetry.gpu"), node,
                         gpu_sample(node, time.time(), lost=lost, xids=[(2, 79)]))])


def _excluded(template: dict[str, Any]) -> list[str]:
    terms = (((template["spec"].get("affinity") or {}).get("nodeAffinity") or {})
             .get("requiredDuringSchedulingIgnoredDuringExecution") or {}).get("nodeSelectorTerms") or []
    return sorted({v for t in terms for e in t.get("matchExpressions") or []
                   if e["key"] == "kubernetes.io/hostname" and e["operator"] == "NotIn" for v in e["values"]})


def _start_pytorchjob(training, name: str, *, pool: str, prefer: str, rtype: str) -> tuple[str, list[Any], str]:
    """Submit a PyTorchJob, wait for its two pods to run and for the watcher's start
    record of both; its id, its pods and the node of its ``rtype`` replica."""
    bootstrap, worker, c, custom, ns, _, _ = training
    custom.create_namespaced_custom_object("kubeflow.org", "v1", ns, "pytorchjobs",
                                           _pytorchjob(name, pool=pool, prefer=prefer))
    pods = _running(c, ns, name, 2)
    node = next(p.spec.node_name for p in pods if p.metadata.labels["training.kubeflow.org/replica-type"] == rtype)
    job = f"{ns}/{name}"
    collect(bootstrap, worker.topic("telemetry.job"),
            lambda rs: any(r["job"] == job and r["event"] == "started" and len(r["nodes"]) == 2 for r in rs), 60)
    return job, pods, node


def _actions(bootstrap: str, worker: Worker, until, timeout: float = 90) -> list[dict[str, Any]]:
    return collect(bootstrap, worker.topic("actions"), until, timeout)


def test_a_pytorchjob_on_a_node_with_xid79_is_restarted_by_its_operator_without_that_node(training):
    bootstrap, worker, c, custom, ns, kubelet, _ = training
    job, pods, bad = _start_pytorchjob(training, "llama", pool="pj", prefer="pj2", rtype="worker")
    old = {p.metadata.uid for p in pods}

    _xid79(bootstrap, worker, bad)
    acts = _actions(bootstrap, worker, lambda rs: any(a["target"] == job and a["action"] == "requeue"
                                                      and a["outcome"] != "failed" for a in rs)
                    or any(a["target"] == job and a["outcome"] == "failed" for a in rs), 120)
    mine = [a for a in acts if a["target"] == job]
    assert [a["outcome"] for a in mine] == ["applied"], mine

    pj = custom.get_namespaced_custom_object("kubeflow.org", "v1", ns, "pytorchjobs", "llama")
    for rtype, spec in pj["spec"]["pytorchReplicaSpecs"].items():
        assert _excluded(spec["template"]) == [bad], rtype
        assert spec["restartPolicy"] == "OnFailure"  # the job's own restart policy is kept
    assert pj["spec"]["runPolicy"].get("suspend") is False
    # the operator recreated every replica (a gang restart from the checkpoint), off the bad node
    fresh = wait_for("both replicas recreated and running elsewhere",
                     lambda: (ps if len(ps := [p for p in _job_pods(c, ns, "llama") if p.metadata.uid not in old
                                               and p.status.phase == "Running"]) == 2 else None), 120)
    assert all(p.spec.node_name != bad for p in fresh)
    assert all(p.metadata.owner_references[0].kind == "PyTorchJob" for p in fresh)
    custom.delete_namespaced_custom_object("kubeflow.org", "v1", ns, "pytorchjobs", "llama")


def test_a_job_admitted_by_kueue_is_requeued_through_kueue_without_the_node(training):
    bootstrap, worker, c, custom, ns, kubelet, _ = training
    body = batch_job("queued", pool="kq", prefer="kq3", labels={"kueue.x-k8s.io/queue-name": "team"})
    c.batch.create_namespaced_job(ns, body)
    # Kueue's webhook suspended it at creation; its admission lets it run
    wl = wait_for("a Workload admitted by Kueue", lambda: next(
        (w for w in custom.list_namespaced_custom_object("kueue.x-k8s.io", "v1beta2", ns, "workloads")["items"]
         if any(r["name"] == "queued" for r in w["metadata"].get("ownerReferences") or [])
         and (w.get("status") or {}).get("admission")), None), 60)
    first = wait_for("the admitted job's pod running", lambda: next(
        (p for p in c.pods(ns, "job-name=queued") if p.status.phase == "Running"), None), 60)
    bad = first.spec.node_name
    job = f"{ns}/queued"
    collect(bootstrap, worker.topic("telemetry.job"),
            lambda rs: any(r["job"] == job and r["event"] == "started" for r in rs), 60)

    _xid79(bootstrap, worker, bad)
    acts = _actions(bootstrap, worker, lambda rs: any(a["target"] == job and a["action"] == "requeue" for a in rs), 150)
    mine = [a for a in acts if a["target"] == job and a["action"] == "requeue"]
    assert [a["outcome"] for a in mine] == ["applied"], mine
    assert "Kueue" in mine[0]["detail"]

    j = c.batch.read_namespaced_job("queued", ns)
    affinity = c.api.sanitize_for_serialization(j.spec.template)
    assert _excluded(affinity) == [bad]
    # Kueue evicted it (its Workload was deactivated), then admitted it again
    events = [e.reason for e in c.core.list_namespaced_event(ns).items
              if e.involved_object.kind == "Workload" or e.involved_object.name == "queued"]
    assert "FleetmedicRequeue" in events
    again = wait_for("the job admitted again and its new pod running elsewhere", lambda: next(
        (p for p in c.pods(ns, "job-name=queued") if p.metadata.uid != first.metadata.uid
         and p.status.phase == "Running"), None), 120)
    assert again.spec.node_name != bad
    w = custom.get_namespaced_custom_object("kueue.x-k8s.io", "v1beta2", ns, "workloads", wl["metadata"]["name"]) \
        if any(x["metadata"]["name"] == wl["metadata"]["name"] for x in
               custom.list_namespaced_custom_object("kueue.x-k8s.io", "v1beta2", ns, "workloads")["items"]) else None
    assert w is None or w["spec"].get("active", True) is True
    c.batch.delete_namespaced_job("queued", ns, propagation_policy="Background")


def _degrade(bootstrap: str, worker: Worker, node: str) -> None:
    """Three degradation findings of a detector on ``node`` (the node track's confirmations)."""
    _placement_known()
    t = time.time()
    produce(bootstrap, [(worker.topic("anomalies"), node, {
        "schema": "anomaly/1", "ts": t + i, "id": f"sbe-{node}-{uuid.uuid4().hex[:6]}", "detector": "gpu_rates",
        "subject_type": "gpu", "subject": f"{node}/gpu3", "node": node, "gpu": 3, "kind": "ecc_sbe_rate",
        "fault_class": "node_degrading", "score": 6.0, "severity": "warning",
        "evidence": {"rate_per_h": 40.0}}) for i in range(3)])


def _downward_file(pod: Any, path: Path) -> Path:
    """What the kubelet writes for a ``metadata.annotations`` downward-API item: one
    ``key="value"`` line per annotation, sorted, Go-quoted (pkg/fieldpath FormatMap)."""
    ann = pod.metadata.annotations or {}
    path.write_text("".join(f"{k}={json.dumps(v)}\n" for k, v in sorted(ann.items())))
    return path


def _client(args: list[str], env: dict[str, str], work: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "fleetmedic.client", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=60, env={**os.environ, **env, "HOME": str(work)})


def test_checkpoint_now_round_trip_the_request_the_ack_then_the_move_and_the_drain(training):
    bootstrap, worker, c, custom, ns, kubelet, work = training
    job, pods, node = _start_pytorchjob(training, "ckpt", pool="ck", prefer="ck1", rtype="master")

    _degrade(bootstrap, worker, node)
    asked = wait_for("the checkpoint request on the job's pods", lambda: next(
        (p for p in _job_pods(c, ns, "ckpt") if (p.metadata.annotations or {}).get(CHECKPOINT)), None), 90)
    # the job's own client reads the kubelet's file, saves, and answers with its checkpoint record
    env = {"FLEETMEDIC_PODINFO_ANNOTATIONS": str(_downward_file(asked, work / "annotations")),
           "FLEETMEDIC_JOB": job, "FLEETMEDIC_SCHEDULER": "kubernetes", "FLEETMEDIC_BOOTSTRAP": bootstrap,
           "FLEETMEDIC_TOPIC_PREFIX": worker.topic("telemetry.job").removesuffix("telemetry.job"),
           "FLEETMEDIC_ACK_STATE": str(work / "ack-state")}
    check = _client(["check"], env, work)
    assert check.returncode == 0, check.stdout + check.stderr
    acts = _actions(bootstrap, worker, lambda rs: any(a["target"] == job and a["action"] == "checkpoint" for a in rs))
    assert not [a for a in acts if a["target"] == node and a["action"] == "drain"]  # nothing drained before the ack
    ack = _client(["ack", "--step", "1200"], env, work)
    assert ack.returncode == 0, ack.stdout + ack.stderr

    pj = custom.get_namespaced_custom_object("kubeflow.org", "v1", ns, "pytorchjobs", "ckpt")
    assert pj["metadata"]["annotations"][CHECKPOINT] == asked.metadata.annotations[CHECKPOINT]
    # cordoned as well (the node's verdict is carried out beside the job's): no new work lands there
    wait_for(f"{node} cordoned", lambda: c.node(node).spec.unschedulable, 30)
    records = collect(bootstrap, worker.topic("telemetry.job"),
                      lambda rs: any(r["job"] == job and r["event"] == "checkpoint_requested" for r in rs), 30)
    req = next(r for r in records if r["job"] == job and r["event"] == "checkpoint_requested")
    assert req["checkpoint_deadline"] > req["ts"]

    acts = _actions(bootstrap, worker, lambda rs: any(a["target"] == node and a["action"] == "drain" for a in rs)
                    and any(a["target"] == job and a["action"] == "requeue" for a in rs), 120)
    [requeue] = [a for a in acts if a["target"] == job and a["action"] == "requeue"]
    assert requeue["outcome"] == "applied", requeue
    verdicts = collect(bootstrap, worker.topic("verdicts"),
                       lambda rs: any(v["subject"] == job and v["actions"][0]["action"] == "requeue" for v in rs), 30)
    move = next(v for v in verdicts if v["subject"] == job and v["actions"][0]["action"] == "requeue")
    assert move["evidence"]["reason"] == "checkpoint reached" and move["evidence"]["checkpoint"]["step"] == 1200
    assert move["actions"][0]["params"]["exclude"] == [node]
    drain = next(v for v in verdicts if v["subject"] == node and v["actions"][0]["action"] == "drain")
    assert drain["ts"] >= move["ts"]
    fresh = wait_for("the job running again off the degrading node", lambda: (
        ps if len(ps := [p for p in _job_pods(c, ns, "ckpt") if p.status.phase == "Running"
                         and p.metadata.uid not in {x.metadata.uid for x in pods}]) == 2 else None), 120)
    assert all(p.spec.node_name != node for p in fresh)
    custom.delete_namespaced_custom_object("kubeflow.org", "v1", ns, "pytorchjobs", "ckpt")


def test_checkpoint_now_without_an_answer_moves_the_job_at_the_deadline(training):
    bootstrap, worker, c, custom, ns, kubelet, _ = training
    c.batch.create_namespaced_job(ns, batch_job("silent", pool="dl", prefer="dl2"))
    pod = wait_for("the silent job's pod running", lambda: next(
        (p for p in c.pods(ns, "job-name=silent") if p.status.phase == "Running"), None), 60)
    node = pod.spec.node_name
    job = f"{ns}/silent"
    collect(bootstrap, worker.topic("telemetry.job"),
            lambda rs: any(r["job"] == job and r["event"] == "started" for r in rs), 60)
    asked_at = time.time()
    _degrade(bootstrap, worker, node)
    wait_for("the checkpoint request on the pod", lambda: (c.core.read_namespaced_pod(pod.metadata.name, ns)
                                                           .metadata.annotations or {}).get(CHECKPOINT), 90)
    # no answer: at the deadline the job moves from its last checkpoint, and the node is drained
    verdicts = collect(bootstrap, worker.topic("verdicts"),
                       lambda rs: any(v["subject"] == job and v["actions"][0]["action"] == "requeue" for v in rs),
                       DEADLINE_S + 90)
    move = next(v for v in verdicts if v["subject"] == job and v["actions"][0]["action"] == "requeue")
    assert "deadline" in move["evidence"]["reason"]
    assert time.time() - asked_at >= DEADLINE_S - 1  # not before the deadline
    # the drain and the move go together: whichever comes first moves the pod (the other is already so)
    acts = _actions(bootstrap, worker, lambda rs: any(a["target"] == node and a["action"] == "drain" for a in rs)
                    and any(a["target"] == job and a["action"] == "requeue" for a in rs), 90)
    assert any(a["target"] == node and a["action"] == "drain" and a["outcome"] in ("applied", "already_so")
               for a in acts)
    assert any(a["target"] == job and a["action"] == "requeue" and a["outcome"] in ("applied", "already_so")
               for a in acts)
    wait_for("the silent job's pod evicted from the node", lambda: not [
        p for p in c.pods(ns, "job-name=silent") if p.spec.node_name == node and p.metadata.deletion_timestamp is None
        and p.status.phase == "Running"], 60)
    c.batch.delete_namespaced_job("silent", ns, propagation_policy="Background")
