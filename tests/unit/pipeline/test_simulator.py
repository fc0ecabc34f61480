"""The simulated cluster, driven tick by tick without Kafka."""

from __future__ import annotations

import orjson
import pytest

from pipeline.sim.cluster import Cluster, SimConfig, score
from schemas import GpuSample, JobEvent, NetworkSample, decode

from .builders import T0

MODELS = {"telemetry.gpu": GpuSample, "telemetry.network": NetworkSample, "telemetry.job": JobEvent}


def _cluster(**cfg) -> Cluster:
    return Cluster(SimConfig(**{"nodes": 8, "faults": "none", "seed": 3, **cfg}), t0=T0)


def _run(c: Cluster, ticks: int) -> list[tuple[str, str, bytes]]:
    for _ in range(ticks):
        c.tick()
    out, c.out = c.out, []
    return out


def _job_events(out) -> list[dict]:
    return [orjson.loads(v) for t, _, v in out if t == "telemetry.job"]


def _act(c: Cluster, key: str, action: str, target: str, **params) -> tuple[int, dict]:
    return c.act({"key": key, "action": action, "target": target, "params": params})


def _running_job(c: Cluster):
    return next(j for j in c.jobs.values() if j.status == "running")


def test_every_record_the_simulator_emits_is_a_valid_record() -> None:
    c = Cluster(SimConfig(nodes=16, faults="demo", duration=30, speed=10, seed=1), t0=T0)
    out = _run(c, 300)
    assert {e["fault"] for e in c.events if "fault" in e} >= {"sbe_rise", "nvlink", "thermal", "xid79"}
    assert {t for t, _, _ in out} == set(MODELS)
    for topic, key, value in out:
        record = decode(MODELS[topic], value)
        assert key == (record.job if topic == "telemetry.job" else record.node)
    xids = {x.code for t, _, v in out if t == "telemetry.gpu" for x in decode(GpuSample, v).xids}
    assert 79 in xids


def test_cordoned_nodes_receive_no_new_jobs() -> None:
    c = _cluster()
    cordoned = {"node-0000", "node-0002", "node-0004", "node-0006"}
    for n in cordoned:
        assert _act(c, f"v-{n}:isolate:{n}", "isolate", n) == (200, {"outcome": "applied", "detail": "cordoned and tainted"})
    started = [e for e in _job_events(_run(c, 400)) if e["event"] == "started"]
    assert len(started) >= 2
    assert not any(set(e["nodes"]) & cordoned for e in started)


def test_a_requeued_job_restarts_elsewhere_from_its_checkpoint_and_never_on_excluded_nodes() -> None:
    c = _cluster(checkpoint_every=30)
    _run(c, 70)
    job = _running_job(c)
    assert job.checkpoint_step > 0
    bad = job.nodes[0]
    checkpoint, step = job.checkpoint_step, int(job.step)
    assert checkpoint < step
    status, body = _act(c, "v-1:requeue:" + job.id, "requeue", job.id, exclude=[bad], attempt=job.attempt)
    assert (status, body["outcome"]) == (200, "applied")
    events = [e for e in _job_events(_run(c, 300)) if e["job"] == job.id]
    starts = [e for e in events if e["event"] == "started"]
    assert starts and starts[0]["attempt"] == 2
    assert starts[0]["step"] == checkpoint
    assert all(bad not in e["nodes"] for e in events)


def test_a_failed_job_keeps_its_allocation_until_acted_upon() -> None:
    c = _cluster(auto_retry_after=300)
    _run(c, 20)
    job = _running_job(c)
    nodes = list(job.nodes)
    c.fail_job(job, "worker process exited with signal 9", -9, "signal 9")
    later = _job_events(_run(c, 60))
    assert all(c.nodes[n].job == job.id for n in nodes)
    assert not any(set(e["nodes"]) & set(nodes) for e in later if e["event"] == "started")
    _act(c, "v-1:requeue:" + job.id, "requeue", job.id, exclude=[], attempt=job.attempt)
    assert all(c.nodes[n].job is None for n in nodes)


def test_acting_twice_with_the_same_key_acts_once() -> None:
    c = _cluster()
    _run(c, 20)
    job = _running_job(c)
    attempt = job.attempt
    first = _act(c, "v-7:requeue:" + job.id, "requeue", job.id, exclude=[])
    again = _act(c, "v-7:requeue:" + job.id, "requeue", job.id, exclude=[])
    assert first[1]["outcome"] == "applied"
    assert again == (200, {"outcome": "already_so", "detail": "this key was applied before"})
    assert job.attempt == attempt + 1


@pytest.mark.parametrize(
    ("body", "status"),
    [({"key": "k", "action": "isolate", "target": "node-9999"}, 404),
     ({"key": "k", "action": "requeue", "target": "no-such-job"}, 404),
     ({"key": "k", "action": "reboot", "target": "node-0001"}, 400),
     ({"action": "isolate", "target": "node-0001"}, 400)],
)
def test_the_cluster_api_refuses_what_it_cannot_do(body, status) -> None:
    c = _cluster()
    assert c.act(body)[0] == status
    assert not c.nodes["node-0001"].cordoned


def test_score_counts_a_healthy_node_isolated_as_a_false_isolation() -> None:
    c = _cluster()
    _run(c, 5)
    _act(c, "v-1:isolate:node-0003", "isolate", "node-0003")
    result = score(c, verdicts=[], actions=[])
    assert result["false_isolations"] == 1
    assert result["false_isolated_nodes"] == ["node-0003"]


def test_score_does_not_count_isolating_a_faulty_node_as_false() -> None:
    c = _cluster(faults="xid79", duration=30, speed=10)
    _run(c, 250)
    [fault] = [f for f in c.faults if f.applied_ts is not None]
    _act(c, "v-1:isolate:" + fault.node, "isolate", fault.node)
    result = score(c, verdicts=[], actions=[])
    assert result["false_isolations"] == 0
    assert result["faults_injected"] == 1


def test_a_transient_faults_rerun_is_not_spoiled_by_a_later_fault_injected_on_one_of_its_nodes() -> None:
    from pipeline.sim.cluster import Fault

    c = _cluster()
    transient = Fault(kind="nccl_timeout", at=10.0, job="train-0001", applied_ts=c.t0 + 10)
    c.faults = [transient]
    rerun = {"scope": "job", "subject": "train-0001", "ts": c.t0 + 12, "fault_class": "unknown",
             "actions": [{"action": "requeue", "target": "train-0001", "params": {}}],
             "nodes": ["node-0001", "node-0002"]}
    c.events.append({"t": 60.0, "isolated": "node-0002"})
    # node-0002 isolated later with no fault of its own: isolated for the transient fault
    assert score(c, verdicts=[rerun], actions=[])["transient_faults_retried"] == 0
    # ... but with an Xid 79 injected on it, that isolation is its own fault's
    c.faults.append(Fault(kind="xid79", at=50.0, node="node-0002", applied_ts=c.t0 + 50))
    assert score(c, verdicts=[rerun], actions=[])["transient_faults_retried"] == 1


def test_score_names_each_transient_fault_not_retried_and_each_user_error_not_stopped() -> None:
    from pipeline.sim.cluster import Fault

    c = _cluster()
    c.faults = [Fault(kind="nccl_timeout", at=10.0, job="train-0001", applied_ts=c.t0 + 10),
                Fault(kind="transient_crash", at=20.0, job="train-0002", applied_ts=c.t0 + 20),
                Fault(kind="user_bug", at=30.0, job="train-0003", applied_ts=c.t0 + 30)]
    stopped_instead = {"scope": "job", "subject": "train-0002", "ts": c.t0 + 21, "fault_class": "user_error",
                       "actions": [{"action": "stop", "target": "train-0002", "params": {}}], "nodes": []}
    result = score(c, verdicts=[stopped_instead], actions=[])
    assert result["transient_faults_retried"] == 0
    assert result["transient_not_retried"] == ["nccl_timeout@train-0001 t=10: no verdict",
                                               "transient_crash@train-0002 t=20: first verdict stop (user_error)"]
    assert result["user_errors_not_stopped"] == ["user_bug@train-0003 t=30"]


def test_a_fault_with_nothing_to_strike_waits_for_a_running_job_until_it_gives_up() -> None:
    from pipeline.sim.cluster import Fault
    c = _cluster()
    _run(c, 5)
    for j in c.jobs.values():  # every job has failed and waits on the pipeline
        if j.status == "running":
            c.fail_job(j, "worker process exited with signal 9", -9, "signal 9")
    waits, drops = Fault("nccl_timeout", at=c.now + 1, give_up_at=c.now + 400), Fault("transient_crash", at=c.now + 1)
    c.faults, c.pending_faults = [waits, drops], [waits, drops]
    _run(c, 200)
    assert waits.applied_ts is None and waits in c.pending_faults
    assert drops.applied_ts is None and drops not in c.pending_faults  # the default: 120 s
    failed = next(j for j in c.jobs.values() if j.status != "running")
    _act(c, "k1:requeue:" + failed.id, "requeue", failed.id, exclude=[], attempt=failed.attempt)
    _run(c, 30)
    assert waits.applied_ts is not None and waits not in c.pending_faults
