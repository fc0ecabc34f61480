"""NVML collector: one ``telemetry.gpu`` record per node per interval, Xids as they happen.

Reads every field of :class:`schemas.GpuSample` that NVML offers, per GPU:

========================  ==================================================================
record field              NVML call
========================  ==================================================================
util                      ``nvmlDeviceGetUtilizationRates().gpu``
mem_used                  ``nvmlDeviceGetMemoryInfo().used`` (MiB)
temp                      ``nvmlDeviceGetTemperature(NVML_TEMPERATURE_GPU)``
power                     ``nvmlDeviceGetPowerUsage()`` (mW -> W)
sm_clock, mem_clock       ``nvmlDeviceGetClockInfo(NVML_CLOCK_SM / NVML_CLOCK_MEM)``
throttle                  ``nvmlDeviceGetCurrentClocksEventReasons()`` (older drivers:
                          ``...ClocksThrottleReasons``)
ecc_sbe, ecc_dbe          ``nvmlDeviceGetTotalEccErrors(corrected / uncorrected, volatile)``
ecc_*_aggregate           the same, ``NVML_AGGREGATE_ECC``
retired_pages             ``nvmlDeviceGetRetiredPages()`` for both causes (before Ampere)
remapped_rows,            ``nvmlDeviceGetRemappedRows()`` (Ampere and later)
remap_pending/failure
nvlink_crc/replay/        ``nvmlDeviceGetNvLinkErrorCounter()`` summed over active links
recovery
pcie_replay               ``nvmlDeviceGetPcieReplayCounter()``
lost                      any call failing with ``NVML_ERROR_GPU_IS_LOST``
pci_bus_id                ``nvmlDeviceGetPciInfo()`` (``domain``, ``bus``, ``device``), read once
                          at start: it maps the kernel log's ``NVRM: Xid (PCI:...)`` to an index
========================  ==================================================================

A field that a GPU does not support (``NVML_ERROR_NOT_SUPPORTED``, ``NO_PERMISSION``,
a missing function in an old library) is ``None`` for that GPU, and the field is left
out of the record when no GPU supports it: absent, never zero.  A GPU that is lost is
reported with ``lost: true`` and ``None`` elsewhere; the collector keeps running and
keeps reporting it.

Xid errors come from an NVML event set (``nvmlEventTypeXidCriticalError``) waited on
by a thread, not from polling: each is queued with its GPU and time, goes into the
next record, and wakes the agent so that a record carrying it is sent at once.

The ``nvml`` argument is the ``pynvml`` module (``nvidia-ml-py``) or any object with
the same functions and constants (tests use a fake NVML).
"""

from __future__ import annotations

import logging
import threading
import time
import warnings
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

_MIB = 1024 * 1024


def load_nvml() -> Any:
    """The real ``pynvml`` module (imported lazily: nodes without NVIDIA drivers never load it)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        import pynvml
    return pynvml


class GpuLost(Exception):
    """NVML says the GPU is lost (fallen off the bus)."""


class _Unsupported(Exception):
    """The GPU or driver does not offer the field."""


class NvmlCollector:
    """Samples every GPU of this node through NVML.

    ``open()`` initialises NVML and starts the Xid event thread; ``sample()`` returns one
    record as a wire dict; ``close()`` stops the thread and shuts NVML down.
    """

    def __init__(self, nvml: Any, node: str, *, clock: Callable[[], float] = time.time,
                 on_xid: Callable[[], None] | None = None, event_timeout_ms: int = 500,
                 sink: Callable[[dict[str, Any]], None] | None = None) -> None:
        self.nvml = nvml
        #: where Xid events go (the agent's merger of NVML and kernel-log events); without
        #: one they wait in this collector for the next sample
        self.sink = sink
        self.node = node
        self.clock = clock
        self.on_xid = on_xid
        self.event_timeout_ms = event_timeout_ms
        self.handles: list[Any] = []
        self.lost: set[int] = set()
        self._xids: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._event_set: Any = None
        self.unsupported: dict[str, set[int]] = {}
        #: each GPU's PCI bus id (``dddd:bb:dd``), None where NVML did not say
        self.bus_ids: list[str | None] = []

    # ------------------------------------------------------------------ lifecycle

    def open(self) -> NvmlCollector:
        n = self.nvml
        n.nvmlInit()
        count = n.nvmlDeviceGetCount()
        self.handles = [n.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
        self.bus_ids = [self._bus_id(i, h) for i, h in enumerate(self.handles)]
        log.info("NVML: %d GPUs on %s (driver %s)", count, self.node, self._driver())
        self._start_events()
        return self

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(2 * self.event_timeout_ms / 1000 + 1)
        if self._event_set is not None:
            try:
                self.nvml.nvmlEventSetFree(self._event_set)
            except Exception:  # shutting down: nothing to do about it
                pass
        try:
            self.nvml.nvmlShutdown()
        except Exception:
            pass

    def _bus_id(self, i: int, h: Any) -> str | None:
        from detectors.nvrm import normalize_pci

        try:
            info = self.nvml.nvmlDeviceGetPciInfo(h)
        except Exception as exc:
            log.warning("GPU %d: no PCI info (%s): its kernel-log Xids cannot be mapped to it", i, exc)
            return None
        domain, bus, device = (getattr(info, k, None) for k in ("domain", "bus", "device"))
        if isinstance(bus, int) and isinstance(device, int) and isinstance(domain, int) and (bus or device):
            return f"{domain & 0xFFFF:04x}:{bus:02x}:{device:02x}"
        raw = getattr(info, "busId", "") or getattr(info, "busIdLegacy", "")
        return normalize_pci(raw.decode() if isinstance(raw, bytes) else str(raw))

    def gpu_of_bus(self, bus_id: str) -> int | None:
        """The index of the GPU at PCI ``bus_id`` (any spelling), or None."""
        from detectors.nvrm import normalize_pci

        want = normalize_pci(bus_id)
        return next((i for i, b in enumerate(self.bus_ids) if b is not None and b == want), None)

    def _driver(self) -> str:
        try:
            v = self.nvml.nvmlSystemGetDriverVersion()
            return v.decode() if isinstance(v, bytes) else str(v)
        except Exception:
            return "unknown"

    # ------------------------------------------------------------------ Xid events

    def _start_events(self) -> None:
        n = self.nvml
        try:
            self._event_set = n.nvmlEventSetCreate()
        except Exception as exc:
            log.warning("NVML event sets unavailable (%s): Xid errors will not be reported", exc)
            return
        registered = 0
        for i, h in enumerate(self.handles):
            try:
                n.nvmlDeviceRegisterEvents(h, n.nvmlEventTypeXidCriticalError, self._event_set)
                registered += 1
            except Exception as exc:
                log.warning("GPU %d: Xid events not available (%s)", i, exc)
        if registered:
            self._thread = threading.Thread(target=self._wait_events, name="nvml-xid", daemon=True)
            self._thread.start()

    def _gpu_index(self, handle: Any) -> int | None:
        for i, h in enumerate(self.handles):
            if h == handle:
                return i
        try:
            return int(self.nvml.nvmlDeviceGetIndex(handle))
        except Exception:
            return None

    def _wait_events(self) -> None:
        n = self.nvml
        while not self._stop.is_set():
            try:
                data = n.nvmlEventSetWait_v2(self._event_set, self.event_timeout_ms)
            except Exception as exc:
                if getattr(exc, "value", None) == getattr(n, "NVML_ERROR_TIMEOUT", 10):
                    continue
                if getattr(exc, "value", None) == getattr(n, "NVML_ERROR_GPU_IS_LOST", 15):
                    # the driver reports a lost GPU on the event set too; sample() marks it
                    self._stop.wait(self.event_timeout_ms / 1000)
                    continue
                log.warning("NVML event wait failed (%s); retrying", exc)
                self._stop.wait(1.0)
                continue
            if data.eventType & n.nvmlEventTypeXidCriticalError:
                gpu = self._gpu_index(data.device)
                code = int(data.eventData)
                if gpu is None or not 0 <= code <= 65535:
                    log.warning("Xid event with unknown GPU or code (%r, %r)", gpu, code)
                    continue
                log.warning("Xid %d on GPU %d of %s", code, gpu, self.node)
                ev = {"gpu": gpu, "code": code, "source": "nvml",
                      **({"pci_bus_id": self.bus_ids[gpu]} if gpu < len(self.bus_ids) and self.bus_ids[gpu] else {})}
                if self.sink is not None:
                    self.sink(ev)
                else:
                    with self._lock:
                        self._xids.append(ev)
                if self.on_xid is not None:
                    self.on_xid()

    def pending_xids(self) -> int:
        with self._lock:
            return len(self._xids)

    # ------------------------------------------------------------------ sampling

    def _call(self, gpu: int, field: str, fn: Callable[[], Any]) -> Any:
        n = self.nvml
        try:
            return fn()
        except AttributeError:  # an older library without the function
            raise _Unsupported(field) from None
        except Exception as exc:
            value = getattr(exc, "value", None)
            if value == getattr(n, "NVML_ERROR_GPU_IS_LOST", 15):
                raise GpuLost(gpu) from None
            if value in (getattr(n, "NVML_ERROR_NOT_SUPPORTED", 3), getattr(n, "NVML_ERROR_NO_PERMISSION", 4),
                         getattr(n, "NVML_ERROR_FUNCTION_NOT_FOUND", 13)):
                raise _Unsupported(field) from None
            # anything else (a transient driver error): unknown this time, logged once
            if gpu not in self.unsupported.setdefault(f"error:{field}", set()):
                self.unsupported[f"error:{field}"].add(gpu)
                log.warning("GPU %d: %s failed (%s); reported as unknown", gpu, field, exc)
            raise _Unsupported(field) from None

    def _gpu(self, i: int, h: Any) -> dict[str, Any]:
        """Every field of GPU ``i``; raises :class:`GpuLost`."""
        n = self.nvml
        out: dict[str, Any] = {}

        def read(field: str, fn: Callable[[], Any]) -> None:
            try:
                out[field] = fn()
            except _Unsupported:
                self.unsupported.setdefault(field, set()).add(i)

        def call(field: str, fn: Callable[[], Any]) -> Any:
            return self._call(i, field, fn)

        read("util", lambda: float(call("util", lambda: n.nvmlDeviceGetUtilizationRates(h)).gpu))
        read("mem_used", lambda: call("mem_used", lambda: n.nvmlDeviceGetMemoryInfo(h)).used / _MIB)
        read("temp", lambda: float(call("temp", lambda: n.nvmlDeviceGetTemperature(h, n.NVML_TEMPERATURE_GPU))))
        read("power", lambda: call("power", lambda: n.nvmlDeviceGetPowerUsage(h)) / 1000.0)
        read("sm_clock", lambda: float(call("sm_clock", lambda: n.nvmlDeviceGetClockInfo(h, n.NVML_CLOCK_SM))))
        read("mem_clock", lambda: float(call("mem_clock", lambda: n.nvmlDeviceGetClockInfo(h, n.NVML_CLOCK_MEM))))
        read("throttle", lambda: int(self._throttle(i, h)))
        for field, kind, counter in (
            ("ecc_sbe", n.NVML_MEMORY_ERROR_TYPE_CORRECTED, n.NVML_VOLATILE_ECC),
            ("ecc_dbe", n.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, n.NVML_VOLATILE_ECC),
            ("ecc_sbe_aggregate", n.NVML_MEMORY_ERROR_TYPE_CORRECTED, n.NVML_AGGREGATE_ECC),
            ("ecc_dbe_aggregate", n.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, n.NVML_AGGREGATE_ECC),
        ):
            read(field, lambda f=field, k=kind, c=counter: int(call(f, lambda: n.nvmlDeviceGetTotalEccErrors(h, k, c))))
        read("retired_pages", lambda: sum(
            len(call("retired_pages", lambda c=cause: n.nvmlDeviceGetRetiredPages(h, c)))
            for cause in (n.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS,
                          n.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR)))
        try:
            corr, unc, pending, failure = call("remapped_rows", lambda: n.nvmlDeviceGetRemappedRows(h))
            out.update(remapped_rows=int(corr) + int(unc), remap_pending=bool(pending), remap_failure=bool(failure))
        except _Unsupported:
            self.unsupported.setdefault("remapped_rows", set()).add(i)
        nvlink = self._nvlink(i, h)
        if nvlink is not None:
            out["nvlink_crc"], out["nvlink_replay"], out["nvlink_recovery"] = nvlink
        read("pcie_replay", lambda: int(call("pcie_replay", lambda: n.nvmlDeviceGetPcieReplayCounter(h))))
        out["lost"] = False
        return out

    def _throttle(self, i: int, h: Any) -> int:
        n = self.nvml
        fn = getattr(n, "nvmlDeviceGetCurrentClocksEventReasons", None)
        if fn is not None:
            try:
                return self._call(i, "throttle", lambda: fn(h))
            except _Unsupported:
                pass
        return self._call(i, "throttle", lambda: n.nvmlDeviceGetCurrentClocksThrottleReasons(h))

    def _nvlink(self, i: int, h: Any) -> tuple[int | None, int | None, int | None] | None:
        """CRC, replay and recovery errors summed over the active links; None without NVLink,
        and each None where no active link gives that counter (NOT_SUPPORTED: Blackwell
        drivers report NVLink errors through field values instead)."""
        n = self.nvml
        sums = [0, 0, 0]
        given = [False, False, False]
        active = 0
        for link in range(getattr(n, "NVML_NVLINK_MAX_LINKS", 18)):
            try:
                state = n.nvmlDeviceGetNvLinkState(h, link)
            except AttributeError:
                return None
            except Exception as exc:
                value = getattr(exc, "value", None)
                if value == getattr(n, "NVML_ERROR_GPU_IS_LOST", 15):
                    raise GpuLost(i) from None
                break  # past the GPU's last link (INVALID_ARGUMENT), or no NVLink (NOT_SUPPORTED)
            if state != getattr(n, "NVML_FEATURE_ENABLED", 1):
                continue
            active += 1
            for k, (field, counter) in enumerate((("nvlink_crc", n.NVML_NVLINK_ERROR_DL_CRC_FLIT),
                                                  ("nvlink_replay", n.NVML_NVLINK_ERROR_DL_REPLAY),
                                                  ("nvlink_recovery", n.NVML_NVLINK_ERROR_DL_RECOVERY))):
                try:
                    sums[k] += int(self._call(i, field, lambda lk=link, c=counter:
                                              n.nvmlDeviceGetNvLinkErrorCounter(h, lk, c)))
                    given[k] = True
                except _Unsupported:
                    self.unsupported.setdefault(field, set()).add(i)
        if not active:
            return None
        crc, replay, recovery = (v if ok else None for v, ok in zip(sums, given, strict=True))
        return crc, replay, recovery

    def sample(self, xids: list[dict[str, Any]] | None = None,
               sxids: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        """One ``telemetry.gpu`` record (wire dict) for every GPU of the node, and the
        Xids seen since the previous sample (``xids`` and ``sxids`` when the agent merges
        them from several sources)."""
        from schemas.records import PER_GPU_FIELDS

        per_gpu: list[dict[str, Any]] = []
        for i, h in enumerate(self.handles):
            try:
                values = self._gpu(i, h)
                if i in self.lost:
                    log.warning("GPU %d of %s answers again", i, self.node)
                    self.lost.discard(i)
            except GpuLost:
                if i not in self.lost:
                    log.error("GPU %d of %s is lost (fallen off the bus)", i, self.node)
                self.lost.add(i)
                values = {"lost": True}
            if i < len(self.bus_ids):
                values["pci_bus_id"] = self.bus_ids[i]
            per_gpu.append(values)
        if xids is None:
            with self._lock:
                xids, self._xids = self._xids, []
        rec: dict[str, Any] = {"schema": "gpu/1", "ts": self.clock(), "node": self.node,
                               "util": [v.get("util") for v in per_gpu]}
        for field in PER_GPU_FIELDS:
            if field == "util":
                continue
            values = [v.get(field) for v in per_gpu]
            if any(x is not None for x in values):
                rec[field] = values
        rec["xids"] = xids
        if sxids:
            rec["sxids"] = sxids
        return rec
