"""A recording replayed at 1x and at 100x into fresh workers gives identical verdicts.

The recording is a simulated incident stream (8 nodes; Xid 79 under a job, a user's bug
retried and stopped, an NCCL timeout, an ECC DBE), made by the in-process loop, which
acts on its cluster so the job events include the reruns the verdicts caused.  It is
replayed with ``fleetmedic replay`` into two workers at once, one at real time and one a
hundred times faster.  Every decision runs on event time (detector windows, the
correlation grace, deadlines), so the verdicts must be the same to the id: time stamp,
subject, class, incident and every action with its parameters.  ``fleetmedic record``
then reads the replayed topics back into the same recording.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import orjson
import pytest

from pipeline.eval.inproc import InProcessLoop
from pipeline.sim.recording import INPUT_TOPICS, Recorded, read, write
from pipeline.sim.cluster import Cluster, Fault, SimConfig

from .harness import ClusterAPI, Worker, collect

pytestmark = pytest.mark.integration

PLAN = [("xid79", 40.0), ("user_bug", 70.0), ("nccl_timeout", 100.0), ("ecc_dbe", 125.0)]
END = 150
ROOT = Path(__file__).resolve().parents[2]


def _recording(settings, path: Path) -> list[dict]:
    t0 = time.time() - END - 600
    cfg = SimConfig(nodes=8, speed=1.0, duration=1e9, seed=4, faults="none", gpu_every=5, network_every=10)
    cluster = Cluster(cfg, t0=t0)
    plan = [Fault(kind=k, at=at) for k, at in PLAN]
    cluster.faults, cluster.pending_faults = plan, list(plan)
    loop = InProcessLoop(settings, cluster)
    recs: list[Recorded] = []
    records = loop._records

    def capture(raw):
        for topic, key, value in raw:
            recs.append(Recorded(topic, key, orjson.loads(value)["ts"], value))
        return records(raw)

    loop._records = capture  # type: ignore[method-assign]
    try:
        loop.step(END)
        loop.finish()
    finally:
        loop.close()
    assert all(f.applied_ts is not None for f in plan), "every fault struck a running job"
    assert {r.topic for r in recs} == set(INPUT_TOPICS)
    write(path, recs)
    return loop.verdict_dicts()


def _full(v: dict) -> tuple:
    return (v["ts"], v["id"], v["scope"], v["subject"], v["fault_class"], v["incident"],
            tuple((a["action"], a["target"], orjson.dumps(a["params"], option=orjson.OPT_SORT_KEYS))
                  for a in v["actions"]))


def _replay(bootstrap: str, worker: Worker, path: Path, speed: float) -> subprocess.Popen:
    env = {**os.environ, "FLEETMEDIC_KAFKA__TOPIC_PREFIX": worker.settings.kafka.topic_prefix}
    return subprocess.Popen([sys.executable, "-m", "pipeline", "--bootstrap", bootstrap, "replay", str(path),
                             "--speed", str(speed)], cwd=ROOT, env=env, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _verdicts(bootstrap: str, worker: Worker, n: int) -> list[dict]:
    got = collect(bootstrap, worker.topic("verdicts"), lambda rs: len(rs) >= n, timeout=120)
    time.sleep(2 * worker.settings.policy.correlation_wait_max_s)  # anything the worker would still say
    return collect(bootstrap, worker.topic("verdicts"), lambda rs: False, timeout=3) if len(got) >= n else got


def test_a_replay_at_1x_and_at_100x_gives_identical_verdicts(kafka_bootstrap, tmp_path):
    from pipeline.config import load_settings

    api = ClusterAPI(load_settings(environ={}))
    env = {"FLEETMEDIC_SAFETY__FLEET_SIZE": "64"}
    real, fast = Worker(kafka_bootstrap, sim_url=api.url, env=env), Worker(kafka_bootstrap, sim_url=api.url, env=env)
    path = tmp_path / "incident.jsonl"
    expected = _recording(real.settings, path)
    kinds = Counter(v["fault_class"] for v in expected)
    assert {"gpu_hardware", "gpu_memory", "user_error"} <= set(kinds), expected
    real.start()
    fast.start()
    try:
        procs = {1.0: _replay(kafka_bootstrap, real, path, 1.0), 100.0: _replay(kafka_bootstrap, fast, path, 100.0)}
        outs = {}
        for speed, p in procs.items():
            out, err = p.communicate(timeout=END / speed + 120)
            assert p.returncode == 0, err
            outs[speed] = orjson.loads(out.strip().splitlines()[-1])
        # the pacing held: real time took about the recording's span, 100x a hundredth of it
        assert outs[1.0]["wall_s"] >= 0.9 * outs[1.0]["event_span_s"] > 0
        assert outs[100.0]["wall_s"] < 0.1 * outs[100.0]["event_span_s"]
        at_1x = _verdicts(kafka_bootstrap, real, len(expected))
        at_100x = _verdicts(kafka_bootstrap, fast, len(expected))
        assert len(at_1x) == len(expected), real.log_tail()
        a, b = Counter(map(_full, at_1x)), Counter(map(_full, at_100x))
        assert a == b, "only at 1x:\n" + "\n".join(map(str, sorted(a - b))) + "\nonly at 100x:\n" + \
            "\n".join(map(str, sorted(b - a)))
        # per subject, in the same order
        for subject in {v["subject"] for v in at_1x}:
            assert [_full(v) for v in at_1x if v["subject"] == subject] == \
                   [_full(v) for v in at_100x if v["subject"] == subject]
        # and what the in-process loop decided, class for class
        def key(v: dict) -> tuple:
            return v["scope"], v["subject"], v["fault_class"], tuple(a["action"] for a in v["actions"])

        assert Counter(map(key, at_1x)) == Counter(map(key, expected))

        # the replayed input topics record back into the same recording
        again = tmp_path / "again.jsonl"
        env_rec = {**os.environ, "FLEETMEDIC_KAFKA__TOPIC_PREFIX": fast.settings.kafka.topic_prefix}
        rec = subprocess.run([sys.executable, "-m", "pipeline", "--bootstrap", kafka_bootstrap, "record",
                              "--out", str(again), "--seconds", "60", "--idle", "3"], cwd=ROOT, env=env_rec,
                             stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=120)
        assert rec.returncode == 0, rec.stderr

        def norm(rs: list[Recorded]) -> Counter:
            return Counter((r.topic, r.key, r.ts, r.value) for r in rs)

        assert norm(read(again)) == norm(read(path))
    finally:
        real.stop()
        fast.stop()
        api.close()
