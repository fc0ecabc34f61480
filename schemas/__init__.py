"""fleetmedic's wire contract: the records on every topic and their JSON Schemas."""

from .codec import DecodeError, decode, dead_letter, encode
from .records import (
    HARDWARE_CLASSES,
    INFRASTRUCTURE_CLASSES,
    NODE_FAULT_CLASSES,
    JOB_ACTIONS,
    NODE_ACTIONS,
    ActionName,
    ActionRecord,
    ActionStep,
    Anomaly,
    ControlRecord,
    DeadLetter,
    FaultClass,
    GpuSample,
    JobEvent,
    JobEventKind,
    JobNotice,
    NetworkSample,
    NodeNotice,
    Outcome,
    PlannedAction,
    PortSample,
    Record,
    Severity,
    SwitchNotice,
    Verdict,
    Window,
    XidEvent,
)

__all__ = [
    "HARDWARE_CLASSES", "INFRASTRUCTURE_CLASSES", "NODE_FAULT_CLASSES", "JOB_ACTIONS", "NODE_ACTIONS", "ActionName", "ActionRecord", "ActionStep", "Anomaly",
    "ControlRecord", "DeadLetter", "DecodeError", "FaultClass", "GpuSample", "JobEvent", "JobEventKind", "JobNotice",
    "NetworkSample", "NodeNotice", "Outcome", "PlannedAction", "PortSample", "Record", "Severity",
    "SwitchNotice", "Verdict", "Window", "XidEvent", "decode", "dead_letter", "encode",
]
