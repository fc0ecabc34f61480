"""Operator decisions outlive every worker: an operator holds a node out and switches
dry-run on, every worker is killed with SIGKILL, and after the restart both decisions
still hold, and so does an isolation the breaker held back for a person."""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import pytest

from .harness import ClusterAPI, Worker, api_call, collect, lose_gpus, wait_for

pytestmark = pytest.mark.integration


def call(worker: Worker, method: str, path: str, body: Any = None) -> tuple[int, Any]:
    return api_call(worker, method, path, None, body)


def _wait(fn, timeout: float = 30.0):
    return wait_for(fn, timeout)


def _health(workers: list[Worker], node: str) -> dict[str, Any]:
    """The node's state from the worker that owns its partition of the node table."""
    for w in workers:
        status, body = call(w, "GET", f"/api/v1/nodes/{node}")
        if status == 200:
            return body["health"]
    return {}


def _kill(worker: Worker) -> None:
    os.killpg(worker.proc.proc.pid, signal.SIGKILL)
    worker.proc.proc.wait(10)


def test_dry_run_a_hold_and_a_held_isolation_survive_sigkill_of_every_worker(kafka_bootstrap) -> None:
    from pipeline.config import load_settings

    api = ClusterAPI(load_settings(environ={}))
    nodes = ["os-0", "os-1", "os-2", "os-3"]
    api.add_nodes(nodes)
    env = {"FLEETMEDIC_SAFETY__FLEET_SIZE": "40", "FLEETMEDIC_SAFETY__MAX_ABSOLUTE": "1",
           "FLEETMEDIC_WORKER__SESSION_TIMEOUT_S": "8"}
    first = Worker(kafka_bootstrap, sim_url=api.url, env=env)
    same = {k: v for k, v in first.env.items() if k.startswith("FLEETMEDIC_KAFKA__")}
    workers = [first.start(), Worker(kafka_bootstrap, sim_url=api.url, env={**env, **same}).start()]
    try:
        a, b = workers
        # the breaker (budget 1) applies one isolation and holds the other for a person
        lose_gpus(kafka_bootstrap, a, ["os-1", "os-2"])
        actions = collect(kafka_bootstrap, a.topic("actions"),
                          lambda rs: sum(1 for x in rs if x["action"] == "isolate" and x["target"] in ("os-1", "os-2")
                                         and x["outcome"] in ("applied", "held_by_budget")) >= 2, 60)
        held = [x for x in actions if x["action"] == "isolate" and x["outcome"] == "held_by_budget"]
        assert len(held) == 1
        held_key = held[0]["key"]
        # every worker lists it, whichever carried the verdict out
        for w in workers:
            assert _wait(lambda w=w: [h["key"] for h in call(w, "GET", "/api/v1/held")[1]["held"]] == [held_key])

        # an operator holds os-0 out (carried out), then switches dry-run on, on the other worker
        status, body = call(b, "POST", "/api/v1/nodes/os-0/hold")
        assert status == 202
        assert _wait(lambda: api.state(lambda c: c.nodes["os-0"].cordoned))
        assert call(a, "PUT", "/api/v1/dry-run", {"enabled": True})[0] == 200
        assert _wait(lambda: call(b, "GET", "/api/v1/dry-run")[1]["dry_run"] is True)
        assert _wait(lambda: _health(workers, "os-0").get("state") == "isolated")

        for w in workers:
            _kill(w)
        workers = [Worker(kafka_bootstrap, sim_url=api.url, env={**env, **same}).start() for _ in range(2)]
        a, b = workers

        for w in workers:  # ready means the decisions are loaded: no waiting here
            origin = call(w, "GET", "/api/v1/dry-run")[1]
            assert origin["dry_run"] is True and origin["set_by"] != "configuration (safety.dry_run)", origin
            assert [h["key"] for h in call(w, "GET", "/api/v1/held")[1]["held"]] == [held_key]
        assert _wait(lambda: _health(workers, "os-0").get("state") == "isolated")
        health = _health(workers, "os-0")
        assert "hold" in health.get("operator", {}), health
        assert api.state(lambda c: c.nodes["os-0"].cordoned)

        # what is decided after the restart runs dry: returning os-0 to service is recorded
        # as dry_run and the node stays cordoned (the breaker, full, would hold automation's
        # isolations before dry-run is asked: see docs/contract.md)
        since = time.time()
        status, body = call(a, "POST", "/api/v1/nodes/os-0/return")
        assert status == 202
        later = collect(kafka_bootstrap, a.topic("actions"),
                        lambda rs: any(x["action"] == "return" and x["target"] == "os-0" and x["ts"] >= since
                                       for x in rs), 60)
        ret = [x for x in later if x["action"] == "return" and x["target"] == "os-0" and x["ts"] >= since]
        assert {x["outcome"] for x in ret} == {"dry_run"}, ret
        assert api.state(lambda c: c.nodes["os-0"].cordoned)

        # a person rejects the held isolation on one worker: it is gone from both
        assert call(b, "POST", f"/api/v1/held/{held_key}/reject")[0] == 202
        for w in workers:
            assert _wait(lambda w=w: call(w, "GET", "/api/v1/held")[1]["held"] == [])
        assert call(a, "POST", f"/api/v1/held/{held_key}/reject")[0] == 404
    finally:
        for w in workers:
            w.stop()
        api.close()
