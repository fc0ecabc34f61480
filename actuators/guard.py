"""Guards that stand between a verdict and an isolation.

:class:`CircuitBreaker` caps isolations per sliding window: never more than
``max_fraction`` of the fleet and never more than ``max_absolute`` nodes.  Beyond the cap
an isolation is *held*: it becomes an alert for a human, recorded with the outcome
``held_by_budget``.  Time is passed in, so tests control it.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field


@dataclass
class BreakerDecision:
    allowed: bool
    used: int
    budget: int
    reason: str


@dataclass
class CircuitBreaker:
    max_fraction: float = 0.1
    max_absolute: int = 50
    window_s: float = 3600.0
    min_budget: int = 1
    _events: deque[tuple[float, str]] = field(default_factory=deque, init=False, repr=False)
    #: isolations counted per node in the window (``_events`` by node, for O(1) lookups)
    _count: dict[str, int] = field(default_factory=dict, init=False, repr=False)
    #: the latest counted time of each node in the window
    _at: dict[str, float] = field(default_factory=dict, init=False, repr=False)
    #: how many times the window changed: a caller keeping a copy writes it only then
    changes: int = field(default=0, init=False)
    #: nodes whose counted time changed since :meth:`take_changes` (None: all of them, after a restore)
    _dirty: set[str] | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if not 0.0 < self.max_fraction <= 1.0:
            raise ValueError(f"max_fraction must be in (0, 1], got {self.max_fraction}")
        if self.max_absolute < 0:
            raise ValueError(f"max_absolute must be >= 0, got {self.max_absolute}")
        if self.window_s <= 0:
            raise ValueError(f"window_s must be > 0, got {self.window_s}")
        if self.min_budget < 0:
            raise ValueError(f"min_budget must be >= 0, got {self.min_budget}")

    def budget(self, fleet_size: int) -> int:
        """How many isolations one window allows for a fleet of ``fleet_size`` nodes."""
        share = math.floor(self.max_fraction * max(fleet_size, 0))
        return min(self.max_absolute, max(self.min_budget, share))

    def _expire(self, now: float) -> None:
        while self._events and self._events[0][0] <= now - self.window_s:
            _, node = self._events.popleft()
            self._forget_one(node)
            self.changes += 1

    def _forget_one(self, node: str) -> None:
        left = self._count.get(node, 0) - 1
        if left > 0:
            self._count[node] = left
        else:
            self._count.pop(node, None)
            self._at.pop(node, None)
            self._touch(node)

    def _touch(self, node: str) -> None:
        if self._dirty is not None:
            self._dirty.add(node)

    def used(self, now: float) -> int:
        self._expire(now)
        return len(self._events)

    def check(self, node: str, fleet_size: int, now: float) -> BreakerDecision:
        """Ask for one isolation of ``node`` at ``now``; records it when allowed."""
        self._expire(now)
        budget = self.budget(fleet_size)
        used = len(self._events)
        if node in self._count:
            return BreakerDecision(True, used, budget, "already counted in this window")
        if used >= budget:
            return BreakerDecision(
                False,
                used,
                budget,
                f"circuit breaker open: {used} isolations in the last {self.window_s:.0f}s, "
                f"budget {budget} (max {self.max_fraction:.0%} of {fleet_size} nodes, cap {self.max_absolute})",
            )
        self._events.append((now, node))
        self._count[node] = self._count.get(node, 0) + 1
        self._at[node] = now
        self._touch(node)
        self.changes += 1
        return BreakerDecision(True, used + 1, budget, "within budget")

    def release(self, node: str) -> None:
        """Forget a counted isolation that did not happen (for example it failed)."""
        if node not in self._count:
            return
        self._events = deque((t, n) for t, n in self._events if n != node)
        del self._count[node]
        self._at.pop(node, None)
        self._touch(node)
        self.changes += 1

    def snapshot(self) -> list[tuple[float, str]]:
        return list(self._events)

    @property
    def size(self) -> int:
        """How many isolations the window holds (as of the last check or expiry)."""
        return len(self._events)

    def counted_at(self, node: str) -> float | None:
        """When ``node``'s isolation was last counted in the window, or None."""
        return self._at.get(node)

    def take_changes(self) -> set[str] | None:
        """The nodes whose counted time changed since the last call (None: the window was
        restored since, and any node may have), and start counting afresh: a caller
        keeping a copy of the window writes what changed, not the window."""
        dirty, self._dirty = self._dirty, set()
        return dirty

    def restore(self, events: list[tuple[float, str]]) -> None:
        self._events = deque(sorted((float(t), str(n)) for t, n in events))
        self._count, self._at = {}, {}
        for t, n in self._events:
            self._count[n] = self._count.get(n, 0) + 1
            self._at[n] = t
        self._dirty = None
        self.changes += 1
