"""The circuit breaker: a sliding-window budget of isolations."""

from __future__ import annotations

import pytest

from actuators.guard import CircuitBreaker

T = 1_000_000.0


@pytest.mark.parametrize(
    ("fraction", "absolute", "min_budget", "fleet", "expected"),
    [
        (0.1, 50, 1, 100, 10),    # a share of the fleet
        (0.1, 50, 1, 19, 1),      # floor(1.9) = 1
        (0.1, 50, 1, 5, 1),       # small fleets still get the minimum
        (0.1, 50, 0, 5, 0),       # ... unless the minimum is zero
        (0.1, 50, 3, 10, 3),      # the minimum beats a smaller share
        (0.1, 5, 1, 1000, 5),     # the absolute cap beats the share
        (0.1, 2, 3, 10, 2),       # ... and the minimum
        (0.5, 50, 1, 0, 1),       # no fleet seen yet
    ],
)
def test_budget_is_the_share_of_the_fleet_within_minimum_and_cap(fraction, absolute, min_budget, fleet, expected):
    breaker = CircuitBreaker(max_fraction=fraction, max_absolute=absolute, min_budget=min_budget)
    assert breaker.budget(fleet) == expected


def test_when_the_budget_is_spent_no_further_node_is_isolated() -> None:
    breaker = CircuitBreaker(max_fraction=0.1, max_absolute=50, window_s=3600)
    allowed = [breaker.check(f"n{i}", 20, T + i).allowed for i in range(3)]
    assert allowed == [True, True, False]
    held = breaker.check("n9", 20, T + 10)
    assert not held.allowed and (held.used, held.budget) == (2, 2)
    assert "circuit breaker open" in held.reason


def test_isolations_leave_the_window_once_it_has_passed() -> None:
    breaker = CircuitBreaker(max_fraction=0.1, window_s=600)
    assert breaker.check("n1", 10, T).allowed
    assert not breaker.check("n2", 10, T + 599).allowed
    assert breaker.used(T + 599) == 1
    assert breaker.check("n2", 10, T + 600).allowed
    assert breaker.snapshot() == [(T + 600, "n2")]


def test_the_same_node_is_counted_once_per_window() -> None:
    breaker = CircuitBreaker(max_fraction=0.1, window_s=600)
    first = breaker.check("n1", 10, T)
    again = breaker.check("n1", 10, T + 5)
    assert first.allowed and again.allowed
    assert again.reason == "already counted in this window"
    assert breaker.used(T + 5) == 1
    assert not breaker.check("n2", 10, T + 6).allowed


def test_a_released_isolation_frees_its_slot() -> None:
    breaker = CircuitBreaker(max_fraction=0.1, window_s=600)
    breaker.check("n1", 10, T)
    breaker.release("n1")
    assert breaker.used(T) == 0
    assert breaker.check("n2", 10, T + 1).allowed


@pytest.mark.parametrize(
    ("param", "value"),
    [("max_fraction", 0.0), ("max_fraction", 1.5), ("max_absolute", -1), ("window_s", 0), ("min_budget", -1)],
)
def test_invalid_parameters_are_refused_by_name(param, value) -> None:
    with pytest.raises(ValueError, match=param):
        CircuitBreaker(**{param: value})


def test_a_restored_breaker_remembers_the_isolations_of_the_window() -> None:
    breaker = CircuitBreaker(max_fraction=0.1, window_s=600)
    breaker.check("n1", 20, T)
    breaker.check("n2", 20, T + 100)
    saved = [list(e) for e in breaker.snapshot()]  # as it comes back from a JSON store

    restored = CircuitBreaker(max_fraction=0.1, window_s=600)
    restored.restore(saved)
    assert restored.snapshot() == [(T, "n1"), (T + 100, "n2")]
    assert not restored.check("n3", 20, T + 200).allowed
    assert restored.check("n3", 20, T + 600).allowed  # n1 has left the window


def test_the_breaker_counts_its_changes_and_keeps_its_node_index_through_expiry_release_and_restore() -> None:
    b = CircuitBreaker(max_fraction=1.0, max_absolute=100, window_s=100.0)
    assert b.check("n1", 100, 0.0).allowed and b.check("n2", 100, 10.0).allowed
    seen = b.changes
    assert b.check("n1", 100, 20.0).reason == "already counted in this window"
    assert b.changes == seen  # a repeat changes nothing: no copy needs writing
    b.release("n9")
    assert b.changes == seen
    b.release("n1")
    assert b.changes == seen + 1 and b.used(20.0) == 1
    assert b.check("n1", 100, 30.0).reason == "within budget"  # released: counted afresh
    assert b.used(105.0) == 2 and b.changes == seen + 2  # n1 at 30 and n2 at 10 still in
    assert b.used(111.0) == 1  # n2 expired
    assert b.check("n2", 100, 111.0).reason == "within budget"
    copy = CircuitBreaker(max_fraction=1.0, max_absolute=100, window_s=100.0)
    copy.restore(b.snapshot())
    assert copy.check("n1", 100, 112.0).reason == "already counted in this window"
    assert copy.check("n2", 100, 112.0).reason == "already counted in this window"


def test_the_breaker_says_which_nodes_changed_so_a_copy_is_kept_without_a_walk_over_the_window() -> None:
    b = CircuitBreaker(max_fraction=1.0, max_absolute=100, window_s=100.0)
    b.restore([(0.0, "old")])
    assert b.take_changes() is None  # restored: any node may have changed
    for i, node in enumerate(("n1", "n2", "n3")):
        assert b.check(node, 100, 10.0 + i).allowed
    assert b.take_changes() == {"n1", "n2", "n3"} and b.counted_at("n2") == 11.0
    assert b.check("n2", 100, 20.0).allowed and b.take_changes() == set()  # counted already: no change
    b.release("n1")
    assert b.used(100.5) == 2  # "old" (at 0) expires
    assert b.take_changes() == {"n1", "old"} and b.counted_at("n1") is None and b.counted_at("old") is None
    assert b.size == 2 and b.take_changes() == set()
