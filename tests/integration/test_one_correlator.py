"""One correlator, three callers: the same input gives the same verdicts in each.

The correlator (:class:`pipeline.correlate.core.Correlator`) is driven by three adapters:
the closed-loop evaluation's in-process loop (:class:`pipeline.eval.inproc.InProcessLoop`,
which steps a simulated cluster and acts on it), the replay
(:class:`pipeline.eval.replay.LocalPipeline`, fed a recording in one go) and the Faust
worker on real Kafka (fed the same recording by ``fleetmedic replay``).  Three scenarios
cover the node, job and switch tracks: an Xid 79 under a job and a user's bug retried
then stopped; an NCCL timeout, an ECC double-bit error and a crash; an NVLink error rate,
a rising ECC rate that moves a job before its GPU fails, and a degrading leaf switch.

Each scenario is first run by the in-process loop, which records the records it decided
on; that recording is the input of the two other callers.  The verdicts must be equal in
every field (time stamp, id, subject, class, incident, actions with their parameters):
in the same order for the two in-process callers, and per subject in the same order for
the worker (its partitions interleave subjects in no fixed order).
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

from pipeline.config import Settings
from pipeline.eval.inproc import RECORD_OF, InProcessLoop
from pipeline.eval.replay import LocalPipeline
from pipeline.sim.cluster import Cluster, Fault, SimConfig
from pipeline.sim.recording import Recorded, read, write
from schemas.codec import decode

from .harness import ClusterAPI, Worker, collect

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
SPEED = 25.0
#: name -> (faults as (kind, sim second), sim seconds to run); the detectors warm up first
SCENARIOS: dict[str, tuple[list[tuple[str, float]], int]] = {
    "xid-and-user-bug": ([("xid79", 40.0), ("user_bug", 70.0)], 150),
    "transient-and-memory": ([("nccl_timeout", 40.0), ("ecc_dbe", 60.0), ("transient_crash", 100.0)], 160),
    "nvlink-degrading-switch": ([("nvlink", 620.0), ("sbe_rise", 640.0), ("leaf", 660.0)], 1000),
}


def _full(v: dict) -> tuple:
    return (v["ts"], v["id"], v["scope"], v["subject"], v["fault_class"], v["incident"],
            tuple((a["action"], a["target"], orjson.dumps(a["params"], option=orjson.OPT_SORT_KEYS))
                  for a in v["actions"]))


def _closed_loop(settings: Settings, plan: list[tuple[str, float]], end: int, path: Path) -> list[dict]:
    """Caller 1: the closed loop's in-process loop; records its input to ``path``."""
    t0 = time.time() - end - 600
    cfg = SimConfig(nodes=8, speed=1.0, duration=1e9, seed=4, faults="none", gpu_every=5, network_every=10)
    cluster = Cluster(cfg, t0=t0)
    faults = [Fault(kind=k, at=at) for k, at in plan]
    cluster.faults, cluster.pending_faults = faults, list(faults)
    loop = InProcessLoop(settings, cluster)
    recs: list[Recorded] = []
    records = loop._records

    def capture(raw):
        for topic, key, value in raw:
            recs.append(Recorded(topic, key, orjson.loads(value)["ts"], value))
        return records(raw)

    loop._records = capture  # type: ignore[method-assign]
    try:
        loop.step(end)
        loop.finish()
    finally:
        loop.close()
    assert all(f.applied_ts is not None for f in faults), [(f.kind, f.applied_ts) for f in faults]
    write(path, recs)
    return loop.verdict_dicts()


def _replayed(settings: Settings, path: Path) -> list[dict]:
    """Caller 2: the replay, fed the recording in one go."""
    lp = LocalPipeline(settings)
    lp.feed(decode(RECORD_OF[r.topic], r.value) for r in read(path))
    lp.finish()
    return [v.model_dump(mode="json") for v in lp.verdicts]


def _replay_into(bootstrap: str, worker: Worker, path: Path) -> subprocess.Popen:
    env = {**os.environ, "FLEETMEDIC_KAFKA__TOPIC_PREFIX": worker.settings.kafka.topic_prefix}
    return subprocess.Popen([sys.executable, "-m", "pipeline", "--bootstrap", bootstrap, "replay", str(path),
                             "--speed", str(SPEED)], cwd=ROOT, env=env, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_the_worker_the_replay_and_the_closed_loop_give_identical_verdicts(kafka_bootstrap, tmp_path):
    from pipeline.config import load_settings

    api = ClusterAPI(load_settings(environ={}))
    # the wall-clock fallback of the correlation grace is kept out of the way: every
    # caller judges on event time alone
    env = {"FLEETMEDIC_SAFETY__FLEET_SIZE": "64", "FLEETMEDIC_POLICY__CORRELATION_WAIT_MAX_S": "120"}
    workers = {name: Worker(kafka_bootstrap, sim_url=api.url, env=env) for name in SCENARIOS}
    expected: dict[str, list[dict]] = {}
    paths: dict[str, Path] = {}
    for name, (plan, end) in SCENARIOS.items():
        settings = workers[name].settings
        paths[name] = tmp_path / f"{name}.jsonl"
        expected[name] = _closed_loop(settings, plan, end, paths[name])
        assert expected[name], f"{name}: the scenario gave no verdict"
        # caller 2 against caller 1: the same sequence
        assert list(map(_full, _replayed(settings, paths[name]))) == list(map(_full, expected[name])), name
    scopes = Counter(v["scope"] for vs in expected.values() for v in vs)
    assert set(scopes) == {"node", "job", "switch"}, scopes
    try:
        for w in workers.values():
            w.start()
        procs = {name: _replay_into(kafka_bootstrap, workers[name], paths[name]) for name in SCENARIOS}
        for name, p in procs.items():
            _, err = p.communicate(timeout=SCENARIOS[name][1] / SPEED + 180)
            assert p.returncode == 0, err
        for name, w in workers.items():
            want = expected[name]
            got = collect(kafka_bootstrap, w.topic("verdicts"), lambda rs, n=len(want): len(rs) >= n, timeout=120)
            time.sleep(3)  # anything the worker would still say
            got = collect(kafka_bootstrap, w.topic("verdicts"), lambda rs: False, timeout=3)
            a, b = Counter(map(_full, want)), Counter(map(_full, got))
            assert a == b, (f"{name}: only in process:\n" + "\n".join(map(str, sorted(a - b))) +
                            "\nonly in the worker:\n" + "\n".join(map(str, sorted(b - a))) + "\n" + w.log_tail(30))
            for subject in {v["subject"] for v in want}:
                assert [_full(v) for v in want if v["subject"] == subject] == \
                       [_full(v) for v in got if v["subject"] == subject], (name, subject)
    finally:
        for w in workers.values():
            w.stop()
        api.close()
