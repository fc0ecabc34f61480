"""The node agent: sources, validation, an Xid sent at once, --once output."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import sys
from pathlib import Path

from pipeline.collect.agent import Agent
from pipeline.collect.fake_nvml import FakeNVML
from pipeline.config import CollectSettings
from schemas import GpuSample, NetworkSample

ROOT = Path(__file__).resolve().parents[3]
SYSFS = ROOT / "tests" / "fixtures" / "sysfs-infiniband"


def test_one_round_collects_gpu_and_fabric_records(tmp_path) -> None:
    cfg = CollectSettings(node="gpu-node-017", infiniband_root=str(SYSFS), switches={"mlx5_0": "leaf-03"},
                          kernel_log="off")
    agent = Agent(cfg, nvml=FakeNVML(8))
    try:
        records = asyncio.run(agent.collect_once())
    finally:
        agent.close()
    topics = [t for t, _ in records]
    assert topics == ["telemetry.gpu", "telemetry.network"]
    GpuSample.model_validate(records[0][1])
    net = NetworkSample.model_validate(records[1][1])
    assert net.node == "gpu-node-017" and net.ports[0].switch == "leaf-03"


def test_fabric_ports_from_a_node_exporter_endpoint_instead_of_sysfs(tmp_path) -> None:
    """node_exporter's own output for its fixture tree, served over HTTP on loopback."""
    from aiohttp import web
    from aiohttp.test_utils import TestServer

    text = (ROOT / "tests" / "fixtures" / "node_exporter" / "infiniband-e2e-output.txt").read_text()

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(text=text, content_type="text/plain")

    async def run() -> list:
        app = web.Application()
        app.router.add_get("/metrics", metrics)
        async with TestServer(app, host="127.0.0.1", port=0) as server:
            cfg = CollectSettings(node="gpu-node-017", nvml="off", kernel_log="off",
                                  infiniband_root=str(SYSFS),  # not read: the exporter is the source
                                  node_exporter_url=str(server.make_url("/metrics")), switches={"mlx4_0": "leaf-03"})
            agent = Agent(cfg)
            try:
                return await agent.network()
            finally:
                agent.close()

    (rec,) = asyncio.run(run())
    net = NetworkSample.model_validate(rec)
    assert [q.port for q in net.ports] == ["i40iw0/1", "mlx4_0/1", "mlx4_0/2"]
    assert net.ports[2].rcv_bytes == 18527668 and net.ports[1].saturated == ["xmit_wait"]
    assert net.ports[1].switch == "leaf-03" and net.ports[0].switch == "unknown"


def test_an_xid_is_sent_at_once_not_at_the_next_interval(tmp_path) -> None:
    fake = FakeNVML(8)
    cfg = CollectSettings(node="n1", interval_s=60, infiniband_root=str(tmp_path / "none"), kernel_log="off")
    agent = Agent(cfg, nvml=fake)
    sent: list[tuple[float, dict]] = []

    async def run() -> None:
        stop = asyncio.Event()

        async def emit(topic: str, key: str, rec: dict) -> None:
            sent.append((asyncio.get_running_loop().time(), rec))

        task = asyncio.create_task(agent.run(emit, stop=stop))
        await asyncio.sleep(0.3)
        fake.inject_xid(6, 48)
        for _ in range(40):
            await asyncio.sleep(0.05)
            if any(r["xids"] for _, r in sent):
                break
        stop.set()
        await task

    try:
        asyncio.run(run())
    finally:
        agent.close()
    assert len(sent) == 2, "one round at start, then the Xid record, long before the 60 s interval"
    assert sent[1][1]["xids"] == [{"gpu": 6, "code": 48, "source": "nvml", "pci_bus_id": "0000:d1:00"}]


def test_without_nvml_or_devices_auto_mode_collects_nothing_and_says_so(tmp_path) -> None:
    fleetmedic = shutil.which("fleetmedic") or str(Path(sys.executable).parent / "fleetmedic")
    res = subprocess.run([fleetmedic, "collect", "--once", "--node", "n1", "--nvml", "off",
                          "--infiniband-root", str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert res.returncode == 1 and "no source produced a record" in res.stderr


def test_collect_once_prints_valid_json_records_with_the_fake_nvml() -> None:
    fleetmedic = shutil.which("fleetmedic") or str(Path(sys.executable).parent / "fleetmedic")
    res = subprocess.run([fleetmedic, "collect", "--once", "--node", "n7", "--fake-nvml", "4",
                          "--infiniband-root", str(SYSFS)], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert "FAKE NVML" in res.stderr
    lines = [json.loads(x) for x in res.stdout.splitlines()]
    gpu = GpuSample.model_validate(lines[0])
    assert gpu.node == "n7" and gpu.gpu_count == 4
    NetworkSample.model_validate(lines[1])


def test_nvml_on_without_a_library_fails_at_start_with_a_clear_message() -> None:
    class Broken:
        def nvmlInit(self) -> None:  # noqa: N802
            raise OSError("libnvidia-ml.so.1: cannot open shared object file")

    try:
        Agent(CollectSettings(node="n1", nvml="on", kernel_log="off"), nvml=Broken())
    except RuntimeError as exc:
        assert "collect.nvml is 'on'" in str(exc) and "libnvidia-ml" in str(exc)
    else:
        raise AssertionError("expected a RuntimeError")
