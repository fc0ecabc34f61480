"""InfiniBand ports as other projects' fixtures describe them: node_exporter's and procfs's
sysfs trees (ttar), and node_exporter's own metrics for its tree (see the fixtures' READMEs)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from pipeline.collect.infiniband import read_network_sample
from pipeline.collect.node_exporter import parse_node_exporter
from pipeline.config import DetectorSettings, NetworkSettings
from pipeline.detect.glue import NetworkDetection
from schemas import NetworkSample
from schemas.codec import decode
from tests.ttar import unpack

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures"
NODE_EXPORTER = FIXTURES / "node_exporter"
PROCFS = FIXTURES / "procfs"
TS = 1_700_000_000.0
NODE = "fixture-node"


def tree(tmp_path: Path, where: Path, strip: str = "") -> Path:
    return unpack(where / "infiniband.ttar", tmp_path, strip=strip) / "sys" / "class" / "infiniband"


def expected(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())


def by_port(rec: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {p["port"]: p for p in rec["ports"]}


# ------------------------------------------------------------------ the ttar helper


def test_ttar_unpacks_files_without_final_newline(tmp_path: Path) -> None:
    root = tree(tmp_path, PROCFS, "fixtures/")
    assert (root / "mlx5_0" / "node_guid").read_text() == "0a7f:bc12:45ef:d23b"
    assert (root / "mlx5_0" / "ports" / "1" / "rate").read_text() == "25 Gb/sec (1X EDR)\n"
    assert not (tmp_path / "fixtures").exists()


def test_ttar_refuses_a_path_outside_the_target(tmp_path: Path) -> None:
    bad = tmp_path / "bad.ttar"
    bad.write_text("# ttar - - -\nPath: ../escape\nLines: 1\nx\nMode: 644\n")
    with pytest.raises(ValueError, match="leaves the target"):
        unpack(bad, tmp_path / "into")


# ------------------------------------------------------------------ node_exporter's sysfs tree


def test_node_exporter_tree_gives_the_expected_record(tmp_path: Path) -> None:
    rec = read_network_sample(NODE, ts=TS, root=tree(tmp_path, NODE_EXPORTER))
    assert rec == expected(NODE_EXPORTER / "infiniband.expected.json")
    decode(NetworkSample, json.dumps(rec))


def test_no_pma_port_is_unknown_not_idle(tmp_path: Path) -> None:
    port = by_port(read_network_sample(NODE, ts=TS, root=tree(tmp_path, NODE_EXPORTER)))["i40iw0/1"]
    counters = ("symbol_errors", "link_error_recovery", "link_downed", "rcv_errors", "xmit_discards", "xmit_wait",
                "xmit_bytes", "rcv_bytes")
    assert all(port[c] is None for c in counters)
    assert port["state"] == "up" and port["rate_gbps"] == 10.0 and port["width"] == 4


def test_counters_ext_gives_the_bytes_counters_misses(tmp_path: Path) -> None:
    ports = by_port(read_network_sample(NODE, ts=TS, root=tree(tmp_path, NODE_EXPORTER)))
    # counters/port_rcv_data of mlx4_0/2 is 0; counters_ext/port_rcv_data_64 holds 4631917 words
    assert ports["mlx4_0/2"]["rcv_bytes"] == 4 * 4631917 == 18527668
    assert ports["mlx4_0/2"]["xmit_bytes"] == 4 * 3733440


def test_saturated_xmit_wait_is_flagged_not_a_value(tmp_path: Path) -> None:
    port = by_port(read_network_sample(NODE, ts=TS, root=tree(tmp_path, NODE_EXPORTER)))["mlx4_0/1"]
    assert port["xmit_wait"] is None and port["saturated"] == ["xmit_wait"]
    assert port["xmit_discards"] == 5


def _node_exporter_metrics() -> dict[tuple[str, str, str], float]:
    text = (NODE_EXPORTER / "infiniband-e2e-output.txt").read_text()
    return {(s.name, s.labels["device"], s.labels["port"]): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples if "port" in s.labels}


#: record field -> node_exporter's metric for the same value
SAME_VALUE = {
    "link_error_recovery": "node_infiniband_link_error_recovery_total",
    "link_downed": "node_infiniband_link_downed_total",
    "rcv_errors": "node_infiniband_port_errors_received_total",
    "xmit_discards": "node_infiniband_port_discards_transmitted_total",
    "xmit_bytes": "node_infiniband_legacy_data_transmitted_bytes_total",
    "rcv_bytes": "node_infiniband_legacy_data_received_bytes_total",
}


def test_sysfs_reading_agrees_with_node_exporters_own_numbers(tmp_path: Path) -> None:
    metrics = _node_exporter_metrics()
    ports = by_port(read_network_sample(NODE, ts=TS, root=tree(tmp_path, NODE_EXPORTER)))
    compared = 0
    for port_id, port in ports.items():
        device, number = port_id.split("/")
        for field, metric in SAME_VALUE.items():
            theirs = metrics.get((metric, device, number))
            assert (port[field] is None) == (theirs is None), (port_id, field, theirs)
            if theirs is not None:
                assert port[field] == theirs, (port_id, field)
                compared += 1
        assert port["rate_gbps"] == metrics[("node_infiniband_rate_bytes_per_second", device, number)] * 8 / 1e9
        assert (port["state"] == "up") == (metrics[("node_infiniband_state_id", device, number)] == 4)
        # node_exporter passes the saturated value on; fleetmedic names it instead
        wait = metrics.get(("node_infiniband_port_transmit_wait_total", device, number))
        assert port["xmit_wait"] is None and (wait is None or "xmit_wait" in port["saturated"])
    assert compared == 10  # mlx4_0/1: all six; mlx4_0/2: no error counters but the two link counters


# ------------------------------------------------------------------ node_exporter's metrics as the source


def test_node_exporter_metrics_give_the_expected_record() -> None:
    rec = parse_node_exporter((NODE_EXPORTER / "infiniband-e2e-output.txt").read_text(), NODE, ts=TS)
    assert rec == expected(NODE_EXPORTER / "infiniband-e2e-output.expected.json")
    decode(NetworkSample, json.dumps(rec))


def test_node_exporter_metrics_and_the_sysfs_tree_they_came_from_agree(tmp_path: Path) -> None:
    """node_exporter does not export width, lane speed, link layer or hw counters; every
    other field of every port is the same whichever source is read."""
    from_metrics = by_port(parse_node_exporter((NODE_EXPORTER / "infiniband-e2e-output.txt").read_text(), NODE,
                                               ts=TS))
    from_sysfs = by_port(read_network_sample(NODE, ts=TS, root=tree(tmp_path, NODE_EXPORTER)))
    assert from_metrics.keys() == from_sysfs.keys()
    for port_id, port in from_sysfs.items():
        shared = {k: v for k, v in port.items() if k not in ("width", "speed", "link_layer", "hw")}
        assert from_metrics[port_id] == shared


def test_node_exporter_metrics_without_infiniband_give_nothing() -> None:
    text = "# TYPE node_load1 gauge\nnode_load1 0.5\n"
    assert parse_node_exporter(text, NODE, ts=TS) is None


# ------------------------------------------------------------------ procfs's tree


def test_procfs_tree_gives_the_expected_record(tmp_path: Path) -> None:
    rec = read_network_sample(NODE, ts=TS, root=tree(tmp_path, PROCFS, "fixtures/"))
    assert rec == expected(PROCFS / "infiniband.expected.json")
    decode(NetworkSample, json.dumps(rec))
    ports = by_port(rec)
    assert ports["hfi1_0/1"]["xmit_bytes"] == 4 * 273558326543  # 64-bit, above 2**32: not saturated
    assert (ports["mlx5_0/1"]["rate_gbps"], ports["mlx5_0/1"]["width"], ports["mlx5_0/1"]["speed"]) == (25.0, 1, "EDR")
    assert ports["mlx5_0/1"]["hw"]["roce_adp_retrans"] == 99 and "lifespan" not in ports["mlx5_0/1"]["hw"]


# ------------------------------------------------------------------ a link that trained down


def _detector(**net: Any) -> NetworkDetection:
    return NetworkDetection(DetectorSettings(), net=NetworkSettings(**net))


def test_port_below_its_rated_speed_is_a_finding(tmp_path: Path) -> None:
    rec = decode(NetworkSample, json.dumps(read_network_sample(NODE, ts=TS, root=tree(tmp_path, PROCFS, "fixtures/"))))
    found = _detector(rated_gbps={"mlx5_0": 100}).process([rec])
    assert [(a.kind, a.subject) for a in found] == [("link_degraded", f"{NODE}/mlx5_0/1")]
    ev = found[0].evidence
    assert (ev["rate_gbps"], ev["expected_gbps"], ev["width"], ev["basis"]) == (25.0, 100.0, 1, "rated")
    # without a rated speed the EDR port has no alike peer on this node: no finding
    assert _detector().process([rec]) == []


def test_port_below_its_alike_peers_is_a_finding(tmp_path: Path) -> None:
    """Eight ports of procfs's mlx5 adapter on one node; seven trained to 4X, one stayed
    at the 1X it has in the fixture."""
    src = tree(tmp_path / "src", PROCFS, "fixtures/") / "mlx5_0"
    root = tmp_path / "node"
    for k in range(8):
        shutil.copytree(src, root / f"mlx5_{k}")
        if k != 5:
            (root / f"mlx5_{k}" / "ports" / "1" / "rate").write_text("100 Gb/sec (4X EDR)\n")
    rec = decode(NetworkSample, json.dumps(read_network_sample(NODE, ts=TS, root=root)))
    found = _detector().process([rec])
    assert [(a.kind, a.evidence["port"], a.evidence["basis"], a.evidence["expected_gbps"]) for a in found] == [
        ("link_degraded", "mlx5_5/1", "node_peers", 100.0)]


def test_port_that_falls_below_its_own_past_is_a_finding(tmp_path: Path) -> None:
    root = tree(tmp_path, PROCFS, "fixtures/")
    rate = root / "mlx5_0" / "ports" / "1" / "rate"
    det = _detector()
    rate.write_text("100 Gb/sec (4X EDR)\n")
    assert det.process([decode(NetworkSample, json.dumps(read_network_sample(NODE, ts=TS, root=root)))]) == []
    rate.write_text("25 Gb/sec (1X EDR)\n")  # the link retrained on one lane
    found = det.process([decode(NetworkSample, json.dumps(read_network_sample(NODE, ts=TS + 10, root=root)))])
    assert [(a.kind, a.evidence["basis"], a.evidence["expected_gbps"]) for a in found] == [
        ("link_degraded", "own_history", 100.0)]


def test_unknown_counters_never_make_increments(tmp_path: Path) -> None:
    """The no-PMA and saturated ports of node_exporter's tree: a later sample whose counters
    become readable again does not count everything up to them as new errors."""
    root = tree(tmp_path, NODE_EXPORTER)
    det = _detector()
    first = decode(NetworkSample, json.dumps(read_network_sample(NODE, ts=TS, root=root)))
    assert det.process([first]) == []
    for name, value in (("symbol_error", "60000"), ("port_rcv_errors", "9000"), ("link_downed", "0")):
        (root / "i40iw0" / "ports" / "1" / "counters" / name).write_text(value + "\n")
    (root / "mlx4_0" / "ports" / "1" / "counters" / "port_xmit_wait").write_text("0\n")  # cleared
    second = decode(NetworkSample, json.dumps(read_network_sample(NODE, ts=TS + 10, root=root)))
    assert det.process([second]) == []
    fleet = det.fleets[3]
    i = fleet.index[NODE]
    assert fleet.ftot[i].sum() == 0  # no increments from unknown to known
