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
(:mod:`pipeline.correlate.triage`) call these functions on text that drivers printed.  What an
Xid's own text means (154's recovery action, 144-150's unit and registers) is the Xid
table's concern: :mod:`detectors.xid`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["KernelXid", "Sxid", "normalize_pci", "parse_sxid", "parse_xid"]

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
