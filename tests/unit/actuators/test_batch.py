"""Calls that arrive together are made together; a lone call waits for nothing."""

from __future__ import annotations

import asyncio

import pytest

from actuators.batch import Coalescer

pytestmark = pytest.mark.asyncio


async def _ticks(n: int = 5) -> None:
    for _ in range(n):
        await asyncio.sleep(0)


class Gate:
    """A batch function held at a gate, recording each batch it was given."""

    def __init__(self) -> None:
        self.gate = asyncio.Event()
        self.seen: list[list[int]] = []

    async def __call__(self, items: list[int]) -> list[int | BaseException]:
        self.seen.append(list(items))
        await self.gate.wait()
        return [ValueError(f"odd {i}") if i % 2 else i * 10 for i in items]


async def test_calls_made_while_a_batch_runs_go_in_the_next_batch_together() -> None:
    run = Gate()
    c: Coalescer[int, int] = Coalescer(run, max_batch=3)
    first = asyncio.ensure_future(c.submit(0))
    await _ticks()
    assert run.seen == [[0]]  # a lone call starts at once
    rest = [asyncio.ensure_future(c.submit(i)) for i in (2, 4, 6, 8)]
    await _ticks()
    run.gate.set()
    assert await first == 0
    assert await asyncio.gather(*rest) == [20, 40, 60, 80]
    assert run.seen == [[0], [2, 4, 6], [8]]  # at most max_batch each, in arrival order
    assert c.batches == [1, 3, 1]


async def test_an_items_exception_goes_to_its_caller_alone() -> None:
    run = Gate()
    run.gate.set()
    c: Coalescer[int, int] = Coalescer(run)
    got = await asyncio.gather(c.submit(2), c.submit(3), return_exceptions=True)
    assert got[0] == 20 and isinstance(got[1], ValueError) and "odd 3" in str(got[1])


async def test_a_failed_batch_fails_each_of_its_callers_and_the_next_batch_still_runs() -> None:
    calls: list[list[int]] = []

    async def flaky(items: list[int]) -> list[int | BaseException]:
        calls.append(items)
        if len(calls) == 1:
            raise ConnectionError("controller unreachable")
        return items

    c: Coalescer[int, int] = Coalescer(flaky)
    with pytest.raises(ConnectionError):
        await c.submit(1)
    assert await c.submit(2) == 2


async def test_a_caller_that_gave_up_is_left_out_of_the_next_batch() -> None:
    run = Gate()
    c: Coalescer[int, int] = Coalescer(run)
    first = asyncio.ensure_future(c.submit(0))
    await _ticks()
    gone = asyncio.ensure_future(c.submit(2))
    kept = asyncio.ensure_future(c.submit(4))
    await _ticks()
    gone.cancel()
    run.gate.set()
    assert await first == 0 and await kept == 40
    assert run.seen == [[0], [4]]


async def test_a_batch_that_answers_the_wrong_number_of_items_fails_them() -> None:
    async def short(items: list[int]) -> list[int | BaseException]:
        return items[:-1]

    c: Coalescer[int, int] = Coalescer(short)
    with pytest.raises(RuntimeError, match="gave 0 outcomes"):
        await c.submit(1)
