"""Retry policy as data: exponential backoff with jitter and an overall deadline."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

from .base import ActuatorError, PermanentError, TemporaryError

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    max_attempts: int = 6
    base_delay: float = 0.2
    max_delay: float = 10.0
    multiplier: float = 2.0
    jitter: float = 0.1

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {self.max_attempts}")
        if self.base_delay < 0 or self.max_delay < 0:
            raise ValueError("base_delay and max_delay must be >= 0")
        if self.multiplier < 1:
            raise ValueError(f"multiplier must be >= 1, got {self.multiplier}")

    def delay(self, attempt: int, hint: float | None = None, rng: random.Random | None = None) -> float:
        """Delay before attempt ``attempt + 1`` (attempt counts from 1)."""
        d = min(self.max_delay, self.base_delay * self.multiplier ** (attempt - 1))
        r = rng or random
        d *= 1 + self.jitter * (2 * r.random() - 1)
        if hint is not None:
            # a server's Retry-After is a floor: never come back sooner than asked
            d = max(d, hint)
        return d


class RetriesExhausted(ActuatorError):
    def __init__(self, attempts: int, last: BaseException) -> None:
        super().__init__(f"gave up after {attempts} attempts: {last}")
        self.attempts = attempts
        self.last = last


async def call_with_retry(
    fn: Callable[[], Awaitable[T]],
    policy: RetryPolicy,
    *,
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    on_retry: Callable[[int, BaseException, float], None] | None = None,
) -> tuple[T, int]:
    """Run ``fn`` until it succeeds; returns (result, attempts).

    :class:`TemporaryError` and connection/timeout errors are retried; a
    :class:`PermanentError` propagates at once; after ``max_attempts`` a
    :class:`RetriesExhausted` is raised.
    """
    attempt = 0
    while True:
        attempt += 1
        try:
            return await fn(), attempt
        except PermanentError:
            raise
        except (TemporaryError, ConnectionError, TimeoutError, OSError) as exc:
            if attempt >= policy.max_attempts:
                raise RetriesExhausted(attempt, exc) from exc
            hint = exc.delay if isinstance(exc, TemporaryError) else None
            d = policy.delay(attempt, hint)
            if on_retry is not None:
                on_retry(attempt, exc, d)
            await sleep(d)
