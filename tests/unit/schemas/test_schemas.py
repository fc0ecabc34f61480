"""The wire contract: JSON Schema files, decoding, rejection reasons, dead letters."""

from __future__ import annotations

import json

import pytest

from schemas import DecodeError, GpuSample, JobEvent, dead_letter, decode, encode
from schemas.codec import DEADLETTER_PAYLOAD_BYTES
from schemas.jsonschema import JSON_DIR, expected_files
from schemas.records import PUBLIC_RECORDS
from tests.unit.pipeline.builders import gpu_wire


def _wire(**over) -> bytes:
    return json.dumps(gpu_wire(**over)).encode()


# ------------------------------------------------------------------ JSON Schema files


def test_committed_json_schema_files_match_the_records() -> None:
    expected = expected_files()
    committed = {p.name: p.read_text() for p in JSON_DIR.glob("*.schema.json")}
    stale = sorted(name for name in expected if committed.get(name) != expected[name])
    extra = sorted(set(committed) - set(expected))
    assert not stale and not extra, (
        f"schemas/json/ drifted from schemas/records.py (stale: {stale}, not a record: {extra}); "
        "run `python -m schemas.jsonschema` and commit the result"
    )


@pytest.mark.parametrize("name", sorted(PUBLIC_RECORDS))
def test_every_public_record_schema_declares_its_version_and_timestamp(name: str) -> None:
    schema = json.loads(expected_files()[f"{name}.schema.json"])
    version = PUBLIC_RECORDS[name].model_fields["schema_"].default
    assert "ts" in schema["required"]
    prop = schema["properties"]["schema"]
    assert prop.get("const") == version or version in prop["enum"]
    assert version.startswith(f"{name}/")


# ------------------------------------------------------------------ decoding


def test_a_valid_gpu_sample_round_trips_through_encode() -> None:
    sample = decode(GpuSample, _wire(xids=[{"gpu": 3, "code": 79}]))
    again = decode(GpuSample, encode(sample))
    assert again == sample
    assert again.gpu_count == 8 and again.xids[0].code == 79


def test_a_wire_record_without_schema_is_rejected() -> None:
    body = gpu_wire()
    del body["schema"]
    with pytest.raises(DecodeError) as err:
        decode(GpuSample, json.dumps(body))
    assert "schema" in err.value.reason


def test_records_built_in_code_get_the_current_schema_version() -> None:
    body = gpu_wire()
    del body["schema"]
    assert GpuSample.model_validate(body).schema_ == "gpu/1"


def test_an_unknown_schema_version_is_rejected_with_the_version_named() -> None:
    with pytest.raises(DecodeError) as err:
        decode(GpuSample, _wire(schema="gpu/2"))
    assert err.value.reason.startswith("unsupported schema version 'gpu/2'")


@pytest.mark.parametrize("bad", ["NaN", "Infinity", "-Infinity"])
def test_non_finite_numbers_are_rejected(bad: str) -> None:
    text = json.dumps(gpu_wire()).replace('"ts": 1700000000.0', f'"ts": {bad}')
    assert bad in text
    with pytest.raises(DecodeError) as err:
        decode(GpuSample, text)
    assert err.value.reason == "invalid record: ts: Input should be a finite number"


def test_non_finite_numbers_inside_per_gpu_arrays_are_rejected() -> None:
    text = json.dumps(gpu_wire()).replace('"temp": [65.0,', '"temp": [NaN,')
    with pytest.raises(DecodeError) as err:
        decode(GpuSample, text)
    assert "temp.0: Input should be a finite number" in err.value.reason


def test_per_gpu_arrays_of_unequal_length_are_rejected_naming_the_field() -> None:
    with pytest.raises(DecodeError) as err:
        decode(GpuSample, _wire(ecc_dbe=[0] * 7))
    assert "ecc_dbe: expected 8 entries" in err.value.reason


def test_an_xid_on_a_gpu_the_node_does_not_have_is_rejected() -> None:
    with pytest.raises(DecodeError) as err:
        decode(GpuSample, _wire(xids=[{"gpu": 8, "code": 79}]))
    assert "xids" in err.value.reason


def test_an_oversized_message_is_refused_before_parsing() -> None:
    data = _wire()
    with pytest.raises(DecodeError) as err:
        decode(GpuSample, data, max_bytes=len(data) - 1)
    assert err.value.reason.startswith("oversized message")
    assert decode(GpuSample, data, max_bytes=len(data)).node == "node-0001"


def test_an_empty_message_and_broken_json_have_their_own_reasons() -> None:
    with pytest.raises(DecodeError, match="empty message"):
        decode(JobEvent, None)
    with pytest.raises(DecodeError, match="invalid JSON"):
        decode(JobEvent, b'{"schema": "job/1", ')


# ------------------------------------------------------------------ dead letters


def test_dead_letter_truncates_the_payload_and_keeps_the_reason() -> None:
    payload = b"x" * (DEADLETTER_PAYLOAD_BYTES * 3)
    dl = dead_letter(source_topic="fleetmedic.telemetry.gpu", reason="oversized message", payload=payload,
                     ts=1.0, key=b"node-0001", partition=2, offset=17)
    assert len(dl.payload) == DEADLETTER_PAYLOAD_BYTES
    assert dl.reason == "oversized message"
    assert (dl.key, dl.partition, dl.offset) == ("node-0001", 2, 17)
    assert json.loads(encode(dl))["schema"] == "deadletter/1"


def test_dead_letter_keeps_undecodable_bytes_as_text() -> None:
    dl = dead_letter(source_topic="t", reason="invalid JSON", payload=b"\xff\xfe{", ts=1.0)
    assert dl.payload.endswith("{")


def test_a_job_that_lists_a_node_twice_is_refused_by_the_record_and_its_json_schema() -> None:
    """Found by the chaos fuzzer: one node listed 20,000 times was accepted, and its start
    became 20,000 placement notices, which starved the job and node tracks."""
    import json
    from pathlib import Path

    import jsonschema
    import orjson

    from schemas import JobEvent
    from schemas.codec import DecodeError, decode

    rec = {"schema": "job/1", "ts": 1.8e9, "job": "j", "event": "started", "scheduler": "sim",
           "nodes": ["n1"] * 20000, "attempt": 1}
    with pytest.raises(DecodeError, match="listed more than once"):
        decode(JobEvent, orjson.dumps(rec))
    schema = json.loads((Path(__file__).resolve().parents[3] / "schemas/json/job.schema.json").read_text())
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(rec, schema)
    ok = {**rec, "nodes": ["n1", "n2"]}
    assert decode(JobEvent, orjson.dumps(ok)).nodes == ["n1", "n2"]
    jsonschema.validate(ok, schema)
