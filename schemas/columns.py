"""Batches of GPU samples as validated columns: how the telemetry hot path decodes.

:func:`decode_gpu_batch` turns a batch of ``telemetry.gpu`` messages into a
:class:`GpuBatch`: per GPU count, one ``(samples, GPUs)`` float array per per-GPU field,
NaN where an entry is ``null`` or the field is absent (booleans are 0 and 1).

It accepts and rejects exactly what ``decode(GpuSample, ...)`` does, with the same
reasons. Each message is first read by :class:`WireGpuSample`, a msgspec mirror of the
record: the same field names, types and bounds, checked in C, strictly (no lax
spellings). What the mirror does not take as is (a lax spelling that pydantic accepts,
such as ``3.0`` for a counter; a sample with Xid or SXid events; an invalid record) is
decoded by pydantic, which accepts it or says why not for the dead-letter topic. The
mirror's accepted set is a subset of pydantic's, and both read the same values from it:
``tests/unit/schemas/test_columns.py`` checks that on the repository's samples, on
real collectors' output and on generated messages.
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal, NamedTuple

import msgspec
import numpy as np
from msgspec import Meta

from .codec import MAX_MESSAGE_BYTES, DecodeError, decode
from .records import MAX_COUNTER, MAX_GPUS, PER_GPU_FIELDS, GpuSample

#: per-GPU fields that are numbers or flags (all but the bus ids), the columns a batch can hold
GPU_COLUMNS: tuple[str, ...] = tuple(f for f in PER_GPU_FIELDS if f != "pci_bus_id")

# The record's bounds (schemas.records), in msgspec's terms. Patterns are matched with
# Python's re.search, so they are anchored with \A and \Z: a "$" would also match before
# a final newline, which the record's (Rust) pattern refuses.
_F = float
_Percent = Annotated[_F, Meta(ge=0.0, le=100.0)]
_Temp = Annotated[_F, Meta(ge=-50.0, le=200.0)]
_Power = Annotated[_F, Meta(ge=0.0, le=5000.0)]
_SmClock = Annotated[_F, Meta(ge=0.0, le=10000.0)]
_MemClock = Annotated[_F, Meta(ge=0.0, le=20000.0)]
_MemUsed = Annotated[_F, Meta(ge=0.0, le=10_000_000.0)]
_Mask = Annotated[int, Meta(ge=0, le=2**32)]
_Counter = Annotated[int, Meta(ge=0, le=MAX_COUNTER)]
_Node = Annotated[str, Meta(min_length=1, max_length=253, pattern=r"\A[A-Za-z0-9][A-Za-z0-9._:/-]*\Z")]
_Bus = Annotated[str, Meta(pattern=r"\A[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\Z")]


class WireGpuSample(msgspec.Struct, rename={"schema_": "schema"}):
    """msgspec's mirror of :class:`schemas.GpuSample` for the fast path (same names,
    types and bounds; unknown fields ignored). It takes only empty ``xids`` and
    ``sxids``: events go through the record itself."""

    schema_: Literal["gpu/1"]
    ts: Annotated[_F, Meta(ge=0.0, le=32503680000.0)]
    node: _Node
    util: Annotated[list[_Percent | None], Meta(min_length=1, max_length=MAX_GPUS)]
    temp: list[_Temp | None] | None = None
    power: list[_Power | None] | None = None
    sm_clock: list[_SmClock | None] | None = None
    mem_clock: list[_MemClock | None] | None = None
    mem_used: list[_MemUsed | None] | None = None
    throttle: list[_Mask | None] | None = None
    ecc_sbe: list[_Counter | None] | None = None
    ecc_dbe: list[_Counter | None] | None = None
    ecc_sbe_aggregate: list[_Counter | None] | None = None
    ecc_dbe_aggregate: list[_Counter | None] | None = None
    retired_pages: list[_Counter | None] | None = None
    remapped_rows: list[_Counter | None] | None = None
    remap_pending: list[bool | None] | None = None
    remap_failure: list[bool | None] | None = None
    nvlink_crc: list[_Counter | None] | None = None
    nvlink_replay: list[_Counter | None] | None = None
    nvlink_recovery: list[_Counter | None] | None = None
    pcie_replay: list[_Counter | None] | None = None
    lost: list[bool | None] | None = None
    xids: Annotated[list[Any], Meta(max_length=0)] = []
    sxids: Annotated[list[Any], Meta(max_length=0)] = []
    pci_bus_id: list[_Bus | None] | None = None


#: msgspec's decoder of the mirror (strict)
MIRROR = msgspec.json.Decoder(WireGpuSample)
_GETTERS = {name: operator.attrgetter(name) for name in PER_GPU_FIELDS}
_NODE, _TS = operator.attrgetter("node"), operator.attrgetter("ts")


def _entries(values: list[Any]) -> np.ndarray:
    """The number of entries of each list of ``values``; -1 for an absent field."""
    try:
        lens = list(map(len, values))
    except TypeError:  # an absent field in some records
        lens = [-1 if v is None else len(v) for v in values]
    return np.asarray(lens, dtype=np.int64)


def _unequal(records: list[WireGpuSample]) -> list[int]:
    """The positions of ``records`` that fail the record's own check: every per-GPU list
    present has one entry per GPU."""
    gpus = _entries(list(map(_GETTERS["util"], records)))
    bad = np.zeros(len(records), dtype=bool)
    for name in PER_GPU_FIELDS[1:]:
        lens = _entries(list(map(_GETTERS[name], records)))
        bad |= (lens != gpus) & (lens != -1)
    return np.flatnonzero(bad).tolist()


@dataclass(slots=True)
class GpuGroup:
    """The samples of one batch that have ``gpus`` GPUs."""

    gpus: int
    #: their positions in the batch
    rows: np.ndarray
    #: field -> ``(len(rows), gpus)`` float64; NaN where null or absent
    columns: dict[str, np.ndarray]


@dataclass(slots=True)
class GpuBatch:
    """GPU samples as columns, in the order they came. ``records`` are the samples
    themselves (mirror or pydantic records: the same attribute names)."""

    records: list[Any]
    node: list[str]
    ts: np.ndarray
    gpus: np.ndarray
    groups: dict[int, GpuGroup]
    #: each sample's position inside its group
    local: np.ndarray
    #: (position, event) of every Xid and SXid event, in batch order
    xids: list[tuple[int, Any]] = field(default_factory=list)
    sxids: list[tuple[int, Any]] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.records)

    @classmethod
    def from_records(cls, records: Sequence[Any], fields: Iterable[str] = GPU_COLUMNS) -> GpuBatch:
        """Columns of ``fields`` from validated samples (:class:`GpuSample` or
        :class:`WireGpuSample`)."""
        records = list(records)
        fields = tuple(fields)
        unknown = set(fields) - set(GPU_COLUMNS)
        if unknown:
            raise ValueError(f"not a column of GPU samples: {', '.join(sorted(unknown))}")
        m = len(records)
        node = list(map(_NODE, records))
        ts = np.fromiter(map(_TS, records), dtype=np.float64, count=m)
        gpus = np.fromiter(map(len, map(_GETTERS["util"], records)), dtype=np.int64, count=m)
        local = np.zeros(m, dtype=np.int64)
        groups: dict[int, GpuGroup] = {}
        if m:
            first = int(gpus[0])
            if (gpus == first).all():
                local = np.arange(m, dtype=np.int64)
                groups[first] = GpuGroup(first, local, _columns(records, first, fields))
            else:
                for g in np.unique(gpus).tolist():
                    rows = np.flatnonzero(gpus == g)
                    local[rows] = np.arange(len(rows))
                    groups[g] = GpuGroup(g, rows, _columns([records[k] for k in rows.tolist()], g, fields))
        xids = [(k, x) for k, r in enumerate(records) if r.xids for x in r.xids]
        sxids = [(k, x) for k, r in enumerate(records) if r.sxids for x in r.sxids]
        return cls(records, node, ts, gpus, groups, local, xids, sxids)


def _columns(records: list[Any], g: int, fields: tuple[str, ...]) -> dict[str, np.ndarray]:
    """``(len(records), g)`` arrays of ``fields``: NaN where an entry is null (numpy reads
    None as NaN) or the field absent. Every list present has ``g`` entries."""
    out = {}
    m = len(records)
    chain = itertools.chain.from_iterable
    for name in fields:
        lists = list(map(_GETTERS[name], records))
        try:
            arr = np.fromiter(chain(lists), dtype=np.float64, count=m * g).reshape(m, g)
        except TypeError:  # an absent field in some records
            arr = np.full((m, g), np.nan)
            for k, v in enumerate(lists):
                if v is not None:
                    arr[k] = np.fromiter(v, dtype=np.float64, count=g)
        out[name] = arr
    return out


class Decoded(NamedTuple):
    """A decoded batch: the valid samples as columns, the position of each in the
    messages given, and ``(position, reason)`` of every message that is not a valid
    sample."""

    batch: GpuBatch
    positions: list[int]
    errors: list[tuple[int, str]]


def decode_gpu_batch(values: Sequence[bytes | str | None], fields: Iterable[str] = GPU_COLUMNS, *,
                     max_bytes: int = MAX_MESSAGE_BYTES) -> Decoded:
    """Decode ``telemetry.gpu`` messages into columns of ``fields``; see the module."""
    read: dict[int, Any] = {}  # message position -> its sample
    for k, v in enumerate(values):
        if v is not None and len(v) <= max_bytes:
            try:
                read[k] = MIRROR.decode(v)
            except (msgspec.ValidationError, msgspec.DecodeError):
                pass
    positions = list(read)
    for j in _unequal(list(read.values())):  # pydantic says which list is too long or short
        del read[positions[j]]
    errors: list[tuple[int, str]] = []
    if len(read) < len(values):
        for k, v in enumerate(values):
            if k not in read:
                try:
                    read[k] = decode(GpuSample, v, max_bytes=max_bytes)
                except DecodeError as exc:
                    errors.append((k, exc.reason))
        read = dict(sorted(read.items()))
    return Decoded(GpuBatch.from_records(list(read.values()), fields), list(read), errors)
