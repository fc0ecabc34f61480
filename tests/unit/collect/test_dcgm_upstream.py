"""dcgm-exporter output as upstream projects captured or render it, through the parser, with
the expected records written beside each fixture (``tests/fixtures/dcgm-exporter/upstream``,
sources and commits in its README).

The expected records were checked by hand against the fixture text: a container id as
``Hostname`` names no node (the agent's own node stands in), lines without a ``gpu``
label are skipped, a float-printed DCGM blank is unknown, the exporter's windowed Xid
counts become Xid events with their counts, clock-event counts become the throttle mask
where no reasons gauge is exported, and 1.x names read as their 2.x fields.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeline.collect.dcgm import CLOCK_EVENT_BITS, DcgmExporterParser
from schemas import GpuSample

UPSTREAM = Path(__file__).resolve().parents[2] / "fixtures" / "dcgm-exporter" / "upstream"
CASES = sorted(p.name.removesuffix(".expected.json") for p in UPSTREAM.glob("*.expected.json"))


@pytest.mark.parametrize("name", CASES)
def test_upstream_fixture_gives_its_expected_records(name: str) -> None:
    expected = json.loads((UPSTREAM / f"{name}.expected.json").read_text())
    text = (UPSTREAM / f"{name}.txt").read_text()
    got = DcgmExporterParser().parse(text, expected["ts"], fallback_node=expected["fallback_node"])
    assert got == expected["records"]
    for rec in got:
        GpuSample.model_validate(rec)


def test_a_container_id_is_no_node_name() -> None:
    text = (UPSTREAM / "datadog-dcgm-metrics.txt").read_text()
    with pytest.raises(ValueError, match="no Hostname"):
        DcgmExporterParser().parse(text, 1.0)


def test_the_lowercase_hostname_label_names_the_node_and_blanks_are_unknown() -> None:
    (rec,) = DcgmExporterParser().parse((UPSTREAM / "hostname-lowercase.txt").read_text(), 1.0)
    assert rec["node"] == "gpu-node-021"
    assert rec["ecc_sbe"] == [None, 3]  # 9.223372036854776e+18 is DCGM's int64 blank printed as a float
    assert rec["throttle"][0] == CLOCK_EVENT_BITS["hw_thermal"] | CLOCK_EVENT_BITS["sw_thermal"]
    assert rec["pci_bus_id"] == ["0000:18:00", "0000:2a:00"]


def test_a_repeated_xid_is_seen_again_in_the_exporters_count() -> None:
    text = (UPSTREAM / "hostname-lowercase.txt").read_text()
    parser = DcgmExporterParser()
    first = parser.parse(text, 1.0)[0]["xids"]
    assert [(x["code"], x["count"]) for x in first] == [(13, 2), (79, 1)]
    assert parser.parse(text, 2.0)[0]["xids"] == []  # nothing new in the window
    again = text.replace('xid="13"} 2', 'xid="13"} 3')
    assert [(x["code"], x["count"]) for x in parser.parse(again, 3.0)[0]["xids"]] == [(13, 1)]
