"""Xid and NVSwitch SXid events: what NVIDIA's catalog says each one means for recovery.

The table ships as ``detectors/data/xid_catalog.csv``, derived row by row from NVIDIA's
Xid catalog by ``detectors/tools/build_xid_table.py`` (its docstring states the rules,
the named overrides and their reasons; ``docs/xid-conformance.md`` puts fleetmedic's
action beside the catalog's immediate action for every code).  It is loaded once, at
import.

Each row carries an **action**: ``isolate`` (with a ``remedy``: reset the GPU, reboot,
service), ``restart_app``, ``app_unless_repeated``, ``record``, ``escalate``, or one
decided by the event's own text: ``by_subcode`` (NVLink5, Xid 144-150, against the
catalog's decode sheet in ``detectors/data/xid_nvlink5.csv``) and ``by_recovery_action``
(Xid 154, the action the driver prints).  :func:`resolve` turns a code and its text
into the action taken; the detector reports it in each finding's evidence, and the
node track (``pipeline.correlate.policy``) applies the rules over time: repeats of an
application-side code on one GPU across jobs, any code five times on one GPU in a day.

Text parsing here is only of the event's own detail (the part of the driver's line
after the code); finding the line in a kernel log is the collector's job.
"""

from __future__ import annotations

import csv
import io
import numbers
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from importlib import resources
from types import MappingProxyType

import numpy as np

from .base import SEVERITIES, Detector, FaultClass, Finding, as_array, check_same_shape

__all__ = ["ACTIONS", "XID_TABLE", "Nvlink5", "Resolution", "XidDetector", "XidInfo", "lookup", "parse_nvlink5",
           "recovery_action", "resolve", "resolve_sxid", "sxid_findings"]

ACTIONS = ("isolate", "restart_app", "app_unless_repeated", "record", "escalate", "by_subcode",
           "by_recovery_action")


@dataclass(frozen=True, slots=True)
class XidInfo:
    """One row of the Xid table; ``basis`` names the rule or override behind it."""

    xid: int
    mnemonic: str
    action: str
    remedy: str
    degrade: bool
    fault_class: str
    severity: str
    nvidia_immediate_action: str
    nvidia_investigatory_action: str
    description: str
    basis: str = ""

    @property
    def hardware(self) -> bool:
        """Whether the code alone takes the node out of service."""
        return self.action == "isolate"


def _data(name: str) -> str:
    return resources.files(__package__).joinpath("data").joinpath(name).read_text("utf-8")


def _load_table() -> Mapping[int, XidInfo]:
    table: dict[int, XidInfo] = {}
    for row in csv.DictReader(io.StringIO(_data("xid_catalog.csv"))):
        info = XidInfo(
            xid=int(row["xid"]), mnemonic=row["mnemonic"], action=row["action"], remedy=row["remedy"],
            degrade={"true": True, "false": False}[row["degrade"]],
            fault_class=FaultClass(row["fault_class"]).value, severity=row["severity"],
            nvidia_immediate_action=row["nvidia_immediate_action"],
            nvidia_investigatory_action=row["nvidia_investigatory_action"],
            description=row["description"], basis=row.get("basis", ""),
        )
        if info.severity not in SEVERITIES:
            raise ValueError(f"xid_catalog.csv: bad severity {info.severity!r} for xid {info.xid}")
        if info.action not in ACTIONS:
            raise ValueError(f"xid_catalog.csv: bad action {info.action!r} for xid {info.xid}")
        table[info.xid] = info
    return MappingProxyType(table)


#: Xid code -> :class:`XidInfo` (read-only).
XID_TABLE: Mapping[int, XidInfo] = _load_table()


def lookup(code: int) -> XidInfo:
    """The table row for ``code``; a code not in the catalog is escalated to a person."""
    code = int(code)
    info = XID_TABLE.get(code)
    if info is not None:
        return info
    return XidInfo(
        xid=code, mnemonic="UNKNOWN", action="escalate", remedy="", degrade=False,
        fault_class=FaultClass.unknown.value, severity="warning", nvidia_immediate_action="",
        nvidia_investigatory_action="", description="not in the Xid catalog",
        basis="a code the catalog does not list: a person decides",
    )


# ------------------------------------------------------------------ the event's own text

@dataclass(frozen=True, slots=True)
class Resolution:
    """What fleetmedic does with one event: the action, the remedy for ``isolate``, the
    finding's class and severity, and the rule that decided."""

    action: str
    remedy: str
    degrade: bool
    fault_class: str
    severity: str
    rule: str


#: Xid 154's recovery actions by value (NVML's ``nvmlDeviceGpuRecoveryAction_t``) ...
RECOVERY_BY_VALUE = {0: "none", 1: "reset_gpu", 2: "reboot", 3: "drain_p2p", 4: "drain_reset",
                     5: "recover_imex", 6: "bus_reset", 7: "system_reboot"}
#: ... and by the name the driver prints (lower-case), for a line without a value
RECOVERY_BY_NAME = {"none": "none", "gpu reset required": "reset_gpu", "node reboot required": "reboot",
                    "drain p2p": "drain_p2p", "drain and reset": "drain_reset"}
_RECOVERY = re.compile(r"\bto\s+(?:(0x[0-9a-fA-F]+|\d+)\s*)?(?:\(([^)]*)\))?", re.IGNORECASE)


def recovery_action(detail: str | None) -> str | None:
    """The action an Xid 154 line says the GPU needs now: ``none``, ``reset_gpu``,
    ``reboot``, ``drain_p2p``, ``drain_reset``, ... ; ``unknown:<text>`` for a value or
    name not known here; None when the text names no action.

    The driver prints ``GPU recovery action changed from 0x0 (None) to 0x1 (GPU Reset
    Required)``.  The action after ``to`` is the new one; its value decides (the names
    differ between driver branches), the name only where no value is printed.
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
    """An NVLink5 Xid's text: ``<unit> <Fatal|Nonfatal> XC<n> i<n> Link <n> (<IntrInfo>
    <errorStatus> ...)``, as NVIDIA's catalog documents the message."""

    unit: str
    fatal: bool | None
    link: int | None
    intr_info: int | None
    error_status: int | None

    @property
    def link_down_reason(self) -> int | None:
        """Bits 25:20 of IntrInfo: a NETIR link event's reason (catalog, "Xid 144-150 Decode")."""
        return None if self.intr_info is None else (self.intr_info >> 20) & 0x3F


_NVL5 = re.compile(
    r"\b(?P<unit>[A-Z][A-Z0-9_]*)\s+(?P<sev>Fatal|Nonfatal|Non-fatal)\b(?:\s+XC\d+)?(?:\s+i\d+)?"
    r"(?:\s+Link\s+(?P<link>-?\d+))?\s*(?:\((?P<regs>[^)]*)\))?", re.IGNORECASE)


def parse_nvlink5(detail: str | None) -> Nvlink5 | None:
    """The unit, severity, link and registers of an NVLink5 Xid's text; None if absent."""
    m = _NVL5.search(detail or "")
    if not m:
        return None
    regs = [int(x, 16) for x in re.findall(r"0x[0-9a-fA-F]+", m.group("regs") or "")]
    link = int(m.group("link")) if m.group("link") else None
    return Nvlink5(unit=m.group("unit").upper(), fatal=m.group("sev").lower() == "fatal",
                   link=link if link is None or link >= 0 else None,
                   intr_info=regs[0] if regs else None, error_status=regs[1] if len(regs) > 1 else None)


def _load_nvlink5() -> list[tuple[int, str, int | None, int | None, str]]:
    rows = []
    for r in csv.DictReader(io.StringIO(_data("xid_nvlink5.csv"))):
        status = None if r["error_status"] in ("", "*") else int(r["error_status"], 16)
        reason = None if r["link_down_reason"] in ("", "*") else int(r["link_down_reason"])
        rows.append((int(r["xid"]), r["unit"], status, reason, r["action"]))
    return rows


#: (xid, unit or "*", errorStatus or None for any, link-down reason or None for any, action)
NVLINK5_RULES = _load_nvlink5()


def _nvlink5(code: int, detail: str | None) -> Resolution:
    ev = parse_nvlink5(detail)
    if ev is None:
        return Resolution("escalate", "", False, "nvlink", "warning",
                          "nvlink5: no unit or registers in the event (NVML reports the code alone)")
    for xid, unit, status, reason, action in NVLINK5_RULES:
        if xid != code or unit not in ("*", ev.unit):
            continue
        if status is not None and ev.error_status != status:
            continue
        if reason is not None and ev.link_down_reason != reason:
            continue
        rule = f"nvlink5 decode: {code} {ev.unit} status={ev.error_status!r} reason={ev.link_down_reason!r}"
        if action == "reset_gpu":
            return Resolution("isolate", "reset_gpu", False, "nvlink", "critical", rule + " -> RESET_GPU")
        if action == "xid154_eval":
            return Resolution("record", "", False, "nvlink", "info", rule + " -> the Xid 154 that follows decides")
        return Resolution("record", "", False, "nvlink", "info", rule + " -> IGNORE")
    if ev.fatal:
        return Resolution("isolate", "reset_gpu", False, "nvlink", "critical",
                          f"nvlink5: {code} {ev.unit} not in the decode sheet; the driver says Fatal")
    return Resolution("record", "", False, "nvlink", "info",
                      f"nvlink5: {code} {ev.unit} not in the decode sheet; the driver says Nonfatal")


def _xid154(detail: str | None) -> Resolution:
    action = recovery_action(detail)
    if action is None or action.startswith("unknown"):
        return Resolution("escalate", "", False, "gpu_hardware", "warning",
                          f"xid 154: recovery action {action or 'not printed'}: a person decides")
    if action == "none":
        return Resolution("record", "", False, "gpu_hardware", "info", "xid 154: recovery action None")
    remedy = {"system_reboot": "reboot", "drain_reset": "reset_gpu"}.get(action, action)
    return Resolution("isolate", remedy, False, "gpu_hardware", "critical", f"xid 154: recovery action {action}")


def resolve(code: int, detail: str | None = None) -> Resolution:
    """What fleetmedic does with Xid ``code``, whose driver text (after the code) is
    ``detail`` when a kernel log supplied it."""
    info = lookup(code)
    if info.action == "by_subcode":
        return _nvlink5(info.xid, detail)
    if info.action == "by_recovery_action":
        return _xid154(detail)
    return Resolution(info.action, info.remedy, info.degrade, info.fault_class, info.severity, info.basis)


# Dense per-code arrays for vectorised lookups; index len(...)-1 is "unknown".
_MAX_CODE = max(XID_TABLE)
_ROWS = [lookup(c) for c in range(_MAX_CODE + 1)] + [lookup(-1)]
_SEVERITY_RANK = np.array([SEVERITIES.index(r.severity) + 1 for r in _ROWS], dtype=np.float64)
_BY_TEXT = np.array([r.action in ("by_subcode", "by_recovery_action") for r in _ROWS], dtype=bool)


def _row_index(codes: np.ndarray) -> np.ndarray:
    """Index into the dense arrays; codes outside the table map to the unknown row."""
    inside = (codes >= 0) & (codes <= _MAX_CODE)
    return np.where(inside, codes, _MAX_CODE + 1).astype(np.intp)


class XidDetector(Detector):
    """Classify a batch of Xid events with the catalog table.

    Parameters
    ----------
    ignore:
        Xid codes to drop (site policy, e.g. codes a fleet knows to be noise).

    Score
    -----
    ``score(codes)`` -> ``(k,)`` float: the finding severity rank of each event as the
    table gives it, 1 info, 2 warning, 3 critical; 0 for ignored codes.  Codes decided
    by their text (144-150, 154) rank by what :func:`resolve` makes of the text in
    :meth:`detect`.  There is no warm-up.

    Findings
    --------
    One per event that is not ignored: kind ``"xid"``, the resolution's class and
    severity, and in the evidence the action, remedy, degrade flag and rule.
    """

    def __init__(self, ignore: Iterable[int] = ()) -> None:
        try:
            items = tuple(ignore) if not isinstance(ignore, (str, bytes)) else None
        except TypeError:
            items = None
        if items is None or any(
            isinstance(c, bool) or not isinstance(c, numbers.Integral) or c < 0 for c in items
        ):
            raise ValueError(
                f"ignore must be an iterable of non-negative Xid codes, got {ignore!r}"
            )
        codes = tuple(sorted({int(c) for c in items}))
        self.ignore = codes

    def _codes(self, codes: np.ndarray) -> np.ndarray:
        return as_array("codes", codes, 1, "(k,)", "i").astype(np.int64, copy=False)

    def _kept(self, codes: np.ndarray) -> np.ndarray:
        if not self.ignore:
            return np.ones(codes.shape, dtype=bool)
        return ~np.isin(codes, np.asarray(self.ignore, dtype=np.int64))

    def score(self, codes: np.ndarray) -> np.ndarray:
        """Severity rank per event from the table (``(k,)`` int codes -> ``(k,)`` float64)."""
        codes = self._codes(codes)
        return np.where(self._kept(codes), _SEVERITY_RANK[_row_index(codes)], 0.0)

    def detect(self, codes: np.ndarray, rows: np.ndarray, gpus: np.ndarray,
               details: Sequence[str | None] | None = None,
               counts: Sequence[int | None] | None = None) -> list[Finding]:
        """Findings for a batch of Xid events.

        Parameters
        ----------
        codes: ``(k,)`` int, Xid codes.
        rows: ``(k,)`` int >= 0, node-sample row each event belongs to.
        gpus: ``(k,)`` int, GPU index within the node; negative for an event
            not tied to one GPU (reported as ``gpu=None``).
        details: ``k`` strings or None: the driver's text after the code, when a
            kernel log supplied it (it decides 144-150 and 154).
        counts: ``k`` ints or None: occurrences an event stands for (a windowed count),
            reported as ``evidence["count"]`` when above 1.
        """
        codes = self._codes(codes)
        rows = as_array("rows", rows, 1, "(k,)", "i")
        gpus = as_array("gpus", gpus, 1, "(k,)", "i")
        check_same_shape(("codes", "rows", "gpus"), (codes, rows, gpus))
        if details is not None and len(details) != len(codes):
            raise ValueError(f"details must have one entry per code, got {len(details)} for {len(codes)}")
        if rows.size and rows.min() < 0:
            raise ValueError(f"rows must be >= 0, got {int(rows.min())}")
        kept = self._kept(codes)
        findings = []
        for i in np.flatnonzero(kept):
            code = int(codes[i])
            detail = details[int(i)] if details is not None else None
            info = lookup(code)
            res = resolve(code, detail)
            evidence = {
                "xid": code, "mnemonic": info.mnemonic, "action": res.action, "remedy": res.remedy,
                "degrade": res.degrade, "hardware": res.action == "isolate", "rule": res.rule,
                "nvidia_immediate_action": info.nvidia_immediate_action,
                "nvidia_investigatory_action": info.nvidia_investigatory_action,
            }
            if detail:
                evidence["detail"] = detail[:300]
            count = counts[int(i)] if counts is not None else None
            if count is not None and count > 1:
                evidence["count"] = int(count)
            findings.append(Finding(
                kind="xid", fault_class=res.fault_class, severity=res.severity,
                score=float(SEVERITIES.index(res.severity) + 1), index=int(rows[i]),
                gpu=int(gpus[i]) if gpus[i] >= 0 else None, evidence=evidence,
            ))
        return findings


# ------------------------------------------------------------------------ NVSwitch SXid

#: SXids the Fabric Manager guide calls always fatal to the whole fabric (restart the host)
SXID_ALWAYS_FATAL = frozenset({12020, 22003, 22011, *range(23001, 23018)})
#: fatal SXids (Fabric Manager guide, "NVSwitch SXid Errors"): reset / restart the node's partition
SXID_FATAL = frozenset({
    11001, 11009, 11013, 11018, 11019, 11020, 12001, 12002, 12022, 12024, 12025, 12026, 12027, 12030, 12031,
    12032, 14017, 15001, 15006, 15009, 15010, 15012, 15013, 19047, 19048, 19054, 19056, 19058, 19060, 19061,
    19063, 19064, 19066, 19067, 19069, 19070, 20034, 22012, 24004, 24005, 24006, 24007, 10003,
})
#: non-fatal SXids of the same guide
SXID_NON_FATAL = frozenset({
    11004, 11012, 11021, 11022, 11023, 12021, 12023, 15008, 15011, 19049, 19055, 19057, 19059, 19062, 19065,
    19068, 19071, 24001, 24002, 24003, 20001, 12028, 19084, 22013, 20012, 10001, 10002, 10004, 10005, 20009,
})
_COMPANION = re.compile(r"^\s*(?:Severity \d+ Engine instance|Data \{)", re.IGNORECASE)


def resolve_sxid(code: int, fatal: bool | None, detail: str | None) -> Resolution | None:
    """What fleetmedic does with an NVSwitch SXid; None for the companion lines that follow
    one event ("Severity ... Engine instance ...", "Data {...}").

    The severity word the driver prints decides; without one, the Fabric Manager guide's
    lists do; an SXid in neither is escalated to a person.
    """
    if fatal is None and _COMPANION.match(detail or ""):
        return None
    if code in SXID_ALWAYS_FATAL:
        return Resolution("isolate", "reboot", False, "nvlink", "critical",
                          f"sxid {code}: always fatal to the fabric (Fabric Manager guide): restart the host")
    if fatal or (fatal is None and code in SXID_FATAL):
        return Resolution("isolate", "reset_gpu", False, "nvlink", "critical",
                          f"sxid {code}: fatal NVSwitch error (the driver's word or the Fabric Manager guide)")
    if fatal is False or code in SXID_NON_FATAL:
        return Resolution("record", "", True, "nvlink", "warning",
                          f"sxid {code}: non-fatal NVSwitch error; counts towards the node's degradation")
    return Resolution("escalate", "", False, "nvlink", "warning",
                      f"sxid {code}: severity not printed and not in the Fabric Manager guide: a person decides")


def sxid_findings(codes: Sequence[int], rows: Sequence[int], fatal: Sequence[bool | None],
                  details: Sequence[str | None], switches: Sequence[str | None]) -> list[Finding]:
    """Node-level findings (kind ``"sxid"``) for a batch of NVSwitch SXid events: one per
    event, none for the companion lines of an event already reported."""
    out = []
    for code, row, f, detail, switch in zip(codes, rows, fatal, details, switches, strict=True):
        res = resolve_sxid(int(code), f, detail)
        if res is None:
            continue
        out.append(Finding(
            kind="sxid", fault_class=res.fault_class, severity=res.severity,
            score=float(SEVERITIES.index(res.severity) + 1), index=int(row), gpu=None,
            evidence={"sxid": int(code), "action": res.action, "remedy": res.remedy, "degrade": res.degrade,
                      "hardware": res.action == "isolate", "rule": res.rule, "switch_pci": switch,
                      "detail": (detail or "")[:300]},
        ))
    return out
