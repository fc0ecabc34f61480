"""Derive ``detectors/data/xid_catalog.csv`` and the conformance table from NVIDIA's Xid catalog.

Usage::

    python -m detectors.tools.build_xid_table ../shared/data/nvidia-xid-catalog.csv \\
        [--out detectors/data/xid_catalog.csv] [--doc docs/xid-conformance.md]

The input is NVIDIA's catalog (columns ``xid, mnemonic, description, immediate_action,
investigatory_action``).  Each output row says what fleetmedic does when the Xid is
seen, beside what the catalog says to do at once, and why:

``action``
    What fleetmedic does with the event, following the catalog's **immediate action**
    (:data:`ACTION_OF_IMMEDIATE`):

    ``isolate``
        The GPU needs a reset, the node a reboot or a technician (``RESET_GPU``,
        ``RESTART_BM``, ``RESTART_VM``, ``CHECK_MECHANICALS``, the DBE and NVLink
        workflows): the node is cordoned and drained, its job requeued elsewhere, and
        the node diagnosed with the remedy in ``remedy``.
    ``restart_app``
        The error was contained to the application (``RESTART_APP``): the job restarts,
        the node stays in service.
    ``app_unless_repeated``
        The application's fault (NVIDIA's Xid 13 and 31 workflows): it restarts, and the
        node stays, unless the code repeats on the same GPU in two or more jobs within a
        day; then the node is isolated and diagnosed.
    ``record``
        Nothing to do at once (``IGNORE``, or an event that follows another Xid): kept in
        the node's history.
    ``escalate``
        A person must look (``CONTACT_SUPPORT``, ``UPDATE_SWFW``, ``CHECK_UVM``, and a
        code the catalog calls unused): an alert, the node stays.
    ``by_subcode``
        NVLink5 (144-150): decided by the unit and registers the driver prints, row by
        row from the catalog's "Xid 144-150 Decode" sheet (``xid_nvlink5.csv``).
    ``by_recovery_action``
        Xid 154: the recovery action the driver prints (reset, reboot, drain and reset).

    Besides the row's action, any code seen five times on one GPU within a day is
    escalated, and a code not in the table is escalated, never silenced.
``remedy``
    For ``isolate``: ``reset_gpu``, ``reboot`` or ``service`` (the diagnosis step).
``degrade``
    ``true`` when the event also counts as degradation evidence for the node (a
    contained or corrected memory error, wear): enough of them isolate it.
``fault_class``, ``severity``
    The finding's class (from the mnemonic: memory, link, board, application) and its
    severity (``critical`` for ``isolate``, ``warning`` for ``escalate`` and ``degrade``,
    else ``info``).
``basis``
    The rule that produced the row, or for an override its reason.  An override is an
    explained disagreement with the catalog's immediate action (or a row the catalog
    gives none); the conformance table lists them.
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
    "action",
    "remedy",
    "degrade",
    "fault_class",
    "severity",
    "nvidia_immediate_action",
    "nvidia_investigatory_action",
    "description",
    "basis",
)

ACTIONS = ("isolate", "restart_app", "app_unless_repeated", "record", "escalate", "by_subcode",
           "by_recovery_action")

#: the catalog's immediate action -> (fleetmedic's action, remedy)
ACTION_OF_IMMEDIATE: dict[str, tuple[str, str]] = {
    "RESET_GPU": ("isolate", "reset_gpu"),
    "RESTART_BM": ("isolate", "reboot"),
    "RESTART_VM": ("isolate", "reboot"),
    "CHECK_MECHANICALS": ("isolate", "service"),
    "WORKFLOW_XID_48": ("isolate", "reset_gpu"),
    "WORKFLOW_NVLINK_ERR": ("isolate", "reset_gpu"),
    "RESTART_APP": ("restart_app", ""),
    "IGNORE": ("record", ""),
    "WORKFLOW_XID_45": ("record", ""),
    "CONTACT_SUPPORT": ("escalate", ""),
    "UPDATE_SWFW": ("escalate", ""),
    "CHECK_UVM": ("escalate", ""),
    "WORKFLOW_NVLINK5_ERR": ("by_subcode", ""),
    "XID_154": ("by_recovery_action", ""),
}

#: Explained exceptions: xid -> (action, remedy, degrade, reason).  A row whose catalog
#: immediate action is empty has no default and must be here.
OVERRIDES: dict[int, tuple[str, str, bool, str]] = {
    43: ("app_unless_repeated", "", False,
         "GPU stopped processing a channel: NVIDIA's debug guide lists 43 with 13 and 31 as the "
         "application's fault; the catalog's IGNORE keeps the node, and a repeat on one GPU across jobs "
         "points at the GPU as for 13 and 31"),
    63: ("record", "", True,
         "a row marked for remapping (catalog: IGNORE): the node keeps working; the remap activates at "
         "the next GPU reset, and the event counts as memory wear"),
    92: ("record", "", True,
         "a high corrected (single-bit) error rate (catalog: IGNORE): the node keeps working; it counts "
         "as degradation evidence"),
    93: ("record", "", True,
         "InfoROM wear limit exceeded (catalog: IGNORE): the node keeps working; it counts as wear"),
    94: ("restart_app", "", True,
         "contained memory error (catalog: RESTART_APP): the application restarts and the node stays; "
         "the error counts as degradation evidence, so repeats isolate the node"),
    162: ("record", "", False, "power-smoothing circuitry re-engaged (no catalog action): informational"),
    163: ("record", "", True,
          "power-smoothing circuitry disengaged (no catalog action): the GPU keeps working; wear"),
    164: ("record", "", True,
          "power-smoothing circuitry near end of life (no catalog action): the GPU keeps working; wear"),
    165: ("record", "", True,
          "power-smoothing circuitry lifetime exhausted (no catalog action): the GPU keeps working; wear"),
    166: ("escalate", "", False,
          "confidential-computing traffic before the link was set up for it (no catalog action): a "
          "configuration for a person to check"),
    167: ("isolate", "reboot", False,
          "fatal PCIe timeout (no catalog action): the GPU is unreachable over PCIe, as with Xid 79 "
          "(RESTART_BM)"),
    168: ("isolate", "reboot", False,
          "errors in the write-protected region reduce usable memory (no catalog action; NVIDIA's "
          "workflow restarts the VM)"),
    169: ("isolate", "reset_gpu", False,
          "internal micro-controller halt (no catalog action): the same text as Xid 62 (RESET_GPU)"),
    170: ("escalate", "", False,
          "interrupt seen in confidential-computing mode (no catalog action): for a person to check"),
    171: ("isolate", "reset_gpu", False,
          "detail of an uncorrectable DRAM error that accompanies Xid 48 (WORKFLOW_XID_48) (no catalog "
          "action)"),
    172: ("isolate", "reset_gpu", False,
          "detail of an uncorrectable SRAM error that accompanies Xid 48 (WORKFLOW_XID_48) (no catalog "
          "action)"),
}

_MEMORY_MNEMONIC = re.compile(r"ECC|DBE|SBE|DRAM|SRAM|RESOURCE_RETIREMENT|MEMORY|CONTAINED|INFOROM")
_MEMORY_TEXT = re.compile(r"memory error|memory remapping|memory capacity|ECC", re.IGNORECASE)
_LINK_MNEMONIC = re.compile(r"NVLINK|C2C|ALI_TRAINING")
_APP_WORKFLOWS = ("WORKFLOW_XID_13", "WORKFLOW_XID_31")


def decide(xid: int, immediate: str, investigatory: str) -> tuple[str, str, bool, str]:
    """``(action, remedy, degrade, basis)`` of one catalog row."""
    if xid in OVERRIDES:
        action, remedy, degrade, reason = OVERRIDES[xid]
        return action, remedy, degrade, f"override: {reason}"
    if immediate not in ACTION_OF_IMMEDIATE:
        raise ValueError(f"xid {xid}: immediate action {immediate!r} has no rule; add an override")
    action, remedy = ACTION_OF_IMMEDIATE[immediate]
    if action == "restart_app" and investigatory in _APP_WORKFLOWS:
        return "app_unless_repeated", "", False, f"catalog: {immediate} with {investigatory}"
    return action, remedy, False, f"catalog: {immediate}"


def fault_class_of(xid: int, mnemonic: str, description: str, action: str) -> str:
    """The finding's fault class, from what the code is about."""
    if description.strip().lower() == "unused":
        return "unknown"
    if action == "by_recovery_action":
        return "gpu_hardware"
    if action == "app_unless_repeated":
        return "user_error"
    if _LINK_MNEMONIC.search(mnemonic) or action == "by_subcode":
        return "nvlink"
    if _MEMORY_MNEMONIC.search(mnemonic) or _MEMORY_TEXT.search(description):
        return "gpu_memory"
    if mnemonic.startswith("PSHC") or xid == 93:
        return "node_degrading"
    if action == "isolate":
        return "gpu_hardware"
    if action == "escalate":
        return "unknown"
    return "transient_software"


def severity_of(action: str, degrade: bool) -> str:
    if action == "isolate":
        return "critical"
    if action in ("escalate", "by_subcode", "by_recovery_action") or degrade:
        return "warning"
    return "info"


def build_rows(rows: list[dict[str, str]]) -> list[dict[str, str]]:
    """Turn NVIDIA catalog rows into output rows (see :data:`OUT_COLUMNS`)."""
    out = []
    for row in rows:
        xid = int(row["xid"])
        immediate = row["immediate_action"].strip()
        investigatory = row["investigatory_action"].strip()
        mnemonic = row["mnemonic"].strip()
        description = row["description"].strip()
        action, remedy, degrade, basis = decide(xid, immediate, investigatory)
        out.append({
            "xid": str(xid),
            "mnemonic": mnemonic,
            "action": action,
            "remedy": remedy,
            "degrade": "true" if degrade else "false",
            "fault_class": fault_class_of(xid, mnemonic, description, action),
            "severity": severity_of(action, degrade),
            "nvidia_immediate_action": immediate,
            "nvidia_investigatory_action": investigatory,
            "description": description,
            "basis": basis,
        })
    out.sort(key=lambda r: int(r["xid"]))
    xids = [r["xid"] for r in out]
    if len(set(xids)) != len(xids):
        raise ValueError("catalog has duplicate xid rows")
    return out


#: what the catalog's immediate action and fleetmedic's action each do to the node and the job
EFFECT = {
    "isolate": "node out", "restart_app": "job restarts", "app_unless_repeated": "job restarts",
    "record": "nothing", "escalate": "a person", "by_subcode": "by subcode", "by_recovery_action": "by 154",
}


def conformance_markdown(rows: list[dict[str, str]]) -> str:
    """The conformance table: every catalog row, NVIDIA's immediate action beside
    fleetmedic's, and the reason wherever the two differ."""
    head = [
        "# Xid conformance: NVIDIA's catalog beside fleetmedic",
        "",
        "Generated by `python -m detectors.tools.build_xid_table ../shared/data/nvidia-xid-catalog.csv "
        "--doc docs/xid-conformance.md` from NVIDIA's Xid catalog (docs.nvidia.com, \"Analyzing Xid "
        "catalog\"); a test fails when this file, the shipped table or the catalog drift apart, and on any "
        "disagreement that is not explained here.",
        "",
        "fleetmedic follows the catalog's immediate action: `RESET_GPU`, `RESTART_BM`, `RESTART_VM`, "
        "`CHECK_MECHANICALS` and the DBE and NVLink workflows take the node out (cordon, drain, requeue "
        "the job elsewhere, diagnose with the remedy); `RESTART_APP` restarts the job and keeps the "
        "node; `IGNORE` records the event; `CONTACT_SUPPORT`, `UPDATE_SWFW` and `CHECK_UVM` alert a "
        "person. 144-150 are decided by the unit and registers the driver prints (the catalog's "
        "\"Xid 144-150 Decode\" sheet), 154 by the recovery action it prints. Across all codes: Xid 13, "
        "31 and 43 are the application's unless repeated on the same GPU in 2 or more jobs within 24 h "
        "(then the node is isolated and diagnosed); any code seen 5 or more times on one GPU within 24 h "
        "is escalated; a code not in the catalog is escalated to a person, never silenced.",
        "",
        "| Xid | mnemonic | catalog immediate | catalog investigatory | fleetmedic | remedy | degrade | agrees | why |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    lines = []
    for r in rows:
        default = ACTION_OF_IMMEDIATE.get(r["nvidia_immediate_action"])
        agrees = default is not None and default[0] == r["action"] and default[1] == r["remedy"]
        if r["action"] == "app_unless_repeated" and r["nvidia_immediate_action"] == "RESTART_APP":
            agrees = True  # the catalog's own workflow for 13 and 31
        why = "" if agrees and not r["basis"].startswith("override") else r["basis"].removeprefix("override: ")
        cells = [r["xid"], f"`{r['mnemonic']}`", r["nvidia_immediate_action"] or "(none)",
                 r["nvidia_investigatory_action"] or "", r["action"], r["remedy"],
                 "yes" if r["degrade"] == "true" else "", "yes" if agrees else "**no**", why]
        lines.append("| " + " | ".join(c.replace("|", "/") for c in cells) + " |")
    return "\n".join(head + lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("catalog", type=Path, help="NVIDIA Xid catalog CSV")
    parser.add_argument(
        "--out", type=Path, default=Path(__file__).resolve().parents[1] / "data" / "xid_catalog.csv",
        help="output CSV (default: the packaged detectors/data/xid_catalog.csv)",
    )
    parser.add_argument("--doc", type=Path, default=None,
                        help="also write the conformance table (Markdown) here, e.g. docs/xid-conformance.md")
    args = parser.parse_args(argv)
    with args.catalog.open(newline="", encoding="utf-8") as fh:
        rows = build_rows(list(csv.DictReader(fh)))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("w", newline="", encoding="utf-8") as fh:
        writer = csv.DictWriter(fh, fieldnames=OUT_COLUMNS, lineterminator="\n")
        writer.writeheader()
        writer.writerows(rows)
    print(f"wrote {len(rows)} rows to {args.out}", file=sys.stderr)
    if args.doc is not None:
        args.doc.write_text(conformance_markdown(rows), encoding="utf-8")
        print(f"wrote the conformance table to {args.doc}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
