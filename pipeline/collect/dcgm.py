"""dcgm-exporter ingestion: Prometheus text from ``http://<host>:9400/metrics`` -> ``telemetry.gpu``.

For nodes where NVIDIA's dcgm-exporter already runs (GPU Operator, DGX images) this reads
its output instead of NVML.  The text is parsed with ``prometheus_client``'s parser; every
GPU metric line carries the labels ``gpu`` (DCGM GPU id), ``UUID``, ``pci_bus_id``,
``device``, ``modelName`` and, unless the exporter runs with ``--no-hostname``,
``Hostname``; then label-type counters (``DCGM_FI_DRIVER_VERSION``) and attributes (pod,
namespace, container; ``err_code``/``err_msg`` on the Xid gauge).  One record is built
per ``Hostname``, its GPUs ordered by the integer ``gpu`` label:

=================  =========================================================================
record field       dcgm-exporter metric
=================  =========================================================================
util               ``DCGM_FI_DEV_GPU_UTIL`` (always present: all ``None`` if not exported)
temp               ``DCGM_FI_DEV_GPU_TEMP``
power              ``DCGM_FI_DEV_POWER_USAGE`` (W)
sm_clock           ``DCGM_FI_DEV_SM_CLOCK``
mem_clock          ``DCGM_FI_DEV_MEM_CLOCK``
mem_used           ``DCGM_FI_DEV_FB_USED`` (MiB)
throttle           ``DCGM_FI_DEV_CLOCKS_EVENT_REASONS`` or ``DCGM_FI_DEV_CLOCK_THROTTLE_REASONS``
ecc_sbe, ecc_dbe   ``DCGM_FI_DEV_ECC_SBE_VOL_TOTAL``, ``DCGM_FI_DEV_ECC_DBE_VOL_TOTAL``
ecc_*_aggregate    ``DCGM_FI_DEV_ECC_SBE_AGG_TOTAL``, ``DCGM_FI_DEV_ECC_DBE_AGG_TOTAL``
retired_pages      ``DCGM_FI_DEV_RETIRED_SBE`` + ``DCGM_FI_DEV_RETIRED_DBE``
remapped_rows      ``DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS`` +
                   ``DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS``
remap_pending      ``DCGM_FI_DEV_ROW_REMAP_PENDING``
remap_failure      ``DCGM_FI_DEV_ROW_REMAP_FAILURE``
nvlink_crc         ``DCGM_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL``
nvlink_replay      ``DCGM_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL``
nvlink_recovery    ``DCGM_FI_DEV_NVLINK_RECOVERY_ERROR_COUNT_TOTAL``
pcie_replay        ``DCGM_FI_DEV_PCIE_REPLAY_COUNTER``
xids               ``DCGM_FI_DEV_XID_ERRORS`` (see below)
lost               no metric: inferred from GPUs that stop being reported (see below)
=================  =========================================================================

A field that no GPU of the host reported is absent from the record; an entry is ``None``
where that GPU did not report it or reported something unusable.  A value that is NaN,
infinite, negative, not an integer where the field is a counter, or outside the schema's
limits becomes ``None`` with a logged warning, so one bad value never invalidates the
record.  DCGM's "blank" sentinels (``9223372036854775792`` and the next three values,
``2147483632``.. for 32-bit fields, ``140737488355328.0``.. for doubles), which older
exporters print for unsupported fields, also become ``None`` (logged at debug level:
they mean "not supported", not "broken").  A summed field (``retired_pages``,
``remapped_rows``) is ``None`` for a GPU that lacks one of the parts the host reports,
so a part that comes and goes does not make the sum jump.  When several lines describe
the same GPU and metric (MIG instances, one line per pod on a shared GPU) the first
whole-GPU line wins.  Metric lines without a ``gpu`` label, NVLink and NVSwitch entity
lines, and ``DCGM_EXP_*`` metrics are ignored.

Known gaps of dcgm-exporter as a source:

* **The Xid metric is a gauge holding only the last Xid of each GPU.**  Two Xids between
  scrapes are seen as one (the later); the same Xid code occurring again is invisible
  because the value does not change.  :class:`DcgmExporterParser` reports an Xid when
  the gauge is non-zero and differs from the last value it saw for that GPU, so the
  first scrape after the parser starts reports whatever Xid the gauge still holds, even
  an old one.
* **Counters reset when the exporter's DCGM restarts** (and volatile ECC counters on a
  driver reload); detectors treat a counter that goes down as a reset.
* **No lost-GPU signal.**  A GPU that fell off the bus simply disappears from the output.
  The parser remembers each host's GPUs (by ``UUID``, by ``gpu`` label where there is no
  UUID) and, when one it has seen stops being reported, keeps it in the record in its
  old position with ``lost: true`` and ``None`` elsewhere, so the GPU count does not
  change.  It cannot see a GPU that was already gone at its first scrape, and a host
  whose GPUs all vanish produces no record at all (indistinguishable from DCGM being
  down); the scrape loop must treat a host with no output as a failure of its own.  A
  GPU removed on purpose stays reported lost until :meth:`DcgmExporterParser.forget`.
* Many of the fields above (ECC, retired pages, NVLink errors, clock-event reasons) are
  commented out of dcgm-exporter's default ``default-counters.csv``; the exporter must
  be given a counters file that enables them, or they are absent from the records.
"""

from __future__ import annotations

import logging
import math
import re
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal, get_args, get_origin

import aiohttp
from prometheus_client.parser import text_string_to_metric_families
from pydantic import TypeAdapter, ValidationError

from schemas.records import MAX_GPUS, GpuSample, NodeName, XidEvent

from detectors.nvrm import normalize_pci

log = logging.getLogger(__name__)

#: dcgm-exporter's default listen port.
DEFAULT_PORT = 9400

_XID_METRIC = "DCGM_FI_DEV_XID_ERRORS"

# DCGM's blank / not-found / not-supported / not-permissioned values for each field type.
_INT64_BLANK = 0x7FFFFFFFFFFFFFF0
_INT32_BLANK = 0x7FFFFFF0
_FP64_BLANK = 140737488355328.0
_SENTINELS = frozenset(
    [_INT64_BLANK + k for k in range(4)] + [_INT32_BLANK + k for k in range(4)] + [_FP64_BLANK + k for k in range(4)]
)


def _blank(raw: float) -> bool:
    """A DCGM blank: the sentinels, also when printed as a float (``9.223372036854776e+18``:
    the int64 blanks round to 2**63 in a double)."""
    return raw in _SENTINELS or (isinstance(raw, float) and math.isfinite(raw) and abs(raw - 2.0 ** 63) <= 2.0 ** 11)


#: dcgm-exporter 1.x metric names (its etc/1.x-compatibility-metrics.csv) -> today's
_V1_NAMES = {
    "dcgm_sm_clock": "DCGM_FI_DEV_SM_CLOCK", "dcgm_memory_clock": "DCGM_FI_DEV_MEM_CLOCK",
    "dcgm_gpu_temp": "DCGM_FI_DEV_GPU_TEMP", "dcgm_power_usage": "DCGM_FI_DEV_POWER_USAGE",
    "dcgm_pcie_replay_counter": "DCGM_FI_DEV_PCIE_REPLAY_COUNTER", "dcgm_gpu_utilization": "DCGM_FI_DEV_GPU_UTIL",
    "dcgm_xid_errors": "DCGM_FI_DEV_XID_ERRORS", "dcgm_fb_used": "DCGM_FI_DEV_FB_USED",
    "dcgm_ecc_sbe_volatile_total": "DCGM_FI_DEV_ECC_SBE_VOL_TOTAL",
    "dcgm_ecc_dbe_volatile_total": "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL",
    "dcgm_ecc_sbe_aggregate_total": "DCGM_FI_DEV_ECC_SBE_AGG_TOTAL",
    "dcgm_ecc_dbe_aggregate_total": "DCGM_FI_DEV_ECC_DBE_AGG_TOTAL",
    "dcgm_retired_pages_sbe": "DCGM_FI_DEV_RETIRED_SBE", "dcgm_retired_pages_dbe": "DCGM_FI_DEV_RETIRED_DBE",
    "dcgm_nvlink_flit_crc_error_count_total": "DCGM_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL",
    "dcgm_nvlink_replay_error_count_total": "DCGM_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL",
    "dcgm_nvlink_recovery_error_count_total": "DCGM_FI_DEV_NVLINK_RECOVERY_ERROR_COUNT_TOTAL",
}
#: the exporter's windowed counters: Xids by code, clock events by reason
_XID_COUNT = "DCGM_EXP_XID_ERRORS_COUNT"
_CLOCK_COUNT = "DCGM_EXP_CLOCK_EVENTS_COUNT"
#: DCGM_EXP_CLOCK_EVENTS_COUNT's clock_event label -> its bit in the clock-event reasons mask
#: (dcgm-exporter internal/pkg/collector/clock_events_collector.go; NVML's nvmlClocksEventReason*)
CLOCK_EVENT_BITS = {"gpu_idle": 0x1, "clocks_setting": 0x2, "power_cap": 0x4, "hw_slowdown": 0x8,
                    "sync_boost": 0x10, "sw_thermal": 0x20, "hw_thermal": 0x40, "hw_power_brake": 0x80,
                    "display_clocks": 0x100}
#: a Hostname label that is a container's id (the exporter in a container without
#: --hostname or the downward API): not a node name
_CONTAINER_ID = re.compile(r"^[0-9a-f]{12}$|^[0-9a-f]{64}$")


@dataclass(frozen=True)
class _Map:
    """How one record field is made from dcgm-exporter metrics.

    ``one``: the first of ``metrics`` (in order of preference) that the GPU reports;
    ``sum``: the sum of every one of ``metrics`` that the host reports.
    """

    field: str
    metrics: tuple[str, ...]
    kind: Literal["float", "int", "bool"]
    combine: Literal["one", "sum"] = "one"


_FIELDS: tuple[_Map, ...] = (
    _Map("util", ("DCGM_FI_DEV_GPU_UTIL",), "float"),
    _Map("temp", ("DCGM_FI_DEV_GPU_TEMP",), "float"),
    _Map("power", ("DCGM_FI_DEV_POWER_USAGE",), "float"),
    _Map("sm_clock", ("DCGM_FI_DEV_SM_CLOCK",), "float"),
    _Map("mem_clock", ("DCGM_FI_DEV_MEM_CLOCK",), "float"),
    _Map("mem_used", ("DCGM_FI_DEV_FB_USED",), "float"),
    _Map("throttle", ("DCGM_FI_DEV_CLOCKS_EVENT_REASONS", "DCGM_FI_DEV_CLOCK_THROTTLE_REASONS"), "int"),
    _Map("ecc_sbe", ("DCGM_FI_DEV_ECC_SBE_VOL_TOTAL",), "int"),
    _Map("ecc_dbe", ("DCGM_FI_DEV_ECC_DBE_VOL_TOTAL",), "int"),
    _Map("ecc_sbe_aggregate", ("DCGM_FI_DEV_ECC_SBE_AGG_TOTAL",), "int"),
    _Map("ecc_dbe_aggregate", ("DCGM_FI_DEV_ECC_DBE_AGG_TOTAL",), "int"),
    _Map("retired_pages", ("DCGM_FI_DEV_RETIRED_SBE", "DCGM_FI_DEV_RETIRED_DBE"), "int", "sum"),
    _Map(
        "remapped_rows",
        ("DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS", "DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS"),
        "int",
        "sum",
    ),
    _Map("remap_pending", ("DCGM_FI_DEV_ROW_REMAP_PENDING",), "bool"),
    _Map("remap_failure", ("DCGM_FI_DEV_ROW_REMAP_FAILURE",), "bool"),
    _Map("nvlink_crc", ("DCGM_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL",), "int"),
    _Map("nvlink_replay", ("DCGM_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL",), "int"),
    _Map("nvlink_recovery", ("DCGM_FI_DEV_NVLINK_RECOVERY_ERROR_COUNT_TOTAL",), "int"),
    _Map("pcie_replay", ("DCGM_FI_DEV_PCIE_REPLAY_COUNTER",), "int"),
)


def _item_adapter(name: str) -> TypeAdapter[Any]:
    """A validator for one entry of a per-GPU field, taken from :class:`GpuSample` itself."""
    annotation = GpuSample.model_fields[name].annotation
    if get_origin(annotation) is not list:
        annotation = next(a for a in get_args(annotation) if get_origin(a) is list)
    (item,) = get_args(annotation)
    return TypeAdapter(item)


_ADAPTERS: dict[str, TypeAdapter[Any]] = {m.field: _item_adapter(m.field) for m in _FIELDS}
_XID_CODE: TypeAdapter[int] = TypeAdapter(Annotated[int, XidEvent.model_fields["code"]])
_NODE_NAME: TypeAdapter[str] = TypeAdapter(NodeName)


class ScrapeError(RuntimeError):
    """dcgm-exporter could not be scraped (connection failed, timed out, or not HTTP 200)."""


async def scrape(url: str, *, timeout: float = 5.0) -> str:
    """GET the exporter's metrics page and return its text; :class:`ScrapeError` otherwise."""
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout)) as session:
            async with session.get(url) as resp:
                body = await resp.text(errors="replace")
                if resp.status != 200:
                    raise ScrapeError(f"GET {url}: HTTP {resp.status} {resp.reason or ''}: {body[:200].strip()}")
                return body
    except (aiohttp.ClientError, TimeoutError) as exc:
        raise ScrapeError(f"GET {url}: {type(exc).__name__}: {str(exc) or 'timed out'}") from exc


@dataclass
class _Gpu:
    """What one exporter text says about one GPU: metric name -> raw value."""

    label: int
    uuid: str | None
    values: dict[str, float] = field(default_factory=dict)
    from_instance: set[str] = field(default_factory=set)
    pci_bus_id: str | None = None
    #: DCGM_EXP_XID_ERRORS_COUNT: Xid code -> occurrences in the exporter's window
    xid_counts: dict[int, int] = field(default_factory=dict)
    #: DCGM_EXP_CLOCK_EVENTS_COUNT: the clock-event bits seen in the window
    clock_events: int = 0

    @property
    def key(self) -> str:
        return self.uuid or f"gpu{self.label}"

    def put(self, metric: str, value: float, instance: bool) -> None:
        # First line wins; a whole-GPU line replaces a MIG-instance line.
        if metric in self.values and (instance or metric not in self.from_instance):
            return
        self.values[metric] = value
        if instance:
            self.from_instance.add(metric)
        else:
            self.from_instance.discard(metric)


def _read_hosts(text: str) -> dict[str | None, dict[int, _Gpu]]:
    """Group the GPU metric lines of an exporter text by ``Hostname`` and ``gpu`` label."""
    hosts: dict[str | None, dict[int, _Gpu]] = {}
    legacy: set[str] = set()
    try:
        for family in text_string_to_metric_families(text):
            name = family.name
            v1 = _V1_NAMES.get(name) or _V1_NAMES.get(name + "_total")
            if v1 is not None:
                legacy.add(name)
            elif not name.startswith(("DCGM_FI_", _XID_COUNT, _CLOCK_COUNT)):
                continue
            for sample in family.samples:
                # The parser names counter samples "<family>_total"; anything else
                # (e.g. "_created") is not the value itself.
                if sample.name not in (name, name + "_total"):
                    continue
                _add_sample(hosts, v1 or name, sample.labels, sample.value)
    except ValueError as exc:
        raise ValueError(f"dcgm-exporter output is not valid Prometheus text format: {exc}") from exc
    if legacy:
        log.warning("dcgm-exporter 1.x metric names read as their 2.x names (%s); 1.x has no ECC, NVLink or "
                    "row-remap fields by default", ", ".join(sorted(legacy)))
    return hosts


def _add_sample(hosts: dict[str | None, dict[int, _Gpu]], name: str, labels: dict[str, str], value: float) -> None:
    gpu_label = labels.get("gpu")
    if gpu_label is None or "nvlink" in labels or "nvswitch" in labels:
        return
    try:
        index = int(gpu_label)
    except ValueError:
        index = -1
    if index < 0:
        log.warning("dcgm-exporter: ignoring %s with gpu label %r (not a GPU index)", name, gpu_label)
        return
    host = labels.get("Hostname") or labels.get("hostname") or None  # "hostname" since dcgm-exporter PR #655
    if host is not None and _CONTAINER_ID.match(host):
        host = None  # a container's id names no node
    gpus = hosts.setdefault(host, {})
    gpu = gpus.get(index)
    if gpu is None:
        gpu = gpus[index] = _Gpu(index, labels.get("UUID") or labels.get("uuid") or None)
    if gpu.pci_bus_id is None and labels.get("pci_bus_id"):
        gpu.pci_bus_id = normalize_pci(labels["pci_bus_id"])
    if name == _XID_COUNT:
        try:
            code = int(labels.get("xid", ""))
        except ValueError:
            return
        if math.isfinite(value) and value >= 0 and not _blank(value):
            gpu.xid_counts[code] = gpu.xid_counts.get(code, 0) + int(value)
        return
    if name == _CLOCK_COUNT:
        if math.isfinite(value) and value > 0 and not _blank(value):
            gpu.clock_events |= CLOCK_EVENT_BITS.get(labels.get("clock_event", ""), 0)
        return
    gpu.put(name, value, "GPU_I_ID" in labels)


def _convert(m: _Map, metric: str, raw: float, node: str, slot: int) -> Any:
    """One raw exporter value as a valid entry of ``m.field``, or ``None``."""
    if _blank(raw):
        log.debug("%s: GPU %d: %s is a DCGM blank value (not supported)", node, slot, metric)
        return None
    value: Any = raw
    problem = None
    if isinstance(raw, float) and not math.isfinite(raw):
        problem = "not a finite number"
    elif m.kind in ("int", "bool"):
        if raw != int(raw):
            problem = "not an integer"
        else:
            value = int(raw)
            if m.kind == "bool":
                value = {0: False, 1: True}.get(value)
                problem = None if value is not None else "not 0 or 1"
    else:
        value = float(raw)
    if problem is None:
        try:
            return _ADAPTERS[m.field].validate_python(value)
        except ValidationError as exc:
            problem = exc.errors(include_url=False)[0]["msg"]
    log.warning("%s: GPU %d: %s = %r is unusable for %s (%s): reported as unknown",
                node, slot, metric, raw, m.field, problem)
    return None


def _entry(m: _Map, reported: list[str], gpu: _Gpu, node: str, slot: int) -> Any:
    """The value of field ``m`` for one GPU; ``reported`` are the metrics the host reports."""
    if m.combine == "one":
        metric = next((x for x in reported if x in gpu.values), None)
        return None if metric is None else _convert(m, metric, gpu.values[metric], node, slot)
    parts = []
    for metric in reported:
        if metric not in gpu.values:
            return None
        part = _convert(m, metric, gpu.values[metric], node, slot)
        if part is None:
            return None
        parts.append(part)
    return _convert(m, "+".join(reported), sum(parts), node, slot)


def _xid(raw: float, node: str, slot: int) -> int | None:
    """The Xid code the gauge holds, or ``None`` if it holds no usable code."""
    if _blank(raw) or (isinstance(raw, float) and not math.isfinite(raw)) or raw != int(raw):
        return None
    try:
        return int(_XID_CODE.validate_python(int(raw)))
    except ValidationError:
        log.warning("%s: GPU %d: %s = %r is not an Xid code: ignored", node, slot, _XID_METRIC, raw)
        return None


def _record(node: str, ts: float, gpus: list[_Gpu | None], xids: list[dict[str, int]]) -> dict[str, Any]:
    """A GpuSample wire dict; a ``None`` GPU is a lost one."""
    rec: dict[str, Any] = {"schema": "gpu/1", "ts": ts, "node": node}
    for m in _FIELDS:
        reported = [x for x in m.metrics if any(g is not None and x in g.values for g in gpus)]
        if reported or m.field == "util":
            rec[m.field] = [None if g is None else _entry(m, reported, g, node, i) for i, g in enumerate(gpus)]
    if any(g is None for g in gpus):
        rec["lost"] = [g is None for g in gpus]
    if "throttle" not in rec and any(g is not None and g.clock_events for g in gpus):
        # no clock-event reasons gauge: the exporter's windowed clock-event counts say which ones happened
        rec["throttle"] = [None if g is None else g.clock_events for g in gpus]
    if any(g is not None and g.pci_bus_id for g in gpus):
        rec["pci_bus_id"] = [None if g is None else g.pci_bus_id for g in gpus]
    rec["xids"] = xids
    return rec


class DcgmExporterParser:
    """Turns successive dcgm-exporter texts into GpuSample wire dicts.

    Keeps, per host, the GPUs seen so far (to report a vanished GPU as lost) and the last
    Xid gauge value of each GPU (to report each new Xid once).  Use one instance per
    scrape target and feed it every scrape in order.
    """

    def __init__(self) -> None:
        self._slots: dict[str, list[str]] = {}
        self._last_xid: dict[tuple[str, str], int] = {}
        self._xid_counts: dict[tuple[str, str, int], int] = {}

    def forget(self, node: str) -> None:
        """Drop what is remembered about ``node`` (e.g. after its GPUs were changed on purpose)."""
        self._slots.pop(node, None)
        self._last_xid = {k: v for k, v in self._last_xid.items() if k[0] != node}

    def parse(self, text: str, ts: float, node: str | None = None,
              fallback_node: str | None = None) -> list[dict[str, Any]]:
        """One record per host in ``text``; ``node`` names the host instead of ``Hostname``;
        ``fallback_node`` names a host whose lines carry no host label, or a container's id
        (the agent passes its own node for an exporter on the same machine).

        Raises ``ValueError`` when the text is not Prometheus text format, when a host
        has no name (no ``Hostname`` label and no ``node``), when ``node`` is given for a
        text describing several hosts, or when a host name is not a valid node name.
        """
        hosts = _read_hosts(text)
        if node is not None and len(hosts) > 1:
            names = sorted(str(h) for h in hosts)
            raise ValueError(f"node={node!r} names one host, but the dcgm-exporter text describes {names}")
        records = []
        if None in hosts and fallback_node is not None:
            merged = hosts.pop(None)
            for index, gpu in hosts.pop(fallback_node, {}).items():
                merged.setdefault(index, gpu)
            hosts[fallback_node] = merged
        for host, gpus in hosts.items():
            name = node if node is not None else host
            if name is None:
                raise ValueError("dcgm-exporter metrics have no Hostname label (exporter run with "
                                 "--no-hostname?) and no node name was given")
            try:
                _NODE_NAME.validate_python(name)
            except ValidationError as exc:
                raise ValueError(f"{name!r} is not a valid node name") from exc
            records.append(self._host_record(name, ts, [gpus[i] for i in sorted(gpus)]))
        return records

    def _host_record(self, node: str, ts: float, current: list[_Gpu]) -> dict[str, Any]:
        keys = [g.key for g in current]
        if len(set(keys)) != len(keys):  # UUIDs unusable: fall back to the gpu labels
            keys = [f"gpu{g.label}" for g in current]
        by_key = dict(zip(keys, current, strict=True))
        slots = self._slots.get(node)
        if slots is None or not set(keys) <= set(slots):
            if slots is not None:
                log.info("%s: dcgm-exporter reports new GPUs %s; GPU list reset",
                         node, sorted(set(keys) - set(slots)))
            slots = self._slots[node] = keys
        gpus = [by_key.get(k) for k in slots]
        if len(gpus) > MAX_GPUS:
            raise ValueError(f"{node}: dcgm-exporter reports {len(gpus)} GPUs, more than {MAX_GPUS}")
        lost = [i for i, g in enumerate(gpus) if g is None]
        if lost:
            log.warning("%s: GPU(s) %s no longer reported by dcgm-exporter: reported lost",
                        node, ", ".join(f"{i} ({slots[i]})" for i in lost))
        xids = []
        for i, (key, gpu) in enumerate(zip(slots, gpus, strict=True)):
            if gpu is not None and gpu.xid_counts:
                # the exporter's per-code counts over its window: every new occurrence shows,
                # a repeated code too (the gauge below holds only the last code)
                for code, count in sorted(gpu.xid_counts.items()):
                    previous = self._xid_counts.get((node, key, code), 0)
                    self._xid_counts[(node, key, code)] = count
                    if count > previous and 0 < code <= 65535:
                        xids.append({"gpu": i, "code": code, "source": "dcgm", "count": count - previous})
                continue
            if gpu is None or _XID_METRIC not in gpu.values:
                continue
            code = _xid(gpu.values[_XID_METRIC], node, i)
            if code is None:
                continue
            previous = self._last_xid.get((node, key))
            self._last_xid[(node, key)] = code
            if code != 0 and code != previous:
                xids.append({"gpu": i, "code": code, "source": "dcgm"})
        return _record(node, ts, gpus, xids)


def parse_exporter(text: str, *, ts: float, node: str | None = None) -> list[dict[str, Any]]:
    """Stateless :meth:`DcgmExporterParser.parse`: reports any non-zero Xid gauge, no lost GPUs."""
    return DcgmExporterParser().parse(text, ts, node)
