"""Xid events: what NVIDIA's catalog says each code means for recovery.

The table ships as ``detectors/data/xid_catalog.csv``, derived from NVIDIA's
Xid catalog by ``detectors/tools/build_xid_table.py`` (its docstring states
the rules and the named overrides). It is loaded once, at import.

``hardware`` marks codes whose NVIDIA guidance points at the GPU or board
(reset, reboot, uncorrectable memory error, NVLink workflow). Application-side
codes such as 13 (graphics engine exception) and 31 (MMU fault) are
``user_error`` and not hardware: NVIDIA notes that a code repeating on the
same GPU suggests hardware while a code spread over GPUs or seen once suggests
the application, and judging repetition over time is the correlator's job.
"""

from __future__ import annotations

import csv
import io
import numbers
from dataclasses import dataclass
from importlib import resources
from types import MappingProxyType
from typing import Iterable, Mapping

import numpy as np

from .base import SEVERITIES, Detector, FaultClass, Finding, as_array, check_same_shape

__all__ = ["XID_TABLE", "XidDetector", "XidInfo", "lookup"]


@dataclass(frozen=True, slots=True)
class XidInfo:
    """One row of the Xid table.

    ``basis`` names the derivation rule or override that classified the row.
    """

    xid: int
    mnemonic: str
    fault_class: str
    severity: str
    hardware: bool
    nvidia_immediate_action: str
    nvidia_investigatory_action: str
    description: str
    basis: str = ""


def _load_table() -> Mapping[int, XidInfo]:
    path = resources.files(__package__).joinpath("data").joinpath("xid_catalog.csv")
    text = path.read_text("utf-8")
    table: dict[int, XidInfo] = {}
    for row in csv.DictReader(io.StringIO(text)):
        info = XidInfo(
            xid=int(row["xid"]),
            mnemonic=row["mnemonic"],
            fault_class=FaultClass(row["fault_class"]).value,
            severity=row["severity"],
            hardware={"true": True, "false": False}[row["hardware"]],
            nvidia_immediate_action=row["nvidia_immediate_action"],
            nvidia_investigatory_action=row["nvidia_investigatory_action"],
            description=row["description"],
            basis=row.get("basis", ""),
        )
        if info.severity not in SEVERITIES:
            raise ValueError(f"xid_catalog.csv: bad severity {info.severity!r} for xid {info.xid}")
        table[info.xid] = info
    return MappingProxyType(table)


#: Xid code -> :class:`XidInfo` (read-only).
XID_TABLE: Mapping[int, XidInfo] = _load_table()


def lookup(code: int) -> XidInfo:
    """The table row for ``code``; an unknown code gets class ``unknown``, not hardware."""
    code = int(code)
    info = XID_TABLE.get(code)
    if info is not None:
        return info
    return XidInfo(
        xid=code,
        mnemonic="UNKNOWN",
        fault_class=FaultClass.UNKNOWN.value,
        severity="warning",
        hardware=False,
        nvidia_immediate_action="",
        nvidia_investigatory_action="",
        description="not in the Xid catalog",
        basis="unknown code",
    )


# Dense per-code arrays for vectorised lookups; index len(...)-1 is "unknown".
_MAX_CODE = max(XID_TABLE)
_ROWS = [lookup(c) for c in range(_MAX_CODE + 1)] + [lookup(-1)]
_HARDWARE = np.array([r.hardware for r in _ROWS], dtype=bool)
_SEVERITY_RANK = np.array(
    [SEVERITIES.index("critical" if r.hardware else r.severity) + 1 for r in _ROWS],
    dtype=np.float64,
)


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
    ``score(codes)`` -> ``(k,)`` float: the finding severity rank of each event,
    1 info, 2 warning, 3 critical; 0 for ignored codes. Hardware codes rank
    3 (critical); others take the table's severity (warning, or info for
    informational codes such as SMBPBI test messages). There is no warm-up.

    Findings
    --------
    One per event that is not ignored: kind ``"xid"``, the table's fault class;
    severity critical for hardware codes, else the table's severity.
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
        """Severity rank per event.

        Parameters
        ----------
        codes: ``(k,)`` int, Xid codes.

        Returns
        -------
        ``(k,)`` float64 (see the class docstring).
        """
        codes = self._codes(codes)
        return np.where(self._kept(codes), _SEVERITY_RANK[_row_index(codes)], 0.0)

    def detect(self, codes: np.ndarray, rows: np.ndarray, gpus: np.ndarray) -> list[Finding]:
        """Findings for a batch of Xid events.

        Parameters
        ----------
        codes: ``(k,)`` int, Xid codes.
        rows: ``(k,)`` int >= 0, node-sample row each event belongs to.
        gpus: ``(k,)`` int, GPU index within the node; negative for an event
            not tied to one GPU (reported as ``gpu=None``).
        """
        codes = self._codes(codes)
        rows = as_array("rows", rows, 1, "(k,)", "i")
        gpus = as_array("gpus", gpus, 1, "(k,)", "i")
        check_same_shape(("codes", "rows", "gpus"), (codes, rows, gpus))
        if rows.size and rows.min() < 0:
            raise ValueError(f"rows must be >= 0, got {int(rows.min())}")
        scores = self.score(codes)
        findings = []
        for i in np.flatnonzero(scores > 0):
            info = lookup(codes[i])
            findings.append(
                Finding(
                    kind="xid",
                    fault_class=info.fault_class,
                    severity=SEVERITIES[int(scores[i]) - 1],
                    score=float(scores[i]),
                    index=int(rows[i]),
                    gpu=int(gpus[i]) if gpus[i] >= 0 else None,
                    evidence={
                        "xid": int(codes[i]),
                        "mnemonic": info.mnemonic,
                        "hardware": info.hardware,
                        "nvidia_immediate_action": info.nvidia_immediate_action,
                        "nvidia_investigatory_action": info.nvidia_investigatory_action,
                    },
                )
            )
        return findings
