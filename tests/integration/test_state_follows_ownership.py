"""Detector state follows the partitions: a worker that hands half its partitions to a
second worker frees the state of their nodes, and the two hold the fleet between them.

Real parts: Kafka and two worker processes of one group. The samples are the bench's
realistic fleet (pipeline.eval.bench.FleetLoad).
"""

from __future__ import annotations

import time

import pytest

from pipeline.eval.bench import FleetLoad

from .harness import Worker, produce, wait_for

pytestmark = pytest.mark.integration

NODES = 96


def test_a_second_worker_takes_half_the_nodes_and_the_first_frees_their_state(kafka_bootstrap) -> None:
    load = FleetLoad(NODES, seed=3)
    first = Worker(kafka_bootstrap, sim_url="http://127.0.0.1:9",
                   env={"FLEETMEDIC_ACTUATORS__BACKEND": "dryrun", "FLEETMEDIC_SAFETY__FLEET_SIZE": str(NODES)}).start()
    workers = [first]
    try:
        topic = first.topic("telemetry.gpu")

        def send(k: int) -> None:
            produce(kafka_bootstrap, [(topic, key, value) for key, value in load.gpu_round(k, ts=time.time())])

        send(0)
        assert wait_for(lambda: first.stats()["nodes_seen"] == NODES, 60), first.stats()
        alone_bytes = first.stats()["detector_state_bytes"]
        second = Worker(kafka_bootstrap, sim_url="http://127.0.0.1:9",
                        env={k: v for k, v in first.env.items() if k.startswith("FLEETMEDIC_")
                             and k != "FLEETMEDIC_WORKER__WEB_PORT"})
        workers.append(second.start())

        def shared() -> bool:
            send(shared.k)
            shared.k += 1
            a, b = first.stats(), second.stats()
            return a["nodes_forgotten"] > 0 and b["nodes_seen"] > 0 and a["nodes_seen"] + b["nodes_seen"] == NODES

        shared.k = 1
        assert wait_for(shared, 90), (first.stats(), second.stats())
        a, b = first.stats(), second.stats()
        assert a["nodes_seen"] < NODES and b["nodes_seen"] < NODES
        assert a["nodes_forgotten"] == NODES - a["nodes_seen"]
        assert a["detector_state_bytes"] < alone_bytes
    finally:
        for w in workers:
            w.stop()
