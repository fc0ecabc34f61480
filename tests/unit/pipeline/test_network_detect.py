"""Fabric detection over batches of network samples: link rules, symbol-error rate, order."""

from __future__ import annotations

import numpy as np
import pytest

from pipeline.config import DetectorSettings
from pipeline.detect.glue import NetworkDetection
from schemas import FaultClass, NetworkSample

from .builders import T0

NODE = "node-0001"


def port(name: str, *, switch: str = "leaf-01", state: str = "up", sym: int = 0, downed: int = 0,
         k: int = 0) -> dict:
    return {"port": name, "switch": switch, "state": state, "symbol_errors": sym, "link_error_recovery": 0,
            "link_downed": downed, "rcv_errors": 0, "xmit_discards": 0, "xmit_wait": 1000 * k,
            "xmit_bytes": 25_000_000_000 * k, "rcv_bytes": 25_000_000_000 * k}


def sample(ts: float, ports: list[dict], node: str = NODE) -> NetworkSample:
    return NetworkSample.model_validate({"schema": "network/1", "ts": ts, "node": node, "ports": ports})


def healthy(ts: float, k: int, node: str = NODE) -> NetworkSample:
    return sample(ts, [port(f"mlx5_{p}/1", k=k, switch="leaf-07" if p == 1 else "leaf-01") for p in range(4)], node)


def test_healthy_ports_yield_nothing() -> None:
    det = NetworkDetection(DetectorSettings())
    assert det.process([healthy(T0 + i, i) for i in range(200)]) == []


def test_a_port_that_goes_down_and_one_that_flaps_are_named_with_their_switch() -> None:
    det = NetworkDetection(DetectorSettings())
    det.process([healthy(T0 + i, i) for i in range(10)])
    ports = [port(f"mlx5_{p}/1", k=10) for p in range(4)]
    ports[1] = port("mlx5_1/1", state="down", switch="leaf-07", k=10)  # as cabled from the start
    ports[3] = port("mlx5_3/1", downed=2, k=10)
    found = det.process([sample(T0 + 10, ports)])
    got = {(a.kind, a.subject, a.evidence["switch"], a.fault_class) for a in found}
    assert got == {("link_down", f"{NODE}/mlx5_1/1", "leaf-07", FaultClass.node_network),
                   ("link_flap", f"{NODE}/mlx5_3/1", "leaf-01", FaultClass.node_network)}


def _symbol_ramp(n: int, seed: int) -> list[NetworkSample]:
    """Port 2 starts accumulating symbol errors at sample 200; other ports stay clean."""
    rng = np.random.default_rng(seed)
    sym, out = 0, []
    for i in range(n):
        if i >= 200:
            sym += int(rng.poisson(3))
        ports = [port(f"mlx5_{p}/1", k=i, sym=sym if p == 2 else 0) for p in range(4)]
        out.append(sample(T0 + 10 * i, ports))  # every 10 s, the agent's default
    return out


def test_rising_symbol_errors_are_found_on_the_right_port() -> None:
    found = NetworkDetection(DetectorSettings()).process(_symbol_ramp(300, 0))
    assert found
    assert {(a.subject, a.kind) for a in found} == {(f"{NODE}/mlx5_2/1", "symbol_error_rate")}
    assert min(a.ts for a in found) >= T0 + 200 * 10


@pytest.mark.parametrize("size", [1, 7, 300])
def test_findings_do_not_depend_on_batching(size: int) -> None:
    samples = _symbol_ramp(300, 1)
    whole = [(a.ts, a.subject, a.kind) for a in NetworkDetection(DetectorSettings()).process(samples)]
    det = NetworkDetection(DetectorSettings())
    parts = []
    for k in range(0, len(samples), size):
        parts += [(a.ts, a.subject, a.kind) for a in det.process(samples[k:k + size])]
    assert whole and parts == whole


def test_late_duplicate_and_reordered_samples_are_counted_not_used() -> None:
    det = NetworkDetection(DetectorSettings())
    det.process([healthy(T0 + i, i) for i in range(5)])
    bad = [port(f"mlx5_{p}/1", state="down") for p in range(4)]
    assert det.process([sample(T0 + 4, bad), sample(T0 + 1, bad), sample(T0 + 2.5, bad)]) == []
    assert (det.late, det.duplicates) == (1, 2)
    assert [(r.position, r.why) for r in det.refused] == [(0, "duplicate"), (1, "duplicate"), (2, "late")]


def test_a_node_whose_ports_change_starts_a_new_window() -> None:
    det = NetworkDetection(DetectorSettings())
    det.process([healthy(T0 + i, i) for i in range(5)])
    # re-cabled: three ports now, with large counters; no increment is invented
    ports = [port(f"mlx5_{p}/1", sym=10_000, downed=5, k=5) for p in range(3)]
    assert det.process([sample(T0 + 5, ports)]) == []
    # moved to another switch: a new window too, no flap invented from the old counters
    moved = [port(f"mlx5_{p}/1", sym=10_000, downed=9, k=6, switch="leaf-02") for p in range(3)]
    assert det.process([sample(T0 + 6, moved)]) == []
    # and from there on, a real flap is seen
    flap = [port(f"mlx5_{p}/1", sym=10_000, downed=9 + (p == 0), k=7, switch="leaf-02") for p in range(3)]
    assert [(a.kind, a.evidence["switch"]) for a in det.process([sample(T0 + 7, flap)])] == [("link_flap", "leaf-02")]
    assert det.nodes == 1


def test_the_training_sample_is_the_same_whatever_order_and_batching_the_windows_come_in() -> None:
    """Bottom-k by a stable hash per event-time cell: the rows kept depend on the rows
    alone; a cell is capped, and later cells never push out an earlier cell's rows."""
    from pipeline.detect.glue import FIT_GRID_S, _row_keys

    rng = np.random.default_rng(3)
    n = 30_000
    rows = rng.normal(size=(n, 7))
    ts = T0 + rng.uniform(0, 3 * FIT_GRID_S, n)
    keys = _row_keys(rng.integers(0, 2**32, n).astype(np.uint64), 1, ts)
    a, b = NetworkDetection(DetectorSettings()), NetworkDetection(DetectorSettings())
    a._keep(rows, keys, ts)
    order = rng.permutation(n)
    for part in np.array_split(order, 37):
        b._keep(rows[part], keys[part], ts[part])
    at = (np.floor((T0 + 3 * FIT_GRID_S) / FIT_GRID_S) + 1) * FIT_GRID_S
    assert np.array_equal(a.training_rows(at), b.training_rows(at))
    assert all(len(k) <= a.cell_cap for k, _ in a.cells.values())
    # the keys spread the sample over the whole cell (no bias to early or late rows)
    kept_ts = np.concatenate([ts[np.isin(keys, k)] for k, _ in a.cells.values()])
    assert abs(np.median(kept_ts % FIT_GRID_S) - FIT_GRID_S / 2) < FIT_GRID_S / 10


def test_partition_watermark_waits_for_the_slowest_partition():
    from pipeline.detect.glue import PartitionWatermark

    wm = PartitionWatermark(idle_s=300.0)
    assert wm.value == 0.0
    wm.update(0, 1000.0)
    wm.update(1, 940.0)  # partition 1 is a minute behind: its anomalies may still come
    assert wm.value == 940.0
    wm.update(1, 1010.0)
    wm.update(0, 990.0)  # older than what partition 0 had: ignored
    assert wm.value == 1000.0
    # a partition that went quiet (its nodes left) stops holding the clock after idle_s
    wm.update(0, 1400.0)
    assert wm.value == 1400.0
    # and it never moves backwards when a late partition shows up
    wm.update(2, 1200.0)
    assert wm.value == 1400.0
    with pytest.raises(ValueError):
        PartitionWatermark(idle_s=0)


def test_the_fabric_model_fits_and_scores_alike_at_any_batching_and_interleaving() -> None:
    """A live worker reads nodes' samples in batches that interleave nodes differently at
    each replay speed; with fits on the event-time grid over an order-free sample, and
    each window scored by the model in force at its time, the findings are the same."""
    from pipeline.config import NetworkSettings
    from pipeline.eval.network import Fabric, FabricFault

    step = 10.0
    fab = Fabric(32, 4, step, seed=5)
    t0 = 1_700_000_000.0
    faults = [FabricFault("port_degrade", t0 + 900, t0 + 1e6, node=7, port=1)]
    steps = []
    for k in range(150):
        t = t0 + k * step
        fab.step(t, [f for f in faults if f.start <= t < f.end])
        steps.append(fab.samples(t))
    net = NetworkSettings(min_train_rows=500, refit_s=300)

    def run(chunk: int, reverse: bool) -> tuple[list, int]:
        det = NetworkDetection(DetectorSettings(), net=net)
        found = []
        for k in range(0, len(steps), chunk):
            batch = [s for st in steps[k:k + chunk] for s in (reversed(st) if reverse else st)]
            # per node in time order, nodes interleaved in another order than the other run
            batch.sort(key=lambda s: s.ts)
            found += [(a.ts, a.subject, a.kind) for a in det.process(batch)]
            det.refit(min(s.ts for s in steps[min(k + chunk, len(steps)) - 1]))
        return sorted(found), det.fits

    one, fits_one = run(1, False)
    other, fits_other = run(7, True)
    assert fits_one == fits_other >= 3
    assert one == other
    assert {subj for _, subj, kind in one if kind == "port_errors"} == {"gpu-0007/mlx5_1/1"}, one
