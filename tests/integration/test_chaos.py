"""Trust under fire, short versions: the chaos harness with a few kills and a few thousand
fuzzed messages, and the circuit breaker across a worker kill."""

from __future__ import annotations

import os
import signal
import time

import pytest

from .harness import ClusterAPI, Worker, collect, gpu_sample, produce

pytestmark = pytest.mark.integration


def test_short_chaos_run_loses_no_verdict_and_acts_once(kafka_bootstrap, tmp_path, monkeypatch) -> None:
    from pipeline.chaos import run

    # the suite's broker (started by tests/run.sh or the fixture) is the one the harness finds
    # the demo's scenario (1,200 simulated seconds: every planned fault has time to show)
    r = run(nodes=16, duration=120, speed=10, kills=3, outage_s=10, hostile=3000, seed=3, broker_restart=False,
            out=tmp_path / "chaos.json", say=lambda *a: None)
    assert r["kills"] == 3 and r["recoveries_failed"] == 0
    assert r["hostile_inputs"] == 3000 and len(r["hostile_kinds"]) >= 10
    assert r["verdicts_expected"] > 0
    assert r["verdicts_lost"] == 0, r["scenario"]
    assert r["duplicate_actuations"] == 0, r["duplicates"]
    assert r["agent_crashes"] == 0
    assert r["backend_refusals"] > 0, "the outage never met an action"
    assert r["max_recovery_s"] is not None and r["max_recovery_s"] < 120


def test_the_breaker_cap_holds_across_a_worker_kill(kafka_bootstrap) -> None:
    from pipeline.config import load_settings

    api = ClusterAPI(load_settings(environ={}))
    names = [f"st-{i}" for i in range(8)]
    api.add_nodes(names)
    env = {"FLEETMEDIC_SAFETY__FLEET_SIZE": "40", "FLEETMEDIC_SAFETY__MAX_FRACTION": "1.0",
           "FLEETMEDIC_SAFETY__MAX_ABSOLUTE": "3"}
    worker = Worker(kafka_bootstrap, sim_url=api.url, env=env).start()
    lost = [True] + [False] * 7
    try:
        produce(kafka_bootstrap, [(worker.topic("telemetry.gpu"), n, gpu_sample(n, time.time(), lost=lost))
                                  for n in names[:2]])
        collect(kafka_bootstrap, worker.topic("actions"),
                lambda rs: sum(1 for a in rs if a["action"] == "isolate" and a["outcome"] == "applied") >= 2, 60)
        os.killpg(worker.proc.proc.pid, signal.SIGKILL)
        worker.proc.proc.wait(10)
        worker = Worker(kafka_bootstrap, sim_url=api.url, env={**env, **{
            k: v for k, v in worker.env.items() if k.startswith("FLEETMEDIC_KAFKA__")}}).start()
        produce(kafka_bootstrap, [(worker.topic("telemetry.gpu"), n, gpu_sample(n, time.time(), lost=lost))
                                  for n in names[2:]])
        actions = collect(kafka_bootstrap, worker.topic("actions"),
                          lambda rs: sum(1 for a in rs if a["action"] == "isolate") >= len(names), 90)
    finally:
        worker.stop()
    isolations = [a for a in actions if a["action"] == "isolate"]
    applied = {a["target"] for a in isolations if a["outcome"] == "applied"}
    held = {a["target"] for a in isolations if a["outcome"] == "held_by_budget"}
    assert len(applied) == 3, applied
    assert held == set(names) - applied
    cordoned = api.state(lambda c: {n.name for n in c.nodes.values() if n.cordoned})
    api.close()
    assert cordoned == applied
