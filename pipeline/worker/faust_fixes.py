"""A fix for a message-loss race in faust-streaming's recovery (0.15.x), applied on import.

When a worker gets its partitions (at start, or after a rebalance), Faust's table
recovery ends with ``Recovery.on_recovery_completed``: it resumes the stream
partitions, seeks them to their committed offsets, and then calls
``app.flow_control.resume()``. That ``resume()`` also *clears* every stream queue. Flow
control is already open at that point (recovery opened it to read the changelogs), so
records fetched right after the seek are put into the queues and then dropped by the
clear, while the consumer's read offset has moved past them. Their offsets are never
acked, but the commit of later offsets in the same partition carries the committed
offset past them: they are lost for good. On a loaded machine the window between the
seek and the clear is long enough to lose the first records of a partition after a
restart (``tests/integration/test_kafka_smoke.py`` caught it; with an artificially
slow seek it loses a third of a backlog every time).

A second loss has the same shape: aiokafka's ``seek_to_committed`` seeks only the
partitions that have a committed offset above 0. A partition newly assigned in a
rebalance with nothing committed yet (a dead worker's partition that received its first
records just before it died) keeps whatever position the fetcher reached during
recovery, and records fetched then but never delivered are skipped. fleetmedic reads
from the earliest offset, so such partitions are now sought to their earliest offset
explicitly, as a fresh assignment would be.

The fix keeps Faust's order but closes the window: before the seek, flow control is
suspended (records fetched meanwhile wait at the queue instead of entering it) and the
queues are cleared (whatever was fetched before the seek is fetched again by it), and
the ``resume()`` that ends recovery then opens the flow without clearing. The worst
case becomes a redelivered record, which at-least-once processing already allows.
``Recovery._resume_streams`` (the same sequence for apps without tables) gets the same
treatment.
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable
from typing import Any

from faust.tables.recovery import Recovery
from faust.transport.consumer import ThreadDelegateConsumer
from mode.utils.queues import FlowControlEvent

_MARK = "_fleetmedic_seek_safe"


def _resume_without_clear(fc: FlowControlEvent) -> None:
    """``FlowControlEvent.resume`` minus the queue clear."""
    fc._suspend.clear()
    fc._resume.set()


def _seek_safe(method: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
    @functools.wraps(method)
    async def wrapper(self: Recovery, *args: Any, **kwargs: Any) -> Any:
        fc = self.app.flow_control
        fc.suspend()
        fc.clear()
        fc.resume = functools.partial(_resume_without_clear, fc)  # type: ignore[method-assign]
        try:
            return await method(self, *args, **kwargs)
        finally:
            del fc.resume  # back to the class's resume()

    setattr(wrapper, _MARK, True)
    return wrapper


def _seek_uncommitted_to_earliest(method: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
    @functools.wraps(method)
    async def wrapper(self: ThreadDelegateConsumer, *args: Any, **kwargs: Any) -> Any:
        committed = await method(self, *args, **kwargs)
        if self.app.conf.consumer_auto_offset_reset != "earliest":
            return committed
        changelogs = self.app.tables.changelog_topics
        fresh = [tp for tp, offset in committed.items() if not offset and tp.topic not in changelogs]
        if fresh:
            earliest = await self.earliest_offsets(*fresh)
            await self.seek_wait({tp: earliest[tp] for tp in fresh if earliest.get(tp) is not None})
        return committed

    setattr(wrapper, _MARK, True)
    return wrapper


def apply() -> None:
    """Patch Faust's recovery and its consumer's seek (idempotent)."""
    for name in ("on_recovery_completed", "_resume_streams"):
        method = getattr(Recovery, name)
        if not getattr(method, _MARK, False):
            setattr(Recovery, name, _seek_safe(method))
    if not getattr(ThreadDelegateConsumer.seek_to_committed, _MARK, False):
        ThreadDelegateConsumer.seek_to_committed = _seek_uncommitted_to_earliest(  # type: ignore[method-assign]
            ThreadDelegateConsumer.seek_to_committed)


apply()
