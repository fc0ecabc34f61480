"""A fake NVML for machines without NVIDIA GPUs: tests, demos, trying the agent.

``FakeNVML`` has the functions and constants of ``pynvml`` that
:class:`~pipeline.collect.nvml.NvmlCollector` calls, and raises the real ``pynvml``
exceptions (``NVMLError`` with NVML's error codes).  Its values are those of an 8 x H100
80GB SXM node under training load (about 650 W and 65 C per GPU, 1980 MHz SM clock,
2619 MHz memory clock, 18 active NVLinks per GPU, row remapping instead of page
retirement); counters grow slowly as a healthy node's do.  Tests steer it: mark a field
unsupported, lose a GPU, inject an Xid event, raise error counters.

It is a fake: nothing here talks to a GPU.
"""

from __future__ import annotations

import queue
import warnings
from dataclasses import dataclass, field
from typing import Any

import numpy as np

with warnings.catch_warnings():
    warnings.simplefilter("ignore", FutureWarning)
    import pynvml as _real


@dataclass
class FakeGpu:
    index: int
    util: float = 97.0
    temp: float = 65.0
    power_mw: int = 650_000
    sm_clock: int = 1980
    mem_clock: int = 2619
    mem_used: int = 71 * 1024**3
    mem_total: int = 80 * 1024**3
    throttle: int = 0
    ecc: dict[tuple[int, int], int] = field(default_factory=dict)  # (error type, counter type) -> count
    remapped: tuple[int, int, int, int] = (0, 0, 0, 0)
    nvlink_links: int = 18
    nvlink: dict[tuple[int, int], int] = field(default_factory=dict)  # (link, counter) -> count
    pcie_replay: int = 0
    lost: bool = False
    bus_id: str = ""
    #: what this GPU answers NOT_SUPPORTED to (record field names; "nvlink" for all of NVLink)
    unsupported: set[str] = field(default_factory=set)


@dataclass
class FakeEventData:
    device: Any
    eventType: int  # noqa: N815 (NVML's name)
    eventData: int  # noqa: N815
    gpuInstanceId: int = 0xFFFFFFFF  # noqa: N815
    computeInstanceId: int = 0xFFFFFFFF  # noqa: N815


class FakeNVML:
    """A fake of the ``pynvml`` module for one node (see the module docstring)."""

    # the constants the collector uses, from the real library
    NVML_TEMPERATURE_GPU = _real.NVML_TEMPERATURE_GPU
    NVML_CLOCK_SM = _real.NVML_CLOCK_SM
    NVML_CLOCK_MEM = _real.NVML_CLOCK_MEM
    NVML_MEMORY_ERROR_TYPE_CORRECTED = _real.NVML_MEMORY_ERROR_TYPE_CORRECTED
    NVML_MEMORY_ERROR_TYPE_UNCORRECTED = _real.NVML_MEMORY_ERROR_TYPE_UNCORRECTED
    NVML_VOLATILE_ECC = _real.NVML_VOLATILE_ECC
    NVML_AGGREGATE_ECC = _real.NVML_AGGREGATE_ECC
    NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS = _real.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS
    NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR = _real.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR
    NVML_NVLINK_MAX_LINKS = _real.NVML_NVLINK_MAX_LINKS
    NVML_NVLINK_ERROR_DL_CRC_FLIT = _real.NVML_NVLINK_ERROR_DL_CRC_FLIT
    NVML_NVLINK_ERROR_DL_REPLAY = _real.NVML_NVLINK_ERROR_DL_REPLAY
    NVML_NVLINK_ERROR_DL_RECOVERY = _real.NVML_NVLINK_ERROR_DL_RECOVERY
    NVML_FEATURE_ENABLED = _real.NVML_FEATURE_ENABLED
    NVML_FEATURE_DISABLED = _real.NVML_FEATURE_DISABLED
    NVML_ERROR_NOT_SUPPORTED = _real.NVML_ERROR_NOT_SUPPORTED
    NVML_ERROR_NO_PERMISSION = _real.NVML_ERROR_NO_PERMISSION
    NVML_ERROR_GPU_IS_LOST = _real.NVML_ERROR_GPU_IS_LOST
    NVML_ERROR_TIMEOUT = _real.NVML_ERROR_TIMEOUT
    NVML_ERROR_INVALID_ARGUMENT = _real.NVML_ERROR_INVALID_ARGUMENT
    NVML_ERROR_FUNCTION_NOT_FOUND = _real.NVML_ERROR_FUNCTION_NOT_FOUND
    nvmlEventTypeXidCriticalError = _real.nvmlEventTypeXidCriticalError  # noqa: N815
    NVMLError = _real.NVMLError

    #: the GPUs' PCI buses of an 8-GPU HGX H100 baseboard (DGX H100 user guide), in NVML order
    BUSES = (0x1B, 0x43, 0x52, 0x61, 0x9D, 0xC3, 0xD1, 0xDF)

    def __init__(self, gpus: int = 8, *, seed: int = 0, retired_pages_supported: bool = False,
                 bus_ids: list[str] | None = None) -> None:
        """``bus_ids``: the GPUs' PCI bus ids as NVML spells them (``00000000:3B:00.0``);
        default those of an HGX H100 baseboard."""
        if bus_ids is not None and len(bus_ids) != gpus:
            raise ValueError(f"bus_ids: expected {gpus}, got {len(bus_ids)}")
        buses = bus_ids or [f"00000000:{self.BUSES[i % 8] + 8 * (i // 8):02X}:00.0" for i in range(gpus)]
        self.gpus = [FakeGpu(i, bus_id=b) for i, b in enumerate(buses)]
        self.rng = np.random.default_rng(seed)
        self.unsupported: set[str] = set() if retired_pages_supported else {"retired_pages"}
        self.initialised = False
        self.events: queue.Queue[FakeEventData] = queue.Queue()
        self.registered: set[int] = set()

    # ------------------------------------------------------------------ steering

    def advance(self) -> None:
        """One interval of healthy training: values jitter, counters rarely move."""
        for g in self.gpus:
            g.util = float(np.clip(self.rng.normal(96.0, 1.5), 0, 100))
            g.temp = float(np.round(self.rng.normal(66.0, 1.2), 0))
            g.power_mw = int(self.rng.normal(650_000, 12_000))
            if self.rng.random() < 0.01:
                key = (self.NVML_MEMORY_ERROR_TYPE_CORRECTED, self.NVML_VOLATILE_ECC)
                g.ecc[key] = g.ecc.get(key, 0) + 1

    def lose(self, gpu: int) -> None:
        """The GPU falls off the bus: every call on it fails with GPU_IS_LOST."""
        self.gpus[gpu].lost = True

    def inject_xid(self, gpu: int, code: int) -> None:
        """An Xid error on ``gpu``, delivered through the event set as the driver would."""
        if gpu in self.registered:
            self.events.put(FakeEventData(device=self.gpus[gpu], eventType=self.nvmlEventTypeXidCriticalError,
                                          eventData=code))

    def add_ecc(self, gpu: int, *, sbe: int = 0, dbe: int = 0) -> None:
        g = self.gpus[gpu]
        for kind, n in ((self.NVML_MEMORY_ERROR_TYPE_CORRECTED, sbe), (self.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, dbe)):
            for counter in (self.NVML_VOLATILE_ECC, self.NVML_AGGREGATE_ECC):
                g.ecc[(kind, counter)] = g.ecc.get((kind, counter), 0) + n

    # ------------------------------------------------------------------ helpers

    def _err(self, code: int) -> Exception:
        return _real.NVMLError(code)

    def _gpu(self, handle: Any, what: str) -> FakeGpu:
        if not self.initialised:
            raise self._err(_real.NVML_ERROR_UNINITIALIZED)
        if not isinstance(handle, FakeGpu):
            raise self._err(self.NVML_ERROR_INVALID_ARGUMENT)
        if handle.lost:
            raise self._err(self.NVML_ERROR_GPU_IS_LOST)
        if what in self.unsupported or what in handle.unsupported:
            raise self._err(self.NVML_ERROR_NOT_SUPPORTED)
        return handle

    # ------------------------------------------------------------------ the pynvml surface

    def nvmlInit(self) -> None:  # noqa: N802 (pynvml's names)
        self.initialised = True

    def nvmlShutdown(self) -> None:  # noqa: N802
        self.initialised = False

    def nvmlSystemGetDriverVersion(self) -> str:  # noqa: N802
        return "550.54.15 (fake NVML)"

    def nvmlDeviceGetCount(self) -> int:  # noqa: N802
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, i: int) -> FakeGpu:  # noqa: N802
        if not 0 <= i < len(self.gpus):
            raise self._err(self.NVML_ERROR_INVALID_ARGUMENT)
        return self.gpus[i]

    def nvmlDeviceGetIndex(self, h: FakeGpu) -> int:  # noqa: N802
        return self._gpu(h, "index").index

    def nvmlDeviceGetPciInfo(self, h: FakeGpu) -> Any:  # noqa: N802
        g = self._gpu(h, "pci")
        domain, bus, dev = g.bus_id.split(":")[0], g.bus_id.split(":")[1], g.bus_id.split(":")[2].split(".")[0]
        return _real.nvmlPciInfo_t(busId=g.bus_id.encode(), busIdLegacy=g.bus_id[-12:].encode(),
                                   domain=int(domain, 16), bus=int(bus, 16), device=int(dev, 16))

    def nvmlDeviceGetUtilizationRates(self, h: FakeGpu) -> Any:  # noqa: N802
        g = self._gpu(h, "util")
        return _real.c_nvmlUtilization_t(gpu=int(round(g.util)), memory=40)

    def nvmlDeviceGetMemoryInfo(self, h: FakeGpu) -> Any:  # noqa: N802
        g = self._gpu(h, "mem_used")
        return _real.c_nvmlMemory_t(total=g.mem_total, free=g.mem_total - g.mem_used, used=g.mem_used)

    def nvmlDeviceGetTemperature(self, h: FakeGpu, sensor: int) -> int:  # noqa: N802
        return int(self._gpu(h, "temp").temp)

    def nvmlDeviceGetPowerUsage(self, h: FakeGpu) -> int:  # noqa: N802
        return self._gpu(h, "power").power_mw

    def nvmlDeviceGetClockInfo(self, h: FakeGpu, kind: int) -> int:  # noqa: N802
        g = self._gpu(h, "sm_clock" if kind == self.NVML_CLOCK_SM else "mem_clock")
        return g.sm_clock if kind == self.NVML_CLOCK_SM else g.mem_clock

    def nvmlDeviceGetCurrentClocksEventReasons(self, h: FakeGpu) -> int:  # noqa: N802
        return self._gpu(h, "throttle").throttle

    def nvmlDeviceGetCurrentClocksThrottleReasons(self, h: FakeGpu) -> int:  # noqa: N802
        return self._gpu(h, "throttle").throttle

    def nvmlDeviceGetTotalEccErrors(self, h: FakeGpu, kind: int, counter: int) -> int:  # noqa: N802
        name = {(0, 0): "ecc_sbe", (1, 0): "ecc_dbe", (0, 1): "ecc_sbe_aggregate", (1, 1): "ecc_dbe_aggregate"}
        g = self._gpu(h, name.get((kind, counter), "ecc"))
        return g.ecc.get((kind, counter), 0)

    def nvmlDeviceGetRetiredPages(self, h: FakeGpu, cause: int) -> list[int]:  # noqa: N802
        self._gpu(h, "retired_pages")
        return []

    def nvmlDeviceGetRemappedRows(self, h: FakeGpu) -> tuple[int, int, int, int]:  # noqa: N802
        return self._gpu(h, "remapped_rows").remapped

    def nvmlDeviceGetNvLinkState(self, h: FakeGpu, link: int) -> int:  # noqa: N802
        g = self._gpu(h, "nvlink")
        if link >= g.nvlink_links:
            raise self._err(self.NVML_ERROR_INVALID_ARGUMENT if link < self.NVML_NVLINK_MAX_LINKS
                            else self.NVML_ERROR_NOT_SUPPORTED)
        return self.NVML_FEATURE_ENABLED

    def nvmlDeviceGetNvLinkErrorCounter(self, h: FakeGpu, link: int, counter: int) -> int:  # noqa: N802
        g = self._gpu(h, "nvlink")
        field = {self.NVML_NVLINK_ERROR_DL_CRC_FLIT: "nvlink_crc", self.NVML_NVLINK_ERROR_DL_REPLAY: "nvlink_replay",
                 self.NVML_NVLINK_ERROR_DL_RECOVERY: "nvlink_recovery"}.get(counter, "nvlink_other")
        return self._gpu(g, field).nvlink.get((link, counter), 0)

    def nvmlDeviceGetPcieReplayCounter(self, h: FakeGpu) -> int:  # noqa: N802
        return self._gpu(h, "pcie_replay").pcie_replay

    def nvmlEventSetCreate(self) -> object:  # noqa: N802
        return object()

    def nvmlDeviceRegisterEvents(self, h: FakeGpu, types: int, event_set: object) -> None:  # noqa: N802
        self._gpu(h, "events")
        self.registered.add(h.index)

    def nvmlEventSetWait_v2(self, event_set: object, timeout_ms: int) -> FakeEventData:  # noqa: N802
        try:
            return self.events.get(timeout=timeout_ms / 1000)
        except queue.Empty:
            raise self._err(self.NVML_ERROR_TIMEOUT) from None

    def nvmlEventSetFree(self, event_set: object) -> None:  # noqa: N802
        return None
