"""GPU detection over batches of samples: hard faults, late samples, resets, batching."""

from __future__ import annotations

import pytest

from pipeline.config import DetectorSettings
from pipeline.detect import GpuDetection
from schemas import FaultClass, Severity

from .builders import GPUS, T0, gpu_sample, sbe_ramp

NODE = "node-0001"


def _detection() -> GpuDetection:
    return GpuDetection(DetectorSettings())


def _lost(gpu: int, n: int = GPUS) -> list[bool]:
    return [i == gpu for i in range(n)]


def test_a_gpu_fallen_off_the_bus_is_a_critical_hardware_anomaly() -> None:
    det = _detection()
    sample = gpu_sample(NODE, T0, lost=_lost(3), xids=[{"gpu": 3, "code": 79}])
    found = det.process([sample])
    kinds = {(a.detector, a.kind) for a in found}
    assert kinds == {("gpu_hard", "gpu_lost"), ("xid", "xid")}
    for a in found:
        assert (a.fault_class, a.severity) == (FaultClass.gpu_hardware, Severity.critical)
        assert (a.node, a.gpu, a.subject, a.ts) == (NODE, 3, f"{NODE}/gpu3", T0)
    assert [a.evidence["xid"] for a in found if a.kind == "xid"] == [79]


def test_a_healthy_sample_yields_nothing() -> None:
    assert _detection().process([gpu_sample(NODE, T0 + i) for i in range(5)]) == []


def test_duplicate_and_out_of_order_samples_are_ignored_and_counted() -> None:
    det = _detection()
    assert det.process([gpu_sample(NODE, T0 + i) for i in range(10)]) == []
    stale = [
        gpu_sample(NODE, T0 + 9, lost=_lost(1)),                 # a duplicate of the newest time
        gpu_sample(NODE, T0 + 4, ecc_dbe=[1] + [0] * (GPUS - 1)),  # from the past
    ]
    assert det.process(stale) == []
    assert det.late == 2
    # the late DBE value was not taken as the counter's new baseline either
    [a] = det.process([gpu_sample(NODE, T0 + 10, ecc_dbe=[1] + [0] * (GPUS - 1))])
    assert (a.kind, a.gpu, a.evidence["dbe_delta"]) == ("ecc_dbe", 0, 1.0)


def test_late_samples_of_one_node_do_not_hold_back_another_node() -> None:
    det = _detection()
    det.process([gpu_sample(NODE, T0 + 100)])
    found = det.process([gpu_sample("node-0002", T0 + 50, lost=_lost(0))])
    assert [(a.node, a.kind) for a in found] == [("node-0002", "gpu_lost")]
    assert det.late == 0


def test_a_counter_reset_is_not_a_negative_increment_nor_a_finding() -> None:
    det = _detection()
    samples = []
    for i in range(300):
        # a steady trickle of single-bit errors; the driver reloads at 150 and counts from 0
        sbe = (i // 4) if i < 150 else (i - 150) // 4
        dbe = 3 if i < 150 else 0
        samples.append(gpu_sample(NODE, T0 + i, ecc_sbe=[sbe] * GPUS, ecc_dbe=[dbe] * GPUS,
                                  pcie_replay=[sbe] * GPUS, nvlink_crc=[sbe] * GPUS))
    assert det.process(samples[:150]) == []
    assert det.process(samples[150:]) == []
    # after the reset a real new uncorrectable error is still seen
    [a] = det.process([gpu_sample(NODE, T0 + 300, ecc_dbe=[0, 1] + [0] * (GPUS - 2))])
    assert (a.kind, a.gpu) == ("ecc_dbe", 1)


def test_an_error_storm_is_found_as_a_rate_rise_on_the_right_gpu() -> None:
    found = _detection().process(sbe_ramp(400, seed=0))
    assert found, "the storm was not detected"
    assert {(a.subject, a.kind, a.fault_class) for a in found} == {
        (f"{NODE}/gpu5", "ecc_sbe_rate", FaultClass.node_degrading)
    }
    assert min(a.ts for a in found) > T0 + 200


def _in_batches(samples, size: int) -> list[tuple[float, str, str]]:
    det = _detection()
    found = []
    for k in range(0, len(samples), size):
        found += det.process(samples[k:k + size])
    return [(a.ts, a.subject, a.kind) for a in found]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_findings_do_not_depend_on_how_samples_are_batched(seed: int) -> None:
    samples = sbe_ramp(400, seed=seed)
    one_by_one = _in_batches(samples, 1)
    assert one_by_one, "the ramp must produce findings for this comparison to mean anything"
    assert _in_batches(samples, 400) == one_by_one


# ------------------------------------------------------------------------------ unchanged samples


def test_sustained_thermal_throttling_in_identical_samples_is_found() -> None:
    """Identical samples skip conversion only while the node is quiet; a throttled one is not."""
    from detectors.gpu import HW_THERMAL

    det = _detection()
    samples = [gpu_sample(NODE, T0 + i, throttle=[HW_THERMAL] + [0] * (GPUS - 1), temp=[91.0] * GPUS)
               for i in range(80)]
    found = det.process(samples)
    assert {(a.kind, a.gpu) for a in found} == {("thermal_throttle", 0)}
    assert found[0].evidence["max_temp"] == 91.0


def test_a_gpu_that_stays_lost_is_reported_again_after_the_cooldown() -> None:
    det = _detection()
    found = det.process([gpu_sample(NODE, T0 + i, lost=_lost(2)) for i in range(40)])
    times = [a.ts for a in found if a.kind == "gpu_lost"]
    assert times[0] == T0 and len(times) >= 2 and times[1] - times[0] >= DetectorSettings().anomaly_cooldown_s


def test_a_counter_moving_after_a_long_quiet_stretch_is_still_counted() -> None:
    det = _detection()
    assert det.process([gpu_sample(NODE, T0 + i) for i in range(50)]) == []
    [a] = det.process([gpu_sample(NODE, T0 + 50, ecc_dbe=[0, 0, 2] + [0] * (GPUS - 3))])
    assert (a.kind, a.gpu, a.evidence["dbe_delta"]) == ("ecc_dbe", 2, 2.0)


def test_absent_fields_and_null_entries_are_no_evidence_and_no_crash() -> None:
    """What an NVML agent sends for unsupported fields and a lost GPU."""
    from schemas import GpuSample

    det = _detection()
    base = {"schema": "gpu/1", "node": NODE, "util": [95.0] * GPUS, "xids": []}
    quiet = [GpuSample.model_validate({**base, "ts": T0 + i, "ecc_sbe": [0] * (GPUS - 1) + [None]})
             for i in range(5)]
    assert det.process(quiet) == []
    lost = {**base, "ts": T0 + 5, "util": [95.0] * (GPUS - 1) + [None],
            "lost": [False] * (GPUS - 1) + [True], "temp": [60.0] * (GPUS - 1) + [None]}
    found = det.process([GpuSample.model_validate(lost)])
    assert [(a.kind, a.gpu) for a in found] == [("gpu_lost", GPUS - 1)]
