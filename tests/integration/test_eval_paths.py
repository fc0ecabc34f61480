"""The closed-loop evaluation's in-process path gives the Kafka pipeline's verdicts.

One small scenario (8 simulated nodes; Xid 79, a user bug, an NCCL timeout and an ECC
DBE) runs through :class:`pipeline.eval.inproc.InProcessLoop`, which acts on its cluster;
every record that loop fed the pipeline is then written, in event-time order, to a real
broker for a real ``fleetmedic worker`` process.  Both must reach the same verdicts
(scope, subject, fault class and action names; not timestamps or ids).
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter

import orjson
import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer

from pipeline.eval.inproc import InProcessLoop
from pipeline.sim.cluster import Cluster, Fault, SimConfig

from .harness import ClusterAPI, Worker, collect

pytestmark = pytest.mark.integration

PLAN = [("xid79", 700.0), ("user_bug", 1000.0), ("nccl_timeout", 1300.0), ("ecc_dbe", 1600.0)]
END = 1900


def _key(v: dict) -> tuple:
    return (v["scope"], v["subject"], v["fault_class"], tuple(a["action"] for a in v["actions"]))


def _in_process(settings, t0: float) -> tuple[list[tuple], list[list[tuple[str, str, bytes]]]]:
    cfg = SimConfig(nodes=8, speed=1.0, duration=1e9, seed=4, faults="none", gpu_every=5, network_every=10**7)
    cluster = Cluster(cfg, t0=t0)
    plan = [Fault(kind=k, at=at) for k, at in PLAN]
    cluster.faults, cluster.pending_faults = plan, list(plan)
    loop = InProcessLoop(settings, cluster)
    fed: list[list[tuple[str, str, bytes]]] = []
    records = loop._records

    def capture(raw):
        fed.append(list(raw))
        return records(raw)

    loop._records = capture  # type: ignore[method-assign]
    try:
        loop.step(END)
        loop.finish()
    finally:
        loop.close()
    assert all(f.applied_ts is not None for f in plan), "every fault struck a running job"
    return [_key(v) for v in loop.verdict_dicts()], fed


async def _replay(bootstrap: str, worker: Worker, fed: list[list[tuple[str, str, bytes]]]) -> None:
    """Send the records second by second as fast as the broker takes them: the worker
    judges on event time (the correlation grace included), so no pacing is needed, with
    one exception.  A diagnostics job runs only because the node was isolated, so its
    events are sent once the worker has given that isolation: sent earlier, they could
    overtake the anomaly that caused them (it passes through detection first), which no
    real cluster can do."""
    p = AIOKafkaProducer(bootstrap_servers=bootstrap, linger_ms=5, max_request_size=4 * 1024 * 1024)
    c = AIOKafkaConsumer(worker.topic("verdicts"), bootstrap_servers=bootstrap, auto_offset_reset="earliest",
                         group_id=None, enable_auto_commit=False)
    await p.start()
    await c.start()
    isolated: set[str] = set()

    async def isolation_of(node: str) -> None:
        await p.flush()
        deadline = time.monotonic() + 120
        while node not in isolated:
            assert time.monotonic() < deadline, f"no isolation of {node} before its diagnostics"
            for msgs in (await c.getmany(timeout_ms=300)).values():
                for m in msgs:
                    v = orjson.loads(m.value)
                    if v["scope"] == "node" and any(a["action"] == "isolate" for a in v["actions"]):
                        isolated.add(v["subject"])

    try:
        for second in fed:
            for topic, key, value in second:
                if topic == "telemetry.job":
                    node = orjson.loads(value).get("diagnostics_for")
                    if node:
                        await isolation_of(node)
                await p.send(worker.topic(topic), key=key.encode(), value=value)
        await p.flush()
    finally:
        await c.stop()
        await p.stop()


def test_in_process_and_kafka_paths_give_the_same_verdicts(kafka_bootstrap):
    from pipeline.config import load_settings

    api = ClusterAPI(load_settings(environ={}))
    # judged on event time only, as the in-process loop judges: the wall-clock fallback for
    # job events with no telemetry after them (4 s in the harness) fired on a loaded
    # machine while the GPU partitions were still being read, and judged a failure early
    worker = Worker(kafka_bootstrap, sim_url=api.url, env={"FLEETMEDIC_SAFETY__FLEET_SIZE": "64",
                                                           "FLEETMEDIC_POLICY__CORRELATION_WAIT_MAX_S": "120"})
    t0 = time.time() - END - 600
    expected, fed = _in_process(worker.settings, t0)
    kinds = Counter(k[2] for k in expected)
    assert {"gpu_hardware", "gpu_memory", "user_error"} <= set(kinds), expected
    assert {"transient_software", "unknown"} & set(kinds), expected  # a crash's real output names a cause or not
    worker.start()
    try:
        asyncio.run(_replay(kafka_bootstrap, worker, fed))
        got = collect(kafka_bootstrap, worker.topic("verdicts"), lambda rs: len(rs) >= len(expected), timeout=180)
        time.sleep(3)  # anything extra the worker would still say
        got = collect(kafka_bootstrap, worker.topic("verdicts"), lambda rs: False, timeout=3) if len(got) >= len(expected) else got
        assert Counter(_key(v) for v in got) == Counter(expected), worker.log_tail()
        # the same order for each subject
        for subject in {k[1] for k in expected}:
            assert [k for k in (_key(v) for v in got) if k[1] == subject] == [k for k in expected if k[1] == subject]
    finally:
        worker.stop()
        api.close()
