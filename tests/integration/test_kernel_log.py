"""Kernel-log lines that real drivers printed, through the node agent and a worker on the real broker.

Six nodes, each with its own (fake) NVML, whose GPUs sit at the bus ids the real lines
name, and its own kernel log: journald JSON for three of them, /dev/kmsg records for the
other three.  Each log gets one real line (``tests/fixtures/kernel-log/lines.toml``):
Xid 79, 48, 94, 119, 154 and an NVSwitch SXid.  NVML also reports the Xids it sees, as
the driver does; each must reach the worker once, with the kernel's text, and the
verdicts must be those of the Xid table.
"""

from __future__ import annotations

import asyncio
import json
import time
import tomllib
from pathlib import Path

import pytest

from pipeline.collect.agent import Agent, publish
from pipeline.collect.fake_nvml import FakeNVML
from pipeline.config import CollectSettings
from schemas import GpuSample

from .harness import BackgroundLoop, Worker, collect

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
LINES = tomllib.loads((REPO / "tests/fixtures/kernel-log/lines.toml").read_text())["line"]


def _line(**want: object) -> str:
    for ln in LINES:
        if all(ln.get(k) == v if k != "contains" else v in ln["text"] for k, v in want.items()):
            return ln["text"]
    raise LookupError(want)


#: node -> (line, framing, expected (isolate, fault class, remedy) or None for no isolation)
CASES = {
    "kl-xid79": (_line(xid=79, contains="pid='<unknown>'"), "journald", ("gpu_hardware", "reboot")),
    "kl-xid48": (_line(xid=48), "kmsg", ("gpu_memory", "reset_gpu")),
    "kl-xid94": (_line(xid=94, contains="PCI:0000:00:08"), "journald", None),
    "kl-xid119": (_line(xid=119, contains="GSP_RM_ALLOC"), "kmsg", ("gpu_hardware", "reset_gpu")),
    "kl-xid154": (_line(xid=154, contains="0x0 (None) to 0x1 (GPU Reset Required)"), "journald",
                  ("gpu_hardware", "reset_gpu")),
    "kl-sxid": (_line(sxid=20034, contains="Fatal"), "kmsg", ("nvlink", "reset_gpu")),
}


def _bus(text: str) -> str:
    inner = text.split("(PCI:", 1)[1].split(")", 1)[0].split()[0]
    domain, bus, dev = inner.split(".")[0].split(":")
    return f"0000{domain}:{bus.upper()}:{dev.upper()}.0"


def _frame(text: str, framing: str, seq: int) -> str:
    if framing == "journald":
        return json.dumps({"_TRANSPORT": "kernel", "SYSLOG_IDENTIFIER": "kernel", "SYSLOG_FACILITY": "0",
                           "PRIORITY": "4", "MESSAGE": text, "__REALTIME_TIMESTAMP": str(int(time.time() * 1e6)),
                           "_BOOT_ID": "b03ed610f21d46ab8243a495ba5a0058"}) + "\n"
    escaped = "".join(c if 32 <= ord(c) < 127 and c != "\\" else f"\\x{ord(c):02x}" for c in text)
    return f"4,{seq},{int(time.monotonic() * 1e6)},-;{escaped}\n"


def test_real_kernel_lines_become_the_tables_verdicts(kafka_bootstrap, tmp_path) -> None:
    worker = Worker(kafka_bootstrap, sim_url="http://127.0.0.1:9",
                    env={"FLEETMEDIC_ACTUATORS__BACKEND": "dryrun", "FLEETMEDIC_SAFETY__FLEET_SIZE": "100"}).start()
    agents: dict[str, tuple[Agent, FakeNVML, Path]] = {}
    for node, (text, framing, _) in CASES.items():
        gpu_bus = None if "SXid" in text else _bus(text)
        buses = [gpu_bus or "00000000:1B:00.0"] + [f"00000000:{0xA0 + k:02X}:00.0" for k in range(7)]
        fake = FakeNVML(8, seed=len(agents), bus_ids=buses)
        log = tmp_path / f"{node}.log"
        log.write_text("")
        cfg = CollectSettings(node=node, interval_s=1.0, infiniband_root=str(tmp_path / "none"),
                              kernel_log=f"{framing}:{log}")
        agents[node] = (Agent(cfg, nvml=fake), fake, log)
    bg = BackgroundLoop()
    stop = asyncio.Event()
    futs = [asyncio.run_coroutine_threadsafe(publish(a, worker.settings, stop), bg.loop) for a, _, _ in agents.values()]
    try:
        collect(kafka_bootstrap, worker.topic("telemetry.gpu"), lambda rs: len({r["node"] for r in rs}) >= 6,
                timeout=30)
        for k, (node, (text, framing, _)) in enumerate(CASES.items()):
            agent, fake, log = agents[node]
            x = None if "SXid" in text else int(text.split("): ", 1)[1].split(",")[0])
            if x is not None:
                fake.inject_xid(0, x)  # NVML sees it too
            with log.open("a") as f:
                f.write(_frame(text, framing, 5000 + k))
        isolating = {n for n, c in CASES.items() if c[2] is not None}
        verdicts = collect(kafka_bootstrap, worker.topic("verdicts"),
                           lambda rs: isolating <= {v["subject"] for v in rs}, timeout=45)
        anomalies = collect(kafka_bootstrap, worker.topic("anomalies"),
                            lambda rs: any(a["node"] == "kl-xid94" for a in rs), timeout=20)
        sent = collect(kafka_bootstrap, worker.topic("telemetry.gpu"), lambda rs: False, timeout=3)
    finally:
        bg.loop.call_soon_threadsafe(stop.set)
        for f in futs:
            f.result(15)
        bg.stop()
        for a, _, _ in agents.values():
            a.close()
        worker.stop()

    by_node: dict[str, list[dict]] = {}
    for v in verdicts:
        by_node.setdefault(v["subject"], []).append(v)
    for node, (text, _, want) in CASES.items():
        if want is None:
            continue
        v = next(v for v in by_node[node] if any(a["action"] == "isolate" for a in v["actions"]))
        diagnose = next(a for a in v["actions"] if a["action"] == "diagnose")
        assert (v["fault_class"], diagnose["params"].get("remedy")) == want, (node, v)
        assert v["evidence"]["action"] == "isolate" and v["evidence"]["rule"]
    # 94: the driver contained it to the application: a degrade finding, and the node stays
    [a94] = [a for a in anomalies if a["node"] == "kl-xid94" and a["kind"] == "xid"]
    assert (a94["evidence"]["action"], a94["severity"], a94["evidence"]["degrade"]) == ("restart_app", "warning", True)
    assert not any(any(x["action"] == "isolate" for x in v["actions"]) for v in by_node.get("kl-xid94", []))
    # each Xid reached the worker once, from the kernel log, with the driver's text and process
    for rec in sent:
        GpuSample.model_validate(rec)
    xids = [(r["node"], x) for r in sent for x in r["xids"]]
    for node, (text, _, _) in CASES.items():
        mine = [x for n, x in xids if n == node]
        if "SXid" in text:
            assert [s["code"] for r in sent if r["node"] == node for s in r.get("sxids", [])] == [20034]
            continue
        assert len(mine) == 1, (node, mine)
        assert mine[0]["source"] == "kernel" and mine[0]["gpu"] == 0 and mine[0]["detail"]
