"""What NVIDIA's kernel drivers print about GPU and NVSwitch errors, parsed.

The GPU driver reports an Xid error as one kernel-log line::

    NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, name=python3, GPU has fallen off the bus.

older drivers without ``pid``/``name`` (``NVRM: Xid (PCI:0000:3b:00): 79, GPU has fallen
off the bus.``), some without the ``PCI:`` tag, newer ones with ``pid='<unknown>',
name=<unknown>`` for errors no process caused.  The NVSwitch driver reports an SXid as::

    nvidia-nvswitch3: SXid (PCI:0000:c5:00.0): 24007, Fatal, Link 29 sourcetrack TCEN0 crumbstore ECC DBE Error

Both may carry any prefix (a dmesg timestamp, a syslog header, journald's nothing), so
the parsers search the line rather than anchor it.  Nothing here does I/O; the kernel-log
collector (:mod:`pipeline.collect.kernel`) and the job-failure triage
(:mod:`pipeline.triage`) call these functions on text that drivers printed.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["KernelXid", "Nvlink5", "Sxid", "normalize_pci", "parse_nvlink5", "parse_sxid", "parse_xid", "recovery_action"]

_PCI = r"(?:PCI:)?(?P<pci>(?:[0-9a-fA-F]{4,8}:)?[0-9a-fA-F]{2}:[0-9a-fA-F]{2}(?:\.[0-7])?)"
#: a MIG instance after the bus id: ``(PCI:0000:01:00 GPU-I:05)``
_MIG = r"(?:\s+GPU-I:(?P<mig>\d+))?"
_XID = re.compile(
    r"NVRM: Xid \(" + _PCI + _MIG + r"\):\s*(?P<code>\d{1,5})\b,?\s*"
    r"(?:pid=(?P<pid>'?<unknown>'?|\d+),?\s*)?"
    r"(?:name=(?P<name>'?<unknown>'?|[^,]*?),\s*)?"
    r"(?P<detail>.*)$"
)
_SXID = re.compile(
    r"(?:(?P<dev>nvidia-nvswitch\d+):\s*)?SXid \(" + _PCI + r"\):\s*(?P<code>\d{1,6})\b,?\s*"
    r"(?:(?P<sev>Non-fatal|Fatal)\b,?\s*)?(?P<detail>.*)$",
    re.IGNORECASE,
)
_LINK = re.compile(r"\blink\s+(\d+)\b", re.IGNORECASE)


def normalize_pci(bus_id: str) -> str | None:
    """A PCI bus id in one spelling: ``dddd:bb:dd`` lower-case with a 4-digit domain, the
    function dropped (GPUs are function 0).

    The driver prints ``0000:3b:00`` or ``3b:00``; NVML's ``pciInfo.busId`` is
    ``00000000:3B:00.0``; all three give ``0000:3b:00``.  None when it is not a bus id.
    """
    m = re.fullmatch(r"\s*(?:PCI:)?(?:([0-9a-fA-F]{1,8}):)?([0-9a-fA-F]{1,2}):([0-9a-fA-F]{1,2})(?:\.[0-7])?\s*",
                     bus_id or "")
    if not m:
        return None
    domain = int(m.group(1) or "0", 16)
    if domain > 0xFFFF:
        return None
    return f"{domain:04x}:{int(m.group(2), 16):02x}:{int(m.group(3), 16):02x}"


@dataclass(frozen=True, slots=True)
class KernelXid:
    """One ``NVRM: Xid`` line: the code, the GPU's bus id, and what the driver said."""

    code: int
    pci_bus_id: str
    detail: str
    pid: int | None = None
    process: str | None = None


@dataclass(frozen=True, slots=True)
class Sxid:
    """One NVSwitch ``SXid`` line: the switch's bus id, the code, fatal or not, the link."""

    code: int
    pci_bus_id: str
    fatal: bool | None
    detail: str
    device: str | None = None
    link: int | None = None


def _unknown(value: str | None) -> bool:
    return value is None or value.strip("'\" ") in ("", "<unknown>")


def parse_xid(line: str) -> KernelXid | None:
    """The Xid on ``line``, or None when the line is not an Xid report."""
    if "Xid" not in line:
        return None
    m = _XID.search(line)
    if not m:
        return None
    pci = normalize_pci(m.group("pci"))
    if pci is None:
        return None
    pid = m.group("pid")
    name = m.group("name")
    return KernelXid(
        code=int(m.group("code")),
        pci_bus_id=pci,
        detail=m.group("detail").strip(),
        pid=None if _unknown(pid) else int(pid),
        process=None if _unknown(name) else name.strip(),
    )


def parse_sxid(line: str) -> Sxid | None:
    """The SXid on ``line``, or None when the line is not an NVSwitch SXid report."""
    if "SXid" not in line and "sxid" not in line.lower():
        return None
    m = _SXID.search(line)
    if not m:
        return None
    pci = normalize_pci(m.group("pci"))
    if pci is None:
        return None
    sev = m.group("sev")
    detail = m.group("detail").strip()
    link = _LINK.search(detail)
    return Sxid(
        code=int(m.group("code")),
        pci_bus_id=pci,
        fatal=None if sev is None else sev.lower() == "fatal",
        detail=detail,
        device=m.group("dev"),
        link=int(link.group(1)) if link else None,
    )


# --------------------------------------------------------------- codes read from the detail

#: Xid 154's recovery actions by value (NVML's ``nvmlDeviceGpuRecoveryAction_t``) ...
RECOVERY_BY_VALUE = {0: "none", 1: "reset_gpu", 2: "reboot", 3: "drain_p2p", 4: "drain_reset",
                     5: "recover_imex", 6: "bus_reset", 7: "system_reboot"}
#: ... and by the name the driver prints (lower-case), for a line without a value
RECOVERY_BY_NAME = {"none": "none", "gpu reset required": "reset_gpu", "node reboot required": "reboot",
                    "drain p2p": "drain_p2p", "drain and reset": "drain_reset"}
_RECOVERY = re.compile(r"\bto\s+(?:(0x[0-9a-fA-F]+|\d+)\s*)?(?:\(([^)]*)\))?", re.IGNORECASE)


def recovery_action(detail: str) -> str | None:
    """The action an Xid 154 line says the GPU needs now, or None when the line names
    none that is known.

    The driver prints ``GPU recovery action changed from 0x0 (None) to 0x1 (GPU Reset
    Required)``.  The new action is the one after ``to``; its value decides (names have
    changed between driver branches), the name only where no value is printed.  An
    unknown value or name gives ``unknown:<text>``, for a person to read.
    """
    m = None
    for m in _RECOVERY.finditer(detail or ""):
        pass  # the last "to ..." is the new action
    if m is None or not (m.group(1) or m.group(2)):
        return None
    if m.group(1):
        value = int(m.group(1), 0)
        return RECOVERY_BY_VALUE.get(value, f"unknown:{m.group(1)} {m.group(2) or ''}".strip())
    name = m.group(2).strip().lower()
    return RECOVERY_BY_NAME.get(name, f"unknown:{m.group(2).strip()}")


@dataclass(frozen=True, slots=True)
class Nvlink5:
    """The fields of an NVLink5 Xid (144-150): ``<unit> <Fatal|Nonfatal> XC<n> i<n> Link <n>
    (<IntrInfo> <errorStatus> ...)``, as NVIDIA's catalog documents the message."""

    unit: str
    fatal: bool | None
    link: int | None
    intr_info: int | None
    error_status: int | None

    @property
    def link_down_reason(self) -> int | None:
        """Bits 25:20 of IntrInfo: the reason of a NETIR link event (catalog, Xid 144-150 Decode)."""
        return None if self.intr_info is None else (self.intr_info >> 20) & 0x3F


_NVL5 = re.compile(
    r"\b(?P<unit>[A-Z][A-Z0-9_]*)\s+(?P<sev>Fatal|Nonfatal|Non-fatal)\b(?:\s+XC\d+)?(?:\s+i\d+)?"
    r"(?:\s+Link\s+(?P<link>-?\d+))?\s*(?:\((?P<regs>[^)]*)\))?", re.IGNORECASE)


def parse_nvlink5(detail: str) -> Nvlink5 | None:
    """The unit, severity, link and registers of an NVLink5 Xid's text; None if absent."""
    m = _NVL5.search(detail or "")
    if not m:
        return None
    regs = [int(x, 16) for x in re.findall(r"0x[0-9a-fA-F]+", m.group("regs") or "")]
    link = int(m.group("link")) if m.group("link") else None
    return Nvlink5(unit=m.group("unit").upper(), fatal=m.group("sev").lower() == "fatal",
                   link=link if link is None or link >= 0 else None,
                   intr_info=regs[0] if regs else None, error_status=regs[1] if len(regs) > 1 else None)
