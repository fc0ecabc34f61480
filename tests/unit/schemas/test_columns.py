"""The hot path's batch decoding (schemas.columns) against the record itself.

``decode_gpu_batch`` must accept exactly what ``decode(GpuSample, ...)`` accepts, reject
the rest with pydantic's own reason, and read the same values. Checked on records
derived from upstream dcgm-exporter output, on the simulator's and the bench's samples,
and on generated messages built to probe every rule of the record (types, bounds, lax
spellings, lengths, patterns, duplicate keys, invalid JSON).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline.detect.glue import decode_each
from schemas import GpuSample
from schemas.columns import GPU_COLUMNS, MIRROR, GpuBatch, WireGpuSample, decode_gpu_batch
from schemas.records import PER_GPU_FIELDS

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures"


def _same(a: GpuBatch, b: GpuBatch) -> None:
    assert a.node == b.node
    assert np.array_equal(a.ts, b.ts)
    assert np.array_equal(a.gpus, b.gpus)
    assert set(a.groups) == set(b.groups)
    for g, ga in a.groups.items():
        gb = b.groups[g]
        assert np.array_equal(ga.rows, gb.rows)
        assert set(ga.columns) == set(gb.columns)
        for name, col in ga.columns.items():
            assert col.dtype == gb.columns[name].dtype
            assert np.array_equal(col, gb.columns[name], equal_nan=True), name
    assert [(k, x.model_dump()) for k, x in a.xids] == [(k, x.model_dump()) for k, x in b.xids]
    assert [(k, x.model_dump()) for k, x in a.sxids] == [(k, x.model_dump()) for k, x in b.sxids]


def _agrees(messages: list[bytes | str | None]) -> tuple[int, int]:
    """Decode ``messages`` both ways; they must agree. (accepted, rejected)"""
    accepted, positions, errors, _, _ = decode_each(GpuSample)(messages)
    got = decode_gpu_batch(messages)
    assert got.errors == errors
    assert got.positions == positions
    _same(got.batch, GpuBatch.from_records(accepted))
    return len(accepted), len(errors)


# ------------------------------------------------------------------------------ real and simulated samples


def _dcgm_records() -> list[dict[str, Any]]:
    out = []
    for p in sorted((FIXTURES / "dcgm-exporter" / "upstream").glob("*.expected.json")):
        out.extend(json.loads(p.read_text())["records"])
    return out


def test_records_from_upstream_dcgm_exporter_output_decode_the_same() -> None:
    records = _dcgm_records()
    assert records and any(r.get("xids") for r in records)  # the Xid path is exercised too
    messages = [orjson.dumps(r) for r in records]
    assert _agrees(messages) == (len(records), 0)
    # and in the fast path where they can: a record without events is read by the mirror
    plain = [m for m, r in zip(messages, records, strict=True) if not r.get("xids")]
    assert plain
    for m in plain:
        msgspec.json.decode(m, type=WireGpuSample)


def test_simulated_and_bench_samples_with_nulls_absent_fields_and_mixed_gpu_counts_decode_the_same() -> None:
    from pipeline.eval.bench import FleetLoad

    load = FleetLoad(40)
    messages = [v for k in range(3) for _, v in load.gpu_round(k)]
    docs = [orjson.loads(m) for m in messages]
    docs[3]["temp"][2] = None
    docs[4].pop("power")
    docs[5]["ecc_dbe"] = [None] * len(docs[5]["util"])
    for d in docs[6:12]:  # a node of 4 GPUs
        for k, v in list(d.items()):
            if isinstance(v, list) and k not in ("xids", "sxids"):
                d[k] = v[:4]
    docs[13]["xids"] = [{"gpu": 1, "code": 79, "detail": "GPU has fallen off the bus.", "source": "kernel"}]
    batch = [orjson.dumps(d) for d in docs]
    assert _agrees(batch) == (len(batch), 0)


def test_each_bad_message_gets_pydantics_reason_at_its_position() -> None:
    good = orjson.dumps({"schema": "gpu/1", "ts": 1.0, "node": "n1", "util": [1.0, 2.0]})
    bad = [
        None,
        b"",
        b"{not json",
        orjson.dumps({"schema": "gpu/2", "ts": 1.0, "node": "n1", "util": [1.0]}),
        orjson.dumps({"ts": 1.0, "node": "n1", "util": [1.0]}),
        orjson.dumps({"schema": "gpu/1", "ts": 1.0, "node": "n1", "util": [1.0, 2.0], "temp": [50.0]}),
        orjson.dumps({"schema": "gpu/1", "ts": 1.0, "node": "n1", "util": [101.0]}),
        orjson.dumps({"schema": "gpu/1", "ts": 1.0, "node": "n1\n", "util": [1.0]}),
        b"x" * 2_000_000,
    ]
    messages: list[bytes | None] = [good]
    for b in bad:
        messages += [b, good]
    assert _agrees(messages) == (len(bad) + 1, len(bad))


def test_lax_spellings_that_pydantic_accepts_are_accepted_with_its_values() -> None:
    """The mirror is strict; what it refuses goes to pydantic, which has the last word."""
    lax = [
        {"ecc_sbe": [3.0, 0]},       # an integral float for a counter
        {"temp": ["61.5", 60]},      # a number in a string
        {"remap_failure": [0, 1]},   # 0 and 1 for flags
        {"lost": ["false", "true"]},
    ]
    messages = [orjson.dumps({"schema": "gpu/1", "ts": 5.0, "node": "n1", "util": [50, 60], **f}) for f in lax]
    for m in messages:  # none of them is the mirror's to accept: each goes to pydantic
        with pytest.raises(msgspec.ValidationError):
            MIRROR.decode(m)
    accepted, _ = _agrees(messages)
    assert accepted >= 1


def test_a_duplicate_key_is_read_as_pydantic_reads_it() -> None:
    m = b'{"schema":"gpu/1","ts":1,"node":"n1","util":[1.0],"util":[150.0]}'
    _agrees([m])
    m = b'{"schema":"gpu/1","ts":1,"node":"n1","util":[150.0],"util":[1.0]}'
    _agrees([m])


# ------------------------------------------------------------------------------ generated messages

_BOUNDS = {"util": (0, 100), "temp": (-50, 200), "power": (0, 5000), "sm_clock": (0, 10000),
           "mem_clock": (0, 20000), "mem_used": (0, 10_000_000)}
_FLAGS = {"remap_pending", "remap_failure", "lost"}


def _good(name: str) -> st.SearchStrategy[Any]:
    if name in _BOUNDS:
        lo, hi = _BOUNDS[name]
        return st.one_of(st.floats(lo, hi, allow_nan=False), st.integers(lo, hi), st.none())
    if name in _FLAGS:
        return st.one_of(st.booleans(), st.none())
    if name == "pci_bus_id":
        return st.sampled_from(["0000:3b:00", "0000:86:00", None])
    return st.one_of(st.integers(0, 2**32 if name == "throttle" else 2**62), st.none())


def _edge(name: str) -> list[Any]:
    """Values at and beyond a field's rules, lax spellings among them."""
    edge: list[Any] = [True, False, "1", "x", [], {}, 1.5, -1, 2**64, 1e308, -0.0]
    if name in _BOUNDS:
        lo, hi = _BOUNDS[name]
        return edge + [lo, hi, lo - 1e-9, hi + 1e-9, hi + 1, "50.5"]
    if name in _FLAGS:
        return edge + [0, 1, 2, "true", "false", "yes"]
    if name == "pci_bus_id":
        return edge + ["0000:3B:00", "0000:3b:00\n", "00000000:3b:00.0"]
    hi = 2**32 if name == "throttle" else 2**62
    return edge + [hi, hi + 1, 3.0, 3.5, "7"]


_TOP_EDGES = {
    "schema": ["gpu/2", 1, None, "GPU/1"],
    "ts": [-1, "5", None, 4e10, True, 1e400],
    "node": ["", "-x", "n1\n", "nöde", "x" * 254, "a b", 7, None],
    "xids": [[{"gpu": 99, "code": 79}], [{"code": 79}], None, "x", [{"gpu": 0, "code": -3}]],
    "sxids": [[{"code": -1}], None, [{"code": 5, "fatal": "maybe"}]],
}


@st.composite
def _message(draw: st.DrawFn) -> bytes:
    """A valid message, then none to three changes that probe one rule each."""
    n = draw(st.integers(1, 9))
    doc: dict[str, Any] = {"schema": "gpu/1", "ts": draw(st.floats(0, 3e10, allow_nan=False)),
                           "node": draw(st.sampled_from(["node-0001", "n.1:a/b", "a", "x" * 253, "GPU_7"]))}
    for name in PER_GPU_FIELDS:
        if name == "util" or draw(st.booleans()):
            doc[name] = draw(st.lists(_good(name), min_size=n, max_size=n))
    if draw(st.integers(0, 5)) == 0:
        doc["xids"] = draw(st.sampled_from([
            [], [{"gpu": 0, "code": 79}], [{"gpu": None, "code": 13, "detail": "Graphics SM Warp Exception"}]]))
    if draw(st.integers(0, 8)) == 0:
        doc["sxids"] = draw(st.sampled_from([[], [{"code": 12028, "fatal": True}]]))
    if draw(st.booleans()):
        doc["extra"] = {"ignored": [1, 2]}
    for _ in range(draw(st.sampled_from([0, 0, 0, 1, 1, 2, 3]))):
        change = draw(st.integers(0, 5))
        if change <= 1:  # an entry
            name = draw(st.sampled_from(PER_GPU_FIELDS))
            doc.setdefault(name, [None] * n)
            if isinstance(doc[name], list) and doc[name]:
                doc[name][draw(st.integers(0, len(doc[name]) - 1))] = draw(st.sampled_from(_edge(name)))
        elif change == 2:  # a list's length
            name = draw(st.sampled_from(PER_GPU_FIELDS))
            doc[name] = draw(st.lists(_good(name), min_size=n + draw(st.sampled_from([-1, 1, 60])),
                                      max_size=n + 60).map(lambda v: v[:65]))
        elif change == 3:  # a field's type
            doc[draw(st.sampled_from(PER_GPU_FIELDS))] = draw(st.sampled_from([None, 5, "x", {}, []]))
        elif change == 4:  # a top-level field
            key = draw(st.sampled_from(sorted(_TOP_EDGES)))
            if draw(st.integers(0, 3)) == 0:
                doc.pop(key, None)
            else:
                doc[key] = draw(st.sampled_from(_TOP_EDGES[key]))
        else:
            doc.pop(draw(st.sampled_from(["schema", "ts", "node", "util"])), None)
    text = json.dumps(doc)
    mangle = draw(st.integers(0, 30))
    if mangle == 0:
        text = text[: draw(st.integers(0, len(text)))]       # cut short
    elif mangle == 1:
        text = text.replace("1.0", "NaN", 1)                   # not JSON
    elif mangle == 2 and text != "{}":
        text = text[:-1] + ', "util": [1.0]}'                 # a duplicate key
    return text.encode()


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(_message(), min_size=1, max_size=6))
def test_generated_messages_decode_the_same_both_ways(messages: list[bytes]) -> None:
    _agrees(messages)


# ------------------------------------------------------------------------------ the mirror stays a mirror


def _bounds(schema: Any, defs: dict[str, Any]) -> set[tuple[str, Any]]:
    """Every bound in a JSON Schema subtree; patterns without their anchors."""
    out: set[tuple[str, Any]] = set()
    if isinstance(schema, dict):
        if "$ref" in schema:
            out |= _bounds(defs[schema["$ref"].rsplit("/", 1)[-1]], defs)
        for k, v in schema.items():
            if k in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "minLength", "maxLength",
                     "minItems", "maxItems"):
                out.add((k, float(v)))
            elif k == "pattern":
                out.add((k, re.sub(r"^(\^|\\A)|(\$|\\Z)$", "", v)))
            elif k == "const":
                out.add(("enum", json.dumps([v])))
            elif k == "enum":
                out.add((k, json.dumps(v)))
            elif k not in ("description", "title", "default", "examples"):
                out |= _bounds(v, defs)
    elif isinstance(schema, list):
        for v in schema:
            out |= _bounds(v, defs)
    return out


def test_the_mirror_has_the_records_fields_and_bounds() -> None:
    ours = GpuSample.model_json_schema(by_alias=True)
    (_, mirror_defs) = msgspec.json.schema_components([WireGpuSample])
    mirror = mirror_defs["WireGpuSample"]
    assert set(mirror["properties"]) == set(ours["properties"])
    assert set(GPU_COLUMNS) | {"pci_bus_id"} == set(PER_GPU_FIELDS)
    for name in ours["properties"]:
        if name in ("xids", "sxids"):
            continue  # the mirror takes only empty event lists: events go through the record
        theirs = _bounds(mirror["properties"][name], mirror_defs)
        assert _bounds(ours["properties"][name], ours.get("$defs", {})) == theirs, name


def test_unknown_columns_are_refused() -> None:
    with pytest.raises(ValueError, match="not a column"):
        decode_gpu_batch([], fields=("temp", "tmep"))
