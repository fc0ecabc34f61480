"""The JSON Schemas in schemas/json/ refuse what the worker refuses.

An integrator who validates with the published schemas alone (the ``jsonschema``
library here) must never send a record the worker dead-letters.  Real records (from the
upstream fixtures and from the detectors and policy run on them) are mutated at random;
every mutation the worker's decoder refuses must fail the schema too.  (The reverse is
allowed: the decoder coerces a few things a strict schema refuses, e.g. ``"5"`` for 5.)
"""

from __future__ import annotations

import copy
import json
import random
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from pipeline.correlate import policy, state
from pipeline.config import DetectorSettings, PolicySettings
from pipeline.actuate.control import dry_run_record, held_record
from pipeline.detect.glue import GpuDetection, NetworkDetection
from schemas import GpuSample, JobEvent, NetworkSample
from schemas.codec import DecodeError, dead_letter, decode
from schemas.jsonschema import JSON_DIR
from schemas.records import PUBLIC_RECORDS, ActionRecord

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures"


def validator(name: str) -> jsonschema.protocols.Validator:
    schema = json.loads((JSON_DIR / f"{name}.schema.json").read_text())
    cls = jsonschema.validators.validator_for(schema)
    cls.check_schema(schema)
    return cls(schema)


def examples() -> dict[str, list[dict[str, Any]]]:
    """Records of every public kind, from real input through the real code."""
    gpu = [json.loads((FIXTURES / "dcgm-exporter" / "upstream" / f).read_text())
           for f in ("datadog-dcgm-metrics.expected.json", "hostname-lowercase.expected.json")]
    gpu = [r for g in gpu for r in (g if isinstance(g, list) else g.get("records", [g]))]
    network = [json.loads((FIXTURES / d / "infiniband.expected.json").read_text()) for d in ("node_exporter", "procfs")]
    rated = NetworkDetection(DetectorSettings())
    rated.net = rated.net.model_copy(update={"rated_gbps": {"mlx5_0": 100.0}})
    anomalies = rated.process([decode(NetworkSample, json.dumps(network[1]))])
    xid_sample = copy.deepcopy(gpu[0])
    xid_sample["xids"] = [{"gpu": 0, "code": 79, "detail": "GPU has fallen off the bus."}]
    (xid,) = [a for a in GpuDetection(DetectorSettings()).process([decode(GpuSample, json.dumps(xid_sample))])
              if a.kind == "xid"]
    decision = policy.node_on_anomaly(state.new_node(), xid, PolicySettings())
    verdicts = decision.verdicts
    assert anomalies and verdicts
    first = verdicts[0]
    actions = [ActionRecord(ts=first.ts, key=f"{first.id}:{a.action.value}:{a.target}", verdict_id=first.id,
                            action=a.action, target=a.target, backend="kubernetes", outcome="applied", detail="cordoned")
               for a in first.actions]
    torchrun = (FIXTURES / "torchrun" / "minigpt4-237.txt").read_text()[-4000:]
    jobs = [
        JobEvent(ts=1_700_000_000.0, job="llm-pretrain-7", event="failed", scheduler="slurm",
                 nodes=["gpu-node-017", "gpu-node-018"], attempt=2, exit_code=1, reason="NonZeroExitCode",
                 log_tail=torchrun, origin_node="gpu-node-018", exclude=["gpu-node-003"]),
        JobEvent(ts=1_700_000_060.0, job="llm-pretrain-7", event="progress", scheduler="kubernetes",
                 nodes=["gpu-node-017", "gpu-node-018"], step=1200, step_time=1.92,
                 node_step_times={"gpu-node-017": 1.9, "gpu-node-018": 2.6},
                 node_power={"gpu-node-017": 690.0, "gpu-node-018": 512.5}),
        JobEvent(ts=1_700_000_120.0, job="llm-pretrain-7", event="checkpoint", nodes=["gpu-node-017"],
                 checkpoint_step=1200),
    ]
    dl = dead_letter(source_topic="fleetmedic.telemetry.gpu", reason="invalid JSON", payload=b"{", ts=1.0, key=b"n")
    held = {**actions[0].to_dict(), "outcome": "held_by_budget", "detail": "held: circuit breaker budget 0 of 1 left"}
    control = [dry_run_record(True, "alice@example.org", "maintenance window", ts=1_700_000_200.0),
               held_record(held, ts=1_700_000_201.0)]
    return {
        "gpu": gpu, "network": network, "anomaly": [a.to_dict() for a in anomalies + [xid]],
        "verdict": [v.to_dict() for v in verdicts], "action": [a.to_dict() for a in actions],
        "job": [j.to_dict() for j in jobs], "deadletter": [dl.to_dict()],
        "control": [c.to_dict() for c in control],
    }


EXAMPLES = examples()


def worker_accepts(name: str, doc: Any) -> bool:
    try:
        decode(PUBLIC_RECORDS[name], json.dumps(doc))
    except DecodeError:
        return False
    return True


@pytest.mark.parametrize("name", sorted(PUBLIC_RECORDS))
def test_real_records_pass_both(name: str) -> None:
    v = validator(name)
    assert EXAMPLES[name], name
    for doc in EXAMPLES[name]:
        assert worker_accepts(name, doc)
        errors = [e.message for e in v.iter_errors(doc)]
        assert not errors, errors[:3]


BAD_VALUES: list[Any] = [None, -1, -0.5, 2**63, 1e300, "", "x" * 300, "x" * 9000, True, [], {}, 1.5, "5",
                         [None], [-1], ["a"], {"a": 1}]


def _paths(doc: Any, here: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [here]
    if isinstance(doc, dict):
        for k, v in doc.items():
            out.extend(_paths(v, (*here, k)))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            out.extend(_paths(v, (*here, i)))
    return out


def _mutate(doc: Any, rng: random.Random) -> Any:
    doc = copy.deepcopy(doc)
    path = rng.choice(_paths(doc)[1:])
    parent = doc
    for p in path[:-1]:
        parent = parent[p]
    last = path[-1]
    op = rng.random()
    if op < 0.1 and isinstance(parent, dict):
        del parent[last]
    elif op < 0.2 and isinstance(parent, dict):
        parent[rng.choice(["", "x" * 300, "bad name!", "-lead", "ok-name"])] = parent.pop(last)
    elif op < 0.35 and isinstance(parent[last], list):
        lst = parent[last]
        if lst and rng.random() < 0.5:
            lst.pop(rng.randrange(len(lst)))
        else:
            lst.append(copy.deepcopy(rng.choice(lst)) if lst else rng.choice(BAD_VALUES))
    else:
        parent[last] = copy.deepcopy(rng.choice(BAD_VALUES))
    return doc


@pytest.mark.parametrize("name", sorted(PUBLIC_RECORDS))
def test_mutated_records_the_worker_refuses_fail_the_schema(name: str) -> None:
    v = validator(name)
    rng = random.Random(f"parity-{name}")
    holes, refused = [], 0
    for _ in range(1500):
        doc = _mutate(rng.choice(EXAMPLES[name]), rng)
        if worker_accepts(name, doc):
            continue
        refused += 1
        if v.is_valid(doc):
            holes.append(doc)
    assert refused > 100, refused  # the mutations do reach the decoder's rules
    assert not holes, f"{len(holes)} records pass {name}.schema.json that the worker refuses, e.g. " + json.dumps(
        holes[0])[:600]


def test_the_cross_field_rules_are_in_the_schema() -> None:
    gpu = copy.deepcopy(EXAMPLES["gpu"][0])
    n = len(gpu["util"])
    v = validator("gpu")
    assert v.is_valid(gpu)
    short = {**gpu, "temp": gpu["temp"][:-1]}
    assert not worker_accepts("gpu", short) and not v.is_valid(short)
    bad_xid = {**gpu, "xids": [{"gpu": n, "code": 79}]}
    assert not worker_accepts("gpu", bad_xid) and not v.is_valid(bad_xid)
    ok_xid = {**gpu, "xids": [{"gpu": n - 1, "code": 79}]}
    assert worker_accepts("gpu", ok_xid) and v.is_valid(ok_xid)
    net = copy.deepcopy(EXAMPLES["network"][0])  # node_exporter's tree: null counters
    assert validator("network").is_valid(net)
    old = {**net, "schema": "network/1"}
    assert not worker_accepts("network", old) and not validator("network").is_valid(old)
