"""The records on every fleetmedic topic.

Every record carries ``schema`` (``"<name>/<major>"``) and ``ts`` (event time, Unix
seconds).  A consumer that meets a ``schema`` it does not know sends the message to the
dead-letter topic instead of guessing.  Adding an optional field keeps the major version;
removing or retyping a field bumps it.

Telemetry is one record per node per interval with per-GPU (or per-port) arrays, so the
hot path works on arrays rather than on one message per metric.
"""

from __future__ import annotations

from enum import Enum
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, model_validator

#: Largest number of GPUs (or fabric ports) one node record may describe.
MAX_GPUS = 64
MAX_PORTS = 64
#: Largest counter value accepted; counters above it are absurd and rejected.
MAX_COUNTER = 2**62
#: Longest free text kept in a record (log tails, reasons, details).
MAX_TEXT = 8192

NodeName = Annotated[str, Field(min_length=1, max_length=253, pattern=r"^[A-Za-z0-9][A-Za-z0-9._:/-]*$")]
Counter = Annotated[int, Field(ge=0, le=MAX_COUNTER)]
Percent = Annotated[float, Field(ge=0.0, le=100.0)]


class FaultClass(str, Enum):
    """Fault classes of design.md."""

    transient_software = "transient_software"
    user_error = "user_error"
    gpu_hardware = "gpu_hardware"
    gpu_memory = "gpu_memory"
    nvlink = "nvlink"
    node_network = "node_network"
    fabric_switch = "fabric_switch"
    node_degrading = "node_degrading"
    unknown = "unknown"


#: The one place that says which classes are hardware.  A part of the node itself failed
#: (a GPU, its memory, an NVLink, the node's NIC or cable): the node is at fault now.
NODE_FAULT_CLASSES = frozenset(
    {FaultClass.gpu_hardware, FaultClass.gpu_memory, FaultClass.nvlink, FaultClass.node_network}
)
#: The node is at fault, now or soon: its own parts failed, or they are wearing out.
HARDWARE_CLASSES = NODE_FAULT_CLASSES | {FaultClass.node_degrading}
#: Hardware anywhere a job ran: a node's own parts, or a fabric switch that nodes share.
INFRASTRUCTURE_CLASSES = NODE_FAULT_CLASSES | {FaultClass.fabric_switch}


class ActionName(str, Enum):
    """Job and node actions of design.md."""

    # job actions
    retry = "retry"
    restart = "restart"
    requeue = "requeue"
    stop = "stop"
    #: ask the job to save its state now (checkpoint-now): a Kubernetes annotation, a
    #: Slurm signal; the job answers with a ``checkpoint`` record on ``telemetry.job``
    checkpoint = "checkpoint"
    # node actions
    isolate = "isolate"
    drain = "drain"
    diagnose = "diagnose"
    return_ = "return"
    escalate = "escalate"


JOB_ACTIONS = frozenset(
    {ActionName.retry, ActionName.restart, ActionName.requeue, ActionName.stop, ActionName.checkpoint}
)
NODE_ACTIONS = frozenset(
    {ActionName.isolate, ActionName.drain, ActionName.diagnose, ActionName.return_, ActionName.escalate}
)


class Outcome(str, Enum):
    applied = "applied"
    already_so = "already_so"
    dry_run = "dry_run"
    held_by_budget = "held_by_budget"
    failed = "failed"


class Severity(str, Enum):
    info = "info"
    warning = "warning"
    critical = "critical"


def _require_schema_field(schema: dict[str, Any]) -> None:
    """On the wire ``schema`` is required (it has a default only for records built in code)."""
    required = schema.setdefault("required", [])
    if "schema" in schema.get("properties", {}) and "schema" not in required:
        required.insert(0, "schema")


class Record(BaseModel):
    """Base of every record: strict numbers, no NaN or infinities, extra fields ignored."""

    model_config = ConfigDict(
        extra="ignore",
        allow_inf_nan=False,
        populate_by_name=True,
        serialize_by_alias=True,
        json_schema_extra=_require_schema_field,
    )

    ts: float = Field(ge=0.0, le=32503680000.0, description="event time, Unix seconds")

    @model_validator(mode="before")
    @classmethod
    def _wire_needs_schema(cls, data: Any, info: ValidationInfo) -> Any:
        # Records read off the wire must say which schema they follow; records built in
        # code get the current version by default.
        if info.context and info.context.get("wire") and isinstance(data, dict) and "schema" not in data:
            raise ValueError("missing field 'schema' (the record's schema version)")
        return data

    def to_json(self) -> bytes:
        return self.model_dump_json(exclude_none=True, by_alias=True).encode()

    def to_dict(self) -> dict[str, Any]:
        """What :meth:`to_json` encodes, as plain JSON types."""
        return self.model_dump(mode="json", exclude_none=True, by_alias=True)


# --------------------------------------------------------------------------- telemetry


PciBusId = Annotated[str, Field(pattern=r"^[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}$",
                                 description="PCI bus id as dddd:bb:dd, lower-case (the driver's spelling)")]


class XidEvent(BaseModel):
    """One Xid error of one GPU.  NVML reports the code alone; the kernel log adds the
    driver's text after the code (``detail``, which decides Xid 144-150 and 154), the
    process it names and the GPU's bus id."""

    model_config = ConfigDict(extra="ignore")
    gpu: int | None = Field(ge=0, lt=MAX_GPUS, description="GPU index; null when the bus id maps to no index")
    code: int = Field(ge=0, le=65535, description="NVIDIA Xid code")
    detail: str | None = Field(None, max_length=1024, description="the driver's text after the code")
    pid: int | None = Field(None, ge=0, description="process the driver names")
    process: str | None = Field(None, max_length=256, description="its name")
    pci_bus_id: PciBusId | None = None
    source: Literal["nvml", "kernel", "dcgm", "sim"] | None = Field(
        None, description="who reported it: NVML's event API, the kernel log, dcgm-exporter, the simulator")
    count: int | None = Field(None, ge=1, le=1_000_000,
                              description="occurrences this event stands for (dcgm-exporter's windowed Xid count)")


class SxidEvent(BaseModel):
    """One NVSwitch SXid error (node-level: the switches on the node's baseboard)."""

    model_config = ConfigDict(extra="ignore")
    code: int = Field(ge=0, le=1_000_000, description="NVSwitch SXid code")
    fatal: bool | None = Field(None, description="the driver's severity word; null when it printed none")
    link: int | None = Field(None, ge=0, le=1024)
    switch_pci_bus_id: PciBusId | None = None
    detail: str | None = Field(None, max_length=1024)


PER_GPU_FIELDS = (
    "util",
    "temp",
    "power",
    "sm_clock",
    "mem_clock",
    "mem_used",
    "throttle",
    "ecc_sbe",
    "ecc_dbe",
    "ecc_sbe_aggregate",
    "ecc_dbe_aggregate",
    "retired_pages",
    "remapped_rows",
    "remap_pending",
    "remap_failure",
    "nvlink_crc",
    "nvlink_replay",
    "nvlink_recovery",
    "pcie_replay",
    "lost",
    "pci_bus_id",
)


class GpuSample(Record):
    """One sample of all GPUs of one node (``telemetry.gpu``, key: node).

    Every per-GPU field is a list with one entry per GPU, in GPU index order; ``util``
    is always present and its length is the node's GPU count.  A field that no GPU of
    the node supports is absent (not zero); an entry is ``null`` where that GPU does not
    support the field or did not answer (a lost GPU has ``lost: true`` and ``null``
    elsewhere).  Error counters are cumulative (as NVML reports them); detectors
    difference them.
    """

    model_config = ConfigDict(**{**Record.model_config, "json_schema_extra": lambda s: _gpu_schema_extra(s)})

    schema_: Literal["gpu/1"] = Field(default="gpu/1", alias="schema")
    node: NodeName
    util: list[Percent | None] = Field(min_length=1, max_length=MAX_GPUS,
                                       description="GPU utilisation, percent (one entry per GPU)")
    temp: list[Annotated[float, Field(ge=-50.0, le=200.0)] | None] | None = Field(
        None, description="core temperature, C")
    power: list[Annotated[float, Field(ge=0.0, le=5000.0)] | None] | None = Field(None, description="power draw, W")
    sm_clock: list[Annotated[float, Field(ge=0.0, le=10000.0)] | None] | None = Field(
        None, description="SM clock, MHz")
    mem_clock: list[Annotated[float, Field(ge=0.0, le=20000.0)] | None] | None = Field(
        None, description="memory clock, MHz")
    mem_used: list[Annotated[float, Field(ge=0.0, le=10_000_000.0)] | None] | None = Field(
        None, description="frame buffer memory used, MiB")
    throttle: list[Annotated[int, Field(ge=0, le=2**32)] | None] | None = Field(
        None, description="NVML clocks-event (throttle) reason bitmask"
    )
    ecc_sbe: list[Counter | None] | None = Field(None, description="volatile single-bit ECC errors, cumulative")
    ecc_dbe: list[Counter | None] | None = Field(None, description="volatile double-bit ECC errors, cumulative")
    ecc_sbe_aggregate: list[Counter | None] | None = Field(
        None, description="single-bit ECC errors over the GPU's lifetime")
    ecc_dbe_aggregate: list[Counter | None] | None = Field(
        None, description="double-bit ECC errors over the GPU's lifetime")
    retired_pages: list[Counter | None] | None = Field(
        None, description="pages retired for ECC errors (before Ampere; later GPUs remap rows)")
    remapped_rows: list[Counter | None] | None = Field(
        None, description="rows remapped for correctable plus uncorrectable errors (Ampere and later)")
    remap_pending: list[bool | None] | None = Field(None, description="row remapping pending (reset needed)")
    remap_failure: list[bool | None] | None = Field(None, description="row remapping failed")
    nvlink_crc: list[Counter | None] | None = Field(
        None, description="NVLink CRC errors over all links, cumulative")
    nvlink_replay: list[Counter | None] | None = Field(
        None, description="NVLink replay errors over all links, cumulative")
    nvlink_recovery: list[Counter | None] | None = Field(
        None, description="NVLink recovery errors over all links, cumulative")
    pcie_replay: list[Counter | None] | None = Field(None, description="PCIe replay counter, cumulative")
    lost: list[bool | None] | None = Field(
        None, description="GPU not reachable (fallen off the bus, NVML GPU_IS_LOST)")
    # factories, not ``[]``: pydantic deep-copies a mutable default for every sample (the
    # JSON Schema still says the default is empty)
    xids: list[XidEvent] = Field(default_factory=list, json_schema_extra={"default": []},
                                 description="Xid events since the previous sample")
    sxids: list[SxidEvent] = Field(default_factory=list, json_schema_extra={"default": []},
                                   description="NVSwitch SXid events since the previous sample")
    pci_bus_id: list[PciBusId | None] | None = Field(
        None, description="each GPU's PCI bus id (maps kernel-log lines to GPU indexes)")

    @model_validator(mode="after")
    def _same_length(self) -> "GpuSample":
        n = len(self.util)
        if n == 0 or n > MAX_GPUS:
            raise ValueError(f"util: a node has 1..{MAX_GPUS} GPUs, got {n}")
        for name in PER_GPU_FIELDS:
            v = getattr(self, name)
            if v is not None and len(v) != n:
                raise ValueError(f"{name}: expected {n} entries (one per GPU), got {len(v)}")
        for x in self.xids:
            if x.gpu is not None and x.gpu >= n:
                raise ValueError(f"xids: gpu index {x.gpu} out of range for {n} GPUs")
        return self

    @property
    def gpu_count(self) -> int:
        return len(self.util)


#: The record's port counter fields, in the order detectors stack them.
PORT_COUNTERS = ("symbol_errors", "link_error_recovery", "link_downed", "rcv_errors", "xmit_discards",
                 "xmit_wait", "xmit_bytes", "rcv_bytes")
PortCounterName = Literal["symbol_errors", "link_error_recovery", "link_downed", "rcv_errors", "xmit_discards",
                          "xmit_wait", "xmit_bytes", "rcv_bytes"]


class PortSample(BaseModel):
    """One fabric port.  A counter is ``null`` where the port does not report it (the HCA
    has no performance-management agent, ``N/A (no PMA)``; the file is missing) and where
    it stopped at its maximum (named in ``saturated``): unknown, never 0."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)
    port: str = Field(min_length=1, max_length=64)
    switch: str = Field(min_length=1, max_length=253, description="id of the switch this port is cabled to")
    state: Literal["up", "down"]
    symbol_errors: Counter | None
    link_error_recovery: Counter | None = 0
    link_downed: Counter | None
    rcv_errors: Counter | None
    xmit_discards: Counter | None
    xmit_wait: Counter | None
    xmit_bytes: Counter | None
    rcv_bytes: Counter | None
    # a factory, not ``[]``: pydantic deep-copies a mutable default for every port
    saturated: list[PortCounterName] = Field(
        default_factory=list, json_schema_extra={"default": []}, max_length=len(PORT_COUNTERS),
        description="counters that stopped at the maximum of their width (InfiniBand counters do not wrap): "
                    "reported null, never used in a rate")
    rate_gbps: float | None = Field(None, ge=0.0, le=100000.0, description="link rate the port trained to, Gb/s")
    width: int | None = Field(None, ge=1, le=64, description="lanes the port trained to (the 4 of '4X')")
    speed: str | None = Field(None, max_length=16, description="lane speed name the port trained to (EDR, HDR, NDR)")
    phys_state: str | None = Field(None, max_length=64, description="physical state, e.g. LinkUp, Polling, Disabled")
    link_layer: Literal["InfiniBand", "Ethernet"] | None = Field(None, description="InfiniBand, or Ethernet (RoCE)")
    hca: str | None = Field(None, max_length=64, description="adapter model (sysfs hca_type, e.g. MT4129)")
    hw: dict[Annotated[str, Field(max_length=64)], Counter] | None = Field(
        None, max_length=128, description="driver hardware counters (RoCE: hw_counters), cumulative"
    )


def _gpu_schema_extra(schema: dict[str, Any]) -> None:
    """What :meth:`GpuSample._same_length` checks, in JSON Schema: one branch per GPU count
    ``n``, where every per-GPU array has ``n`` entries and every Xid's ``gpu`` is below ``n``."""
    _require_schema_field(schema)
    schema["anyOf"] = [
        {"properties": {**{f: {"minItems": n, "maxItems": n} for f in PER_GPU_FIELDS},
                        "xids": {"items": {"properties": {"gpu": {"maximum": n - 1}}}}}}
        for n in range(1, MAX_GPUS + 1)
    ]
    schema["$comment"] = ("every per-GPU array has as many entries as util (one per GPU), and an Xid's gpu is an "
                          "index into them: anyOf has one branch per GPU count")


def _network_schema_extra(schema: dict[str, Any]) -> None:
    """What :meth:`NetworkSample._v1_counters_known` checks: no null counter in network/1."""
    _require_schema_field(schema)
    schema["if"] = {"properties": {"schema": {"const": "network/1"}}, "required": ["schema"]}
    schema["then"] = {"properties": {"ports": {"items": {"properties": {c: {"type": "integer"}
                                                                         for c in PORT_COUNTERS}}}}}


class NetworkSample(Record):
    """One sample of all fabric ports of one node (``telemetry.network``, key: node).

    Counters are cumulative, as the InfiniBand/Ethernet port counters report them.
    ``network/2`` lets a counter be ``null`` (unknown) and adds the link's trained rate,
    width and states; a ``network/1`` record (every counter an integer) is still read.
    """

    model_config = ConfigDict(**{**Record.model_config, "json_schema_extra": lambda s: _network_schema_extra(s)})

    schema_: Literal["network/2", "network/1"] = Field(default="network/2", alias="schema")
    node: NodeName
    ports: list[PortSample] = Field(min_length=1, max_length=MAX_PORTS)

    @model_validator(mode="after")
    def _v1_counters_known(self) -> NetworkSample:
        if self.schema_ == "network/1":
            for q in self.ports:
                if missing := [c for c in PORT_COUNTERS if getattr(q, c) is None]:
                    raise ValueError(f"network/1 has no unknown counters ({q.port}: {', '.join(missing)} null); "
                                     "send network/2")
        return self


class JobEventKind(str, Enum):
    started = "started"
    progress = "progress"
    checkpoint = "checkpoint"
    #: fleetmedic asked the job to save its state by ``checkpoint_deadline`` (checkpoint-now)
    checkpoint_requested = "checkpoint_requested"
    failed = "failed"
    completed = "completed"


class JobEvent(Record):
    """A job lifecycle event (``telemetry.job``, key: job id)."""

    schema_: Literal["job/1"] = Field(default="job/1", alias="schema")
    job: str = Field(min_length=1, max_length=253)
    event: JobEventKind
    scheduler: str = Field("sim", max_length=64, description="kubernetes, slurm or sim")
    nodes: list[NodeName] = Field([], max_length=100000, json_schema_extra={"uniqueItems": True},
                                  description="the job's nodes, each once")
    attempt: int = Field(1, ge=1, le=100000)
    step: int | None = Field(None, ge=0, le=MAX_COUNTER)
    step_time: float | None = Field(None, ge=0.0, le=86400.0, description="seconds per step, job-wide")
    node_step_times: dict[str, Annotated[float, Field(ge=0.0, le=86400.0)]] | None = Field(
        None, description="seconds per step per node, for peer comparison"
    )
    node_power: dict[str, Annotated[float, Field(ge=0.0, le=100000.0)]] | None = Field(
        None, description="mean GPU power per node, W, for peer comparison"
    )
    checkpoint_step: int | None = Field(None, ge=0, le=MAX_COUNTER)
    checkpoint_deadline: float | None = Field(
        None, ge=0.0, le=32503680000.0,
        description="checkpoint_requested: Unix seconds by which the job should have saved its state; after it "
                    "fleetmedic moves the job from its last checkpoint",
    )
    exit_code: int | None = Field(None, ge=-255, le=255)
    reason: str | None = Field(None, max_length=MAX_TEXT)
    log_tail: str | None = Field(None, max_length=MAX_TEXT)
    exclude: list[NodeName] = Field([], description="nodes this attempt must avoid")
    origin_node: NodeName | None = Field(
        None, description="failed: the node whose worker failed first, when the scheduler tells (torchrun's root "
                          "cause host, the job's first pod to fail, Slurm's first failed task)"
    )
    diagnostics_for: NodeName | None = Field(
        None, description="set on diagnostics jobs: the node under test (its outcome returns or fails the node)"
    )

    @model_validator(mode="after")
    def _nodes_once(self) -> JobEvent:
        # a node listed twice is no job's placement; each listing would become a notice
        if len(set(self.nodes)) != len(self.nodes):
            raise ValueError("nodes: a node is listed more than once")
        return self


# --------------------------------------------------------------------------- decisions


class Window(BaseModel):
    start: float
    end: float


class Anomaly(Record):
    """A detector finding (``anomalies``, key: subject)."""

    schema_: Literal["anomaly/1"] = Field(default="anomaly/1", alias="schema")
    id: str
    detector: str
    subject_type: Literal["gpu", "node", "port", "switch", "job"]
    subject: str
    node: str | None = None
    gpu: int | None = Field(None, ge=0, lt=MAX_GPUS, description="GPU index on the node, where the subject is a GPU")
    kind: str
    fault_class: FaultClass
    score: float
    severity: Severity
    evidence: dict[str, Any] = Field({})
    window: Window | None = None


class PlannedAction(BaseModel):
    action: ActionName
    target: str
    params: dict[str, Any] = Field({})


class Verdict(Record):
    """A fault verdict (``verdicts``, key: subject).

    ``incident`` links verdicts that come from one failure: a hardware fault during a job
    yields a job verdict (requeue elsewhere) and a node verdict (isolate, diagnose) with
    the same incident.
    """

    schema_: Literal["verdict/1"] = Field(default="verdict/1", alias="schema")
    id: str
    incident: str
    scope: Literal["job", "node", "switch"]
    subject: str
    fault_class: FaultClass
    confidence: float = Field(ge=0.0, le=1.0)
    evidence: dict[str, Any] = Field({})
    actions: list[PlannedAction]
    job: str | None = None
    nodes: list[str] = Field([])


class ActionRecord(Record):
    """What an actuator did (``actions``, key: target)."""

    schema_: Literal["action/1"] = Field(default="action/1", alias="schema")
    key: str = Field(description="idempotency key: verdict id + action + target")
    verdict_id: str
    action: ActionName
    target: str
    backend: str
    outcome: Outcome
    detail: str = ""
    attempts: int = Field(1, ge=1, le=1_000_000, description="tries it took (1: the first)")


class DeadLetter(Record):
    """Undecodable or invalid input with the reason (``deadletter``)."""

    schema_: Literal["deadletter/1"] = Field(default="deadletter/1", alias="schema")
    source_topic: str
    partition: int | None = Field(None, ge=0, le=2**31 - 1)
    offset: int | None = Field(None, ge=0, le=2**63 - 1)
    key: str | None = None
    reason: str
    payload: str = Field(description="the offending payload, truncated, as text")


# --------------------------------------------------------------------------- internal


class NodeNotice(Record):
    """Internal: what the job track tells a node's owner (key: node)."""

    schema_: Literal["node-notice/1"] = Field(default="node-notice/1", alias="schema")
    node: str
    kind: Literal["placed", "released", "job_failed", "diag_started", "diag_passed", "diag_failed",
                  "network_fault", "fabric_switch", "operator_return", "operator_hold", "hardware_failure",
                  "job_moved"]
    job: str
    attempt: int = 1
    reason: str | None = None
    signature: str | None = None
    #: job_failed: how many nodes the failed job ran on (its blame is shared among them)
    job_nodes: int | None = Field(None, ge=1)
    #: job_failed: the failure began on this node (the job's ``origin_node``)
    origin: bool = False
    #: hardware_failure: the class the job's own output names (an Xid line, an uncorrectable
    #: ECC error, a GPU off the bus) and the triage rule behind it
    fault_class: FaultClass | None = None
    evidence: dict[str, Any] = Field({})


class JobNotice(Record):
    """Internal: what a node's owner tells the job track (key: job)."""

    schema_: Literal["job-notice/1"] = Field(default="job-notice/1", alias="schema")
    job: str
    node: str
    kind: Literal["node_fault", "node_degrading", "fabric", "tick", "xid"]
    fault_class: FaultClass
    incident: str
    anomalies: list[str] = Field([])
    evidence: dict[str, Any] = Field({})


class SwitchNotice(Record):
    """Internal: a fabric-port anomaly of a node, sent to the owner of its switch (key: switch).

    The switch track decides whether anomalies under one switch are the switch's
    (several nodes at once) or one node's (alone for a hold period).
    """

    schema_: Literal["switch-notice/1"] = Field(default="switch-notice/1", alias="schema")
    switch: str
    node: str
    kind: Literal["port_anomaly", "tick"]
    port: str | None = None
    anomaly: str | None = None
    anomaly_kind: str | None = None
    evidence: dict[str, Any] = Field({})


class ActionStep(Record):
    """Internal: one try of an action that the worker's action runner made (topic
    ``internal.actions``, the verdict's partition): ``retry`` with the work as it now
    stands, ``done`` with its action record, or ``wake`` (load the work kept in the
    table, after a start or a rebalance)."""

    schema_: Literal["action-step/1"] = Field(default="action-step/1", alias="schema")
    kind: Literal["retry", "done", "wake"]
    key: str = ""
    work: dict[str, Any] | None = None
    record: ActionRecord | None = None


class ControlRecord(Record):
    """An operator decision that must outlive every worker (topic ``control``, compacted;
    key: ``key``). The latest record of a key is the decision in force; a key whose
    message has no value (a tombstone) is no longer in force.

    Keys: ``dry_run`` (``value``: ``{"enabled": bool}``) and ``held/<idempotency key>``
    (``value``: ``{"action": <the held isolate action record>}``, an isolation the breaker
    held back, until an operator approves or rejects it).
    """

    schema_: Literal["control/1"] = Field(default="control/1", alias="schema")
    key: str = Field(pattern=r"^(dry_run|held/[A-Za-z0-9._:@/-]{1,512})$")
    value: dict[str, Any]
    #: who decided (the token's subject; "fleetmedic" for the worker's own records)
    who: str = Field(min_length=1, max_length=256)
    reason: str = Field("", max_length=2048)


#: Every public record, by the short name used for its JSON Schema file.
PUBLIC_RECORDS: dict[str, type[Record]] = {
    "gpu": GpuSample,
    "network": NetworkSample,
    "job": JobEvent,
    "anomaly": Anomaly,
    "verdict": Verdict,
    "action": ActionRecord,
    "deadletter": DeadLetter,
    "control": ControlRecord,
}
