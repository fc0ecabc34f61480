"""Xid and SXid semantics, row by row from NVIDIA's catalog, on lines real drivers printed.

The kernel-log lines come from ``tests/fixtures/kernel-log/lines.toml`` (each with its
public source); the catalog from ``../shared/data/nvidia-xid-catalog.csv``.
"""

from __future__ import annotations

import csv
import io
import tomllib
from importlib import resources
from pathlib import Path

import numpy as np
import pytest

from detectors import XID_TABLE, FaultClass, XidDetector, lookup, resolve
from detectors.tools import build_xid_table
from detectors.xid import recovery_action, resolve_sxid, sxid_findings
from detectors.nvrm import parse_sxid, parse_xid

from .cases import shared_data_dir

REPO = Path(__file__).resolve().parents[3]
LINES = tomllib.loads((REPO / "tests/fixtures/kernel-log/lines.toml").read_text())["line"]


def _lines(code: int) -> list[str]:
    return [ln["text"] for ln in LINES if ln.get("xid") == code]


def _detect_one(code: int, gpu: int = 0, detail: str | None = None):
    findings = XidDetector().detect(np.array([code]), np.array([7]), np.array([gpu]), [detail])
    assert len(findings) == 1
    return findings[0]


def _catalog_rows() -> list[dict[str, str]]:
    data = shared_data_dir()
    if data is None or not (data / "nvidia-xid-catalog.csv").is_file():
        pytest.fail("shared data (../shared/data/nvidia-xid-catalog.csv) is not next to the repo")
    with (data / "nvidia-xid-catalog.csv").open(newline="", encoding="utf-8") as fh:
        return list(csv.DictReader(fh))


def test_xid_79_fallen_off_the_bus_takes_the_node_out_for_a_reboot():
    info = lookup(79)
    assert (info.action, info.remedy, info.fault_class, info.severity) == ("isolate", "reboot", "gpu_hardware",
                                                                          "critical")
    [line] = [t for t in _lines(79) if "pid=" in t]
    x = parse_xid(line)
    f = _detect_one(x.code, gpu=3, detail=x.detail)
    assert (f.kind, f.fault_class, f.severity, f.index, f.gpu) == ("xid", "gpu_hardware", "critical", 7, 3)
    assert f.evidence["action"] == "isolate" and f.evidence["remedy"] == "reboot"
    assert f.evidence["nvidia_immediate_action"] == "RESTART_BM"


@pytest.mark.parametrize("code", [13, 31, 43])
def test_application_side_xids_are_the_applications_unless_repeated(code):
    info = lookup(code)
    assert info.action == "app_unless_repeated" and not info.hardware
    for line in _lines(code):
        f = _detect_one(code, detail=parse_xid(line).detail)
        assert (f.fault_class, f.severity, f.evidence["action"]) == ("user_error", "info", "app_unless_repeated")


def test_xid_45_follows_another_xid_and_is_recorded():
    for line in _lines(45):
        f = _detect_one(45, detail=parse_xid(line).detail)
        assert f.evidence["action"] == "record" and f.severity == "info"


@pytest.mark.parametrize(
    ("code", "action", "remedy", "degrade", "fault_class"),
    [
        (48, "isolate", "reset_gpu", False, "gpu_memory"),    # double-bit ECC: the DBE workflow
        (63, "record", "", True, "gpu_memory"),               # row marked for remapping: wear, keeps working
        (64, "isolate", "reset_gpu", False, "gpu_memory"),    # row remap failure
        (92, "record", "", True, "gpu_memory"),               # high corrected error rate
        (94, "restart_app", "", True, "gpu_memory"),          # contained: restart the app, no isolation
        (95, "isolate", "reset_gpu", False, "gpu_memory"),    # uncontained: reset the GPU
        (140, "isolate", "reset_gpu", False, "gpu_memory"),
        (74, "isolate", "reset_gpu", False, "nvlink"),
        (119, "isolate", "reset_gpu", False, "gpu_hardware"),  # GSP RPC timeout
        (120, "isolate", "reset_gpu", False, "gpu_hardware"),
        (160, "record", "", False, "transient_software"),      # channel retirement, catalog IGNORE
    ],
)
def test_key_codes(code, action, remedy, degrade, fault_class):
    info = lookup(code)
    assert (info.action, info.remedy, info.degrade, info.fault_class) == (action, remedy, degrade, fault_class)
    for line in _lines(code) or [None]:
        detail = parse_xid(line).detail if line else None
        f = _detect_one(code, detail=detail)
        assert f.evidence["action"] == action
        assert f.severity == ("critical" if action == "isolate" else "warning" if degrade else "info")


def test_xid_94_contained_error_restarts_the_app_with_a_degrade_finding_and_no_isolation():
    for line in _lines(94):
        x = parse_xid(line)
        assert x is not None and x.code == 94
        f = _detect_one(94, detail=x.detail)
        assert f.evidence["action"] == "restart_app" and f.evidence["degrade"] is True
        assert f.severity == "warning" and f.evidence["hardware"] is False


@pytest.mark.parametrize("code", [9999, 173, 1000])
def test_an_unknown_code_is_escalated_to_a_person_never_silenced(code):
    info = lookup(code)
    assert (info.fault_class, info.action, info.xid) == ("unknown", "escalate", code)
    f = _detect_one(code)
    assert (f.fault_class, f.severity, f.evidence["action"]) == ("unknown", "warning", "escalate")


def test_xid_154_takes_the_recovery_action_the_driver_prints():
    want = {"0x1 (GPU Reset Required)": ("isolate", "reset_gpu"), "0x4 (Drain and Reset)": ("isolate", "reset_gpu"),
            "0x0 (None)": ("record", "")}
    lines = _lines(154)
    assert len(lines) >= 4
    for line in lines:
        x = parse_xid(line)
        new = line.rsplit(" to ", 1)[1]
        f = _detect_one(154, detail=x.detail)
        assert (f.evidence["action"], f.evidence["remedy"]) == want[new], line
    # the catalog's own example (Xid 154 row, trigger conditions) and an action this table does not know
    assert resolve(154, "GPU recovery action changed from 0x0 (None) to 0x2 (Node Reboot Required)").remedy == "reboot"
    assert recovery_action("GPU recovery action changed from 0x0 (None) to 0x9 (Something New)") == \
        "unknown:0x9 Something New"
    assert resolve(154, "GPU recovery action changed from 0x0 (None) to 0x9 (Something New)").action == "escalate"
    # NVML reports the code alone: what to do is for a person
    assert resolve(154, None).action == "escalate"


def test_nvlink5_xids_are_decided_by_unit_and_registers():
    got = {}
    for code in range(144, 151):
        for line in _lines(code):
            x = parse_xid(line)
            got[line] = resolve(code, x.detail)
    by_unit = {line.split(", ")[-1].split()[0] if "pid=" in line else line.split(": ", 2)[2].split(", ", 1)[1].split()[0]:
               r for line, r in got.items()}
    assert by_unit["NETIR"].action == "isolate"  # NETIR_INT: link fatal, reset
    assert by_unit["NETIR_BER_EVENT"].action == "record"  # IGNORE
    assert by_unit["SAW_MVB"].action == "record"  # errorStatus 0x8: IGNORE
    link_events = [r for line, r in got.items() if "NETIR_LINK_EVT" in line]
    assert link_events and all(r.action == "isolate" for r in link_events)  # reasons 4, 33, 21, 37: reset
    # RLW_SRC_TRACK with errorStatus 0x8: XID_154_EVAL, the 154 that follows decides
    src = [r for line, r in got.items() if "RLW_SRC_TRACK" in line]
    assert src and all(r.action == "record" and "154" in r.rule for r in src)
    # the catalog's link-down reason 38 is ignorable although the line says Fatal
    assert resolve(149, "NETIR_LINK_EVT  Fatal   XC0 i0 Link 01 (0x026001c6 0x00000000)").action == "record"
    # a unit the decode sheet does not list: the printed severity decides
    assert resolve(147, "TREX Fatal XC0 i0 Link 2 (0x1 0x80000000)").action == "record"
    assert resolve(146, "TLW_NEW_UNIT Fatal XC0 i0 Link 2 (0x1 0x4000)").action == "isolate"
    # NVML gives the code alone: escalate rather than guess
    assert resolve(145, None).action == "escalate"


def test_sxid_lines_by_severity_and_the_fabric_manager_guide():
    lines = [ln["text"] for ln in LINES if "sxid" in ln]
    assert len(lines) >= 8
    seen = {}
    for line in lines:
        s = parse_sxid(line)
        assert s is not None, line
        seen[line] = resolve_sxid(s.code, s.fatal, s.detail)
    fatal = [r for line, r in seen.items() if ", Fatal," in line]
    assert fatal and all(r.action == "isolate" for r in fatal)
    nonfatal = [r for line, r in seen.items() if ", Non-fatal," in line]
    assert nonfatal and all(r.action == "record" and r.degrade for r in nonfatal)
    companions = [r for line, r in seen.items() if "Engine instance" in line or "Data {" in line]
    assert companions and all(r is None for r in companions)
    soe = [r for line, r in seen.items() if "SOE Watchdog" in line]
    assert soe and soe[0].action == "escalate"
    fs = sxid_findings([20034, 20034], [0, 0], [True, None], ["Link 48 LTSSM Fault Up", "Data {0x1}"], ["0000:06:00"] * 2)
    assert [(f.kind, f.severity, f.gpu) for f in fs] == [("sxid", "critical", None)]


def test_table_is_complete_and_consistent():
    assert set(XID_TABLE) == set(range(1, 173))
    for code, info in XID_TABLE.items():
        assert info.xid == code
        assert info.fault_class in {c.value for c in FaultClass}
        assert (info.severity == "critical") == (info.action == "isolate"), code
        assert (info.remedy != "") == (info.action == "isolate"), code
        assert info.basis
    with pytest.raises(TypeError):
        XID_TABLE[79] = lookup(13)  # read-only


def test_node_level_event_has_no_gpu_and_ignored_codes_are_dropped():
    det = XidDetector(ignore=[43])
    findings = det.detect(np.array([43, 31]), np.array([0, 1]), np.array([0, -1]))
    assert [(f.evidence["xid"], f.index, f.gpu) for f in findings] == [(31, 1, None)]
    np.testing.assert_array_equal(det.score(np.array([43, 31, 79])), [0.0, 1.0, 3.0])


def test_detect_rejects_negative_rows_and_mismatched_details():
    with pytest.raises(ValueError, match="rows"):
        XidDetector().detect(np.array([79]), np.array([-1]), np.array([0]))
    with pytest.raises(ValueError, match="details"):
        XidDetector().detect(np.array([79]), np.array([0]), np.array([0]), ["a", "b"])


def test_codes_must_be_integers():
    with pytest.raises(ValueError, match="codes"):
        XidDetector().score(np.array([79.0]))


# ------------------------------------------------------------------ conformance with the catalog


def test_packaged_table_is_the_build_script_output():
    rebuilt = build_xid_table.build_rows(_catalog_rows())
    packaged = resources.files("detectors").joinpath("data").joinpath("xid_catalog.csv")
    shipped = list(csv.DictReader(io.StringIO(packaged.read_text("utf-8"))))
    assert shipped == rebuilt


def test_conformance_table_in_the_docs_is_current():
    rows = build_xid_table.build_rows(_catalog_rows())
    doc = (REPO / "docs" / "xid-conformance.md").read_text()
    assert doc == build_xid_table.conformance_markdown(rows), \
        "run: python detectors/tools/build_xid_table.py ../shared/data/nvidia-xid-catalog.csv --doc docs/xid-conformance.md"


def test_every_catalog_row_agrees_with_its_immediate_action_or_the_table_explains_why():
    catalog = _catalog_rows()
    assert len(catalog) == len(XID_TABLE)
    unexplained = []
    for row in catalog:
        code = int(row["xid"])
        info = lookup(code)
        assert info.nvidia_immediate_action == row["immediate_action"].strip()
        default = build_xid_table.ACTION_OF_IMMEDIATE.get(row["immediate_action"].strip())
        agrees = default is not None and (default[0], default[1]) == (info.action, info.remedy)
        agrees = agrees or (info.action == "app_unless_repeated" and row["immediate_action"] == "RESTART_APP"
                            and row["investigatory_action"] in ("WORKFLOW_XID_13", "WORKFLOW_XID_31"))
        if not agrees and not (info.basis.startswith("override: ") and len(info.basis) > 40):
            unexplained.append(code)
    assert unexplained == []
    doc = (REPO / "docs" / "xid-conformance.md").read_text()
    disagreeing = [ln for ln in doc.splitlines() if "| **no** |" in ln]
    assert disagreeing and all(not ln.rstrip().endswith("| **no** | |") for ln in disagreeing)


def test_the_issue_s_named_codes():
    # 94 restarts the application with a degrade finding; 95 resets the GPU; 13/31/43 are the app's
    assert (lookup(94).action, lookup(94).degrade) == ("restart_app", True)
    assert (lookup(95).action, lookup(95).remedy) == ("isolate", "reset_gpu")
    assert {lookup(c).action for c in (13, 31, 43)} == {"app_unless_repeated"}
    assert {lookup(c).action for c in range(144, 151)} == {"by_subcode"}
    assert lookup(154).action == "by_recovery_action"
