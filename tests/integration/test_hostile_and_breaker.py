"""Bad input never stops the worker; a storm never isolates more than the breaker allows."""

from __future__ import annotations

import json
import time

import orjson
import pytest

from .harness import ClusterAPI, Worker, collect, gpu_sample, produce

pytestmark = pytest.mark.integration


def _malformed(n: int) -> list[bytes]:
    good = gpu_sample("node-x", time.time())
    kinds = [
        lambda i: b"{not json" + str(i).encode(),
        lambda i: orjson.dumps({**good, "util": "high"}),
        lambda i: orjson.dumps({k: v for k, v in good.items() if k != "util"}),  # util is required
        lambda i: orjson.dumps(good).replace(b'"power":[', b'"power":[NaN,', 1),
        lambda i: orjson.dumps({**good, "schema": "gpu/99"}),
        lambda i: json.dumps({**good, "ecc_sbe": [10**30] * 8}).encode(),
        lambda i: orjson.dumps({**good, "util": [1.0] * 3}),
        lambda i: b"",
        lambda i: orjson.dumps([1, 2, 3]),
        lambda i: b"x" * 1_000_100 if i % 97 == 0 else orjson.dumps({**good, "ts": -5}),
    ]
    return [kinds[i % len(kinds)](i) for i in range(n)]


@pytest.fixture(scope="module")
def loop(kafka_bootstrap):
    from pipeline.config import load_settings

    api = ClusterAPI(load_settings(environ={}))
    worker = Worker(kafka_bootstrap, sim_url=api.url, env={"FLEETMEDIC_SAFETY__FLEET_SIZE": "40",
                                                          "FLEETMEDIC_SAFETY__MAX_FRACTION": "0.1",
                                                          "FLEETMEDIC_SAFETY__MAX_ABSOLUTE": "3"})
    worker.start()
    yield kafka_bootstrap, worker, api
    worker.stop()
    api.close()


def test_thousand_malformed_messages_go_to_deadletter_and_the_worker_keeps_deciding(loop):
    bootstrap, worker, api = loop
    bad = _malformed(1000)
    produce(bootstrap, [(worker.topic("telemetry.gpu"), f"bad-{i}", v) for i, v in enumerate(bad)])
    src = worker.topic("telemetry.gpu")
    dead = collect(bootstrap, worker.topic("deadletter"),
                   lambda rs: sum(1 for d in rs if d["source_topic"] == src and (d.get("key") or "").startswith("bad-")) >= 1000,
                   timeout=90)
    ours = [d for d in dead if d["source_topic"] == src and (d.get("key") or "").startswith("bad-")]
    assert len(ours) == 1000, f"{len(ours)} of 1000 dead letters\n{worker.log_tail()}"
    assert len({d["key"] for d in ours}) == 1000
    assert all(d["reason"] for d in ours)
    reasons = " ".join(d["reason"] for d in ours)
    for expected in ("invalid JSON", "unsupported schema version", "oversized", "finite number", "one per GPU"):
        assert expected in reasons, expected
    assert worker.alive() and worker.ready()

    # still deciding: a GPU that falls off the bus yields a verdict
    api.add_nodes(["td-0"])
    lost = [False] * 8
    lost[0] = True
    produce(bootstrap, [(src, "td-0", gpu_sample("td-0", time.time(), lost=lost, xids=[(0, 79)]))])
    verdicts = collect(bootstrap, worker.topic("verdicts"), lambda rs: any(v["subject"] == "td-0" for v in rs))
    assert [v["fault_class"] for v in verdicts if v["subject"] == "td-0"] == ["gpu_hardware"]


def test_storm_flagging_half_the_nodes_isolates_no_more_than_the_cap(loop):
    bootstrap, worker, api = loop
    nodes = [f"te-{i:02d}" for i in range(40)]
    api.add_nodes(nodes)
    storm = nodes[::2]  # half the fleet
    now = time.time()
    items = []
    for i, n in enumerate(storm):
        lost = [False] * 8
        lost[i % 8] = True
        items.append((worker.topic("telemetry.gpu"), n, gpu_sample(n, now + i * 0.01, lost=lost, xids=[(i % 8, 79)])))
    produce(bootstrap, items)
    actions = collect(bootstrap, worker.topic("actions"),
                      lambda rs: sum(1 for a in rs if a["action"] == "isolate" and a["target"] in storm) >= len(storm),
                      timeout=90)
    iso = [a for a in actions if a["action"] == "isolate" and a["target"] in storm]
    applied = [a for a in iso if a["outcome"] == "applied"]
    held = [a for a in iso if a["outcome"] == "held_by_budget"]
    # budget: min(cap 3, 10% of 40 = 4) = 3; td-0 from the other test used one slot at most
    assert len(iso) == len(storm)
    assert len(applied) <= 3
    assert len(held) >= len(storm) - 3
    assert all("circuit breaker" in a["detail"] for a in held)
    cordoned = api.state(lambda c: [n for n in nodes if c.nodes[n].cordoned])
    assert len(cordoned) == len(applied) <= 3
    # the other node actions of held verdicts were held too
    diag = [a for a in actions if a["action"] == "diagnose" and a["target"] in storm]
    assert sum(1 for a in diag if a["outcome"] == "applied") == len(applied)
