"""Operator decisions that outlive every worker.

The dry-run switch and the isolations the circuit breaker held back for a person are kept
in a compacted topic, ``control`` (one partition; key: the decision, value: its latest
:class:`~schemas.ControlRecord`, a tombstone when it no longer holds). Every worker reads
that topic from its beginning at start, before it carries out any verdict, and follows it
afterwards, so a decision taken on one worker holds on all of them and after a ``kill -9``
of them all. Holding a node out is a node state (the node track's changelogged table) and
needs nothing here.

:class:`ControlState` is the plain part (records in, decisions out); :class:`ControlLog`
keeps one in step with the topic. See ``docs/decisions/0013-operator-state.md``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from schemas import ControlRecord, DecodeError, decode

log = logging.getLogger(__name__)

DRY_RUN = "dry_run"
HELD = "held/"


@dataclass
class ControlState:
    """The operator decisions in force: the latest record of each key.

    ``default_dry_run`` (the configuration's ``safety.dry_run``) holds until an operator
    switches dry-run; from then on the latest switch holds, across restarts.
    """

    default_dry_run: bool = False
    records: dict[str, ControlRecord] = field(default_factory=dict)
    #: records read that were not valid control records (logged, skipped)
    skipped: int = 0

    def apply(self, key: str, value: bytes | None) -> None:
        """One message of the topic, in topic order: a record replaces the key's last one,
        a tombstone (no value) removes it."""
        if value is None:
            self.records.pop(key, None)
            return
        try:
            rec = decode(ControlRecord, value)
        except DecodeError as exc:
            self.skipped += 1
            log.warning("control record %r skipped: %s", key, exc.reason)
            return
        if rec.key != key:
            self.skipped += 1
            log.warning("control record skipped: its key %r is not the message key %r", rec.key, key)
            return
        self.records[key] = rec

    @property
    def dry_run(self) -> bool:
        r = self.records.get(DRY_RUN)
        return self.default_dry_run if r is None else bool(r.value.get("enabled"))

    def dry_run_origin(self) -> dict[str, Any]:
        """Who set the dry-run switch as it stands, and when."""
        r = self.records.get(DRY_RUN)
        if r is None:
            return {"dry_run": self.default_dry_run, "set_by": "configuration (safety.dry_run)"}
        return {"dry_run": self.dry_run, "set_by": r.who, "at": r.ts, "reason": r.reason}

    def held(self) -> dict[str, dict[str, Any]]:
        """Held isolations awaiting a person, by their idempotency key: the action records."""
        return {k[len(HELD):]: dict(r.value.get("action") or {}) for k, r in self.records.items() if k.startswith(HELD)}


def dry_run_record(enabled: bool, who: str, reason: str = "", ts: float | None = None) -> ControlRecord:
    return ControlRecord(ts=time.time() if ts is None else ts, key=DRY_RUN, value={"enabled": enabled}, who=who,
                         reason=reason)


def held_record(action: dict[str, Any], ts: float | None = None) -> ControlRecord:
    return ControlRecord(ts=time.time() if ts is None else ts, key=HELD + str(action["key"]),
                         value={"action": action}, who="fleetmedic", reason="held by the circuit breaker")


Send = Callable[[str, bytes | None], Awaitable[None]]


class ControlLog:
    """A :class:`ControlState` kept in step with the ``control`` topic.

    It reads the topic with a consumer of its own and no consumer group (every worker
    reads all of it); :attr:`loaded` is set once it has read up to the end offsets it found
    at start, and nothing that depends on a decision should act before that. Writes go
    through ``send`` (the worker's producer, acknowledged by every in-sync replica) and
    are applied here at once, then again in topic order when they are read back.
    """

    def __init__(self, bootstrap: str, topic: str, state: ControlState, send: Send) -> None:
        self.bootstrap, self.topic, self.state, self._send = bootstrap, topic, state, send
        self.loaded = asyncio.Event()
        self.read = 0

    async def put(self, rec: ControlRecord) -> None:
        await self._send(rec.key, rec.to_json())
        self.state.apply(rec.key, rec.to_json())

    async def delete(self, key: str) -> None:
        await self._send(key, None)
        self.state.apply(key, None)

    async def run(self, should_stop: Callable[[], bool]) -> None:
        """Read the topic from its beginning, then follow it; retries with backoff while
        the broker is unreachable (never gives up: without it dry-run is unknown)."""
        from aiokafka import AIOKafkaConsumer, TopicPartition

        delay = 0.5
        while not should_stop():
            consumer = AIOKafkaConsumer(bootstrap_servers=self.bootstrap, group_id=None, enable_auto_commit=False,
                                        auto_offset_reset="earliest")
            try:
                await consumer.start()
                tp = TopicPartition(self.topic, 0)
                consumer.assign([tp])
                await consumer.seek_to_beginning(tp)
                end = (await consumer.end_offsets([tp]))[tp]
                if end == 0:
                    self._loaded()
                delay = 0.5
                while not should_stop():
                    batch = await consumer.getmany(tp, timeout_ms=500)
                    for m in batch.get(tp, []):
                        key = m.key.decode("utf-8", errors="replace") if m.key is not None else ""
                        self.state.apply(key, m.value)
                        self.read += 1
                    if not self.loaded.is_set() and await consumer.position(tp) >= end:
                        self._loaded()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("control topic %s unreadable (%s); retrying in %.1f s", self.topic, exc, delay)
                await asyncio.sleep(delay)  # a background reader, not a stream handler
                delay = min(delay * 2, 30.0)
            finally:
                await consumer.stop()

    def _loaded(self) -> None:
        self.loaded.set()
        o = self.state.dry_run_origin()
        log.info("operator decisions loaded from %s: dry-run %s (set by %s), %d held isolations",
                 self.topic, "ON" if o["dry_run"] else "off", o["set_by"], len(self.state.held()))
