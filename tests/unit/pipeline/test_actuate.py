"""Carrying verdicts out: idempotency, the circuit breaker, retries, alerts."""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest

from actuators import (
    ActionRequest,
    ActionResult,
    CircuitBreaker,
    PermanentError,
    RetryPolicy,
    TemporaryError,
)
from pipeline.actuate.core import Actuation
from schemas import ActionName, Outcome

from .builders import T0, verdict

pytestmark = pytest.mark.asyncio

ISOLATION = [("isolate", "node-0001"), ("drain", "node-0001"), ("diagnose", "node-0001")]


class FakeBackend:
    """Records every request; can fail the next calls with typed errors."""

    def __init__(self, name: str = "fake", *, temporary: int = 0, permanent: bool = False,
                 supported: set[ActionName] | None = None) -> None:
        self.name = name
        self.calls: list[ActionRequest] = []
        self.temporary = temporary
        self.permanent = permanent
        self.supported = supported

    def supports(self, action: ActionName) -> bool:
        return self.supported is None or action in self.supported

    async def apply(self, request: ActionRequest) -> ActionResult:
        self.calls.append(request)
        if self.permanent:
            raise PermanentError(f"no such target {request.target}")
        if self.temporary > 0:
            self.temporary -= 1
            raise TemporaryError("API server answered 503", delay=0.5)
        return ActionResult(Outcome.applied, f"{request.action.value} {request.target}")

    async def close(self) -> None:
        return None

    def keys(self) -> Counter:
        return Counter(r.key for r in self.calls)


class Sleeps:
    def __init__(self) -> None:
        self.delays: list[float] = []

    async def __call__(self, delay: float) -> None:
        self.delays.append(delay)


def _actuation(backend: FakeBackend, *, fleet: int = 100, budget_fraction: float = 0.1,
               notifier: FakeBackend | None = None, sleep: Sleeps | None = None,
               max_attempts: int = 4) -> Actuation:
    return Actuation(
        backend=backend,
        breaker=CircuitBreaker(max_fraction=budget_fraction, max_absolute=50, window_s=3600.0),
        fleet_size=lambda: fleet,
        retry=RetryPolicy(max_attempts=max_attempts, base_delay=0.1, max_delay=1.0, jitter=0.0),
        notifier=notifier,
        sleep=sleep or Sleeps(),
    )


def _outcomes(records) -> list[tuple[str, str, Outcome]]:
    return [(r.action.value, r.target, r.outcome) for r in records]


async def test_a_replayed_verdict_changes_nothing_twice() -> None:
    backend = FakeBackend()
    act = _actuation(backend)
    v = verdict(ISOLATION, id="v-xid")
    first = await act.carry_out(v)
    replay = await act.carry_out(v)
    assert [r.outcome for r in first] == [Outcome.applied] * 3
    assert [r.outcome for r in replay] == [Outcome.already_so] * 3
    assert [r.key for r in replay] == [r.key for r in first]
    assert set(backend.keys().values()) == {1} and len(backend.calls) == 3


async def test_isolations_beyond_the_budget_are_held_with_the_nodes_other_actions() -> None:
    backend = FakeBackend()
    act = _actuation(backend, fleet=10)  # 10% of 10 nodes: one isolation per window
    await act.carry_out(verdict(ISOLATION, id="v-1", subject="node-0001"))
    second = [("isolate", "node-0002"), ("drain", "node-0002"), ("diagnose", "node-0002")]
    records = await act.carry_out(verdict(second, id="v-2", subject="node-0002", ts=T0 + 60))
    assert [r.outcome for r in records] == [Outcome.held_by_budget] * 3
    assert "circuit breaker open" in records[0].detail
    assert not any(r.target == "node-0002" for r in backend.calls)


async def test_a_held_isolation_does_not_hold_the_jobs_requeue() -> None:
    backend = FakeBackend()
    act = _actuation(backend, fleet=10)
    await act.carry_out(verdict(ISOLATION, id="v-1"))
    await act.carry_out(verdict([("isolate", "node-0002"), ("drain", "node-0002")], id="v-2", subject="node-0002"))
    job = verdict([("requeue", "train-0007", {"exclude": ["node-0002"]})], id="v-2-job", scope="job",
                  subject="train-0007")
    [rec] = await act.carry_out(job)
    assert rec.outcome is Outcome.applied
    assert backend.calls[-1].action is ActionName.requeue
    assert backend.calls[-1].params == {"exclude": ["node-0002"]}


async def test_temporary_errors_are_retried_and_the_attempts_recorded() -> None:
    backend = FakeBackend(temporary=2)
    sleeps = Sleeps()
    act = _actuation(backend, sleep=sleeps)
    [rec] = await act.carry_out(verdict([("isolate", "node-0001")]))
    assert rec.outcome is Outcome.applied
    assert rec.attempts == 3
    assert len(backend.calls) == 3
    assert sleeps.delays == [0.5, 0.5]  # the backend's retry hint beats the shorter backoff


async def test_temporary_errors_that_never_end_fail_after_the_last_attempt() -> None:
    backend = FakeBackend(temporary=99)
    act = _actuation(backend, max_attempts=3)
    [rec] = await act.carry_out(verdict([("requeue", "train-0001")], scope="job", subject="train-0001"))
    assert rec.outcome is Outcome.failed
    assert rec.attempts == 3 and len(backend.calls) == 3
    assert "gave up after 3 attempts" in rec.detail


async def test_a_permanent_error_fails_at_once_and_gives_the_isolation_slot_back() -> None:
    backend = FakeBackend(permanent=True)
    act = _actuation(backend, fleet=10)
    [rec] = await act.carry_out(verdict([("isolate", "node-0001")], id="v-1"))
    assert rec.outcome is Outcome.failed and rec.detail.startswith("permanent:")
    assert len(backend.calls) == 1
    assert act.breaker.used(T0) == 0
    backend.permanent = False
    [other] = await act.carry_out(verdict([("isolate", "node-0002")], id="v-2", subject="node-0002"))
    assert other.outcome is Outcome.applied


async def test_a_failed_action_is_tried_again_when_the_verdict_is_replayed() -> None:
    backend = FakeBackend(permanent=True)
    act = _actuation(backend)
    v = verdict([("isolate", "node-0001")])
    await act.carry_out(v)
    backend.permanent = False
    [rec] = await act.carry_out(v)
    assert rec.outcome is Outcome.applied and len(backend.calls) == 2


async def test_an_action_the_backend_cannot_do_fails_without_calling_it() -> None:
    backend = FakeBackend(supported={ActionName.isolate})
    act = _actuation(backend)
    records = await act.carry_out(verdict([("isolate", "node-0001"), ("diagnose", "node-0001")]))
    assert _outcomes(records) == [("isolate", "node-0001", Outcome.applied),
                                  ("diagnose", "node-0001", Outcome.failed)]
    assert [r.action for r in backend.calls] == [ActionName.isolate]


async def test_the_notifier_receives_escalations_once() -> None:
    backend, notifier = FakeBackend(), FakeBackend("webhook")
    act = _actuation(backend, notifier=notifier)
    v = verdict([("escalate", "node-0001", {"reason": "diagnostics failed"})], id="v-esc")
    records = await act.carry_out(v)
    assert [(r.backend, r.outcome) for r in records] == [("fake", Outcome.applied), ("webhook", Outcome.applied)]
    await act.carry_out(v)
    assert [(r.action, r.target) for r in notifier.calls] == [(ActionName.escalate, "node-0001")]


async def test_the_notifier_receives_held_isolations_for_a_human() -> None:
    backend, notifier = FakeBackend(), FakeBackend("webhook")
    act = _actuation(backend, fleet=10, notifier=notifier)
    await act.carry_out(verdict([("isolate", "node-0001")], id="v-1"))
    assert notifier.calls == []
    records = await act.carry_out(verdict([("isolate", "node-0002")], id="v-2", subject="node-0002"))
    assert _outcomes(records) == [("isolate", "node-0002", Outcome.held_by_budget),
                                  ("escalate", "node-0002", Outcome.applied)]
    [alert] = notifier.calls
    assert alert.action is ActionName.escalate and alert.params["held"] == "isolate"
    assert "circuit breaker" in alert.reason


class SlowNotifier(FakeBackend):
    """A webhook that answers only when released: a receiver that hangs."""

    def __init__(self) -> None:
        super().__init__("webhook")
        self.release = asyncio.Event()

    async def apply(self, request):
        await self.release.wait()
        return await super().apply(request)


async def test_escalations_handed_to_the_background_delay_no_action() -> None:
    backend, notifier = FakeBackend(), SlowNotifier()
    act = _actuation(backend, notifier=notifier)
    later: list[asyncio.Task] = []
    act.deliver_later = lambda delivery: later.append(asyncio.ensure_future(delivery)) is None
    esc = await asyncio.wait_for(act.carry_out(verdict([("escalate", "node-0001", {"reason": "lemon"})], id="v-esc")),
                                 1.0)
    assert _outcomes(esc) == [("escalate", "node-0001", Outcome.applied)]  # the node backend's record only
    # the webhook still hangs, yet the next verdict is carried out at once
    iso = await asyncio.wait_for(act.carry_out(verdict(ISOLATION, id="v-iso", subject="node-0002")), 1.0)
    assert [r.outcome for r in iso] == [Outcome.applied] * 3
    assert not later[0].done()
    notifier.release.set()
    [rec] = await asyncio.wait_for(asyncio.gather(*later), 1.0)
    assert (rec.backend, rec.action, rec.target, rec.outcome) == ("webhook", ActionName.escalate, "node-0001",
                                                                  Outcome.applied)


async def test_a_full_notifier_backlog_is_reported_not_dropped() -> None:
    backend, notifier = FakeBackend(), FakeBackend("webhook")
    act = _actuation(backend, fleet=10, notifier=notifier)
    act.deliver_later = lambda delivery: False
    await act.carry_out(verdict([("isolate", "node-0001")], id="v-1"))
    records = await act.carry_out(verdict([("isolate", "node-0002")], id="v-2", subject="node-0002"))
    assert _outcomes(records) == [("isolate", "node-0002", Outcome.held_by_budget),
                                  ("escalate", "node-0002", Outcome.failed)]
    assert "backlog full" in records[-1].detail and notifier.calls == []
