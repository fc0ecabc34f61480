"""The shared contract: fault classes, severities, findings, hyper-parameter handling."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from detectors import SEVERITIES, FaultClass, Finding, PeerDetector


def test_fault_classes_are_the_designs():
    assert {c.value for c in FaultClass} == {
        "transient_software", "user_error", "gpu_hardware", "gpu_memory", "nvlink",
        "node_network", "fabric_switch", "node_degrading", "unknown",
    }
    assert FaultClass.gpu_memory == "gpu_memory"


def test_severities_are_ordered_least_to_most_severe():
    assert SEVERITIES == ("info", "warning", "critical")


def test_finding_normalises_to_plain_json_types():
    f = Finding("ecc_dbe", FaultClass.gpu_memory, "critical", np.float32(1.0), np.int64(3),
                np.int64(2), {"dbe_delta": 1.0})
    assert type(f.fault_class) is str and type(f.score) is float
    assert type(f.index) is int and type(f.gpu) is int
    assert json.loads(json.dumps(f.to_dict()))["fault_class"] == "gpu_memory"


def test_finding_is_frozen():
    f = Finding("xid", "unknown", "warning", 2.0, 0, None, {})
    with pytest.raises(dataclasses.FrozenInstanceError):
        f.score = 3.0  # type: ignore[misc]


@pytest.mark.parametrize(
    ("field", "value"),
    [("fault_class", "broken_gpu"), ("severity", "fatal"), ("evidence", ["not", "a", "dict"])],
)
def test_finding_rejects_bad_values_naming_the_field(field, value):
    args = {"kind": "xid", "fault_class": "unknown", "severity": "warning", "score": 1.0,
            "index": 0, "gpu": None, "evidence": {}}
    with pytest.raises(ValueError, match=field):
        Finding(**{**args, field: value})


def test_clone_changes_only_what_is_asked_and_rejects_unknown_names():
    det = PeerDetector(threshold=6.0)
    low = det.clone(direction="low")
    assert (low.threshold, low.direction, det.direction) == (6.0, "low", "high")
    with pytest.raises(ValueError, match="treshold"):
        det.clone(treshold=3.0)
