"""GPU detection's findings on a fixed stream, against those recorded before the hot path
read columns.

``tests/fixtures/detect/gpu-findings.json.gz`` holds the anomalies and refusals that
GPU detection produced on :func:`stream` when it still decoded every message into a
record and converted each round's lists itself (the implementation of commit 0980ce0).
Detection over decoded columns must give the same, byte for byte, whether it is fed
records or messages decoded by the hot path's batch decoder.

The stream: 24 nodes (every fifth with 4 GPUs, the rest with 8) sampled every 5 s for
2.5 hours, with a rising single-bit ECC rate, a double-bit error and a failed row
remap, a GPU fallen off the bus with its Xid 79, thermal throttling, NVLink and PCIe
error bursts, a power drop and a temperature jump, Xid 13 and 48 and an SXid; and what
real transport and agents add: absent fields, null entries, redelivered and delayed
samples, and batches holding several samples of a node.

Regenerate (only when a change of findings is intended, and say why in the commit):
``python -m tests.unit.pipeline.test_detect_golden > tests/fixtures/detect/gpu-findings.json``
then gzip it.
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import orjson

GOLDEN = Path(__file__).resolve().parents[2] / "fixtures" / "detect" / "gpu-findings.json.gz"
T0 = 1_790_000_000.0
#: NVIDIA driver text for the Xids of the stream (as the kernel prints it after the code)
XID_TEXT = {79: "GPU has fallen off the bus.", 13: "Graphics SM Warp Exception on (GPC 0, TPC 1, SM 0): Out Of Range Address",
            48: "An uncorrectable double bit error (DBE) has been detected on GPU in the framebuffer at partition 6, subpartition 0."}


def stream(nodes: int = 24, steps: int = 1800, every: float = 5.0, seed: int = 11) -> Iterator[list[bytes]]:
    """Batches of ``telemetry.gpu`` messages, as a worker would read them."""
    rng = np.random.default_rng(seed)
    gpus = [4 if i % 5 == 1 else 8 for i in range(nodes)]
    counters = ("ecc_sbe", "ecc_dbe", "nvlink_crc", "nvlink_replay", "nvlink_recovery", "pcie_replay")
    count = [{c: np.zeros(g, dtype=np.int64) for c in counters} for g in gpus]
    held: list[bytes] = []
    pending: list[bytes] = []
    for k in range(steps):
        t = T0 + k * every
        s = k * every  # seconds into the stream
        for i, g in enumerate(gpus):
            busy = not (i == 11 and 1500 <= s < 2500)
            util = np.clip(rng.normal(92.0, 3.0, g), 0, 100) if busy else np.zeros(g)
            temp = rng.normal(66.0, 1.0, g) if busy else rng.normal(40.0, 1.0, g)
            power = rng.normal(650.0, 10.0, g) if busy else rng.normal(90.0, 5.0, g)
            throttle = np.zeros(g, dtype=np.int64)
            lost = np.zeros(g, dtype=bool)
            remap_failure = np.zeros(g, dtype=bool)
            xids: list[dict[str, Any]] = []
            sxids: list[dict[str, Any]] = []
            c = count[i]
            if i == 2 and s >= 3000:  # a single-bit ECC rate rising e-fold every 10 minutes
                c["ecc_sbe"][3] += rng.poisson(0.05 * np.exp((s - 3000) / 600.0))
            if i == 3 and s >= 4000:
                if s == 4000:
                    c["ecc_dbe"][1] += 1
                    xids.append({"gpu": 1, "code": 48, "detail": XID_TEXT[48], "source": "kernel"})
                remap_failure[1] = s >= 4005
            if i == 6 and 2000 <= s < 3200:  # HW and SW thermal slowdown
                throttle[2] = 0x20 | 0x40
                temp[2] = rng.normal(91.0, 0.5)
            if i == 7 and s >= 6000 and k % 3 == 0:
                c["nvlink_crc"][5] += rng.poisson(40)
                c["nvlink_replay"][5] += rng.poisson(5)
            if i == 8 and s >= 3500:
                power[0] = rng.normal(420.0, 5.0)
            if i == 9 and s >= 4500:
                temp[4] += 11.0
            if i == 10 and s >= 5000:
                c["pcie_replay"][0] += rng.poisson(3.0)
            if i == 12 and s in (2600.0, 7000.0):
                code = 13 if s == 2600.0 else 79
                xids.append({"gpu": 6, "code": code, "detail": XID_TEXT[code], "source": "kernel"})
            if i == 13 and s == 5555.0:
                sxids.append({"code": 12028, "fatal": True, "switch_pci_bus_id": "0000:05:00",
                              "detail": "NVSwitch link training failed"})
            doc: dict[str, Any] = {
                "schema": "gpu/1", "ts": t, "node": f"node-{i:03d}",
                "util": np.round(util, 1).tolist(), "temp": np.round(temp, 1).tolist(),
                "power": np.round(power, 1).tolist(), "throttle": throttle.tolist(),
                "remap_failure": remap_failure.tolist(), "lost": lost.tolist(),
                **{name: c[name].tolist() for name in counters}, "xids": xids, "sxids": sxids,
            }
            if i == 4 and s >= 5000:  # GPU 5 fell off the bus: null but for lost
                if s == 5000:
                    doc["xids"] = [{"gpu": 5, "code": 79, "detail": XID_TEXT[79], "source": "kernel"}]
                for name, v in doc.items():
                    if isinstance(v, list) and name not in ("xids", "sxids"):
                        v[5] = True if name == "lost" else None
            r = rng.random()
            if r < 0.02:
                doc.pop(str(rng.choice(["temp", "power", "ecc_sbe", "throttle", "nvlink_crc", "lost", "pcie_replay"])))
            elif r < 0.04:
                name = str(rng.choice(["temp", "power", "ecc_sbe", "ecc_dbe", "throttle", "nvlink_replay", "util"]))
                doc[name][int(rng.integers(g))] = None
            msg = orjson.dumps(doc)
            pending.append(msg)
            if r > 0.995:
                pending.append(msg)   # redelivered
            elif r > 0.99:
                held.append(msg)      # delayed: arrives later, late or in order
        if held and rng.random() < 0.05:
            pending.append(held.pop(0))
        if k % 4 != 3:  # most batches hold three steps: several samples of a node
            continue
        yield pending
        pending = []
    if pending:
        yield pending


def findings(decoded: bool) -> dict[str, Any]:
    """Run GPU detection over :func:`stream`: on records (``decoded`` False), or on the
    hot path's decoded batches."""
    from pipeline.config import DetectorSettings
    from pipeline.detect.glue import GpuDetection, decode_gpu
    from schemas import GpuSample, decode

    det = GpuDetection(DetectorSettings())
    anomalies: list[dict[str, Any]] = []
    refused: list[list[Any]] = []
    for n, batch in enumerate(stream()):
        if decoded:
            got = decode_gpu(batch)
            assert not got.errors
            found = det.process(got.samples)
        else:
            found = det.process([decode(GpuSample, m) for m in batch])
        anomalies += [a.to_dict() for a in found]
        refused += [[n, r.position, r.why, r.node, r.ts] for r in det.refused]
    return {"anomalies": anomalies, "refused": refused}


def _golden() -> dict[str, Any]:
    with gzip.open(GOLDEN, "rt") as f:
        data: dict[str, Any] = json.load(f)
    return _rounded(data)


def _rounded(x: Any) -> Any:
    """``x`` with every float to 10 significant digits: the recording is compared to what
    this machine computes, and SciPy's tail probabilities (the rate scores) may differ in
    the last bit from one release to the next.  The two paths on one machine are compared
    exactly."""
    if isinstance(x, float):
        return float(f"{x:.10g}")
    if isinstance(x, dict):
        return {k: _rounded(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_rounded(v) for v in x]
    return x


def test_the_golden_stream_covers_every_gpu_finding_kind() -> None:
    kinds = {(a["detector"], a["kind"]) for a in _golden()["anomalies"]}
    assert kinds >= {("gpu_hard", "ecc_dbe"), ("gpu_hard", "row_remap_failure"), ("gpu_hard", "gpu_lost"),
                     ("xid", "xid"), ("sxid", "sxid"), ("rate_change", "ecc_sbe_rate"),
                     ("rate_change", "nvlink_error_rate"), ("rate_change", "pcie_replay_rate"),
                     ("throttle", "thermal_throttle"), ("univariate", "power_drift"), ("univariate", "temp_drift")}
    assert {r[2] for r in _golden()["refused"]} == {"duplicate", "late"}


def test_findings_on_records_are_those_recorded_before_columns() -> None:
    assert _rounded(findings(decoded=False)) == _golden()


def test_findings_on_decoded_batches_are_those_recorded_before_columns() -> None:
    got = findings(decoded=True)
    assert _rounded(got) == _golden()
    assert got == findings(decoded=False)  # the hot path's decoding and records agree exactly


def test_findings_on_batches_of_one_sample_per_node_are_those_recorded() -> None:
    """The usual batch (each node once) takes a path of its own; cut the same stream so
    that every batch is one, the findings are the same (refusals are numbered by batch,
    so those are compared by sample; findings of different nodes are ordered by batch)."""
    from pipeline.config import DetectorSettings
    from pipeline.detect.glue import GpuDetection, decode_gpu

    det = GpuDetection(DetectorSettings())
    anomalies: list[dict[str, Any]] = []
    refused: list[tuple[str, str, float]] = []
    for batch in stream():
        cut: list[list[bytes]] = [[]]
        seen: set[str] = set()
        for m in batch:
            node = orjson.loads(m)["node"]
            if node in seen:
                cut.append([])
                seen = set()
            seen.add(node)
            cut[-1].append(m)
        for part in cut:
            anomalies += [a.to_dict() for a in det.process(decode_gpu(part).samples)]
            refused += [(r.why, r.node, r.ts) for r in det.refused]
    golden = _golden()

    def canonical(found: list[dict[str, Any]]) -> list[str]:
        # the order of findings of different nodes follows the batches; each node's own do not
        return sorted(json.dumps(a, sort_keys=True) for a in found)

    assert canonical(_rounded(anomalies)) == canonical(golden["anomalies"])
    assert sorted(refused) == sorted((why, node, ts) for _, _, why, node, ts in golden["refused"])


def test_upstream_dcgm_exporter_records_give_the_same_findings_as_records_and_as_decoded_batches() -> None:
    """Input this project did not write: the records that upstream dcgm-exporter output
    (tests/fixtures/dcgm-exporter/upstream, with Xid counts and a throttle mask) gives,
    scraped again and again with their counters moving, through both paths."""
    from pipeline.config import DetectorSettings
    from pipeline.detect.glue import GpuDetection, decode_gpu
    from schemas import GpuSample, decode

    upstream = GOLDEN.parents[1] / "dcgm-exporter" / "upstream"
    records = [r for p in sorted(upstream.glob("*.expected.json")) for r in json.loads(p.read_text())["records"]]
    batches = []
    for k in range(40):
        batch = []
        for r in records:
            doc = {**r, "ts": r["ts"] + 10.0 * k}
            if "ecc_dbe" in doc and k == 30:
                doc["ecc_dbe"] = [v + 1 if v is not None else v for v in doc["ecc_dbe"]]
            if k != 5:
                doc["xids"] = []  # the exporter's Xid counts in the sixth scrape only
            batch.append(orjson.dumps(doc))
        batches.append(batch)
    by_records, by_batches = GpuDetection(DetectorSettings()), GpuDetection(DetectorSettings())
    one = [a.to_dict() for b in batches for a in by_records.process([decode(GpuSample, m) for m in b])]
    two = [a.to_dict() for b in batches for a in by_batches.process(decode_gpu(b).samples)]
    assert one == two
    assert {a["detector"] for a in one} >= {"xid"}


if __name__ == "__main__":
    print(json.dumps(findings(decoded=False), sort_keys=True, separators=(",", ":")))
