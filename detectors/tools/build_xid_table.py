"""Derive ``detectors/data/xid_catalog.csv`` from NVIDIA's Xid catalog.

Usage::

    python -m detectors.tools.build_xid_table /path/to/nvidia-xid-catalog.csv \
        [--out detectors/data/xid_catalog.csv]

The input is NVIDIA's catalog (columns ``xid, mnemonic, description,
immediate_action, investigatory_action``). The output has one row per Xid with
the columns in :data:`OUT_COLUMNS`; ``basis`` names the rule or override that
produced the row, so every classification can be audited.

Meaning of the output columns
-----------------------------
``fault_class``
    One of the design's fault classes (see ``detectors.base.FaultClass``).
``hardware``
    True when NVIDIA's guidance points at the GPU or board: the GPU must be
    reset or the machine rebooted (``RESET_GPU``, ``RESTART_BM``), a
    per-Xid hardware workflow applies (DBE, NVLink), or the event reports an
    uncorrectable memory error. Such an Xid takes the node out of service.
``severity``
    ``critical`` for hardware rows, ``info`` for named informational codes,
    ``warning`` otherwise.

Rules, applied in order (first match wins)
-------------------------------------------
0. ``OVERRIDES``: named codes whose row text alone does not say enough; each
   carries its reason.
1. ``retired``: description ``Unused``. NVIDIA no longer emits these; if one
   shows up it is ``unknown`` and not hardware.
2. ``memory``: mnemonic mentions ECC/DBE/SBE/DRAM/SRAM/RESOURCE_RETIREMENT/MEMORY
   (channel retirement, Xid 160/161, is a software context event) or the
   description says "memory error"/"memory remapping" -> ``gpu_memory``.
   Hardware unless NVIDIA's immediate action is ``IGNORE`` or missing (a
   successful row remap, a high but corrected SBE rate: degradation signals).
3. ``link``: mnemonic mentions NVLINK/C2C/ALI_TRAINING -> ``nvlink``. Hardware
   when the immediate action resets the GPU, reboots, contacts support or is an
   NVLink workflow; an ``IGNORE``d or action-less link event (privilege
   error, confidential-computing configuration) is not.
4. ``board``: immediate action ``RESTART_BM``, ``RESET_GPU`` or
   ``CHECK_MECHANICALS`` -> ``gpu_hardware``, hardware (fallen off the bus, GSP
   errors and timeouts, micro-controller halts, init failures).
5. ``application``: immediate ``RESTART_APP`` with investigatory
   ``CHECK_APP/CUDA`` or a per-Xid workflow (Xid 13, 31: repeated on one GPU
   suggests hardware, spread over GPUs or once suggests the application) ->
   ``user_error``, not hardware. Repetition is for the correlator to judge.
6. ``software``: any other immediate action that restarts or ignores
   (``RESTART_APP``, ``IGNORE``, ``RESTART_VM``, ``UPDATE_SWFW``,
   ``CHECK_UVM``, ``WORKFLOW_XID_45``) or no action -> ``transient_software``.
7. ``fallback``: anything else -> ``unknown``.
"""

from __future__ import annotations

import argparse
import csv
import re
import sys
from pathlib import Path

OUT_COLUMNS = (
    "xid",
    "mnemonic",
    "fault_class",
    "severity",
    "hardware",
    "nvidia_immediate_action",
    "nvidia_investigatory_action",
    "description",
    "basis",
)

#: Named exceptions to the rules: xid -> (fault_class, hardware, severity, reason).
OVERRIDES: dict[int, tuple[str, bool, str, str]] = {
    93: ("node_degrading", False, "warning",
         "InfoROM wear limit exceeded: board wear, non-fatal; plan service"),
    106: ("transient_software", False, "info", "SMBPBI test message, not a fault"),
    107: ("transient_software", False, "info", "SMBPBI test message, not a fault"),
    142: ("transient_software", False, "warning",
          "video encoder engine error; the other NVENC/NVDEC/NVJPG rows say RESTART_APP"),
    154: ("unknown", False, "info",
          "informational: reports a changed recovery action for another Xid"),
    157: ("gpu_memory", True, "critical",
          "retirement failure leaves a bad resource in service, as Xid 64 "
          "(RESET_GPU, CONTACT_SUPPORT)"),
    162: ("node_degrading", False, "info", "power-smoothing circuitry re-engaged"),
    163: ("node_degrading", False, "warning",
          "power-smoothing circuitry disengaged; GPU keeps working, plan service"),
    164: ("node_degrading", False, "warning",
          "power-smoothing circuitry near end of life; plan service"),
    165: ("node_degrading", False, "warning",
          "power-smoothing circuitry lifetime exhausted; GPU keeps working, plan service"),
    167: ("gpu_hardware", True, "critical",
          "fatal PCIe timeout: GPU unreachable over PCIe, as Xid 79"),
    168: ("gpu_memory", True, "critical",
          "errors in the write-protected memory region reduce usable GPU memory"),
    169: ("gpu_hardware", True, "critical",
          "internal micro-controller halt, same text as Xid 62 (RESET_GPU)"),
    171: ("gpu_memory", True, "critical",
          "detail record of an uncorrectable DRAM error accompanying Xid 48"),
    172: ("gpu_memory", True, "critical",
          "detail record of an uncorrectable SRAM error accompanying Xid 48"),
}

_MEMORY_MNEMONIC = re.compile(r"ECC|DBE|SBE|DRAM|SRAM|RESOURCE_RETIREMENT|MEMORY")
_MEMORY_TEXT = re.compile(r"memory error|memory remapping", re.IGNORECASE)
_LINK_MNEMONIC = re.compile(r"NVLINK|C2C|ALI_TRAINING")
_BOARD_ACTIONS = frozenset({"RESTART_BM", "RESET_GPU", "CHECK_MECHANICALS"})
_LINK_HW_ACTIONS = frozenset({"RESTART_BM", "RESET_GPU", "CONTACT_SUPPORT"})
_SOFTWARE_ACTIONS = frozenset(
    {"", "RESTART_APP", "IGNORE", "RESTART_VM", "UPDATE_SWFW", "CHECK_UVM", "WORKFLOW_XID_45"}
)


def classify(
    xid: int, mnemonic: str, description: str, immediate: str, investigatory: str
) -> tuple[str, bool, str, str]:
    """Return ``(fault_class, hardware, severity, basis)`` for one catalog row."""
    if xid in OVERRIDES:
        fault_class, hardware, severity, reason = OVERRIDES[xid]
        return fault_class, hardware, severity, f"override: {reason}"

    def result(fault_class: str, hardware: bool, basis: str) -> tuple[str, bool, str, str]:
        return fault_class, hardware, "critical" if hardware else "warning", basis

    if description.strip().lower() == "unused":
        return result("unknown", False, "retired")
    if _MEMORY_MNEMONIC.search(mnemonic) or _MEMORY_TEXT.search(description):
        return result("gpu_memory", immediate not in ("", "IGNORE"), "memory")
    if _LINK_MNEMONIC.search(mnemonic):
        hardware = immediate in _LINK_HW_ACTIONS or immediate.startswith("WORKFLOW_NVLINK")
        return result("nvlink", hardware, "link")
    if immediate in _BOARD_ACTIONS:
        return result("gpu_hardware", True, "board")
    if immediate == "RESTART_APP" and (
        investigatory == "CHECK_APP/CUDA" or investigatory.startswith("WORKFLOW_XID_")
    ):
        return result("user_error", False, "application")
    if immediate in _SOFTWARE_ACTIONS:
        return result("transient_software", False, "software")
    return result("unknown", False, "fallback")


def build_rows(rows: list[dict[str, str]]) -> list[dict[str, str]]:
    """Turn NVIDIA catalog rows into output rows (see :data:`OUT_COLUMNS`)."""
    out = []
    for row in rows:
        xid = int(row["xid"])
        immediate = row["immediate_action"].strip()
        investigatory = row["investigatory_action"].strip()
        mnemonic = row["mnemonic"].strip()
        description = row["description"].strip()
        fault_class, hardware, severity, basis = classify(
            xid, mnemonic, description, immediate, investigatory
        )
        out.append(
            {
                "xid": str(xid),
                "mnemonic": mnemonic,
                "fault_class": fault_class,
                "severity": severity,
                "hardware": "true" if hardware else "false",
                "nvidia_immediate_action": immediate,
                "nvidia_investigatory_action": investigatory,
                "description": description,
                "basis": basis,
            }
        )
    out.sort(key=lambda r: int(r["xid"]))
    xids = [r["xid"] for r in out]
    if len(set(xids)) != len(xids):
        raise ValueError("catalog has duplicate xid rows")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("catalog", type=Path, help="NVIDIA Xid catalog CSV")
    parser.add_argument(
        "--out",
        type=Path,
        default=Path(__file__).resolve().parents[1] / "data" / "xid_catalog.csv",
        help="output CSV (default: the packaged detectors/data/xid_catalog.csv)",
    )
    args = parser.parse_args(argv)
    with args.catalog.open(newline="", encoding="utf-8") as fh:
        rows = build_rows(list(csv.DictReader(fh)))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("w", newline="", encoding="utf-8") as fh:
        writer = csv.DictWriter(fh, fieldnames=OUT_COLUMNS, lineterminator="\n")
        writer.writeheader()
        writer.writerows(rows)
    print(f"wrote {len(rows)} rows to {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
