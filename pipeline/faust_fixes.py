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


def apply() -> None:
    """Patch :class:`faust.tables.recovery.Recovery` (idempotent)."""
    for name in ("on_recovery_completed", "_resume_streams"):
        method = getattr(Recovery, name)
        if not getattr(method, _MARK, False):
            setattr(Recovery, name, _seek_safe(method))


apply()
