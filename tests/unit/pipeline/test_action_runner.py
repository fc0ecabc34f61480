"""The action runner: many targets at once, each in its own order, a blocked drain waiting
as data (a due time), never holding up the others, and nothing slept in the stream."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest

from actuators import ActionRequest, ActionResult, CircuitBreaker, RetryPolicy, TemporaryError, Waiting
from pipeline.actuate.core import ActionRunner, Actuation, Work
from schemas import ActionName, ActionRecord, Outcome

from .builders import T0, verdict

pytestmark = pytest.mark.asyncio


class Clock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


class GatedBackend:
    """Each call waits at a gate (to count how many run at once); drains of the nodes in
    ``pdb`` are refused as a PodDisruptionBudget refuses an eviction (HTTP 429)."""

    name = "gated"

    def __init__(self) -> None:
        self.gate = asyncio.Event()
        self.running = 0
        self.most = 0
        self.calls: list[tuple[str, str]] = []
        self.pdb: set[str] = set()

    def supports(self, action: ActionName) -> bool:
        return True

    async def apply(self, request: ActionRequest) -> ActionResult:
        self.calls.append((request.action.value, request.target))
        self.running += 1
        self.most = max(self.most, self.running)
        try:
            await self.gate.wait()
        finally:
            self.running -= 1
        if request.action is ActionName.drain and request.target in self.pdb:
            raise TemporaryError("Cannot evict pod as it would violate the pod's disruption budget", delay=5.0)
        return ActionResult(Outcome.applied, f"{request.action.value} {request.target}")

    async def close(self) -> None:
        return None


def _setup(backend: GatedBackend, clock: Clock, *, max_in_flight: int = 64, drain_wait_s: float = 600.0):
    act = Actuation(backend=backend, breaker=CircuitBreaker(max_fraction=1.0, max_absolute=1000, window_s=3600.0),
                    fleet_size=lambda: 1000, retry=RetryPolicy(max_attempts=3, base_delay=1.0, max_delay=30.0,
                                                               jitter=0.0),
                    clock=clock, drain_wait_s=drain_wait_s)
    reports: list[tuple[Work, ActionRecord | Work]] = []

    async def report(w: Work, got: ActionRecord | Work) -> None:
        reports.append((w, got))

    return act, ActionRunner(act, report, max_in_flight=max_in_flight, clock=clock), reports


async def _plan(act: Actuation, runner: ActionRunner, actions, vid: str, seq: int, subject: str) -> None:
    for step in await act.plan(verdict(actions, id=vid, subject=subject, ts=T0), seq=seq):
        assert isinstance(step, Work)
        runner.add(step)


async def _plan_burst(act: Actuation, runner: ActionRunner, nodes: int) -> None:
    """A burst: each of ``nodes`` nodes with its isolation, drain and diagnosis planned."""
    for i in range(nodes):
        node = f"node-{i:04d}"
        await _plan(act, runner, [("isolate", node), ("drain", node), ("diagnose", node)], f"v-{i}", i, node)


def _by_target(calls: list[tuple[str, str]]) -> dict[str, list[str]]:
    """The backend's calls, each target's actions in the order they reached it."""
    out: dict[str, list[str]] = {}
    for action, target in calls:
        out.setdefault(target, []).append(action)
    return out


async def _settle(runner: ActionRunner) -> None:
    for _ in range(50):
        await asyncio.sleep(0)
    await asyncio.gather(*list(runner.tasks))


async def test_a_hundred_targets_are_acted_on_64_at_a_time_each_in_its_own_order() -> None:
    backend, clock = GatedBackend(), Clock()
    act, runner, reports = _setup(backend, clock)
    for i in range(100):
        node = f"node-{i:04d}"
        await _plan(act, runner, [("isolate", node), ("drain", node)], f"v-{i}", i, node)
    assert runner.start_due(clock()) == 64  # one try per target, 64 targets at once
    await asyncio.sleep(0)
    assert backend.running == 64
    assert runner.start_due(clock()) == 0  # full
    backend.gate.set()
    while runner.pending:
        runner.start_due(clock())
        await _settle(runner)
    assert backend.most == 64
    by_node = _by_target(backend.calls)
    assert all(v == ["isolate", "drain"] for v in by_node.values()) and len(by_node) == 100
    assert all(isinstance(got, ActionRecord) and got.outcome is Outcome.applied for _, got in reports)


async def test_an_older_verdicts_work_on_a_target_goes_first_whatever_order_it_was_queued_in() -> None:
    backend, clock = GatedBackend(), Clock()
    backend.gate.set()
    act, runner, _ = _setup(backend, clock)
    await _plan(act, runner, [("return", "node-0001")], "v-new", 7, "node-0001")
    await _plan(act, runner, [("isolate", "node-0001")], "v-old", 3, "node-0001")
    while runner.pending:
        runner.start_due(clock())
        await _settle(runner)
    assert backend.calls == [("isolate", "node-0001"), ("return", "node-0001")]


async def test_a_drain_blocked_by_a_disruption_budget_waits_as_data_and_holds_up_no_one() -> None:
    backend, clock = GatedBackend(), Clock()
    backend.gate.set()
    backend.pdb.add("node-0001")
    act, runner, reports = _setup(backend, clock)
    await _plan(act, runner, [("drain", "node-0001"), ("diagnose", "node-0001")], "v-pdb", 1, "node-0001")
    for i in range(2, 12):
        await _plan(act, runner, [("isolate", f"node-{i:04d}")], f"v-{i}", i, f"node-{i:04d}")
    runner.start_due(clock())  # the isolations first (containment before drains)
    await _settle(runner)
    assert not backend.calls.count(("drain", "node-0001"))
    runner.start_due(clock())
    await _settle(runner)
    # the others are done; the drain waits for its due time, its diagnose behind it
    done = [got.target for _, got in reports if isinstance(got, ActionRecord)]
    assert sorted(done) == [f"node-{i:04d}" for i in range(2, 12)]
    [(_, retry)] = [(w, got) for w, got in reports if isinstance(got, Work)]
    assert (retry.attempt, retry.due) == (1, clock() + 5.0)  # the server's hint beats the shorter backoff
    assert runner.start_due(clock()) == 0  # not due: nothing tried, nothing slept
    # it keeps being refused past max_attempts: a drain waits up to drain_wait_s
    for _ in range(6):
        clock.t = runner.next_due()
        runner.start_due(clock())
        await _settle(runner)
    assert backend.calls.count(("drain", "node-0001")) == 7
    assert ("diagnose", "node-0001") not in backend.calls
    backend.pdb.clear()  # the budget is relaxed
    while runner.pending:
        clock.t = max(clock.t, runner.next_due() or clock.t)
        runner.start_due(clock())
        await _settle(runner)
    ends = [(got.action.value, got.outcome) for _, got in reports
            if isinstance(got, ActionRecord) and got.target == "node-0001"]
    assert ends == [("drain", Outcome.applied), ("diagnose", Outcome.applied)]


async def test_a_drain_blocked_longer_than_its_wait_fails_and_the_next_action_goes_on() -> None:
    backend, clock = GatedBackend(), Clock()
    backend.gate.set()
    backend.pdb.add("node-0001")
    act, runner, reports = _setup(backend, clock, drain_wait_s=60.0)
    await _plan(act, runner, [("drain", "node-0001"), ("diagnose", "node-0001")], "v-pdb", 1, "node-0001")
    while runner.pending:
        clock.t = max(clock.t, runner.next_due() or clock.t)
        runner.start_due(clock())
        await _settle(runner)
    ends = [(got.action.value, got.outcome) for _, got in reports if isinstance(got, ActionRecord)]
    assert ends == [("drain", Outcome.failed), ("diagnose", Outcome.applied)]
    [drain] = [got for _, got in reports if isinstance(got, ActionRecord) and got.action is ActionName.drain]
    assert drain.attempts >= 3 and "disruption budget" in drain.detail


async def test_work_kept_in_a_table_resumes_where_it_stood_and_settled_work_is_not_done_again() -> None:
    backend, clock = GatedBackend(), Clock()
    backend.gate.set()
    backend.pdb.add("node-0001")
    act, runner, reports = _setup(backend, clock)
    await _plan(act, runner, [("drain", "node-0001")], "v-pdb", 1, "node-0001")
    await _plan(act, runner, [("isolate", "node-0002")], "v-2", 2, "node-0002")
    for _ in range(2):  # the isolation, then the drain
        runner.start_due(clock())
        await _settle(runner)
    table = {w.key: got.to_dict() for w, got in reports if isinstance(got, Work)}  # what the worker keeps
    for w, got in reports:
        if isinstance(got, ActionRecord):
            await act.finish(w, got)  # the ledger
    # a new worker (same ledger) loads the table; node-0002's isolation, settled, is not redone
    backend2, clock2 = GatedBackend(), Clock(clock() + 10)
    backend2.gate.set()
    act.backend = backend2
    runner2 = ActionRunner(act, lambda w, got: asyncio.sleep(0), clock=clock2)
    for d in table.values():
        runner2.add(Work.from_dict(d))
    runner2.add(Work.from_dict({**[w for w, _ in reports if w.target == "node-0002"][0].to_dict()}))
    while runner2.pending:
        runner2.start_due(clock2())
        await _settle(runner2)
    assert backend2.calls == [("drain", "node-0001")]  # node-0002's attempt found the ledger settled


async def test_in_a_burst_every_node_is_isolated_before_the_first_drain_or_diagnosis_starts() -> None:
    """More due work than room: isolations first (then job moves, drains, the rest), each
    target still in its own order."""
    backend, clock = GatedBackend(), Clock()
    backend.gate.set()
    act, runner, _ = _setup(backend, clock, max_in_flight=8)
    await _plan_burst(act, runner, 40)
    await _plan(act, runner, [("requeue", "ns/train")], "v-job", 99, "ns/train")
    while runner.pending:
        runner.start_due(clock())
        await _settle(runner)
    actions = [a for a, _ in backend.calls]
    assert actions.count("isolate") == 40 and actions.count("drain") == 40 and actions.count("diagnose") == 40
    last_isolate = max(i for i, a in enumerate(actions) if a == "isolate")
    assert last_isolate < actions.index("requeue") < actions.index("drain")
    assert max(i for i, a in enumerate(actions) if a == "drain") < actions.index("diagnose")
    by_node = _by_target(backend.calls)
    assert all(v == ["isolate", "drain", "diagnose"] for k, v in by_node.items() if k.startswith("node-"))


class Flush:
    """The worker's producer flush, held at a gate: it records which work the runner had
    started when each flush began (nothing planned may reach the backend before its flush)."""

    def __init__(self, backend: GatedBackend) -> None:
        self.backend = backend
        self.gate = asyncio.Event()
        self.calls_at_start: list[int] = []
        self.fail = False

    async def __call__(self) -> None:
        self.calls_at_start.append(len(self.backend.calls))
        await self.gate.wait()
        if self.fail:
            raise ConnectionError("broker unreachable")


async def test_no_work_reaches_the_backend_before_the_state_it_was_planned_with_is_flushed() -> None:
    backend, clock = GatedBackend(), Clock()
    backend.gate.set()
    act, _, reports = _setup(backend, clock)
    flush = Flush(backend)

    async def report(w: Work, got: ActionRecord | Work) -> None:
        reports.append((w, got))

    runner = ActionRunner(act, report, clock=clock, durable=flush, durable_timeout_s=5.0)
    await _plan(act, runner, [("isolate", "node-0001")], "v-1", 1, "node-0001")
    assert runner.start_due(clock()) == 0  # planned, not yet durable: not started
    stop = asyncio.Event()
    pump = asyncio.ensure_future(runner.run(stop.is_set))
    await _settle(runner)
    assert flush.calls_at_start == [0] and backend.calls == []  # waiting on its flush
    # work planned while that flush is under way waits for the next one
    await _plan(act, runner, [("isolate", "node-0002")], "v-2", 2, "node-0002")
    flush.gate.set()
    for _ in range(20):
        await _settle(runner)
    assert backend.calls == [("isolate", "node-0001"), ("isolate", "node-0002")]
    assert flush.calls_at_start == [0, 1]  # node-0002 only after a flush begun after it was planned
    stop.set()
    runner._wake.set()
    await asyncio.wait_for(pump, 5)


async def test_a_flush_under_way_holds_only_the_new_work_not_the_room_a_finished_try_frees() -> None:
    """One try at a time: while a flush for new work is under way, the try that finishes
    makes room for the durable work behind it at once; the new work waits for its flush."""
    backend, clock = GatedBackend(), Clock()
    act, _, _ = _setup(backend, clock)
    flush = Flush(backend)
    flush.gate.set()
    runner = ActionRunner(act, lambda w, got: asyncio.sleep(0), clock=clock, durable=flush, max_in_flight=1)
    await _plan(act, runner, [("isolate", "node-0001")], "v-1", 1, "node-0001")
    await _plan(act, runner, [("isolate", "node-0002")], "v-2", 2, "node-0002")
    stop = asyncio.Event()
    pump = asyncio.ensure_future(runner.run(stop.is_set))
    for _ in range(5):
        await _settle_started()
    assert backend.calls == [("isolate", "node-0001")]  # flushed, one at a time
    flush.gate.clear()  # the next flush hangs
    await _plan(act, runner, [("isolate", "node-0003")], "v-3", 3, "node-0003")
    for _ in range(5):
        await _settle_started()
    assert len(flush.calls_at_start) == 2  # under way
    backend.gate.set()  # node-0001's try finishes
    for _ in range(10):
        await _settle_started()
    assert backend.calls == [("isolate", "node-0001"), ("isolate", "node-0002")]  # not held by the flush
    flush.gate.set()
    for _ in range(20):
        await _settle_started()
    assert backend.calls[-1] == ("isolate", "node-0003")
    stop.set()
    runner._wake.set()
    await asyncio.wait_for(pump, 5)


async def test_a_flush_that_fails_holds_the_work_and_is_tried_again() -> None:
    backend, clock = GatedBackend(), Clock()
    backend.gate.set()
    act, _, _ = _setup(backend, clock)
    flush = Flush(backend)
    flush.gate.set()
    flush.fail = True
    runner = ActionRunner(act, lambda w, got: asyncio.sleep(0), clock=clock, durable=flush)
    await _plan(act, runner, [("isolate", "node-0001")], "v-1", 1, "node-0001")
    assert await runner.make_durable() is False
    assert runner.start_due(clock()) == 0 and backend.calls == []
    flush.fail = False
    assert await runner.make_durable() is True
    assert runner.start_due(clock()) == 1


async def test_the_breaker_takes_its_window_from_the_table_after_a_recovery_before_anything_else() -> None:
    """A worker that starts (or gets the partition back) reads the window the changelog
    restored, even when the first thing it settles is a try's result and not a verdict."""
    from pipeline.worker.actuation import BreakerWindow

    table: dict[str, object] = {}
    first = CircuitBreaker(max_fraction=1.0, max_absolute=3, window_s=3600.0)
    w1 = BreakerWindow(first, table)
    for node in ("st-0", "st-1"):
        w1.sync()
        assert first.check(node, 40, T0).allowed
        assert w1.keep()
    assert w1.keep() is False  # unchanged: not written again
    # the changelog's copy, as recovery decodes it in a new worker (new objects)
    table = {k: (dict(v) if isinstance(v, dict) else v) for k, v in table.items()}
    second = CircuitBreaker(max_fraction=1.0, max_absolute=3, window_s=3600.0)
    w2 = BreakerWindow(second, table)
    assert w2.sync() is True
    second.release("st-9")  # a settled failure elsewhere: nothing to give back
    w2.keep()
    assert sorted(k for k in table if k.startswith("isolation:")) == ["isolation:st-0", "isolation:st-1"]
    assert second.check("st-2", 40, T0 + 1).allowed
    assert not second.check("st-3", 40, T0 + 2).allowed  # the cap of 3 holds across the restart
    assert w2.sync() is False  # its own write is not a recovery


class CountingTable(dict):
    """A table that counts the values written (what its changelog would carry)."""

    def __init__(self) -> None:
        super().__init__()
        self.written = 0

    def __setitem__(self, key, value) -> None:
        self.written += len(value) if isinstance(value, list) else 1
        super().__setitem__(key, value)


async def test_a_burst_writes_each_isolation_once_not_the_whole_window_per_verdict() -> None:
    from pipeline.worker.actuation import BreakerWindow

    table = CountingTable()
    breaker = CircuitBreaker(max_fraction=1.0, max_absolute=5000, window_s=3600.0)
    w = BreakerWindow(breaker, table)
    for i in range(1000):
        w.sync()
        assert breaker.check(f"node-{i:04d}", 10000, T0 + i * 0.001).allowed
        w.keep()
    assert table.written == 1001  # an entry each and the marker (the whole window each time: 500,500)
    breaker.release("node-0007")  # a failed isolation gives its slot back
    w.keep()
    assert "isolation:node-0007" not in table and len([k for k in table if k.startswith("isolation:")]) == 999
    # expiry: an hour later the window is empty, and so are the table's entries
    assert breaker.used(T0 + 3601.0) == 0
    w.keep()
    assert [k for k in table if k.startswith("isolation:")] == []


async def test_an_older_workers_whole_window_is_read_once_and_rewritten_as_entries() -> None:
    from pipeline.worker.actuation import BreakerWindow

    table: dict[str, object] = {"isolations": [[T0, "old-0"], [T0 + 1, "old-1"]]}
    breaker = CircuitBreaker(max_fraction=1.0, max_absolute=3, window_s=3600.0)
    w = BreakerWindow(breaker, table)
    assert w.sync() is True and breaker.used(T0 + 2) == 2
    assert breaker.check("new-0", 40, T0 + 2).allowed
    w.keep()
    assert sorted(k for k in table if k.startswith("isolation:")) == [
        "isolation:new-0", "isolation:old-0", "isolation:old-1"]
    assert isinstance(table["isolations"], dict) and w.sync() is False
    assert not breaker.check("new-1", 40, T0 + 3).allowed  # 3 of 3 used


async def test_while_an_isolation_runs_no_drain_or_diagnosis_starts_but_one_waiting_to_retry_holds_none() -> None:
    from dataclasses import replace

    backend, clock = GatedBackend(), Clock()
    act, runner, _ = _setup(backend, clock)  # room for 64: it is not room that holds them back
    await _plan(act, runner, [("isolate", "node-0001")], "v-1", 1, "node-0001")
    await _plan(act, runner, [("drain", "node-0002"), ("diagnose", "node-0002")], "v-2", 2, "node-0002")
    await _plan(act, runner, [("requeue", "ns/train")], "v-job", 3, "ns/train")
    assert runner.start_due(clock()) == 2  # the isolation and the job's move, not the drain
    await _settle_started()
    assert sorted(backend.calls) == [("isolate", "node-0001"), ("requeue", "ns/train")]
    backend.gate.set()
    await _settle(runner)
    runner.start_due(clock())
    await _settle(runner)
    assert ("drain", "node-0002") in backend.calls  # contained: the rest follows
    # an isolation waiting for its next try (a backoff) holds nothing up
    await _plan(act, runner, [("isolate", "node-0003")], "v-3", 4, "node-0003")
    q = runner.queues["node-0003"]
    q[0] = replace(q[0], due=clock() + 30.0)
    runner.start_due(clock())
    await _settle(runner)
    assert ("diagnose", "node-0002") in backend.calls and ("isolate", "node-0003") not in backend.calls


async def _settle_started() -> None:
    for _ in range(20):
        await asyncio.sleep(0)


class ControllerBackend(GatedBackend):
    """A requeue that waits on a controller: ``Waiting`` until ``ready`` tries have passed."""

    def __init__(self, ready: int) -> None:
        super().__init__()
        self.gate.set()
        self.ready = ready

    async def apply(self, request: ActionRequest) -> ActionResult:
        self.calls.append((request.action.value, request.target))
        if len(self.calls) < self.ready:
            raise Waiting(f"{request.target}: 2 of its pods still to stop", delay=1.0)
        return ActionResult(Outcome.applied, "resumed")


@pytest.mark.parametrize(("ready", "wait_s", "outcome"), [(8, 600.0, Outcome.applied), (50, 20.0, Outcome.failed)])
async def test_an_action_waiting_on_a_controller_is_patient_past_max_attempts_until_the_wait(
        ready: int, wait_s: float, outcome: Outcome) -> None:
    backend, clock = ControllerBackend(ready), Clock()
    act, runner, reports = _setup(backend, clock, drain_wait_s=wait_s)  # type: ignore[arg-type]
    await _plan(act, runner, [("requeue", "ml/llama")], "v-kueue", 1, "ml/llama")
    while runner.pending:
        clock.t = max(clock.t, runner.next_due() or clock.t)
        runner.start_due(clock())
        await _settle(runner)
    [end] = [got for _, got in reports if isinstance(got, ActionRecord)]
    assert end.outcome is outcome
    assert end.attempts > act.retry.max_attempts  # not cut off at max_attempts
    if outcome is Outcome.failed:
        assert "pods still to stop" in end.detail


async def test_a_bursts_drains_wait_out_the_quiet_window_after_its_last_isolation() -> None:
    """Isolations that arrive over time: a drain queued between two of them does not start
    in the gap; it starts once no isolation has run or been due for ``contain_quiet_s``."""
    backend, clock = GatedBackend(), Clock()
    backend.gate.set()
    act, _, reports = _setup(backend, clock)
    runner = ActionRunner(act, lambda w, got: _append(reports, w, got), clock=clock, contain_quiet_s=2.0)
    await _plan(act, runner, [("isolate", "node-0001"), ("drain", "node-0001")], "v-1", 1, "node-0001")
    runner.start_due(clock())
    await _settle(runner)
    assert backend.calls == [("isolate", "node-0001")]
    clock.t += 1.0  # a gap in the burst: the drain is due, the window is not over
    runner.start_due(clock())
    await _settle(runner)
    assert backend.calls == [("isolate", "node-0001")]
    assert runner.next_due() == 1002.0  # the pump wakes at the window's end, not at once
    await _plan(act, runner, [("isolate", "node-0002")], "v-2", 2, "node-0002")  # the burst goes on
    runner.start_due(clock())
    await _settle(runner)
    assert backend.calls[-1] == ("isolate", "node-0002")
    clock.t += 1.5  # 1.5 s after the second isolation: still held
    runner.start_due(clock())
    await _settle(runner)
    assert ("drain", "node-0001") not in backend.calls
    clock.t += 0.6
    runner.start_due(clock())
    await _settle(runner)
    assert backend.calls[-1] == ("drain", "node-0001")


async def _append(reports: list, w: Work, got: ActionRecord | Work) -> None:
    reports.append((w, got))


async def test_a_pump_round_costs_what_it_starts_not_a_walk_over_every_queue(monkeypatch: pytest.MonkeyPatch) -> None:
    """A burst of 300 nodes, each with its isolation, drain and diagnosis queued, 8 tries at
    a time: each action's urgency is worked out once, not once per queue per round (the
    walk that took most of a worker's time in a burst of 1,000); the order is kept."""
    import pipeline.actuate.core as core

    calls = 0
    real = core.urgency

    def counted(w: Work) -> int:
        nonlocal calls
        calls += 1
        return real(w)

    monkeypatch.setattr(core, "urgency", counted)
    backend, clock = GatedBackend(), Clock()
    backend.gate.set()
    act, runner, _ = _setup(backend, clock, max_in_flight=8)
    await _plan_burst(act, runner, 300)
    rounds = 0
    while runner.pending:
        runner.start_due(clock())
        await _settle(runner)
        rounds += 1
    assert rounds >= 900 // 8 and calls == 900
    actions = [a for a, _ in backend.calls]
    assert max(i for i, a in enumerate(actions) if a == "isolate") < actions.index("drain")
    by_node = _by_target(backend.calls)
    assert all(v == ["isolate", "drain", "diagnose"] for v in by_node.values()) and len(by_node) == 300


async def test_work_of_a_partition_given_up_is_dropped_unstarted_and_the_rest_goes_on() -> None:
    """After a rebalance the new owner carries out a partition's work: what this worker
    still has queued for it is dropped (heads as they come up, and in a sweep), never
    tried; work of the partitions it kept is tried as before."""
    backend, clock = GatedBackend(), Clock()
    backend.gate.set()
    act, _, reports = _setup(backend, clock)
    owned = {0, 1}
    runner = ActionRunner(act, lambda w, got: _append(reports, w, got), clock=clock, owns=lambda p: p in owned)
    for i in range(6):
        node = f"node-{i:04d}"
        for step in await act.plan(verdict([("drain", node), ("diagnose", node)], id=f"v-{i}", subject=node, ts=T0),
                                   seq=i):
            assert isinstance(step, Work)
            runner.add(replace(step, partition=i % 2))
    owned.discard(1)  # partition 1 moves to another worker before anything ran
    clock.t += 2.0
    while runner.pending:
        runner.start_due(clock())
        await _settle(runner)
    assert sorted({t for _, t in backend.calls}) == ["node-0000", "node-0002", "node-0004"]
    assert len(backend.calls) == 6 and runner.queues == {}
