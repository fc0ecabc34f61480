"""The NVML collector through a fake NVML (no GPU here): every field, unsupported fields,
a lost GPU, Xid events as they happen; every record validates."""

from __future__ import annotations

import threading
import time

import pytest

from pipeline.collect.fake_nvml import FakeNVML
from pipeline.collect.nvml import NvmlCollector
from schemas import GpuSample


@pytest.fixture
def nvml():
    fake = FakeNVML(8, seed=3)
    yield fake


def collector(fake: FakeNVML, **kw) -> NvmlCollector:
    return NvmlCollector(fake, "gpu-node-017", clock=lambda: 1_800_000_000.0, event_timeout_ms=50, **kw).open()


def test_a_healthy_h100_node_gives_every_field_nvml_offers(nvml) -> None:
    c = collector(nvml)
    try:
        nvml.advance()
        rec = c.sample()
    finally:
        c.close()
    s = GpuSample.model_validate(rec)
    assert s.node == "gpu-node-017" and s.gpu_count == 8
    assert all(80 <= u <= 100 for u in s.util)
    assert all(600 <= p <= 700 for p in s.power)          # mW -> W
    assert s.sm_clock == [1980.0] * 8 and s.mem_clock == [2619.0] * 8
    assert s.mem_used == [71 * 1024.0] * 8                # bytes -> MiB
    assert s.remap_failure == [False] * 8 and s.remapped_rows == [0] * 8
    assert s.nvlink_crc == [0] * 8 and s.pcie_replay == [0] * 8
    assert s.lost == [False] * 8 and s.xids == []
    # H100s remap rows instead of retiring pages: the field is absent, not zero
    assert "retired_pages" not in rec


def test_an_unsupported_field_is_absent_not_zero(nvml) -> None:
    nvml.unsupported |= {"ecc_sbe", "ecc_dbe", "ecc_sbe_aggregate", "ecc_dbe_aggregate", "nvlink", "pcie_replay"}
    c = collector(nvml)
    try:
        rec = c.sample()
    finally:
        c.close()
    for field in ("ecc_sbe", "ecc_dbe", "nvlink_crc", "nvlink_replay", "pcie_replay"):
        assert field not in rec, field
    GpuSample.model_validate(rec)
    assert {"ecc_sbe", "pcie_replay"} <= set(c.unsupported)


#: record field -> the fake's name of the NVML call behind it
NVML_FIELDS = {
    "util": "util", "mem_used": "mem_used", "temp": "temp", "power": "power", "sm_clock": "sm_clock",
    "mem_clock": "mem_clock", "throttle": "throttle", "ecc_sbe": "ecc_sbe", "ecc_dbe": "ecc_dbe",
    "ecc_sbe_aggregate": "ecc_sbe_aggregate", "ecc_dbe_aggregate": "ecc_dbe_aggregate",
    "retired_pages": "retired_pages", "remapped_rows": "remapped_rows", "remap_pending": "remapped_rows",
    "remap_failure": "remapped_rows", "nvlink_crc": "nvlink_crc", "nvlink_replay": "nvlink_replay",
    "nvlink_recovery": "nvlink_recovery", "pcie_replay": "pcie_replay",
}


def test_every_field_of_the_record_is_covered() -> None:
    from schemas.records import PER_GPU_FIELDS

    assert set(NVML_FIELDS) == set(PER_GPU_FIELDS) - {"lost", "pci_bus_id"}


@pytest.mark.parametrize("field", sorted(NVML_FIELDS))
def test_not_supported_is_none_for_each_field(field: str) -> None:
    """GPU 2 answers NOT_SUPPORTED to the field's call: its entry is None, the others keep a
    value; when no GPU supports it, the field is absent (util stays, all None)."""
    nvml = FakeNVML(4, seed=1, retired_pages_supported=True)
    nvml.gpus[2].unsupported.add(NVML_FIELDS[field])
    c = collector(nvml)
    try:
        rec = c.sample()
        GpuSample.model_validate(rec)
        assert rec[field][2] is None
        assert all(v is not None for k, v in enumerate(rec[field]) if k != 2), rec[field]
        assert rec["lost"] == [False] * 4
        for gpu in nvml.gpus:
            gpu.unsupported.add(NVML_FIELDS[field])
        rec = c.sample()
        GpuSample.model_validate(rec)
        if field == "util":
            assert rec["util"] == [None] * 4
        else:
            assert field not in rec
        assert "temp" in rec or field == "temp"
    finally:
        c.close()


def test_nvlink_counters_not_supported_on_active_links_are_none_not_zero(nvml) -> None:
    """Links up, every error counter NOT_SUPPORTED (as on drivers that give NVLink errors
    only through field values): unknown, not 0 errors."""
    for gpu in nvml.gpus:
        gpu.unsupported |= {"nvlink_crc", "nvlink_replay", "nvlink_recovery"}
    c = collector(nvml)
    try:
        rec = c.sample()
    finally:
        c.close()
    assert not {"nvlink_crc", "nvlink_replay", "nvlink_recovery"} & set(rec)
    assert {"nvlink_crc", "nvlink_replay", "nvlink_recovery"} <= set(c.unsupported)


def test_a_lost_gpu_is_reported_lost_and_the_collector_keeps_going(nvml) -> None:
    c = collector(nvml)
    try:
        nvml.lose(5)
        first = c.sample()
        second = c.sample()
    finally:
        c.close()
    for rec in (first, second):
        s = GpuSample.model_validate(rec)
        assert s.lost == [i == 5 for i in range(8)]
        assert s.util[5] is None and s.temp[5] is None and s.ecc_dbe[5] is None
        assert s.util[4] is not None and s.ecc_dbe[4] == 0
    assert c.lost == {5}


def test_an_xid_event_is_captured_as_it_happens_and_wakes_the_agent(nvml) -> None:
    woke = threading.Event()
    c = collector(nvml, on_xid=woke.set)
    try:
        assert c.sample()["xids"] == []
        nvml.inject_xid(2, 79)
        assert woke.wait(2), "the Xid did not wake the agent"
        rec = c.sample()
        again = c.sample()
    finally:
        c.close()
    assert GpuSample.model_validate(rec).xids[0].model_dump(exclude_none=True) == {
        "gpu": 2, "code": 79, "source": "nvml", "pci_bus_id": "0000:52:00"}
    assert again["xids"] == []  # reported once


def test_rising_error_counters_are_reported_cumulatively(nvml) -> None:
    c = collector(nvml)
    try:
        nvml.add_ecc(1, sbe=3, dbe=1)
        rec = c.sample()
    finally:
        c.close()
    assert rec["ecc_sbe"][1] == 3 and rec["ecc_dbe"][1] == 1 and rec["ecc_dbe_aggregate"][1] == 1


def test_close_stops_the_event_thread(nvml) -> None:
    c = collector(nvml)
    thread = c._thread
    assert thread is not None and thread.is_alive()
    started = time.monotonic()
    c.close()
    assert not thread.is_alive() and time.monotonic() - started < 2
    assert not nvml.initialised
