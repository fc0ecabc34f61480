"""The recovery loop on a real Kubernetes control plane (deploy/k8s.sh) and a real broker.

Real parts: Kafka, the worker process (backend ``kubernetes``, acting as the deployment's
ServiceAccount through impersonation), the ``fleetmedic watch-k8s`` process, the API
server, the Job controller and the scheduler.  The test plays the kubelet (no kubelet
runs here) and the GPU collector (it writes the Xid sample a node agent would).
"""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from actuators.kubernetes import CONDITION_QUARANTINE

from pipeline.eval.failures import excerpt

from .harness import ROOT, Worker, collect, gpu_sample, produce
from .k8s_helpers import Cluster, FakeKubelet, kube_worker_env, batch_job, wait_pod
from .slurm_helpers import wait_for

pytestmark = pytest.mark.integration

NODES = ["n1", "n2", "n3", "n4"]
POOL = "loop"
TAINT = "fleetmedic.dev/quarantine"


@pytest.fixture(scope="module")
def k8s_loop(kafka_bootstrap, k8s_deployed, tmp_path_factory):
    work = tmp_path_factory.mktemp("k8s")
    c = Cluster(k8s_deployed)
    for n in NODES:
        c.register_node(n, pool=POOL)
    ns = c.namespace("ml")
    env = kube_worker_env(k8s_deployed, ACTUATORS__KUBE_JOB_NAMESPACE=ns, SAFETY__FLEET_SIZE="4",
                          SAFETY__MAX_FRACTION="0.5")
    worker = Worker(kafka_bootstrap, sim_url="http://127.0.0.1:9", env=env).start()
    log = open(work / "watcher.log", "w")
    watcher = subprocess.Popen([sys.executable, "-m", "pipeline", "watch-k8s", "--watch-timeout", "30"], cwd=ROOT,
                               env=worker.env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    with FakeKubelet(c, set(NODES)) as kubelet:
        yield kafka_bootstrap, worker, c, ns, kubelet
    watcher.terminate()
    watcher.wait(10)
    log.close()
    worker.stop()
    for n in NODES:
        c.core.delete_node(n)


def job_started(bootstrap: str, worker: Worker, job: str) -> None:
    collect(bootstrap, worker.topic("telemetry.job"),
            lambda rs: any(r["job"] == job and r["event"] == "started" for r in rs), timeout=30)


def test_xid79_cordons_the_node_moves_the_job_and_returns_the_node_after_diagnostics(k8s_loop):
    bootstrap, worker, c, ns, kubelet = k8s_loop
    c.batch.create_namespaced_job(ns, batch_job("train", pool=POOL, prefer="n3"))
    first = wait_pod(c, ns, "job-name=train", lambda p: p.status.phase == "Running", "training pod running", 30)
    assert first.spec.node_name == "n3"
    job = f"{ns}/train"
    job_started(bootstrap, worker, job)

    # the GPU falls off the bus (the node agent's sample) and the training process dies of
    # it at once, before any drain could evict its pod
    lost = [False] * 8
    lost[2] = True
    produce(bootstrap, [(worker.topic("telemetry.gpu"), "n3", gpu_sample("n3", time.time(), lost=lost, xids=[(2, 79)]))])
    kubelet.finish(first, failed=True, exit_code=1, reason="Error",
                   message="RuntimeError: CUDA error: unspecified launch failure")
    # one isolation is three writes (the cordon and taint, then the condition, then an
    # Event): the test waits for all three, not for the first
    wait_for("n3 cordoned, tainted, conditioned and an Event recorded",
             lambda: c.node("n3").spec.unschedulable and (TAINT, "gpu_hardware", "NoSchedule") in c.taints("n3")
             and c.condition("n3", CONDITION_QUARANTINE).status == "True"
             and "FleetmedicIsolate" in {e.reason for e in c.events_about("n3")}, 60)
    cond = c.condition("n3", CONDITION_QUARANTINE)
    assert cond.status == "True"
    assert "FleetmedicIsolate" in {e.reason for e in c.events_about("n3")}

    # the Job controller recreates the pod and the scheduler places it elsewhere
    second = wait_pod(c, ns, "job-name=train",
                      lambda p: p.metadata.uid != first.metadata.uid and bool(p.spec.node_name),
                      "replacement pod scheduled", 90)
    assert second.spec.node_name != "n3"

    verdicts = collect(bootstrap, worker.topic("verdicts"), lambda rs: {job, "n3"} <= {v["subject"] for v in rs}, 60)
    jv = next(v for v in verdicts if v["subject"] == job)
    nv = next(v for v in verdicts if v["subject"] == "n3")
    assert jv["incident"] == nv["incident"]
    assert jv["actions"][0]["action"] == "requeue" and jv["actions"][0]["params"]["exclude"] == ["n3"]

    # the diagnostics pod is bound to n3 (tolerating the quarantine) and passes
    diag = wait_pod(c, "fleetmedic-diag", "fleetmedic.dev/node=n3", lambda p: bool(p.spec.node_name),
                    "diagnostics pod bound", 60)
    assert diag.spec.node_name == "n3"
    wait_pod(c, "fleetmedic-diag", "fleetmedic.dev/node=n3", lambda p: p.status.phase == "Running",
             "diagnostics pod running", 30)
    kubelet.finish(c.pods("fleetmedic-diag", "fleetmedic.dev/node=n3")[0], failed=False)
    wait_for("n3 schedulable again",
             lambda: not c.node("n3").spec.unschedulable and not [t for t in c.taints("n3") if t[0] == TAINT], 60)
    assert c.condition("n3", CONDITION_QUARANTINE).status == "False"

    actions = collect(bootstrap, worker.topic("actions"),
                      lambda rs: any(a["target"] == "n3" and a["action"] == "return" for a in rs), 30)
    done = {(a["action"], a["target"]): a for a in actions}
    for key in [("isolate", "n3"), ("drain", "n3"), ("diagnose", "n3"), ("requeue", job), ("return", "n3")]:
        assert key in done, f"no action record for {key}"
        assert done[key]["outcome"] in ("applied", "already_so"), done[key]
        assert done[key]["backend"] == "kubernetes"
    assert not [a for a in actions if a["outcome"] == "failed"], [a for a in actions if a["outcome"] == "failed"]
    c.batch.delete_namespaced_job("train", ns, propagation_policy="Background")


def test_transient_failure_recreates_the_pod_and_cordons_nothing(k8s_loop):
    bootstrap, worker, c, ns, kubelet = k8s_loop
    since = time.time()
    c.batch.create_namespaced_job(ns, batch_job("flaky", pool=POOL, prefer="n1"))
    first = wait_pod(c, ns, "job-name=flaky", lambda p: p.status.phase == "Running", "flaky pod running", 30)
    job = f"{ns}/flaky"
    job_started(bootstrap, worker, job)
    # the Hugging Face Hub rate-limiting every rank at once, as the job printed it (tests/data/failures/tune)
    rate_limited = excerpt("t-hf-kernels-640-hub-429-multirank-ratelimit")
    kubelet.finish(first, failed=True, exit_code=1, reason="Error", message=rate_limited.log[-4096:])
    verdicts = collect(bootstrap, worker.topic("verdicts"), lambda rs: any(v["subject"] == job for v in rs), 60)
    jv = next(v for v in verdicts if v["subject"] == job)
    assert jv["fault_class"] == "transient_software"
    assert jv["actions"][0]["action"] == "retry"
    assert jv["evidence"]["decided_by"] == "service_unavailable"
    wait_pod(c, ns, "job-name=flaky", lambda p: p.metadata.uid != first.metadata.uid and p.status.phase == "Running",
             "pod recreated and running", 90)
    for n in NODES:
        assert not c.node(n).spec.unschedulable, f"{n} was cordoned"
        assert not [t for t in c.taints(n) if t[0] == TAINT], f"{n} was tainted"
    assert not [v for v in verdicts if v["scope"] == "node" and v["ts"] >= since]
    c.batch.delete_namespaced_job("flaky", ns, propagation_policy="Background")
