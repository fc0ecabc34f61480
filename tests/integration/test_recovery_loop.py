"""The whole recovery loop on the real broker: worker process, telemetry, verdicts, actions.

Telemetry is written straight to Kafka (event time in the records), the worker is the
real ``fleetmedic worker`` process, and it acts through the simulated cluster's API.
"""

from __future__ import annotations

import math
import time

import numpy as np
import pytest

from pipeline.eval.failures import excerpt

from .harness import ClusterAPI, Worker, collect, gpu_sample, job_event, produce

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def loop(kafka_bootstrap):
    from pipeline.config import load_settings

    api = ClusterAPI(load_settings(environ={}))
    worker = Worker(kafka_bootstrap, sim_url=api.url, env={"FLEETMEDIC_SAFETY__FLEET_SIZE": "64",
                                                          "FLEETMEDIC_SAFETY__MAX_FRACTION": "0.5"})
    worker.start()
    yield kafka_bootstrap, worker, api
    worker.stop()
    api.close()


def _verdicts(bootstrap, worker, pred, timeout=60):
    recs = collect(bootstrap, worker.topic("verdicts"), lambda rs: pred(rs), timeout=timeout)
    return recs


def _healthy(bootstrap, worker, nodes, t0, seconds):
    items = []
    for t in range(seconds):
        for n in nodes:
            items.append((worker.topic("telemetry.gpu"), n, gpu_sample(n, t0 + t)))
    produce(bootstrap, items)


def test_transient_fault_is_retried_and_no_node_is_isolated(loop):
    # a preempted Slurm job as submitit logs it (facebookincubator/submitit#1701)
    preempted = excerpt("t-submitit-1701-slurm-preempted-sighup-requeued")
    bootstrap, worker, api = loop
    nodes = [f"ta-{i}" for i in range(4)]
    api.add_nodes(nodes)
    api.add_job("job-transient", nodes, status="failed")
    t0 = time.time() - 600
    _healthy(bootstrap, worker, nodes, t0, 20)
    produce(bootstrap, [
        (worker.topic("telemetry.job"), "job-transient", job_event("job-transient", "started", t0 + 1, nodes)),
        (worker.topic("telemetry.job"), "job-transient", job_event(
            "job-transient", "failed", t0 + 15, nodes, **preempted.failed_fields())),
    ])
    verdicts = _verdicts(bootstrap, worker, lambda rs: any(v["subject"] == "job-transient" for v in rs))
    job_v = [v for v in verdicts if v["subject"] == "job-transient"]
    assert job_v, worker.log_tail()
    assert job_v[0]["fault_class"] == "transient_software"
    assert [a["action"] for a in job_v[0]["actions"]] == ["retry"]
    assert job_v[0]["evidence"]["decided_by"] == "preempted"
    # give the node track time to (wrongly) react, then check nothing touched a node
    time.sleep(3)
    verdicts = collect(bootstrap, worker.topic("verdicts"), lambda rs: False, timeout=3)
    assert not [v for v in verdicts if v["scope"] == "node" and v["subject"] in nodes]
    actions = collect(bootstrap, worker.topic("actions"), lambda rs: any(a["target"] == "job-transient" for a in rs))
    retry = [a for a in actions if a["target"] == "job-transient"]
    assert retry[0]["action"] == "retry" and retry[0]["outcome"] == "applied"
    assert api.state(lambda c: [c.nodes[n].cordoned for n in nodes]) == [False] * 4
    assert api.state(lambda c: c.jobs["job-transient"].attempt) == 2


def test_xid79_requeues_job_without_node_and_isolates_node_from_one_failure(loop):
    bootstrap, worker, api = loop
    nodes = [f"tb-{i}" for i in range(4)]
    bad = nodes[2]
    api.add_nodes(nodes)
    api.add_job("job-xid", nodes)
    t0 = time.time() - 500
    produce(bootstrap, [(worker.topic("telemetry.job"), "job-xid", job_event("job-xid", "started", t0, nodes))])
    _healthy(bootstrap, worker, nodes, t0, 10)
    lost = [False] * 8
    lost[3] = True
    produce(bootstrap, [
        (worker.topic("telemetry.gpu"), bad, gpu_sample(bad, t0 + 10, lost=lost, xids=[(3, 79)])),
        (worker.topic("telemetry.job"), "job-xid", job_event(
            "job-xid", "failed", t0 + 10.5, nodes, exit_code=1, reason="CUDA error: unspecified launch failure",
            log_tail="RuntimeError: CUDA error: unspecified launch failure")),
    ])
    api.state(lambda c: setattr(c.jobs["job-xid"], "status", "failed"))

    def done(rs):
        return any(v["subject"] == "job-xid" for v in rs) and any(v["subject"] == bad for v in rs)

    verdicts = _verdicts(bootstrap, worker, done)
    job_v = [v for v in verdicts if v["subject"] == "job-xid"]
    node_v = [v for v in verdicts if v["subject"] == bad]
    assert job_v and node_v, worker.log_tail()
    jv, nv = job_v[0], node_v[0]
    assert jv["fault_class"] == nv["fault_class"] == "gpu_hardware"
    assert jv["incident"] == nv["incident"], "both verdicts come from the same failure"
    assert jv["actions"][0]["action"] == "requeue" and jv["actions"][0]["params"]["exclude"] == [bad]
    assert [a["action"] for a in nv["actions"]] == ["isolate", "drain", "diagnose"]
    assert not [v for v in verdicts if v["scope"] == "node" and v["subject"] in nodes and v["subject"] != bad]

    def acted(rs):
        keys = {(a["action"], a["target"]) for a in rs}
        return {("requeue", "job-xid"), ("isolate", bad), ("diagnose", bad)} <= keys

    actions = collect(bootstrap, worker.topic("actions"), acted)
    outcomes = {(a["action"], a["target"]): a["outcome"] for a in actions}
    assert outcomes[("isolate", bad)] == "applied"
    assert outcomes[("diagnose", bad)] == "applied"
    assert outcomes[("requeue", "job-xid")] == "applied"
    assert api.state(lambda c: c.nodes[bad].cordoned)
    assert api.state(lambda c: bad in c.jobs["job-xid"].exclude)
    assert api.state(lambda c: c.jobs["job-xid"].attempt) == 2


def test_degrading_node_is_isolated_before_its_scheduled_failure(loop):
    bootstrap, worker, api = loop
    nodes = [f"tc-{i}" for i in range(4)]
    bad, gpu = nodes[1], 5
    api.add_nodes(nodes)
    api.add_job("job-degrade", nodes)
    # a sample every 10 s (the agent's default); 40 minutes of healthy history, then one
    # GPU's corrected errors rise exponentially for 10 minutes until it fails
    every, onset, fail_at = 10, 2400, 2400 + 600
    t0 = time.time() - 4000
    rng = np.random.default_rng(7)
    sbe = {n: np.zeros(8, dtype=np.int64) for n in nodes}
    produce(bootstrap, [(worker.topic("telemetry.job"), "job-degrade", job_event("job-degrade", "started", t0, nodes))])
    failure_ts = t0 + fail_at
    for chunk in range(0, fail_at, 600):
        items = []
        for t in range(chunk, min(chunk + 600, fail_at), every):
            for n in nodes:
                sbe[n] += rng.poisson(2e-4 * every, 8)
                if n == bad and t >= onset:
                    sbe[n][gpu] += rng.poisson(min(5.0, 0.05 * math.exp((t - onset) / 120.0)))
                items.append((worker.topic("telemetry.gpu"), n, gpu_sample(n, t0 + t, sbe=sbe[n].tolist(), rng=rng)))
            if t % 600 == 590:
                items.append((worker.topic("telemetry.job"), "job-degrade",
                              job_event("job-degrade", "checkpoint", t0 + t, nodes, step=t, checkpoint_step=t)))
        produce(bootstrap, items)
    verdicts = _verdicts(bootstrap, worker, lambda rs: any(v["subject"] == bad for v in rs), timeout=60)
    node_v = [v for v in verdicts if v["subject"] == bad]
    assert node_v, worker.log_tail()
    v = node_v[0]
    assert v["fault_class"] == "node_degrading"
    assert v["actions"][0]["action"] == "isolate"
    assert v["ts"] < failure_ts, f"isolated {v['ts'] - failure_ts:.0f}s relative to the failure"
    assert onset <= v["ts"] - t0, "not isolated before the degradation began"
    assert "ecc_sbe_rate" in v["evidence"]["kinds"]
    actions = collect(bootstrap, worker.topic("actions"),
                      lambda rs: any(a["target"] == bad and a["action"] == "isolate" for a in rs))
    assert [a["outcome"] for a in actions if a["target"] == bad and a["action"] == "isolate"] == ["applied"]
    assert api.state(lambda c: c.nodes[bad].cordoned)
    # healthy peers of the same job keep their place
    assert not [x for x in verdicts if x["scope"] == "node" and x["subject"] in nodes and x["subject"] != bad]


def test_the_node_failures_of_different_jobs_keep_beginning_on_is_isolated_after_the_third_job(loop):
    # a host part with no telemetry (a failing power supply): jobs hang in their collectives,
    # each time first on the same node; nothing else points at it.  One job's three attempts
    # are one job: the node is isolated only when a third job begins failing there.
    watchdog = excerpt("w-accelerate-314-slow-file-scan")  # an NCCL watchdog timeout as accelerate prints it
    bootstrap, worker, api = loop
    nodes = [f"to-{i}" for i in range(4)]
    bad = nodes[1]
    api.add_nodes(nodes)
    t0 = time.time() - 3000
    _healthy(bootstrap, worker, nodes, t0, 20)
    topic = worker.topic("telemetry.job")
    plan = [("job-origin-a", 1), ("job-origin-a", 2), ("job-origin-a", 3), ("job-origin-b", 1), ("job-origin-c", 1)]
    for k, (job, attempt) in enumerate(plan):
        api.add_job(job, nodes, status="failed")
        t = t0 + 200 * (k + 1)
        produce(bootstrap, [
            (topic, job, job_event(job, "started", t, nodes, attempt=attempt)),
            (topic, job, job_event(job, "failed", t + 60, nodes, attempt=attempt, origin_node=bad,
                                   **watchdog.failed_fields())),
        ])
        # each failure is judged before the next attempt starts
        collect(bootstrap, worker.topic("verdicts"),
                lambda rs, j=job, a=attempt: sum(1 for v in rs if v["subject"] == j) >= a, timeout=60)
        if k == 2:  # one job's attempts: no node verdict
            time.sleep(2)
            early = collect(bootstrap, worker.topic("verdicts"), lambda rs: False, timeout=2)
            assert not [v for v in early if v["scope"] == "node" and v["subject"] in nodes]
    verdicts = _verdicts(bootstrap, worker, lambda rs: any(v["subject"] == bad for v in rs))
    [nv] = [v for v in verdicts if v["scope"] == "node" and v["subject"] in nodes]
    assert nv["subject"] == bad and nv["fault_class"] == "unknown"
    assert [a["action"] for a in nv["actions"]][:1] == ["isolate"]
    assert nv["evidence"]["failed_jobs"] == ["job-origin-a", "job-origin-b", "job-origin-c"]
    job_v = [v for v in verdicts if v["scope"] == "job" and v["subject"].startswith("job-origin-")]
    assert {v["evidence"]["triage"]["rule"] for v in job_v} == {"nccl_watchdog_timeout"}
    wait = time.time() + 30
    while time.time() < wait and not api.state(lambda c: c.nodes[bad].cordoned):
        time.sleep(0.3)
    assert api.state(lambda c: [c.nodes[n].cordoned for n in nodes]) == [n == bad for n in nodes]
