"""dcgm-exporter ingestion: the exporter's text format -> valid GpuSample wire dicts."""

from __future__ import annotations

import asyncio
import json
import logging
import re
import socket
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from pipeline.collect.dcgm import DcgmExporterParser, ScrapeError, parse_exporter, scrape
from schemas import GpuSample
from schemas.codec import decode

FIXTURE = Path(__file__).resolve().parents[2] / "fixtures" / "dcgm-exporter" / "metrics.txt"
TS = 1_700_000_000.0
HOST = "gpu-node-017"
LOG = "pipeline.collect.dcgm"


def fixture_text() -> str:
    return FIXTURE.read_text()


def line(metric: str, gpu: int, value: str | float, host: str | None = HOST, extra: str = "") -> str:
    """One GPU metric line as dcgm-exporter writes it."""
    hostname = f',Hostname="{host}"' if host is not None else ""
    return (f'{metric}{{gpu="{gpu}",UUID="GPU-0000000{gpu}-test",pci_bus_id="00000000:{0x18 + gpu:02X}:00.0",'
            f'device="nvidia{gpu}",modelName="NVIDIA H100 80GB HBM3"{hostname},'
            f'DCGM_FI_DRIVER_VERSION="550.54.15"{extra}}} {value}')


def exporter_text(*lines: str) -> str:
    return "\n".join(lines) + "\n"


def xid_lines(codes: list[int]) -> str:
    return exporter_text("# TYPE DCGM_FI_DEV_XID_ERRORS gauge", *(
        line("DCGM_FI_DEV_GPU_UTIL", i, 90) + "\n"
        + line("DCGM_FI_DEV_XID_ERRORS", i, code, extra=f',err_code="{code}",err_msg="x"')
        for i, code in enumerate(codes)))


def valid(records: list[dict[str, Any]]) -> list[GpuSample]:
    """Every record decodes as a wire message (schema present, every value in range)."""
    return [decode(GpuSample, json.dumps(r)) for r in records]


def without_gpu(text: str, gpu: int) -> str:
    return "".join(ln for ln in text.splitlines(keepends=True) if f'{{gpu="{gpu}",' not in ln)


# ------------------------------------------------------------------ the fixture node


def test_fixture_maps_every_exported_field() -> None:
    (rec,) = parse_exporter(fixture_text(), ts=TS)
    (sample,) = valid([rec])
    assert sample.node == HOST and sample.ts == TS and sample.gpu_count == 8
    assert rec["util"] == [99.0, 100.0, 98.0, 100.0, 99.0, 97.0, 100.0, 99.0]
    assert rec["temp"] == [58.0, 61.0, 56.0, 64.0, 59.0, 63.0, 57.0, 60.0]
    assert rec["power"][0] == pytest.approx(689.312) and rec["power"][5] == pytest.approx(699.981)
    assert rec["sm_clock"][5] == 1755.0 and rec["sm_clock"][0] == 1980.0
    assert rec["mem_clock"] == [2619.0] * 8
    assert rec["mem_used"][2] == 74215.0
    assert rec["throttle"] == [0, 0, 0, 0, 0, 4, 0, 0]
    assert rec["ecc_sbe"] == [0, 0, 0, 2, 0, 0, 0, 0]
    assert rec["ecc_dbe"] == [0] * 8
    assert rec["ecc_sbe_aggregate"] == [0, 3, 0, 14, 0, 1, 0, 0]
    assert rec["ecc_dbe_aggregate"] == [0] * 8
    assert rec["remapped_rows"] == [0, 0, 0, 1, 0, 0, 0, 0]
    assert rec["remap_failure"] == [False] * 8 and rec["remap_pending"] == [False] * 8
    assert rec["nvlink_crc"] == [0, 0, 0, 0, 0, 0, 6, 0]
    assert rec["nvlink_replay"] == [0] * 8 and rec["nvlink_recovery"] == [0] * 8
    assert rec["pcie_replay"] == [0] * 8
    assert rec["xids"] == []
    # Hopper has no retired pages (blank, so not exported) and the exporter has no lost flag.
    assert "retired_pages" not in rec and "lost" not in rec
    # Counters are ints, not the floats the text parser hands out.
    assert all(type(v) is int for v in rec["ecc_sbe"] + rec["throttle"] + rec["remapped_rows"])
    assert all(type(v) is bool for v in rec["remap_failure"])


def test_gpus_are_ordered_by_the_integer_gpu_label() -> None:
    text = exporter_text(*(line("DCGM_FI_DEV_GPU_UTIL", g, 10 * g) for g in (10, 2, 1, 0)))
    (rec,) = parse_exporter(text, ts=TS)
    valid([rec])
    assert rec["util"] == [0.0, 10.0, 20.0, 100.0]


# ------------------------------------------------------------------ hosts and names


def test_two_hostnames_give_two_records() -> None:
    text = exporter_text(
        line("DCGM_FI_DEV_GPU_UTIL", 0, 50, host="node-a"),
        line("DCGM_FI_DEV_GPU_UTIL", 1, 60, host="node-a"),
        line("DCGM_FI_DEV_GPU_UTIL", 0, 70, host="node-b"),
        line("DCGM_FI_DEV_GPU_TEMP", 0, 41, host="node-b"),
    )
    records = {r["node"]: r for r in parse_exporter(text, ts=TS)}
    valid(list(records.values()))
    assert set(records) == {"node-a", "node-b"}
    assert records["node-a"]["util"] == [50.0, 60.0] and "temp" not in records["node-a"]
    assert records["node-b"]["util"] == [70.0] and records["node-b"]["temp"] == [41.0]


def test_node_names_a_host_without_hostname_label_and_overrides_one() -> None:
    no_host = exporter_text(line("DCGM_FI_DEV_GPU_UTIL", 0, 5, host=None))
    with pytest.raises(ValueError, match="no Hostname label"):
        parse_exporter(no_host, ts=TS)
    (rec,) = parse_exporter(no_host, ts=TS, node="node-x")
    assert rec["node"] == "node-x"
    (rec,) = parse_exporter(fixture_text(), ts=TS, node="node-y")
    assert rec["node"] == "node-y"
    valid([rec])


def test_node_override_refuses_a_text_with_several_hosts() -> None:
    text = exporter_text(line("DCGM_FI_DEV_GPU_UTIL", 0, 5, host="a"), line("DCGM_FI_DEV_GPU_UTIL", 0, 5, host="b"))
    with pytest.raises(ValueError, match="names one host"):
        parse_exporter(text, ts=TS, node="node-x")


def test_invalid_host_name_and_invalid_text_raise_value_error() -> None:
    with pytest.raises(ValueError, match="not a valid node name"):
        parse_exporter(exporter_text(line("DCGM_FI_DEV_GPU_UTIL", 0, 5, host="bad host")), ts=TS)
    with pytest.raises(ValueError, match="not valid Prometheus text"):
        parse_exporter('DCGM_FI_DEV_GPU_UTIL{gpu="0" 5\n', ts=TS)


def test_no_gpu_metrics_give_no_records() -> None:
    assert parse_exporter("# HELP x y\n", ts=TS) == []
    assert parse_exporter('go_goroutines 12\nDCGM_FI_DEV_NVSWITCH_TEMPERATURE_CURRENT{nvswitch="0"} 40\n', ts=TS) == []


# ------------------------------------------------------------------ Xids


def test_xid_gauge_change_is_reported_once() -> None:
    parser = DcgmExporterParser()
    (first,) = parser.parse(xid_lines([0, 0, 0, 0]), TS)
    (second,) = parser.parse(xid_lines([0, 0, 0, 79]), TS + 10)
    (third,) = parser.parse(xid_lines([0, 0, 0, 79]), TS + 20)
    (fourth,) = parser.parse(xid_lines([0, 0, 0, 48]), TS + 30)
    valid([first, second, third, fourth])
    assert first["xids"] == []
    assert second["xids"] == [{"gpu": 3, "code": 79, "source": "dcgm"}]
    assert third["xids"] == []
    assert fourth["xids"] == [{"gpu": 3, "code": 48, "source": "dcgm"}]


def test_xid_seen_again_after_the_gauge_went_back_to_zero() -> None:
    parser = DcgmExporterParser()
    parser.parse(xid_lines([79]), TS)
    assert parser.parse(xid_lines([0]), TS + 10)[0]["xids"] == []
    assert parser.parse(xid_lines([79]), TS + 20)[0]["xids"] == [{"gpu": 0, "code": 79, "source": "dcgm"}]


def test_stateless_wrapper_reports_any_nonzero_xid() -> None:
    for _ in range(2):
        (rec,) = parse_exporter(xid_lines([0, 13]), ts=TS)
        assert rec["xids"] == [{"gpu": 1, "code": 13, "source": "dcgm"}]


def test_unusable_xid_value_is_ignored() -> None:
    (rec,) = parse_exporter(xid_lines([70000, -1]), ts=TS)
    valid([rec])
    assert rec["xids"] == []


# ------------------------------------------------------------------ lost GPUs


def test_gpu_that_disappears_is_reported_lost_in_its_place() -> None:
    parser = DcgmExporterParser()
    (before,) = parser.parse(fixture_text(), TS)
    (after,) = parser.parse(without_gpu(fixture_text(), 3), TS + 10)
    (still,) = parser.parse(without_gpu(fixture_text(), 3), TS + 20)
    valid([before, after, still])
    assert "lost" not in before
    for rec in (after, still):
        assert len(rec["util"]) == 8
        assert rec["lost"] == [False, False, False, True, False, False, False, False]
        assert rec["util"][3] is None and rec["temp"][3] is None and rec["ecc_sbe"][3] is None
        assert rec["temp"][4] == before["temp"][4] and rec["util"][7] == before["util"][7]
    (back,) = parser.parse(fixture_text(), TS + 30)
    assert "lost" not in back and back["ecc_sbe"][3] == 2


def test_lost_gpu_is_found_by_uuid_when_the_exporter_renumbers() -> None:
    # After an exporter restart DCGM enumerates only the GPUs still there: 4..7 become 3..6.
    def renumber(match: re.Match[str]) -> str:
        return f'gpu="{int(match.group(1)) - 1}",'

    parser = DcgmExporterParser()
    (before,) = parser.parse(fixture_text(), TS)
    shifted = re.sub(r'gpu="([4-7])",', renumber, without_gpu(fixture_text(), 3))
    (after,) = parser.parse(shifted, TS + 10)
    valid([after])
    assert after["lost"] == [False, False, False, True, False, False, False, False]
    assert after["temp"][4:] == before["temp"][4:]
    assert after["nvlink_crc"][6] == 6


def test_lost_gpu_also_has_no_xid_and_forget_drops_it() -> None:
    parser = DcgmExporterParser()
    parser.parse(xid_lines([0, 0]), TS)
    (rec,) = parser.parse(xid_lines([0]), TS + 10)
    valid([rec])
    assert rec["lost"] == [False, True] and rec["xids"] == []
    parser.forget(HOST)
    (rec,) = parser.parse(xid_lines([0]), TS + 20)
    assert len(rec["util"]) == 1 and "lost" not in rec


def test_stateless_wrapper_sees_no_lost_gpu() -> None:
    (rec,) = parse_exporter(without_gpu(fixture_text(), 3), ts=TS)
    valid([rec])
    assert len(rec["util"]) == 7 and "lost" not in rec


# ------------------------------------------------------------------ bad values


def test_nan_negative_out_of_range_and_blank_values_become_none(caplog: pytest.LogCaptureFixture) -> None:
    text = exporter_text(
        line("DCGM_FI_DEV_GPU_UTIL", 0, 93), line("DCGM_FI_DEV_GPU_UTIL", 1, 101),
        line("DCGM_FI_DEV_GPU_TEMP", 0, "NaN"), line("DCGM_FI_DEV_GPU_TEMP", 1, 62),
        line("DCGM_FI_DEV_POWER_USAGE", 0, "+Inf"), line("DCGM_FI_DEV_POWER_USAGE", 1, 9999.5),
        line("DCGM_FI_DEV_ECC_SBE_VOL_TOTAL", 0, -3), line("DCGM_FI_DEV_ECC_SBE_VOL_TOTAL", 1, 7),
        line("DCGM_FI_DEV_ECC_DBE_VOL_TOTAL", 0, 2.5), line("DCGM_FI_DEV_ECC_DBE_VOL_TOTAL", 1, 2**62 + 1),
        line("DCGM_FI_DEV_CLOCKS_EVENT_REASONS", 0, 2**33), line("DCGM_FI_DEV_CLOCKS_EVENT_REASONS", 1, 1),
        line("DCGM_FI_DEV_ROW_REMAP_FAILURE", 0, 2), line("DCGM_FI_DEV_ROW_REMAP_FAILURE", 1, 1),
        # DCGM blanks, as older exporters print them: not supported, not broken.
        line("DCGM_FI_DEV_MEM_CLOCK", 0, 9223372036854775794), line("DCGM_FI_DEV_MEM_CLOCK", 1, 140737488355328.0),
        # A 32-bit blank is within a counter's range, but it is no count either.
        line("DCGM_FI_DEV_PCIE_REPLAY_COUNTER", 0, 2147483634), line("DCGM_FI_DEV_PCIE_REPLAY_COUNTER", 1, 0),
    )
    with caplog.at_level(logging.DEBUG, logger=LOG):
        (rec,) = parse_exporter(text, ts=TS)
    valid([rec])
    assert rec["util"] == [93.0, None]
    assert rec["temp"] == [None, 62.0]
    assert rec["power"] == [None, None]
    assert rec["ecc_sbe"] == [None, 7]
    assert rec["ecc_dbe"] == [None, None]
    assert rec["throttle"] == [None, 1]
    assert rec["remap_failure"] == [None, True]
    assert rec["mem_clock"] == [None, None]
    assert rec["pcie_replay"] == [None, 0]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 9
    assert any("DCGM_FI_DEV_GPU_TEMP = nan" in w for w in warnings)
    assert not any("MEM_CLOCK" in w or "PCIE_REPLAY" in w for w in warnings)


def test_field_reported_by_some_gpus_is_none_for_the_others() -> None:
    text = exporter_text(
        line("DCGM_FI_DEV_GPU_TEMP", 0, 50), line("DCGM_FI_DEV_GPU_TEMP", 1, 51),
        line("DCGM_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL", 1, 4),
    )
    (rec,) = parse_exporter(text, ts=TS)
    valid([rec])
    assert rec["nvlink_crc"] == [None, 4]
    # util is required: all unknown when the exporter does not export it (e.g. MIG mode).
    assert rec["util"] == [None, None]
    assert "power" not in rec and "ecc_sbe" not in rec


def test_summed_fields_need_every_part_the_host_reports() -> None:
    text = exporter_text(
        "# TYPE DCGM_FI_DEV_RETIRED_SBE counter",
        *(line("DCGM_FI_DEV_RETIRED_SBE", gpu, value) for gpu, value in enumerate([2, 1, 0])),
        "# TYPE DCGM_FI_DEV_RETIRED_DBE counter",
        line("DCGM_FI_DEV_RETIRED_DBE", 0, 3), line("DCGM_FI_DEV_RETIRED_DBE", 2, "NaN"),
        line("DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS", 0, 5), line("DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS", 1, 0),
        line("DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS", 2, 1),
    )
    (rec,) = parse_exporter(text, ts=TS)
    valid([rec])
    assert rec["retired_pages"] == [5, None, None]
    # Only one remapped-rows part is exported: the sum is that part.
    assert rec["remapped_rows"] == [5, 0, 1]


def test_throttle_reads_either_name_and_prefers_clocks_event_reasons() -> None:
    old = exporter_text(line("DCGM_FI_DEV_CLOCK_THROTTLE_REASONS", 0, 4))
    assert parse_exporter(old, ts=TS)[0]["throttle"] == [4]
    both = exporter_text(line("DCGM_FI_DEV_CLOCK_THROTTLE_REASONS", 0, 4),
                         line("DCGM_FI_DEV_CLOCKS_EVENT_REASONS", 0, 8))
    assert parse_exporter(both, ts=TS)[0]["throttle"] == [8]


# ------------------------------------------------------------------ lines to skip or merge


def test_duplicate_lines_for_one_gpu_keep_the_whole_gpu_value() -> None:
    text = exporter_text(
        # MIG: one line per GPU instance, then the whole GPU; pods sharing a GPU: one line each.
        line("DCGM_FI_DEV_GPU_TEMP", 0, 70, extra=',GPU_I_PROFILE="1g.10gb",GPU_I_ID="1"'),
        line("DCGM_FI_DEV_GPU_TEMP", 0, 55),
        line("DCGM_FI_DEV_GPU_TEMP", 0, 71, extra=',GPU_I_PROFILE="1g.10gb",GPU_I_ID="2"'),
        line("DCGM_FI_DEV_GPU_UTIL", 0, 80, extra=',container="a",namespace="ml",pod="train-0"'),
        line("DCGM_FI_DEV_GPU_UTIL", 0, 81, extra=',container="b",namespace="ml",pod="train-1"'),
    )
    (rec,) = parse_exporter(text, ts=TS)
    valid([rec])
    assert rec["temp"] == [55.0] and rec["util"] == [80.0]


def test_link_lines_are_ignored_and_the_exporters_xid_count_is_read() -> None:
    text = exporter_text(
        line("DCGM_FI_DEV_GPU_UTIL", 0, 90),
        line("DCGM_EXP_XID_ERRORS_COUNT", 0, 2, extra=',window_size_in_ms="300000",xid="79"'),
        'DCGM_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL{nvlink="0",gpu="5",hostname="gpu-node-017"} 3',
        'DCGM_FI_DEV_GPU_UTIL{gpu="x",UUID="GPU-x",Hostname="gpu-node-017"} 90',
    )
    (rec,) = parse_exporter(text, ts=TS)
    valid([rec])
    assert rec["util"] == [90.0] and "nvlink_crc" not in rec
    assert rec["xids"] == [{"gpu": 0, "code": 79, "source": "dcgm", "count": 2}]


# ------------------------------------------------------------------ scraping


def _serve(handler: Any) -> TestServer:
    app = web.Application()
    app.router.add_get("/metrics", handler)
    return TestServer(app)


def test_scrape_returns_the_metrics_text() -> None:
    async def metrics(_: web.Request) -> web.Response:
        return web.Response(text=fixture_text(), content_type="text/plain")

    async def run() -> str:
        async with _serve(metrics) as server:
            return await scrape(str(server.make_url("/metrics")))

    text = asyncio.run(run())
    assert text == fixture_text()
    assert parse_exporter(text, ts=TS)[0]["node"] == HOST


def test_scrape_raises_on_http_error() -> None:
    async def failing(_: web.Request) -> web.Response:
        return web.Response(status=503, text="DCGM not ready")

    async def run() -> None:
        async with _serve(failing) as server:
            await scrape(str(server.make_url("/metrics")))

    with pytest.raises(ScrapeError, match="HTTP 503.*DCGM not ready"):
        asyncio.run(run())


def test_scrape_raises_when_nothing_listens() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(ScrapeError, match=f"127.0.0.1:{port}"):
        asyncio.run(scrape(f"http://127.0.0.1:{port}/metrics", timeout=2.0))
