"""Every record the demo puts on a public topic is valid under schemas/json/.

``fleetmedic demo`` runs as a new user runs it (its own worker and simulated cluster; on
the test broker with a topic prefix of its own).  Then every record on the public
topics (the telemetry the simulator sent, the worker's anomalies, verdicts, actions and
dead letters) is validated with the ``jsonschema`` library against the published
schema its ``schema`` field names: what an integrator who reads only schemas/json/
would check.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import uuid
from collections import Counter
from pathlib import Path

import jsonschema
import orjson
import pytest
from aiokafka import AIOKafkaConsumer

from schemas.jsonschema import JSON_DIR

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
PUBLIC = ("telemetry.gpu", "telemetry.network", "telemetry.job", "anomalies", "verdicts", "actions", "deadletter")


def _validators() -> dict[str, jsonschema.protocols.Validator]:
    out = {}
    for path in JSON_DIR.glob("*.schema.json"):
        schema = json.loads(path.read_text())
        cls = jsonschema.validators.validator_for(schema)
        cls.check_schema(schema)
        out[path.name.removesuffix(".schema.json")] = cls(schema, format_checker=cls.FORMAT_CHECKER)
    return out


async def _read_all(bootstrap: str, topics: list[str], idle_s: float = 3.0) -> dict[str, list[bytes]]:
    c = AIOKafkaConsumer(*topics, bootstrap_servers=bootstrap, group_id=None, enable_auto_commit=False,
                         auto_offset_reset="earliest")
    await c.start()
    out: dict[str, list[bytes]] = {t: [] for t in topics}
    try:
        quiet = 0.0
        while quiet < idle_s:
            batch = await c.getmany(timeout_ms=500)
            quiet = 0.0 if batch else quiet + 0.5
            for tp, msgs in batch.items():
                out[tp.topic].extend(m.value for m in msgs)
    finally:
        await c.stop()
    return out


def test_every_record_the_demo_publishes_validates_against_the_json_schemas(kafka_bootstrap, tmp_path):
    prefix = f"demo{uuid.uuid4().hex[:8]}."
    env = {**os.environ, "FLEETMEDIC_STATE": str(tmp_path), "FLEETMEDIC_KAFKA__TOPIC_PREFIX": prefix}
    proc = subprocess.run(
        [sys.executable, "-m", "pipeline", "--bootstrap", kafka_bootstrap, "demo", "--duration", "60",
         "--nodes", "16", "--seed", "3", "--no-anomalies"],
        cwd=ROOT, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["verdicts"] > 0, summary

    records = asyncio.run(_read_all(kafka_bootstrap, [prefix + t for t in PUBLIC]))
    validators = _validators()
    seen: Counter[str] = Counter()
    errors: list[str] = []
    for topic, values in records.items():
        for raw in values:
            rec = orjson.loads(raw)
            kind = str(rec.get("schema", "?")).split("/")[0]
            v = validators.get(kind)
            if v is None:
                errors.append(f"{topic}: no published schema for {rec.get('schema')!r}")
                continue
            seen[kind] += 1
            for e in v.iter_errors(rec):
                errors.append(f"{topic} ({rec.get('schema')}): {e.json_path}: {e.message[:200]}")
    assert not errors, f"{len(errors)} invalid records, e.g.:\n" + "\n".join(errors[:20])
    # the demo exercised every kind of record it can publish
    for kind in ("gpu", "network", "job", "anomaly", "verdict", "action"):
        assert seen[kind] > 0, (kind, dict(seen))
