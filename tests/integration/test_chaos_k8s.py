"""``make chaos`` in small against the real API server, judged from the API server's audit log.

Real parts: Kafka, the worker (backend ``kubernetes``, acting as the deployment's
ServiceAccount), the API server started by ``deploy/k8s.sh`` with its audit policy, its
disruption controller.  The test plays the GPU collectors (every node sends a sample a
second; a faulty node reports Xid 79, "GPU has fallen off the bus", and loses the GPU
from then on, as the driver does) and the kubelet.

Four worker kills, each with SIGKILL: while it runs just after a fault, while the next
worker starts, while two drains wait on a PodDisruptionBudget, and just after an operator
switched dry-run on.  Nothing the pipeline says about itself is believed: the outcome is
read from the API server's own audit log (:mod:`pipeline.eval.audit`) and judged by the
checker that judges the simulator's log (:mod:`pipeline.eval.groundtruth`): every faulty
node cordoned once or explained by dry-run, no second effect for one incident, no healthy
node touched, every drain that the budget refused done after it relaxed, no effect while
dry-run was on, no crash line in any worker log.
"""

from __future__ import annotations

import os
import signal
import threading
import time
import uuid
from pathlib import Path

import numpy as np
import pytest

from pipeline.eval.audit import AuditLog, requests_from_audit
from pipeline.eval.chaos import DRY_RUN_GRACE_S, crash_lines
from pipeline.eval.groundtruth import InjectedFault, blocked_drains, check

from .harness import GPUS, Worker, api_call, collect, gpu_sample, produce
from .k8s_helpers import Cluster, FakeKubelet, kube_worker_env
from .slurm_helpers import wait_for

pytestmark = pytest.mark.integration

N_NODES = 12


def _pod(name: str, node: str, labels: dict[str, str]) -> dict:
    return {"metadata": {"name": name, "labels": labels},
            "spec": {"nodeName": node, "restartPolicy": "Never", "terminationGracePeriodSeconds": 0,
                     "containers": [{"name": "main", "image": "registry.local/train:1"}]}}


class Collectors:
    """Every node's GPU collector: a sample a second; from its fault on, a node reports
    Xid 79 once and then GPU 3 lost."""

    def __init__(self, bootstrap: str, worker: Worker, nodes: list[str]) -> None:
        self.bootstrap, self.topic, self.nodes = bootstrap, worker.topic("telemetry.gpu"), nodes
        self.faults: dict[str, float] = {}
        self.rng = np.random.default_rng(7)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="collectors")

    def fault(self, node: str) -> float:
        self.faults[node] = time.time()
        return self.faults[node]

    def _run(self) -> None:
        reported: set[str] = set()
        while not self._stop.is_set():
            now = time.time()
            items = []
            for n in self.nodes:
                at = self.faults.get(n)
                lost = [False] * GPUS
                xids: list[tuple[int, int]] = []
                if at is not None and now >= at:
                    lost[3] = True
                    if n not in reported:
                        xids, lost[3] = [(3, 79)], False
                        reported.add(n)
                items.append((self.topic, n, gpu_sample(n, now, lost=lost, xids=xids, rng=self.rng)))
            try:
                produce(self.bootstrap, items)
            except Exception:  # the broker busy: the next second's samples follow
                pass
            self._stop.wait(1.0)

    def __enter__(self) -> Collectors:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)


def test_chaos_against_the_real_api_server_judged_from_its_audit_log(kafka_bootstrap, k8s_deployed) -> None:
    audit_path = Path(k8s_deployed).parent / "log" / "audit.log"
    assert audit_path.parent.is_dir(), (
        f"the control plane of {k8s_deployed} keeps no audit log here ({audit_path}); "
        "this test needs the one deploy/k8s.sh starts")
    c = Cluster(k8s_deployed)
    t_start = time.time()  # the audit log is read from here: the pods' placement included
    tag = uuid.uuid4().hex[:5]
    nodes = [f"ck-{tag}-{i:02d}" for i in range(N_NODES)]
    for n in nodes:
        c.register_node(n, pool=f"ck-{tag}")
    ns = c.namespace("chaosk")
    # the two nodes whose drains meet a budget that allows no disruption
    budget_nodes = nodes[2:4]
    for n in nodes:
        labels = {"app": f"train-{tag}", **({"budget": tag} if n in budget_nodes else {})}
        c.core.create_namespaced_pod(ns, _pod(f"w-{n}", n, labels))
    env = kube_worker_env(k8s_deployed, ACTUATORS__KUBE_JOB_NAMESPACE=ns, SAFETY__FLEET_SIZE=str(N_NODES),
                          SAFETY__MAX_FRACTION="0.75", SAFETY__MAX_ABSOLUTE="100", ACTUATORS__MAX_DELAY_S="5")
    workers: list[Worker] = []
    faults: list[InjectedFault] = []
    dry_run: list[tuple[float, float]] = []
    block: list[tuple[float, float]] = []

    def spawn(wait: bool = True) -> Worker:
        """A worker of the same group and topics; with ``wait``, once it is ready."""
        kafka_env = {k: v for k, v in workers[-1].env.items() if k.startswith("FLEETMEDIC_KAFKA__")} if workers else {}
        w = Worker(kafka_bootstrap, sim_url="http://127.0.0.1:9", env={**env, **kafka_env})
        workers.append(w)
        return w.start(wait=wait)

    def kill(w: Worker) -> None:
        assert w.alive(), f"the worker died on its own:\n{w.log_tail()}"
        os.killpg(w.proc.proc.pid, signal.SIGKILL)
        w.proc.proc.wait(10)

    def hit(node: str) -> None:
        faults.append(InjectedFault("xid_79", node, col.fault(node), True))

    def cordoned(node: str) -> bool:
        return bool(c.core.read_node(node).spec.unschedulable)

    try:
        with FakeKubelet(c, set(nodes)):
            wait_for("every pod running", lambda: sum(
                1 for p in c.pods(ns) if p.status.phase == "Running") == N_NODES, 60)
            c.policy.create_namespaced_pod_disruption_budget(ns, {
                "metadata": {"name": "hold"}, "spec": {"minAvailable": 2, "selector": {"matchLabels": {"budget": tag}}}})
            wait_for("the budget counts both pods healthy", lambda: (c.policy.read_namespaced_pod_disruption_budget(
                "hold", ns).status.current_healthy or 0) == 2, 60)
            w = spawn()
            with Collectors(kafka_bootstrap, w, nodes) as col:
                time.sleep(5)  # the detectors see every node healthy first
                # 1. running: a fault, and the worker killed a moment later
                hit(nodes[0])
                time.sleep(1.5)
                kill(w)
                w = spawn(wait=False)
                # 2. starting: a fault while the new worker imports and joins; killed as it starts
                hit(nodes[1])
                time.sleep(2.0)
                kill(w)
                w = spawn()
                wait_for(f"{nodes[0]} and {nodes[1]} cordoned", lambda: cordoned(nodes[0]) and cordoned(nodes[1]), 90)
                # 3. drain blocked: two faults whose drains meet the budget; killed while they wait
                since = time.time()
                for n in budget_nodes:
                    hit(n)
                wait_for("both cordoned", lambda: all(cordoned(n) for n in budget_nodes), 60)
                wait_for("the drains refused and waiting", lambda: w.stats()["actions_waiting"] >= 1, 60)
                kill(w)
                w = spawn()
                time.sleep(15)
                assert len(c.pods(ns, f"budget={tag}")) == 2, "a pod left against its budget"
                c.policy.delete_namespaced_pod_disruption_budget("hold", ns)
                block.append((since, time.time()))
                wait_for("the waiting drains done", lambda: not c.pods(ns, f"budget={tag}"), 120)
                # 4. dry-run: an operator switches it on, the worker is killed just after; a
                # fault meanwhile is recorded, not carried out
                assert api_call(w, "PUT", "/api/v1/dry-run", None, {"enabled": True})[0] == 200
                on = time.time()
                time.sleep(0.5)
                kill(w)
                w = spawn()
                assert api_call(w, "GET", "/api/v1/dry-run")[1]["dry_run"] is True, "dry-run lost across the kill"
                hit(nodes[4])
                time.sleep(12)
                assert api_call(w, "PUT", "/api/v1/dry-run", None, {"enabled": False})[0] == 200
                dry_run.append((on, time.time()))
                # 5. after dry-run: one more fault, carried out
                hit(nodes[5])
                wait_for(f"{nodes[5]} cordoned", lambda: cordoned(nodes[5]), 60)
                time.sleep(8)  # let late duplicates show, if any
            actions = collect(kafka_bootstrap, w.topic("actions"), lambda rs: False, 8)
    finally:
        for w in workers:
            if w.proc is not None:
                w.stop()

    log = AuditLog.read(audit_path, since=t_start)
    ours = set(nodes)
    entries = [r for r in requests_from_audit(log.events) if r["target"] in ours]
    report = check(entries, faults, actions)
    drains = blocked_drains(entries, block)
    in_dry = [r for r in entries if r["changed"] and any(a + DRY_RUN_GRACE_S < r["wall"] < b for a, b in dry_run)]
    crashes = crash_lines([w.log_path for w in workers])

    # the log is read, not assumed: the cordons the API server saw are the faulty nodes
    cordons = {r["target"] for r in entries if r["action"] == "isolate" and r["changed"]}
    assert cordons == {f.node for f in faults} - {m["node"] for m in report["faulty_nodes_not_isolated"]}, \
        (cordons, report)
    assert report["effects_lost"] == 0, report["faulty_nodes_not_isolated"]
    assert report["duplicate_effects"] == 0, report["duplicates"]
    assert not report["healthy_nodes_touched"], report["healthy_nodes_touched"]
    assert set(drains["blocked"]) == set(budget_nodes), drains
    assert not drains["not_done"], drains
    assert not in_dry, in_dry
    assert not crashes, crashes
    # the node struck during dry-run is explained by it, not lost
    assert {m["node"]: m["explained_by"] for m in report["faulty_nodes_not_isolated"]} in (
        {}, {nodes[4]: "dry-run"}), report["faulty_nodes_not_isolated"]
    for n in nodes:
        c.core.delete_node(n)
