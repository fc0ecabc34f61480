"""Xid table and detector: what each code means for recovery."""

from __future__ import annotations

import csv
import io
from importlib import resources

import numpy as np
import pytest

from detectors import XID_TABLE, FaultClass, XidDetector, lookup
from detectors.tools import build_xid_table

from .cases import shared_data_dir


def _detect_one(code: int, gpu: int = 0):
    findings = XidDetector().detect(np.array([code]), np.array([7]), np.array([gpu]))
    assert len(findings) == 1
    return findings[0]


def test_xid_79_fallen_off_the_bus_is_critical_gpu_hardware():
    info = lookup(79)
    assert (info.fault_class, info.severity, info.hardware) == ("gpu_hardware", "critical", True)
    f = _detect_one(79, gpu=3)
    assert (f.kind, f.fault_class, f.severity) == ("xid", "gpu_hardware", "critical")
    assert (f.index, f.gpu) == (7, 3)
    assert f.evidence["xid"] == 79 and f.evidence["hardware"] is True


@pytest.mark.parametrize("code", [13, 31, 43, 45])
def test_application_side_xids_are_not_hardware(code):
    info = lookup(code)
    assert not info.hardware
    assert info.fault_class in {"user_error", "transient_software"}
    assert _detect_one(code).severity == "warning"


def test_xid_13_and_31_point_at_the_application():
    assert lookup(13).fault_class == lookup(31).fault_class == "user_error"


@pytest.mark.parametrize(
    ("code", "fault_class", "hardware"),
    [
        (48, "gpu_memory", True),    # double-bit ECC
        (63, "gpu_memory", False),   # row remap recorded: degradation, NVIDIA says ignore
        (64, "gpu_memory", True),    # row remap failure
        (92, "gpu_memory", False),   # high (corrected) SBE rate
        (94, "gpu_memory", True),    # contained uncorrectable error
        (95, "gpu_memory", True),    # uncontained uncorrectable error
        (140, "gpu_memory", True),   # unrecovered ECC error
        (74, "nvlink", True),
        (144, "nvlink", True),
        (119, "gpu_hardware", True),  # GSP RPC timeout
        (120, "gpu_hardware", True),  # GSP error
        (160, "transient_software", False),  # channel retirement is not memory retirement
    ],
)
def test_key_codes(code, fault_class, hardware):
    info = lookup(code)
    assert (info.fault_class, info.hardware) == (fault_class, hardware)
    assert _detect_one(code).severity == ("critical" if hardware else "warning")


@pytest.mark.parametrize("code", [9999, 173, -1])
def test_unknown_code_is_unknown_and_not_hardware(code):
    info = lookup(code)
    assert (info.fault_class, info.hardware, info.xid) == ("unknown", False, code)
    f = _detect_one(code)
    assert (f.fault_class, f.severity) == ("unknown", "warning")


def test_informational_codes_are_info():
    assert _detect_one(106).severity == "info"
    assert lookup(154).severity == "info"


def test_table_is_complete_and_consistent():
    assert set(XID_TABLE) == set(range(1, 173))
    for code, info in XID_TABLE.items():
        assert info.xid == code
        assert info.fault_class in {c.value for c in FaultClass}
        assert (info.severity == "critical") == info.hardware, code
        assert info.basis
    with pytest.raises(TypeError):
        XID_TABLE[79] = lookup(13)  # read-only


def test_node_level_event_has_no_gpu_and_ignored_codes_are_dropped():
    det = XidDetector(ignore=[43])
    findings = det.detect(np.array([43, 31]), np.array([0, 1]), np.array([0, -1]))
    assert [(f.evidence["xid"], f.index, f.gpu) for f in findings] == [(31, 1, None)]
    np.testing.assert_array_equal(det.score(np.array([43, 31, 79])), [0.0, 2.0, 3.0])


def test_detect_rejects_negative_rows():
    with pytest.raises(ValueError, match="rows"):
        XidDetector().detect(np.array([79]), np.array([-1]), np.array([0]))


def test_codes_must_be_integers():
    with pytest.raises(ValueError, match="codes"):
        XidDetector().score(np.array([79.0]))


def test_classify_rules_cover_the_named_overrides():
    for code, (fault_class, hardware, severity, _reason) in build_xid_table.OVERRIDES.items():
        info = lookup(code)
        assert (info.fault_class, info.hardware, info.severity) == (fault_class, hardware, severity)
        assert info.basis.startswith("override")


def test_packaged_table_is_the_build_script_output():
    data = shared_data_dir()
    if data is None or not (data / "nvidia-xid-catalog.csv").is_file():
        pytest.fail("shared data (../shared/data/nvidia-xid-catalog.csv) is not next to the repo")
    with (data / "nvidia-xid-catalog.csv").open(newline="", encoding="utf-8") as fh:
        rebuilt = build_xid_table.build_rows(list(csv.DictReader(fh)))
    packaged = resources.files("detectors").joinpath("data").joinpath("xid_catalog.csv")
    shipped = list(csv.DictReader(io.StringIO(packaged.read_text("utf-8"))))
    assert shipped == rebuilt
