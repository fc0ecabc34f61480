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
