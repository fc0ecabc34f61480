"""Calls that arrive together are carried out together.

A backend whose every call has a fixed cost (a process to start, a credential to get)
answers a burst faster when the calls that arrive while one is under way are made in
one go. :class:`Coalescer` does that without a timer: a lone call starts at once, and
the calls that come in while a batch runs wait for the next batch, which takes them all
(at most ``max_batch``). Under load the batches grow by themselves; when it is quiet
nothing waits.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Generic, TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")
R = TypeVar("R")

class Coalescer(Generic[T, R]):
    """``await submit(item)`` is ``run([item, ...])``'s answer for that item.

    ``run`` gets the items in the order they came and returns one outcome per item, a
    result or an exception (raised to that item's caller alone). An exception raised by
    ``run`` itself goes to every caller of that batch.
    """

    def __init__(self, run: Callable[[list[T]], Awaitable[Sequence[R | BaseException]]], *,
                 max_batch: int = 500) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        self._run, self.max_batch = run, max_batch
        self._queue: list[tuple[T, asyncio.Future[R]]] = []
        self._pump: asyncio.Task[None] | None = None
        #: sizes of the batches run so far (for tests and logs)
        self.batches: list[int] = []

    async def submit(self, item: T) -> R:
        fut: asyncio.Future[R] = asyncio.get_running_loop().create_future()
        self._queue.append((item, fut))
        if self._pump is None or self._pump.done():
            self._pump = asyncio.ensure_future(self._drain())
        return await fut

    async def _drain(self) -> None:
        while self._queue:
            batch = [(i, f) for i, f in self._queue[: self.max_batch] if not f.done()]  # a caller may have gone
            del self._queue[: self.max_batch]
            if not batch:
                continue
            self.batches.append(len(batch))
            try:
                outcomes: Sequence[R | BaseException] = await self._run([i for i, _ in batch])
                if len(outcomes) != len(batch):
                    raise RuntimeError(f"a batch of {len(batch)} gave {len(outcomes)} outcomes")
            except Exception as exc:  # the whole batch failed: every caller hears it
                outcomes = [exc] * len(batch)
            for (_, fut), got in zip(batch, outcomes):
                if fut.done():
                    continue
                if isinstance(got, BaseException):
                    fut.set_exception(got)
                else:
                    fut.set_result(got)
