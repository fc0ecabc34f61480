"""Retry policy as data: growing, capped delays; typed errors decide what is retried."""

from __future__ import annotations

import random

import pytest

from actuators.base import PermanentError, TemporaryError
from actuators.retry import RetriesExhausted, RetryPolicy, call_with_retry

class Flaky:
    """Fails with ``errors`` in order, then answers ``"ok"``."""

    def __init__(self, *errors: BaseException) -> None:
        self.errors = list(errors)
        self.calls = 0

    async def __call__(self) -> str:
        self.calls += 1
        if self.errors:
            raise self.errors.pop(0)
        return "ok"


class Sleeps:
    def __init__(self) -> None:
        self.delays: list[float] = []

    async def __call__(self, delay: float) -> None:
        self.delays.append(delay)


def test_delays_grow_and_are_capped() -> None:
    policy = RetryPolicy(base_delay=0.5, max_delay=3.0, multiplier=2.0, jitter=0.0)
    assert [policy.delay(a) for a in range(1, 6)] == [0.5, 1.0, 2.0, 3.0, 3.0]


def test_jitter_stays_within_its_share() -> None:
    policy = RetryPolicy(base_delay=1.0, max_delay=10.0, jitter=0.1)
    rng = random.Random(7)
    delays = [policy.delay(1, rng=rng) for _ in range(200)]
    assert all(0.9 <= d <= 1.1 for d in delays)
    assert len(set(delays)) > 1


def test_a_retry_hint_is_a_floor_on_the_delay() -> None:
    policy = RetryPolicy(base_delay=0.1, max_delay=5.0, jitter=0.0)
    assert policy.delay(1, hint=2.0) == 2.0
    assert policy.delay(1, hint=60.0) == 60.0  # never come back sooner than the server asked
    assert policy.delay(4, hint=0.01) == 0.8  # a shorter hint does not shorten the backoff


def test_jitter_never_brings_the_delay_below_the_hint() -> None:
    policy = RetryPolicy(base_delay=1.0, max_delay=10.0, jitter=0.5)
    rng = random.Random(3)
    assert all(policy.delay(1, hint=1.0, rng=rng) >= 1.0 for _ in range(200))


@pytest.mark.asyncio
async def test_temporary_errors_are_retried_until_success() -> None:
    fn = Flaky(TemporaryError("503", delay=1.5), ConnectionResetError("reset"))
    sleeps, seen = Sleeps(), []
    result, attempts = await call_with_retry(
        fn, RetryPolicy(base_delay=0.2, jitter=0.0), sleep=sleeps,
        on_retry=lambda attempt, exc, delay: seen.append((attempt, type(exc).__name__)),
    )
    assert (result, attempts) == ("ok", 3)
    assert sleeps.delays == [1.5, 0.4]
    assert seen == [(1, "TemporaryError"), (2, "ConnectionResetError")]


@pytest.mark.asyncio
async def test_giving_up_after_max_attempts_reports_the_attempts_and_the_last_error() -> None:
    fn = Flaky(*(TemporaryError(f"503 #{i}") for i in range(10)))
    sleeps = Sleeps()
    with pytest.raises(RetriesExhausted) as err:
        await call_with_retry(fn, RetryPolicy(max_attempts=3, jitter=0.0), sleep=sleeps)
    assert err.value.attempts == 3 and fn.calls == 3
    assert str(err.value.last) == "503 #2"
    assert len(sleeps.delays) == 2  # no sleep after the last attempt


@pytest.mark.asyncio
async def test_a_permanent_error_is_not_retried() -> None:
    fn = Flaky(PermanentError("403 forbidden"))
    sleeps = Sleeps()
    with pytest.raises(PermanentError):
        await call_with_retry(fn, RetryPolicy(), sleep=sleeps)
    assert fn.calls == 1 and sleeps.delays == []


@pytest.mark.asyncio
async def test_an_unexpected_error_is_not_retried() -> None:
    fn = Flaky(KeyError("bug"))
    with pytest.raises(KeyError):
        await call_with_retry(fn, RetryPolicy(), sleep=Sleeps())
    assert fn.calls == 1


@pytest.mark.parametrize(
    ("params", "name"),
    [({"max_attempts": 0}, "max_attempts"), ({"base_delay": -1}, "base_delay"),
     ({"max_delay": -1}, "max_delay"), ({"multiplier": 0.5}, "multiplier")],
)
def test_invalid_policies_are_refused_by_name(params, name) -> None:
    with pytest.raises(ValueError, match=name):
        RetryPolicy(**params)
