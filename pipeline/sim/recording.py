"""Record the pipeline's input topics, and replay a recording at any speed.

A recording is JSON Lines, one input record per line::

    {"topic": "telemetry.gpu", "key": "node-0003", "ts": 1764806400.0, "value": {...the record...}}

``topic`` is the topic's name without the deployment's prefix (one of
:data:`INPUT_TOPICS`), ``ts`` the record's event time, ``value`` the record as it was
published (a JSON object; ``raw``, a string, for a payload that was not JSON, so that
bad input replays as bad input).  Lines are replayed in event-time order (ties keep
their order in the file), each at ``start + (ts - first ts) / speed`` of wall time.

Every decision of the worker runs on event time (detector windows, cooldowns, the
correlation grace, the switch holds, checkpoint deadlines), so a recording replayed at
1x and at 100x gives the same verdicts: this is how an incident is reproduced, a
configuration change is tried on last week's telemetry, or a backlog is caught up.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

#: the topics a recording holds: what collectors, watchers and the simulator publish
INPUT_TOPICS = ("telemetry.gpu", "telemetry.network", "telemetry.job")


class RecordingError(ValueError):
    """A recording that cannot be read; the message names the file and line."""


@dataclass(frozen=True)
class Recorded:
    topic: str
    key: str | None
    ts: float
    value: bytes

    def line(self) -> bytes:
        try:
            body: dict[str, Any] = {"value": orjson.loads(self.value)}
        except orjson.JSONDecodeError:
            body = {"raw": self.value.decode("utf-8", errors="replace")}
        return orjson.dumps({"topic": self.topic, "key": self.key, "ts": self.ts, **body})


def event_time(value: bytes) -> float | None:
    """The ``ts`` of a record payload, or None when it has none (bad input)."""
    try:
        ts = orjson.loads(value).get("ts")
    except (orjson.JSONDecodeError, AttributeError):
        return None
    return float(ts) if isinstance(ts, (int, float)) and not isinstance(ts, bool) else None


def read(path: str | Path) -> list[Recorded]:
    """The records of a recording, in replay order (event time; ties in file order)."""
    out: list[Recorded] = []
    p = Path(path)
    try:
        lines = p.read_bytes().splitlines()
    except OSError as exc:
        raise RecordingError(f"{p}: cannot read: {exc.strerror or exc}") from exc
    for no, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            d = orjson.loads(line)
            topic, ts = d["topic"], d["ts"]
            value = orjson.dumps(d["value"]) if "value" in d else d["raw"].encode()
        except (orjson.JSONDecodeError, KeyError, TypeError, AttributeError) as exc:
            raise RecordingError(f"{p}:{no}: not a recording line (topic, key, ts and value or raw): {exc}") from exc
        if topic not in INPUT_TOPICS:
            raise RecordingError(f"{p}:{no}: topic {topic!r} is not an input topic ({', '.join(INPUT_TOPICS)})")
        if not isinstance(ts, (int, float)) or isinstance(ts, bool):
            raise RecordingError(f"{p}:{no}: ts must be a number (event time, Unix seconds), got {ts!r}")
        key = d.get("key")
        out.append(Recorded(topic, None if key is None else str(key), float(ts), value))
    order = sorted(range(len(out)), key=lambda i: out[i].ts)
    return [out[i] for i in order]


def write(path: str | Path, records: Iterable[Recorded]) -> int:
    n = 0
    with open(path, "wb") as fh:
        for r in records:
            fh.write(r.line() + b"\n")
            n += 1
    return n


def schedule(records: Sequence[Recorded], speed: float) -> list[float]:
    """Wall seconds after the start at which each record is sent (``speed`` event
    seconds per wall second; ``inf``: all at once, in order)."""
    if not speed > 0:
        raise ValueError(f"speed must be > 0, got {speed!r}")
    if not records:
        return []
    t0 = records[0].ts
    return [0.0 if speed == float("inf") else (r.ts - t0) / speed for r in records]


async def replay(send: Callable[[Recorded], Awaitable[None]], records: Sequence[Recorded], speed: float, *,
                 clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], Awaitable[Any]] = asyncio.sleep,
                 progress: Callable[[int, int], None] | None = None) -> dict[str, Any]:
    """Send ``records`` paced by their event time at ``speed``; returns a summary."""
    due = schedule(records, speed)
    start = clock()
    behind = 0.0
    for k, (r, at) in enumerate(zip(records, due, strict=True)):
        wait = start + at - clock()
        if wait > 0:
            await sleep(wait)
        else:
            behind = max(behind, -wait)
        await send(r)
        if progress is not None and (k + 1) % 1000 == 0:
            progress(k + 1, len(records))
    span = records[-1].ts - records[0].ts if records else 0.0
    return {"records": len(records), "speed": speed, "event_span_s": span, "wall_s": clock() - start,
            "max_behind_s": behind}


async def replay_to_kafka(bootstrap: str, prefix: str, records: Sequence[Recorded], speed: float,
                          progress: Callable[[int, int], None] | None = None) -> dict[str, Any]:
    from aiokafka import AIOKafkaProducer

    p = AIOKafkaProducer(bootstrap_servers=bootstrap, linger_ms=2, max_request_size=4 * 1024 * 1024)
    await p.start()
    try:
        async def send(r: Recorded) -> None:
            await p.send(f"{prefix}{r.topic}", key=None if r.key is None else r.key.encode(), value=r.value)

        out = await replay(send, records, speed, progress=progress)
        await p.flush()
        return out
    finally:
        await p.stop()


async def record_from_kafka(bootstrap: str, prefix: str, seconds: float, *, idle_s: float = 0.0,
                            from_beginning: bool = True) -> list[Recorded]:
    """The input topics' records: from their beginning (or from now) for ``seconds`` of wall
    time, or until ``idle_s`` (when > 0) passes without a new record."""
    from aiokafka import AIOKafkaConsumer

    topics = {f"{prefix}{t}": t for t in INPUT_TOPICS}
    c = AIOKafkaConsumer(*topics, bootstrap_servers=bootstrap, group_id=None, enable_auto_commit=False,
                         auto_offset_reset="earliest" if from_beginning else "latest")
    await c.start()
    out: list[Recorded] = []
    try:
        deadline = time.monotonic() + seconds
        last = time.monotonic()
        while time.monotonic() < deadline:
            batch = await c.getmany(timeout_ms=200)
            for tp, msgs in batch.items():
                for m in msgs:
                    ts = event_time(m.value)
                    out.append(Recorded(topics[tp.topic], None if m.key is None else m.key.decode("utf-8", "replace"),
                                        ts if ts is not None else m.timestamp / 1000.0, m.value))
                    last = time.monotonic()
            if idle_s > 0 and time.monotonic() - last >= idle_s:
                break
    finally:
        await c.stop()
    order = sorted(range(len(out)), key=lambda i: out[i].ts)
    return [out[i] for i in order]
