"""The network track on the real broker: a degrading leaf switch is the switch's fault (no
node isolated); one bad port is its node's fault (that node only isolated)."""

from __future__ import annotations

import time

import numpy as np
import orjson
import pytest

from pipeline.eval.network import Fabric, FabricFault

from .harness import Worker, collect, produce

pytestmark = pytest.mark.integration

NODES, LEAVES, STEP = 64, 4, 10.0


def _stream(fab: Fabric, t0: float, steps: int, faults: list[FabricFault], topic: str) -> list:
    items = []
    for k in range(steps):
        t = t0 + k * STEP
        fab.step(t, [f for f in faults if f.start <= t < f.end])
        for s in fab.samples(t):
            items.append((topic, s.node, orjson.loads(s.model_dump_json(by_alias=True))))
    return items


@pytest.fixture(scope="module")
def net_worker(kafka_bootstrap):
    worker = Worker(kafka_bootstrap, sim_url="http://127.0.0.1:9", env={
        "FLEETMEDIC_ACTUATORS__BACKEND": "dryrun", "FLEETMEDIC_SAFETY__FLEET_SIZE": str(NODES),
        "FLEETMEDIC_SAFETY__MAX_FRACTION": "0.5",
        "FLEETMEDIC_NETWORK__ENFORCE": "true", "FLEETMEDIC_NETWORK__MIN_TRAIN_ROWS": "2000",
        "FLEETMEDIC_NETWORK__HOLD_S": "30"}).start()
    yield worker
    worker.stop()


def test_a_degrading_leaf_is_one_switch_verdict_and_a_bad_port_isolates_its_node_only(kafka_bootstrap, net_worker):
    w = net_worker
    fab = Fabric(NODES, LEAVES, STEP, seed=11)
    # event time ends near now: the switch track's holds run on the worker's clock
    steps_healthy, steps_fault = 40, 24
    t0 = time.time() - (steps_healthy + steps_fault) * STEP
    fault_t = t0 + steps_healthy * STEP
    faults = [FabricFault("leaf", fault_t, fault_t + 1e6, leaf=1),
              FabricFault("port_degrade", fault_t - 100, fault_t + 1e6, node=40, port=2)]
    assert fab.leaf_of[40] != 1  # the bad port's node is under another leaf
    items = _stream(fab, t0, steps_healthy + steps_fault, faults, w.topic("telemetry.network"))
    cut = steps_healthy * NODES
    produce(kafka_bootstrap, items[:cut])
    # the model is fitted (in a worker thread) on the healthy fleet before the faults arrive
    deadline = time.monotonic() + 60
    while not w.stats()["fabric_model"]["ready"] and time.monotonic() < deadline:
        time.sleep(0.2)
    assert w.stats()["fabric_model"]["ready"], w.log_tail()
    produce(kafka_bootstrap, items[cut:])
    leaf = "leaf-01"
    verdicts = collect(kafka_bootstrap, w.topic("verdicts"),
                       lambda rs: any(v["subject"] == leaf for v in rs) and any(v["subject"] == fab.names[40] for v in rs),
                       timeout=90)
    switch = [v for v in verdicts if v["scope"] == "switch"]
    assert [(v["subject"], v["fault_class"]) for v in switch] == [(leaf, "fabric_switch")]
    assert switch[0]["actions"][0]["action"] == "escalate" and switch[0]["actions"][0]["params"]["alert_only"]
    under = {fab.names[i] for i in np.flatnonzero(fab.leaf_of == 1)}
    node_verdicts = [v for v in verdicts if v["scope"] == "node"]
    blamed = [(v["subject"], v["evidence"].get("switch_track")) for v in node_verdicts if v["subject"] in under]
    assert not blamed, f"a node under the bad switch was blamed: {blamed}"
    assert [(v["subject"], v["fault_class"]) for v in node_verdicts] == [(fab.names[40], "node_network")]
    assert [a["action"] for a in node_verdicts[0]["actions"]] == ["isolate", "drain", "diagnose"]
    actions = collect(kafka_bootstrap, w.topic("actions"),
                      lambda rs: any(a["target"] == leaf for a in rs)
                      and any(a["target"] == fab.names[40] and a["action"] == "isolate" for a in rs), timeout=60)
    assert [a["outcome"] for a in actions if a["target"] == leaf] == ["applied"]
    isolated = {a["target"] for a in actions if a["action"] == "isolate"}
    assert isolated == {fab.names[40]}
