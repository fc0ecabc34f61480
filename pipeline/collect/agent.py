"""The node agent: run the collectors at an interval and produce their records.

Sources, each optional:

* **NVML** (:mod:`.nvml`): this node's GPUs -> ``telemetry.gpu``; an Xid event wakes the
  agent, so the record carrying it leaves at once instead of at the next interval;
* **dcgm-exporter** endpoints (:mod:`.dcgm`): for clusters that already run NVIDIA's
  exporter, one ``telemetry.gpu`` record per scraped host, nothing to install on nodes;
* **InfiniBand / RoCE sysfs** (:mod:`.infiniband`): this node's fabric ports ->
  ``telemetry.network``; or, where node_exporter already reads them, its
  ``node_infiniband_*`` metrics (:mod:`.node_exporter`, ``collect.node_exporter_url``);
* **the kernel log** (:mod:`.kernel`): the driver's own Xid and NVSwitch SXid lines, with
  the text NVML does not carry; merged with NVML's events so that each Xid is sent once.

Every record is validated against its schema before it is sent; a source that fails
(exporter down, driver error) is logged and retried at the next interval without
stopping the others.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from schemas import GpuSample, NetworkSample

from pipeline.config import CollectSettings

log = logging.getLogger(__name__)

Emit = Callable[[str, str, dict[str, Any]], Awaitable[None]]  # (topic short name, key, record)


def node_name(cfg: CollectSettings) -> str:
    return cfg.node or os.environ.get("NODE_NAME") or socket.gethostname()


@dataclass
class AgentStats:
    samples: dict[str, int] = field(default_factory=lambda: {"gpu": 0, "network": 0, "dcgm": 0})
    errors: dict[str, int] = field(default_factory=lambda: {"gpu": 0, "network": 0, "dcgm": 0})
    invalid: int = 0
    xids: int = 0


class Agent:
    """Collects from the configured sources; :meth:`collect_once` returns the records of one
    round, :meth:`run` sends them through ``emit`` every ``interval_s``."""

    def __init__(self, cfg: CollectSettings, *, nvml: Any = None, clock: Callable[[], float] = time.time,
                 proc_gpus: str = "/proc/driver/nvidia/gpus") -> None:
        from pipeline.collect.kernel import XidMerger, auto_source

        self.cfg = cfg
        self.node = node_name(cfg)
        self.clock = clock
        self.stats = AgentStats()
        self._wake: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.nvml_collector = None
        self.kernel_collector = None
        self._dcgm_parsers: dict[str, Any] = {}
        source = cfg.kernel_log
        if source == "auto":
            source = auto_source() or "off"
            log.info("kernel log: %s", "off (neither journald nor /dev/kmsg can be read)" if source == "off"
                     else source)
        self.merger = XidMerger(window_s=cfg.xid_merge_s, kernel=source != "off", clock=clock)
        if cfg.nvml != "off":
            self.nvml_collector = self._open_nvml(nvml)
        #: the GPUs' bus ids when NVML is not there (the driver's /proc listing)
        self.proc_buses: list[str] = [] if self.nvml_collector is not None else self._proc_buses(proc_gpus)
        if source != "off":
            self.kernel_collector = self._open_kernel(source)

    @staticmethod
    def _proc_buses(root: str) -> list[str]:
        from pipeline.collect.kernel import proc_gpu_buses

        return proc_gpu_buses(root)

    def gpu_of_bus(self, bus_id: str) -> int | None:
        """A kernel line's GPU: its index by NVML's bus ids, else by the driver's listing."""
        if self.nvml_collector is not None:
            return self.nvml_collector.gpu_of_bus(bus_id)
        return self.proc_buses.index(bus_id) if bus_id in self.proc_buses else None

    def _open_kernel(self, source: str) -> Any:
        from pipeline.collect.kernel import KernelLogCollector

        def sink(kind: str, ev: dict[str, Any]) -> None:
            self.merger.add_kernel(kind, ev)
            self._xid_seen()

        try:
            return KernelLogCollector(source, self.gpu_of_bus, sink, from_start=self.cfg.kernel_log_backlog,
                                      clock=self.clock).open()
        except (RuntimeError, OSError, ValueError) as exc:
            if self.cfg.kernel_log != "auto":
                raise RuntimeError(f"collect.kernel_log = {self.cfg.kernel_log!r} cannot be used: {exc}") from exc
            log.warning("kernel log not followed: %s", exc)
            return None

    def _open_nvml(self, nvml: Any) -> Any:
        from pipeline.collect.nvml import NvmlCollector, load_nvml

        try:
            lib = nvml if nvml is not None else load_nvml()
            return NvmlCollector(lib, self.node, clock=self.clock, on_xid=self._xid_seen,
                                 sink=self.merger.add_nvml).open()
        except Exception as exc:
            if self.cfg.nvml == "on":
                raise RuntimeError(f"collect.nvml is 'on' but NVML cannot be used: {exc}") from exc
            log.info("no NVML on this node (%s); GPU telemetry from NVML is off", exc)
            return None

    def _xid_seen(self) -> None:
        # called from the NVML event thread
        self.stats.xids += 1
        if self._loop is not None and self._wake is not None:
            self._loop.call_soon_threadsafe(self._wake.set)

    def close(self) -> None:
        if self.nvml_collector is not None:
            self.nvml_collector.close()
        if self.kernel_collector is not None:
            self.kernel_collector.close()

    # ------------------------------------------------------------------ sources

    def _valid(self, model: type, rec: dict[str, Any], what: str) -> bool:
        try:
            model.model_validate(rec)
            return True
        except ValidationError as exc:
            self.stats.invalid += 1
            log.error("%s record for %s does not validate, not sent: %s", what, rec.get("node"), exc)
            return False

    def _kernel_only_record(self, xids: list[dict[str, Any]], sxids: list[dict[str, Any]]) -> dict[str, Any]:
        """A ``telemetry.gpu`` record of the kernel's events alone (no NVML on the node):
        readings unknown (null), one entry per GPU the driver lists."""
        n = max([len(self.proc_buses), 1] + [x["gpu"] + 1 for x in xids if x.get("gpu") is not None])
        rec: dict[str, Any] = {"schema": "gpu/1", "ts": self.clock(), "node": self.node, "util": [None] * n,
                               "xids": xids}
        if self.proc_buses and len(self.proc_buses) == n:
            rec["pci_bus_id"] = list(self.proc_buses)
        if sxids:
            rec["sxids"] = sxids
        return rec

    async def gpu(self, *, events_only: bool = False) -> list[dict[str, Any]]:
        """This round's ``telemetry.gpu`` record; with ``events_only``, only when an Xid or
        SXid is due (the record that carries it leaves at once)."""
        xids, sxids = self.merger.take()
        if events_only and not (xids or sxids):
            return []
        if self.nvml_collector is None:
            if not (xids or sxids):
                return []
            rec = self._kernel_only_record(xids, sxids)
        else:
            try:
                rec = await asyncio.to_thread(self.nvml_collector.sample, xids, sxids)
            except Exception as exc:
                self.stats.errors["gpu"] += 1
                log.warning("NVML sample failed: %s", exc)
                return []
        if not self._valid(GpuSample, rec, "GPU"):
            return []
        self.stats.samples["gpu"] += 1
        return [rec]

    async def network(self) -> list[dict[str, Any]]:
        from pipeline.collect.dcgm import scrape
        from pipeline.collect.infiniband import read_network_sample
        from pipeline.collect.node_exporter import parse_node_exporter

        try:
            if self.cfg.node_exporter_url:
                text = await scrape(self.cfg.node_exporter_url)
                rec = parse_node_exporter(text, self.node, ts=self.clock(), switches=self.cfg.switches)
            else:
                rec = await asyncio.to_thread(read_network_sample, self.node, ts=self.clock(),
                                              root=self.cfg.infiniband_root, switches=self.cfg.switches,
                                              lldp_dir=self.cfg.lldp_dir)
        except Exception as exc:
            self.stats.errors["network"] += 1
            log.warning("InfiniBand counters not read: %s", exc)
            return []
        if rec is None or not self._valid(NetworkSample, rec, "network"):
            return []
        self.stats.samples["network"] += 1
        return [rec]

    async def dcgm(self) -> list[dict[str, Any]]:
        from pipeline.collect.dcgm import DcgmExporterParser, scrape

        out: list[dict[str, Any]] = []
        for url in self.cfg.dcgm_urls:
            parser = self._dcgm_parsers.setdefault(url, DcgmExporterParser())
            try:
                text = await scrape(url)
                records = parser.parse(text, ts=self.clock(), fallback_node=self._dcgm_fallback(url))
            except Exception as exc:
                self.stats.errors["dcgm"] += 1
                log.warning("dcgm-exporter %s: %s", url, exc)
                continue
            for rec in records:
                if self._valid(GpuSample, rec, "dcgm-exporter"):
                    self.stats.samples["dcgm"] += 1
                    out.append(rec)
        return out

    def _dcgm_fallback(self, url: str) -> str | None:
        """The node an exporter's lines belong to when they carry no host name (``--no-hostname``,
        or a container's id): this node, for an exporter on this machine; else none."""
        import ipaddress
        from urllib.parse import urlsplit

        host = (urlsplit(url).hostname or "").lower()
        try:
            local = host in ("localhost", "localhost.localdomain") or ipaddress.ip_address(host).is_loopback
        except ValueError:
            local = False
        return self.node if local or host == self.node.lower() else None

    async def collect_once(self) -> list[tuple[str, dict[str, Any]]]:
        """One round of every source: (topic short name, record) pairs."""
        gpu, net, dcgm = await asyncio.gather(self.gpu(), self.network(), self.dcgm())
        return [("telemetry.gpu", r) for r in gpu + dcgm] + [("telemetry.network", r) for r in net]

    # ------------------------------------------------------------------ loop

    async def run(self, emit: Emit, *, stop: asyncio.Event | None = None) -> None:
        """Collect every ``interval_s`` (and at once after an Xid) until ``stop``."""
        stop = stop or asyncio.Event()
        self._loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()
        next_at = time.monotonic()
        while not stop.is_set():
            xid_only = (self._wake.is_set() or self.merger.pending() > 0) and time.monotonic() < next_at
            self._wake.clear()
            if xid_only:
                for rec in await self.gpu(events_only=True):
                    await emit("telemetry.gpu", rec["node"], rec)
            else:
                for topic, rec in await self.collect_once():
                    await emit(topic, rec["node"], rec)
                next_at = time.monotonic() + self.cfg.interval_s
            timeout = max(0.0, next_at - time.monotonic())
            due = self.merger.next_due()
            if due is not None:  # an NVML Xid held for its kernel line: send it when the hold ends
                timeout = min(timeout, max(0.05, due - self.clock()))
            waits = {asyncio.ensure_future(stop.wait()), asyncio.ensure_future(self._wake.wait())}
            await asyncio.wait(waits, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
            for w in waits:
                w.cancel()


async def publish(agent: Agent, settings: Any, stop: asyncio.Event) -> None:
    """Run ``agent`` until ``stop``, producing its records to the telemetry topics of
    ``settings`` (a :class:`pipeline.config.Settings`), keyed by node."""
    import orjson
    from aiokafka import AIOKafkaProducer

    producer = AIOKafkaProducer(bootstrap_servers=settings.kafka.bootstrap, acks="all", linger_ms=20,
                                max_request_size=2 * 1024 * 1024)
    await producer.start()

    async def emit(topic: str, key: str, rec: dict[str, Any]) -> None:
        await producer.send(settings.topic(topic), key=key.encode(), value=orjson.dumps(rec))

    try:
        await agent.run(emit, stop=stop)
    finally:
        await producer.stop()
