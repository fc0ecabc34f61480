"""InfiniBand sysfs port counters -> valid NetworkSample wire dicts."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest

from pipeline.collect.infiniband import COUNTERS, parse_rate, read_network_sample
from schemas import NetworkSample
from schemas.codec import decode

FIXTURE = Path(__file__).resolve().parents[2] / "fixtures" / "sysfs-infiniband"
TS = 1_700_000_000.0
NODE = "gpu-node-017"
LOG = "pipeline.collect.infiniband"


def valid(sample: dict[str, Any] | None) -> NetworkSample:
    """The sample decodes as a wire message (schema present, every counter in range)."""
    assert sample is not None
    return decode(NetworkSample, json.dumps(sample))


def make_port(root: Path, device: str, port: str = "1", *, state: str = "4: ACTIVE", phys: str = "5: LinkUp",
              counters: dict[str, str] | None = None, hw: dict[str, str] | None = None) -> Path:
    """A sysfs port directory; every required counter is 0 unless ``counters`` says otherwise."""
    d = root / device / "ports" / port
    (d / "counters").mkdir(parents=True)
    (d / "state").write_text(state + "\n")
    (d / "phys_state").write_text(phys + "\n")
    (d / "link_layer").write_text("InfiniBand\n")
    values = {name: "0" for name, _, _ in COUNTERS.values()} | (counters or {})
    for name, value in values.items():
        (d / "counters" / name).write_text(value + "\n")
    if hw is not None:
        (d / "hw_counters").mkdir()
        for name, value in hw.items():
            (d / "hw_counters" / name).write_text(value + "\n")
    return d


# ------------------------------------------------------------------ the fixture tree


def test_fixture_tree_maps_every_counter() -> None:
    sample = read_network_sample(NODE, ts=TS, root=FIXTURE, switches={"mlx5_0/1": "leaf-a07"})
    rec = valid(sample)
    assert rec.node == NODE and rec.ts == TS
    up, down = sample["ports"]  # type: ignore[index]
    assert up == {
        "port": "mlx5_0/1", "switch": "leaf-a07", "state": "up",
        "symbol_errors": 0, "link_error_recovery": 0, "link_downed": 1, "rcv_errors": 0,
        "xmit_discards": 0, "xmit_wait": 1834501227,
        "xmit_bytes": 4 * 98120394810234, "rcv_bytes": 4 * 97451022876213,
        "rate_gbps": up["rate_gbps"], "width": up["width"], "speed": up["speed"],
        "phys_state": "LinkUp", "link_layer": "InfiniBand", "hca": None, "hw": up["hw"],
    }
    assert down["port"] == "mlx5_1/1" and down["state"] == "down" and down["switch"] == "unknown"
    assert (down["symbol_errors"], down["link_error_recovery"], down["link_downed"]) == (1287, 4, 9)
    assert (down["rcv_errors"], down["xmit_discards"], down["xmit_wait"]) == (311, 26, 2218094413)
    assert down["xmit_bytes"] == 4 * 61033870144517 and down["rcv_bytes"] == 4 * 60877124930866


def test_fixture_hw_counters_skip_the_lifespan_setting() -> None:
    sample = read_network_sample(NODE, ts=TS, root=FIXTURE)
    valid(sample)
    hw0, hw1 = (p["hw"] for p in sample["ports"])  # type: ignore[index]
    assert hw0["out_of_sequence"] == 17 and hw0["local_ack_timeout_err"] == 3 and hw0["rx_write_requests"] == 88213077
    assert hw1 == {"duplicate_request": 0, "implied_nak_seq_err": 0, "local_ack_timeout_err": 41,
                   "out_of_buffer": 0, "out_of_sequence": 212, "packet_seq_err": 19, "rnr_nak_retry_err": 0}
    assert "lifespan" not in hw0 and "lifespan" not in hw1


# ------------------------------------------------------------------ switches


def test_switch_from_port_mapping_then_device_mapping_else_unknown() -> None:
    sample = read_network_sample(NODE, ts=TS, root=FIXTURE, switches={"mlx5_1": "leaf-b02", "mlx5_9/1": "x"})
    valid(sample)
    assert [p["switch"] for p in sample["ports"]] == ["unknown", "leaf-b02"]  # type: ignore[index]
    sample = read_network_sample(NODE, ts=TS, root=FIXTURE, switches={"mlx5_1": "leaf-b02", "mlx5_1/1": "leaf-b03"})
    assert sample["ports"][1]["switch"] == "leaf-b03"  # type: ignore[index]


def test_switch_from_lldp_directory(tmp_path: Path) -> None:
    lldp = tmp_path / "lldp"
    (lldp / "mlx5_0").mkdir(parents=True)
    (lldp / "mlx5_0" / "1").write_text("leaf-a07.fabric.example\nport 23\n")
    (lldp / "mlx5_1").write_text("  \n")  # empty label: ignored
    sample = read_network_sample(NODE, ts=TS, root=FIXTURE, lldp_dir=lldp)
    valid(sample)
    assert [p["switch"] for p in sample["ports"]] == ["leaf-a07.fabric.example", "unknown"]  # type: ignore[index]


def test_switch_from_lldp_json_and_mapping_wins(tmp_path: Path) -> None:
    labels = tmp_path / "lldp.json"
    labels.write_text(json.dumps({"mlx5_0/1": "leaf-a07", "mlx5_1": "leaf-a08"}))
    sample = read_network_sample(NODE, ts=TS, root=FIXTURE, lldp_dir=labels, switches={"mlx5_1/1": "leaf-z99"})
    valid(sample)
    assert [p["switch"] for p in sample["ports"]] == ["leaf-a07", "leaf-z99"]  # type: ignore[index]


def test_unreadable_lldp_json_gives_unknown(tmp_path: Path) -> None:
    labels = tmp_path / "lldp.json"
    labels.write_text("{not json")
    sample = read_network_sample(NODE, ts=TS, root=FIXTURE, lldp_dir=labels)
    valid(sample)
    assert {p["switch"] for p in sample["ports"]} == {"unknown"}  # type: ignore[index]


# ------------------------------------------------------------------ error cases


def test_no_device_gives_none(tmp_path: Path) -> None:
    assert read_network_sample(NODE, ts=TS, root=tmp_path / "absent") is None
    assert read_network_sample(NODE, ts=TS, root=tmp_path) is None
    (tmp_path / "mlx5_0").mkdir()  # a device without ports/
    assert read_network_sample(NODE, ts=TS, root=tmp_path) is None
    (tmp_path / "mlx5_0" / "ports").mkdir()  # ports/ with no port
    assert read_network_sample(NODE, ts=TS, root=tmp_path) is None


def test_missing_or_unreadable_counter_is_unknown_with_one_warning(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    port = make_port(tmp_path, "mlx5_0", counters={"symbol_error": "5", "port_xmit_data": "1000",
                                                   "port_rcv_errors": "seven"})
    (port / "counters" / "link_downed").unlink()
    (port / "counters" / "port_rcv_data").write_text("N/A (no PMA)\n")
    with caplog.at_level(logging.INFO, logger=LOG):
        first = read_network_sample(NODE, ts=TS, root=tmp_path)
        second = read_network_sample(NODE, ts=TS + 10, root=tmp_path)
    valid(first)
    valid(second)
    (p,) = first["ports"]  # type: ignore[index]
    assert p["link_downed"] is None and p["rcv_bytes"] is None and p["rcv_errors"] is None
    assert p["symbol_errors"] == 5 and p["xmit_bytes"] == 4000 and "saturated" not in p
    logged = [r.getMessage() for r in caplog.records]
    assert len(logged) == 3, logged  # once each, not again on the second read
    assert any("counters/link_downed" in m for m in logged) and any("no performance-management" in m for m in logged)
    assert any("'seven'" in m for m in logged)


def test_counter_beyond_schema_limit_is_unknown(tmp_path: Path) -> None:
    make_port(tmp_path, "mlx5_0", counters={"port_xmit_data": str(2**61), "symbol_error": str(2**63)})
    sample = read_network_sample(NODE, ts=TS, root=tmp_path)
    valid(sample)
    (p,) = sample["ports"]  # type: ignore[index]
    assert p["xmit_bytes"] is None and p["symbol_errors"] is None


@pytest.mark.parametrize(("file", "field", "maximum"), [
    ("port_xmit_wait", "xmit_wait", 2**32 - 1), ("port_xmit_data", "xmit_bytes", 2**32 - 1),
    ("symbol_error", "symbol_errors", 2**16 - 1), ("port_rcv_errors", "rcv_errors", 2**16 - 1),
    ("link_downed", "link_downed", 255), ("link_error_recovery", "link_error_recovery", 255),
])
def test_counter_stopped_at_its_width_is_saturated(tmp_path: Path, file: str, field: str, maximum: int) -> None:
    make_port(tmp_path, "mlx5_0", counters={file: str(maximum)})
    (p,) = read_network_sample(NODE, ts=TS, root=tmp_path)["ports"]  # type: ignore[index]
    assert p[field] is None and p["saturated"] == [field]
    make_port(tmp_path / "below", "mlx5_0", counters={file: str(maximum - 1)})
    (q,) = read_network_sample(NODE, ts=TS, root=tmp_path / "below")["ports"]  # type: ignore[index]
    assert q[field] == (maximum - 1) * (4 if field.endswith("bytes") else 1) and "saturated" not in q


def test_counters_ext_is_preferred_and_does_not_saturate_at_32_bits(tmp_path: Path) -> None:
    port = make_port(tmp_path, "mlx4_0", counters={"port_xmit_data": str(2**32 - 1), "port_rcv_data": "0"})
    (port / "counters_ext").mkdir()
    (port / "counters_ext" / "port_xmit_data_64").write_text(f"{2**32 + 5}\n")
    (port / "counters_ext" / "port_rcv_data_64").write_text("N/A (no PMA)\n")  # unusable: counters/ is read
    (p,) = read_network_sample(NODE, ts=TS, root=tmp_path)["ports"]  # type: ignore[index]
    assert p["xmit_bytes"] == 4 * (2**32 + 5) and p["rcv_bytes"] == 0 and "saturated" not in p


@pytest.mark.parametrize(("text", "expected"), [
    ("100 Gb/sec (4X EDR)", (100.0, 4, "EDR")), ("25 Gb/sec (1X EDR)", (25.0, 1, "EDR")),
    ("10 Gb/sec (4X)", (10.0, 4, None)), ("2.5 Gb/sec (1X SDR)", (2.5, 1, "SDR")),
    ("400 Gb/sec (4X NDR)", (400.0, 4, "NDR")), ("56 Gb/sec (4X FDR)", (56.0, 4, "FDR")),
    ("40 Gb/sec (4X FDR10)", (40.0, 4, "FDR10")), ("200 Gb/sec (2X NDR)", (200.0, 2, "NDR")),
    ("", (None, None, None)), ("fast", (None, None, None)),
])
def test_rate_is_parsed(text: str, expected: tuple[float | None, int | None, str | None]) -> None:
    assert parse_rate(text) == expected


def test_unreadable_hw_counter_is_left_out(tmp_path: Path) -> None:
    port = make_port(tmp_path, "mlx5_0", hw={"out_of_sequence": "4", "np_cnp_sent": "not a number",
                                             "rp_cnp_handled": "-1"})
    (port / "hw_counters" / "packet_seq_err").mkdir()  # reading it fails (EISDIR)
    sample = read_network_sample(NODE, ts=TS, root=tmp_path)
    valid(sample)
    assert sample["ports"][0]["hw"] == {"out_of_sequence": 4}  # type: ignore[index]


def test_hw_is_absent_without_hw_counters(tmp_path: Path) -> None:
    make_port(tmp_path, "mlx5_0")
    sample = read_network_sample(NODE, ts=TS, root=tmp_path)
    valid(sample)
    assert "hw" not in sample["ports"][0]  # type: ignore[index]


@pytest.mark.parametrize(
    ("state", "phys", "expected"),
    [
        ("4: ACTIVE", "5: LinkUp", "up"),
        ("4: ACTIVE", "2: Polling", "down"),
        ("4: ACTIVE", "7: Phy Test", "up"),
        ("2: INIT", "5: LinkUp", "down"),
        ("1: DOWN", "3: Disabled", "down"),
        ("garbage", "5: LinkUp", "down"),
    ],
)
def test_state_is_up_only_when_active_and_not_physically_down(tmp_path: Path, state: str, phys: str, expected: str) -> None:
    make_port(tmp_path, "mlx5_0", state=state, phys=phys)
    sample = read_network_sample(NODE, ts=TS, root=tmp_path)
    valid(sample)
    assert sample["ports"][0]["state"] == expected  # type: ignore[index]


def test_missing_state_files_mean_down(tmp_path: Path) -> None:
    port = make_port(tmp_path, "mlx5_0")
    (port / "state").unlink()
    sample = read_network_sample(NODE, ts=TS, root=tmp_path)
    valid(sample)
    assert sample["ports"][0]["state"] == "down"  # type: ignore[index]


def test_ports_are_in_natural_order(tmp_path: Path) -> None:
    for device, port in [("mlx5_10", "1"), ("mlx5_2", "2"), ("mlx5_2", "1"), ("mlx5_1", "1")]:
        make_port(tmp_path, device, port)
    sample = read_network_sample(NODE, ts=TS, root=tmp_path)
    valid(sample)
    ports = [p["port"] for p in sample["ports"]]  # type: ignore[index]
    assert ports == ["mlx5_1/1", "mlx5_2/1", "mlx5_2/2", "mlx5_10/1"]
