"""What a client written from ``schemas/json/`` alone sends, and what it must get back.

The records here are plain JSON written from the JSON Schemas (each is checked against
its schema with ``jsonschema`` before it is sent), not built with fleetmedic's code, and
go through a real worker on the real broker:

1. a job that fails 0.25 s after GPUs on two of its nodes fell off the bus is requeued
   without both nodes, although the second node's evidence is still on its way when the
   failure arrives;
2. a critical NVLink error rate on a node under a running job moves the job off that node
   (from its checkpoint) before it crashes;
3. two jobs that share a node which loses a GPU are each requeued without it.
"""

from __future__ import annotations

import json
import time
from typing import Any

import jsonschema
import pytest

from schemas.jsonschema import JSON_DIR

from .harness import ClusterAPI, Worker, collect, produce

pytestmark = pytest.mark.integration

GPUS = 8
SCHEMAS = {name: json.loads((JSON_DIR / f"{name}.schema.json").read_text()) for name in ("gpu", "job", "verdict")}


def checked(name: str, doc: dict[str, Any]) -> dict[str, Any]:
    jsonschema.validate(doc, SCHEMAS[name])
    return doc


def gpu(node: str, ts: float, *, nvlink_crc: int = 0, nvlink_gpu: int = 3, lost_gpu: int | None = None) -> dict:
    """One telemetry.gpu record (gpu/1): eight busy GPUs; NVLink CRC errors so far on one."""
    crc = [0] * GPUS
    crc[nvlink_gpu] = nvlink_crc
    doc = {"schema": "gpu/1", "ts": ts, "node": node,
           "util": [97.0] * GPUS, "temp": [64.0] * GPUS, "power": [640.0] * GPUS,
           "ecc_sbe": [0] * GPUS, "ecc_dbe": [0] * GPUS, "nvlink_crc": crc, "nvlink_replay": [0] * GPUS,
           "nvlink_recovery": [0] * GPUS, "pcie_replay": [0] * GPUS, "lost": [False] * GPUS}
    if lost_gpu is not None:
        doc["lost"][lost_gpu] = True
        doc["xids"] = [{"gpu": lost_gpu, "code": 79, "detail": "GPU has fallen off the bus."}]
    return checked("gpu", doc)


def job(name: str, event: str, ts: float, nodes: list[str], **extra: Any) -> dict:
    return checked("job", {"schema": "job/1", "ts": ts, "job": name, "event": event, "scheduler": "kubernetes",
                           "nodes": nodes, "attempt": 1, **extra})


@pytest.fixture(scope="module")
def loop(kafka_bootstrap):
    from pipeline.config import load_settings

    api = ClusterAPI(load_settings(environ={}))
    worker = Worker(kafka_bootstrap, sim_url=api.url, env={"FLEETMEDIC_SAFETY__FLEET_SIZE": "100"}).start()
    yield kafka_bootstrap, worker, api
    worker.stop()
    api.close()


def _job_verdicts(bootstrap: str, worker: Worker, jobs: list[str], timeout: float = 60) -> dict[str, list[dict]]:
    recs = collect(bootstrap, worker.topic("verdicts"),
                   lambda rs: all(any(v["scope"] == "job" and v["subject"] == j for v in rs) for j in jobs), timeout)
    # settle: a second verdict for one of them would come within the same grace
    time.sleep(3)
    recs = collect(bootstrap, worker.topic("verdicts"), lambda rs: False, 2)
    out = {j: [checked("verdict", v) for v in recs if v["scope"] == "job" and v["subject"] == j] for j in jobs}
    return out


def test_both_nodes_that_failed_just_before_the_job_are_excluded(loop) -> None:
    bootstrap, worker, api = loop
    nodes = [f"xc1-{i}" for i in range(4)]
    api.add_nodes(nodes)
    api.add_job("xc1-train", nodes)
    t = time.time()
    tg, tj = worker.topic("telemetry.gpu"), worker.topic("telemetry.job")
    items = [(tj, "xc1-train", job("xc1-train", "started", t - 60, nodes))]
    items += [(tg, n, gpu(n, t - 10)) for n in nodes]
    items += [(tg, "xc1-0", gpu("xc1-0", t, lost_gpu=2)),
              (tg, "xc1-1", gpu("xc1-1", t + 0.1, lost_gpu=5)),
              (tj, "xc1-train", job("xc1-train", "failed", t + 0.25, nodes, exit_code=1, origin_node="xc1-0",
                                    reason="Error", log_tail="RuntimeError: CUDA error: unknown error"))]
    # the fleet's telemetry goes on, so event time moves past the failure's grace
    items += [(tg, n, gpu(n, t + 5)) for n in nodes[2:]]
    produce(bootstrap, items)
    [v] = _job_verdicts(bootstrap, worker, ["xc1-train"])["xc1-train"]
    [a] = v["actions"]
    assert a["action"] == "requeue"
    assert a["params"]["exclude"] == ["xc1-0", "xc1-1"], v
    assert v["fault_class"] == "gpu_hardware"


def test_a_critical_nvlink_error_rate_moves_the_running_job_before_it_crashes(loop) -> None:
    bootstrap, worker, api = loop
    nodes = ["xc2-0", "xc2-1"]
    api.add_nodes(nodes)
    api.add_job("xc2-train", nodes)
    tg, tj = worker.topic("telemetry.gpu"), worker.topic("telemetry.job")
    t = time.time()
    start = t - 1800  # event time: 25 quiet minutes, then 5 minutes of NVLink CRC errors on xc2-0
    items = [(tj, "xc2-train", job("xc2-train", "started", start - 30, nodes)),
             (tj, "xc2-train", job("xc2-train", "checkpoint", start + 600, nodes, checkpoint_step=1200))]
    crc = 0
    for i in range(61):
        ts = start + 30 * i
        if ts >= t - 300:
            crc += 400
        items += [(tg, "xc2-0", gpu("xc2-0", ts, nvlink_crc=crc)), (tg, "xc2-1", gpu("xc2-1", ts))]
    produce(bootstrap, items)
    verdicts = _job_verdicts(bootstrap, worker, ["xc2-train"])["xc2-train"]
    [v] = verdicts  # no job failure was ever sent: the job was moved while it ran
    [a] = v["actions"]
    assert (a["action"], a["params"]["exclude"], a["params"]["from_checkpoint"]) == ("requeue", ["xc2-0"], True)
    assert v["fault_class"] == "nvlink"
    assert v["evidence"]["checkpoint"]["step"] == 1200
    node = [x for x in collect(bootstrap, worker.topic("verdicts"), lambda rs: False, 2)
            if x["scope"] == "node" and x["subject"] == "xc2-0"]
    assert node and [p["action"] for p in node[0]["actions"]][:2] == ["isolate", "drain"]
    assert node[0]["incident"] == v["incident"]


def test_every_job_on_a_node_that_fails_is_requeued_without_it(loop) -> None:
    bootstrap, worker, api = loop
    api.add_nodes(["xc3-0", "xc3-1", "xc3-2"])
    api.add_job("xc3-a", ["xc3-0", "xc3-1"])
    tg, tj = worker.topic("telemetry.gpu"), worker.topic("telemetry.job")
    t = time.time()
    # two 4-GPU jobs share xc3-0 (an external scheduler's placement; the simulated cluster
    # keeps one job per node, which the check below does not need)
    items = [(tj, "xc3-a", job("xc3-a", "started", t - 120, ["xc3-0", "xc3-1"])),
             (tj, "xc3-b", job("xc3-b", "started", t - 90, ["xc3-0", "xc3-2"]))]
    items += [(tg, n, gpu(n, t - 5)) for n in ("xc3-0", "xc3-1", "xc3-2")]
    items += [(tg, "xc3-0", gpu("xc3-0", t, lost_gpu=6))]
    items += [(tg, n, gpu(n, t + 5)) for n in ("xc3-1", "xc3-2")]
    produce(bootstrap, items)
    got = _job_verdicts(bootstrap, worker, ["xc3-a", "xc3-b"])
    for name in ("xc3-a", "xc3-b"):
        [v] = got[name]
        [a] = v["actions"]
        assert (a["action"], a["params"]["exclude"]) == ("requeue", ["xc3-0"]), v
