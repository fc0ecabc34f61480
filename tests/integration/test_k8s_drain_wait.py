"""A drain that a PodDisruptionBudget blocks waits, holds up no one, and outlives a kill.

Real parts: Kafka, the worker (backend ``kubernetes`` as the deployment's ServiceAccount),
the API server with its disruption controller. A node's two pods are covered by a budget
that allows no disruption; the verdict to isolate and drain it is carried out while 100
other verdicts, each isolating another node, complete. The worker is killed with SIGKILL
during the wait and a new one resumes the drain from the kept work. After at least two
minutes the budget is relaxed and the drain succeeds, once.
"""

from __future__ import annotations

import os
import signal
import time
import uuid

import pytest

from schemas import Verdict

from .harness import Worker, collect, produce
from .k8s_helpers import Cluster, FakeKubelet, kube_worker_env
from .slurm_helpers import wait_for

pytestmark = pytest.mark.integration

BLOCKED_FOR_S = 125.0  # test time the drain stays blocked (at least 2 minutes)


def _bare_pod(name: str, node: str) -> dict:
    return {"metadata": {"name": name, "labels": {"app": "db"}},
            "spec": {"nodeName": node, "restartPolicy": "Never",
                     "containers": [{"name": "main", "image": "registry.local/app:1"}]}}


def _verdict(vid: str, node: str, actions: list[str]) -> dict:
    return Verdict(ts=time.time(), id=vid, incident=f"inc-{vid}", scope="node", subject=node,
                   fault_class="gpu_hardware", confidence=0.95, nodes=[node],
                   actions=[{"action": a, "target": node, "params": {"reason": "gpu_hardware"} if a == "isolate" else {}}
                            for a in actions]).to_dict()


def _kill(worker: Worker) -> None:
    os.killpg(worker.proc.proc.pid, signal.SIGKILL)
    worker.proc.proc.wait(10)


def test_a_pdb_blocked_drain_waits_holds_up_no_one_and_resumes_after_a_kill(kafka_bootstrap, k8s_deployed) -> None:
    c = Cluster(k8s_deployed)
    tag = uuid.uuid4().hex[:5]
    blocked = f"pd-{tag}"
    others = [f"po-{tag}-{i:03d}" for i in range(100)]
    for n in [blocked, *others]:
        c.register_node(n, pool=f"pd-{tag}")
    ns = c.namespace("pdbw")
    for i in range(2):
        c.core.create_namespaced_pod(ns, _bare_pod(f"db-{i}", blocked))
    c.policy.create_namespaced_pod_disruption_budget(ns, {
        "metadata": {"name": "db"}, "spec": {"minAvailable": 2, "selector": {"matchLabels": {"app": "db"}}}})
    env = kube_worker_env(k8s_deployed, SAFETY__FLEET_SIZE="200", SAFETY__MAX_FRACTION="1.0",
                          SAFETY__MAX_ABSOLUTE="1000", ACTUATORS__MAX_DELAY_S="5")
    workers: list[Worker] = []
    try:
        with FakeKubelet(c, {blocked, *others}):
            wait_for("PDB counts both pods healthy", lambda: (c.policy.read_namespaced_pod_disruption_budget(
                "db", ns).status.current_healthy or 0) == 2, 60)
            workers.append(Worker(kafka_bootstrap, sim_url="http://127.0.0.1:9", env=env).start())
            w = workers[0]
            drain_key = f"v-{tag}-pdb:drain:{blocked}"
            t0 = time.monotonic()
            produce(kafka_bootstrap, [(w.topic("verdicts"), blocked, _verdict(f"v-{tag}-pdb", blocked,
                                                                              ["isolate", "drain"]))])
            wait_for("the drain refused and waiting", lambda: w.stats()["actions_waiting"] >= 1
                     and w.stats()["action_tries"] >= 3, 60)
            # 100 other verdicts complete meanwhile
            produce(kafka_bootstrap, [(w.topic("verdicts"), n, _verdict(f"v-{tag}-{i}", n, ["isolate"]))
                                      for i, n in enumerate(others)])
            acts = collect(kafka_bootstrap, w.topic("actions"),
                           lambda rs: sum(1 for a in rs if a["target"] in others and a["outcome"] == "applied") >= 100,
                           120)
            assert sum(1 for a in acts if a["target"] in others and a["outcome"] == "applied") == 100
            assert not [a for a in acts if a["key"] == drain_key], "the drain settled while its budget forbade it"
            assert len(c.pods(ns)) == 2
            # a kill during the wait: a new worker resumes the drain from the kept work
            _kill(w)
            workers.append(Worker(kafka_bootstrap, sim_url="http://127.0.0.1:9",
                                  env={**env, **{k: v for k, v in w.env.items() if k.startswith("FLEETMEDIC_KAFKA__")}})
                           .start())
            w = workers[-1]
            wait_for("the new worker tries the drain again", lambda: w.stats()["action_tries"] >= 2, 90)
            left = BLOCKED_FOR_S - (time.monotonic() - t0)
            if left > 0:
                time.sleep(left)
            assert len(c.pods(ns)) == 2, "a pod was evicted while its budget forbade it"
            c.policy.delete_namespaced_pod_disruption_budget("db", ns)
            acts = collect(kafka_bootstrap, w.topic("actions"),
                           lambda rs: any(a["key"] == drain_key for a in rs), 90)
            blocked_s = time.monotonic() - t0
            drains = [a for a in acts if a["key"] == drain_key]
            assert [a["outcome"] for a in drains] == ["applied"], drains
            assert blocked_s >= 120
            wait_for("both pods evicted", lambda: not c.pods(ns), 30)
            isolations = [a for a in acts if a["target"] == blocked and a["action"] == "isolate"]
            assert [a["outcome"] for a in isolations if a["outcome"] != "already_so"] == ["applied"], isolations
    finally:
        for w in workers:
            w.stop()
        for n in [blocked, *others]:
            c.core.delete_node(n)
