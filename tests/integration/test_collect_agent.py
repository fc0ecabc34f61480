"""The node agent on the real broker: an Xid 79 from the (fake) NVML becomes an isolation verdict."""

from __future__ import annotations

import asyncio
import time

import pytest

from pipeline.collect.agent import Agent, publish
from pipeline.collect.fake_nvml import FakeNVML
from pipeline.config import CollectSettings
from schemas import GpuSample

from .harness import BackgroundLoop, Worker, collect

pytestmark = pytest.mark.integration


def test_xid79_from_the_agent_isolates_the_node(kafka_bootstrap, tmp_path) -> None:
    worker = Worker(kafka_bootstrap, sim_url="http://127.0.0.1:9",
                    env={"FLEETMEDIC_ACTUATORS__BACKEND": "dryrun", "FLEETMEDIC_SAFETY__FLEET_SIZE": "10"}).start()
    fake = FakeNVML(8, seed=5)
    agent = Agent(CollectSettings(node="gpu-node-042", interval_s=1.0, infiniband_root=str(tmp_path), kernel_log="off"),
                  nvml=fake)
    bg = BackgroundLoop()
    stop = asyncio.Event()

    fut = asyncio.run_coroutine_threadsafe(publish(agent, worker.settings, stop), bg.loop)
    try:
        # healthy samples flow first; then the GPU falls off the bus
        collect(kafka_bootstrap, worker.topic("telemetry.gpu"), lambda rs: len(rs) >= 3, timeout=30)
        injected = time.time()
        fake.inject_xid(3, 79)
        fake.lose(3)
        verdicts = collect(kafka_bootstrap, worker.topic("verdicts"),
                           lambda rs: any(v["subject"] == "gpu-node-042" for v in rs), timeout=30)
    finally:
        bg.loop.call_soon_threadsafe(stop.set)
        fut.result(15)
        bg.stop()
        agent.close()
        worker.stop()
    v = next(v for v in verdicts if v["subject"] == "gpu-node-042")
    assert v["fault_class"] == "gpu_hardware"
    assert [a["action"] for a in v["actions"]][:1] == ["isolate"]
    assert v["ts"] >= injected - 1
    # every record the agent sent is a valid telemetry.gpu record
    sent = collect(kafka_bootstrap, worker.topic("telemetry.gpu"), lambda rs: False, timeout=3)
    for rec in sent:
        GpuSample.model_validate(rec)
    assert any(r["xids"] == [{"gpu": 3, "code": 79, "source": "nvml", "pci_bus_id": "0000:61:00"}] for r in sent)
