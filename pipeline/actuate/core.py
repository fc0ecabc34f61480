"""Carrying a verdict out: guards, idempotency, retries, one audit record per action.

For every planned action, in the verdict's order:

1. **idempotency**: the action's key (verdict id + action + target) is looked up in the
   ledger; an action already carried out is not done twice (a replayed verdict after a
   crash changes nothing), it is recorded as ``already_so``;
2. **guards**: an isolation asks the circuit breaker; beyond the budget it is *held*
   (``held_by_budget``), the node's other actions in that verdict are held too, and the
   hold is escalated for a human;
3. **act**: the backend observes, compares and acts; a temporary error makes the action a
   :class:`Work` item again, with its attempt count and the wall time of its next try
   (backoff), which the worker keeps in a changelogged table and an
   :class:`ActionRunner` tries when due: nothing sleeps in the stream, a drain that a
   PodDisruptionBudget blocks waits (up to ``actuators.drain_wait_s``) without holding up
   any other target;
4. **report**: an :class:`ActionRecord` for the ``actions`` topic, and the ledger entry.

:meth:`Actuation.plan` does 1 and 2 and returns the records and the work in the verdict's
order, :meth:`Actuation.attempt` makes one try, :meth:`Actuation.finish` settles it;
:meth:`Actuation.carry_out` chains them for in-process callers (it waits between tries).

Escalations also go to the notifier (``actuators.webhook_url``).  With ``deliver_later``
set (the worker sets it) those deliveries run in the background, so a webhook that is down
delays no later action; their records are reported when each delivery settles.
"""

from __future__ import annotations

import asyncio
import bisect
import fnmatch
import heapq
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from actuators import (
    ActionRequest,
    ActionResult,
    Backend,
    CircuitBreaker,
    PermanentError,
    RetriesExhausted,
    RetryPolicy,
    TemporaryError,
    Waiting,
    call_with_retry,
)
from actuators.dryrun import DryRun, DryRunBackend
from schemas import (JOB_ACTIONS, ActionName, ActionRecord, JobEvent, JobEventKind, Outcome, PlannedAction,
                     Verdict)
from schemas.ids import stable_id

log = logging.getLogger(__name__)

#: outcomes after which the action is settled and a replay must not act again
SETTLED = frozenset({Outcome.applied, Outcome.already_so, Outcome.dry_run, Outcome.held_by_budget})


class Ledger(Protocol):
    """Outcomes of settled actions by idempotency key (a dict, or a Faust table)."""

    def get(self, key: str, default: Any = None) -> Any: ...

    def __setitem__(self, key: str, value: str) -> None: ...


class BackendRouter:
    """Which backend acts on a target: node pools by name pattern, jobs by their scheduler.

    A job action's ``params["scheduler"]`` (set by the job track from the job's
    ``telemetry.job`` records) picks the backend of that scheduler; a node action goes to
    the backend of the first pool whose pattern matches the node; anything else goes to
    the default backend.
    """

    def __init__(self, backends: dict[str, Backend], *, default: str,
                 pools: list[tuple[list[str], str]] | None = None) -> None:
        if default not in backends:
            raise ValueError(f"default backend {default!r} is not among {sorted(backends)}")
        self.backends = backends
        self.default = default
        self.pools = pools or []

    @property
    def default_backend(self) -> Backend:
        return self.backends[self.default]

    def __call__(self, req: ActionRequest) -> Backend:
        if req.action in JOB_ACTIONS:
            sched = req.params.get("scheduler")
            if sched in self.backends:
                return self.backends[sched]
            return self.default_backend
        for patterns, name in self.pools:
            if any(fnmatch.fnmatchcase(req.target, p) for p in patterns):
                return self.backends[name]
        return self.default_backend


@dataclass(frozen=True)
class Work:
    """An action of a verdict still to be carried out at its backend: plain data, kept
    where a restart finds it (the worker's ``action_pending`` table)."""

    key: str
    #: the verdict, as JSON data (the action is its ``index``-th)
    verdict: dict[str, Any]
    index: int
    target: str
    #: order among the work on one target (the verdict's offset * 64 + index in the worker)
    seq: int = 0
    #: partition of the verdict (its owner carries it out)
    partition: int = 0
    attempt: int = 0
    #: wall time of the next try, and of the first
    due: float = 0.0
    first_at: float | None = None
    last_error: str = ""

    def to_dict(self) -> dict[str, Any]:
        """The fields as plain data. The verdict is shared, not copied: no one changes it
        (``dataclasses.asdict`` deep-copied it, a tenth of the actuation agent's time in a
        burst)."""
        return {name: getattr(self, name) for name in self.__dataclass_fields__}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Work:
        return cls(**{k: d[k] for k in cls.__dataclass_fields__ if k in d})


def checkpoint_request(work: Work, record: ActionRecord) -> JobEvent | None:
    """The ``checkpoint_requested`` record that tells a job on ``telemetry.job`` what its
    ``checkpoint`` action asked (checkpoint-now, ``docs/checkpoint-now.md``), once the
    action reached its scheduler; None for any other action or outcome."""
    if record.action is not ActionName.checkpoint or record.outcome is not Outcome.applied:
        return None  # already_so: asked before (announced then), or nothing of it runs
    v = work.verdict
    params = v["actions"][work.index].get("params") or {}
    deadline = params.get("deadline")
    return JobEvent(
        ts=float(v["ts"]), job=work.target, event=JobEventKind.checkpoint_requested,
        scheduler=str(params.get("scheduler") or "sim"), attempt=int(params.get("attempt") or 1),
        checkpoint_deadline=float(deadline) if deadline is not None else None,
        reason=f"node {params.get('node')} is degrading (verdict {v['id']})",
    )


def failure_alert(work: Work, record: ActionRecord) -> Verdict | None:
    """An alert for a person about an action that failed for good (a workload of a kind
    fleetmedic cannot requeue, a backend that refused it): the verdict it belonged to,
    its one action now an ``escalate`` of the target naming what failed and why.  None
    for any other outcome, and for escalations (their failures are deliveries' own)."""
    if record.outcome is not Outcome.failed or record.action is ActionName.escalate:
        return None
    v = work.verdict
    return Verdict(
        ts=record.ts, id=stable_id("action-failed", record.key), incident=str(v.get("incident") or record.verdict_id),
        scope=v.get("scope") or "job", subject=record.target, fault_class=v.get("fault_class") or "unknown",
        confidence=float(v.get("confidence") or 1.0), job=v.get("job"), nodes=list(v.get("nodes") or []),
        evidence={"action_failed": record.action.value, "detail": record.detail[:2000], "verdict": record.verdict_id,
                  "backend": record.backend, "attempts": record.attempts},
        actions=[PlannedAction(action=ActionName.escalate, target=record.target,
                               params={"reason": f"{record.action.value} failed: {record.detail[:500]}"})],
    )


@dataclass
class Actuation:
    backend: Backend
    breaker: CircuitBreaker
    fleet_size: Callable[[], int]
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    notifier: Backend | None = None
    ledger: Ledger = field(default_factory=lambda: dict[str, str]())
    sleep: Callable[[float], Awaitable[None]] | None = None
    clock: Callable[[], float] = time.time
    router: Callable[[ActionRequest], Backend] | None = None
    #: switched at run time (the operator API): every backend answers dry_run while it is true
    dry_run: Callable[[], bool] | None = None
    #: takes a notifier delivery off the verdict's path and reports its record when it
    #: settles; returns False when it cannot take more.  None: deliveries run inline and
    #: their records come back with the verdict's.
    deliver_later: Callable[[Coroutine[Any, Any, ActionRecord]], bool] | None = None
    #: a drain refused for now (a PodDisruptionBudget) is tried again for this long (wall
    #: seconds since its first try) before it is reported failed
    drain_wait_s: float = 1800.0

    def backend_for(self, req: ActionRequest) -> Backend:
        b = self.router(req) if self.router is not None else self.backend
        if self.dry_run is not None and self.dry_run() and not isinstance(b, (DryRun, DryRunBackend)):
            return DryRun(b)
        return b

    @staticmethod
    def request(verdict: Verdict, index: int) -> ActionRequest:
        planned = verdict.actions[index]
        return ActionRequest(
            verdict_id=verdict.id,
            action=planned.action,
            target=planned.target,
            params=dict(planned.params),
            reason=f"{verdict.fault_class.value} ({verdict.scope} {verdict.subject}, incident {verdict.incident})",
        )

    async def plan(self, verdict: Verdict, *, seq: int = 0, partition: int = 0) -> list[ActionRecord | Work]:
        """The verdict's actions in order: a record for each settled at once (replayed,
        alert-only, held by the breaker, and the escalation of a hold), a :class:`Work`
        for each that the backend must carry out."""
        out: list[ActionRecord | Work] = []
        held_targets: set[str] = set()
        doc: dict[str, Any] | None = None
        for i, planned in enumerate(verdict.actions):
            req = self.request(verdict, i)
            prior = self.ledger.get(req.key)
            if prior is not None and Outcome(prior) in SETTLED:
                out.append(self._record(req, Outcome.already_so, f"replayed: already {prior}", 0, verdict.ts))
                continue
            if planned.params.get("alert_only"):
                # a shared component (a switch) is not ours to act on: alert a human
                alert = await self._alert(req, verdict.ts)
                out.append(alert)
                self.ledger[req.key] = alert.outcome.value
                continue
            if planned.target in held_targets:
                rec = self._record(req, Outcome.held_by_budget, "held with the isolation of this node", 0, verdict.ts)
                out.append(rec)
                self.ledger[req.key] = rec.outcome.value
                continue
            if planned.action is ActionName.isolate and not planned.params.get("operator"):
                # the breaker limits automation; a person's explicit hold or approval is not counted
                decision = self.breaker.check(planned.target, self.fleet_size(), verdict.ts)
                if not decision.allowed:
                    held_targets.add(planned.target)
                    rec = self._record(req, Outcome.held_by_budget, decision.reason, 0, verdict.ts)
                    out.append(rec)
                    self.ledger[req.key] = rec.outcome.value
                    out.extend(await self._escalate_hold(verdict, req, decision.reason))
                    continue
            doc = doc if doc is not None else verdict.to_dict()
            out.append(Work(key=req.key, verdict=doc, index=i, target=planned.target, seq=seq * 64 + i,
                            partition=partition))
        return out

    async def attempt(self, w: Work, now: float) -> ActionRecord | Work:
        """One try of ``w`` at its backend, no waiting: its record when it settled or
        failed for good, else ``w`` again with the attempt counted and its next due time."""
        verdict = Verdict.model_validate(w.verdict)
        req = self.request(verdict, w.index)
        if req.action is ActionName.drain:  # a drain's modes count from its first try
            req = replace(req, params={**req.params, "drain_since": w.first_at if w.first_at is not None else now})
        prior = self.ledger.get(req.key)
        if prior is not None and Outcome(prior) in SETTLED:
            return self._record(req, Outcome.already_so, f"replayed: already {prior}", 0, verdict.ts)
        backend = self.backend_for(req)
        if not backend.supports(req.action):
            return self._record(req, Outcome.failed, f"backend {backend.name} cannot {req.action.value}", 0,
                                verdict.ts, backend.name)
        attempt = w.attempt + 1
        try:
            result = await backend.apply(req)
        except PermanentError as exc:
            return self._record(req, Outcome.failed, f"permanent: {exc}", attempt, verdict.ts, backend.name)
        except (TemporaryError, ConnectionError, TimeoutError, OSError) as exc:
            first = w.first_at if w.first_at is not None else now
            # a drain, or an action whose controller has still to act, waits out drain_wait_s
            patient = (req.action is ActionName.drain or isinstance(exc, Waiting)) and now - first < self.drain_wait_s
            if attempt >= self.retry.max_attempts and not patient:
                return self._record(req, Outcome.failed, f"gave up after {attempt} attempts: {exc}", attempt,
                                    verdict.ts, backend.name)
            delay = self.retry.delay(attempt, exc.delay if isinstance(exc, TemporaryError) else None)
            log.warning("%s %s on %s: attempt %d failed (%s); next try in %.2fs",
                        backend.name, req.action.value, req.target, attempt, exc, delay)
            return replace(w, attempt=attempt, first_at=first, due=now + delay, last_error=str(exc)[:500])
        except Exception as exc:  # a backend bug must not stop the pipeline
            log.exception("backend %s crashed on %s", backend.name, req.key)
            return self._record(req, Outcome.failed, f"backend error: {exc!r}", attempt, verdict.ts, backend.name)
        assert isinstance(result, ActionResult)
        return self._record(req, result.outcome, result.detail, attempt, verdict.ts, backend.name)

    async def finish(self, w: Work, rec: ActionRecord) -> list[ActionRecord]:
        """Settle ``w`` with its record: the ledger, the breaker (a failed isolation gives
        its slot back), the notifier (an escalation); the records to report."""
        records = [rec]
        if rec.action is ActionName.isolate and rec.outcome is Outcome.failed:
            self.breaker.release(rec.target)
        if rec.outcome in SETTLED:
            self.ledger[rec.key] = rec.outcome.value
        if rec.action is ActionName.escalate and self.notifier is not None and rec.outcome is not Outcome.already_so:
            req = self.request(Verdict.model_validate(w.verdict), w.index)
            records.extend(await self._notify(req, rec.ts))
        return records

    async def carry_out(self, verdict: Verdict) -> list[ActionRecord]:
        """The whole verdict, in process: each action tried until it settles (waiting
        between tries with ``sleep``); for callers outside a stream."""
        sleep = self.sleep or asyncio.sleep
        records: list[ActionRecord] = []
        for step in await self.plan(verdict):
            if isinstance(step, ActionRecord):
                records.append(step)
                continue
            w = step
            while True:
                now = self.clock()
                got = await self.attempt(w, now)
                if isinstance(got, ActionRecord):
                    records.extend(await self.finish(w, got))
                    break
                w = got
                await sleep(max(0.0, w.due - now))
        return records

    async def _notify(self, req: ActionRequest, ts: float) -> list[ActionRecord]:
        assert self.notifier is not None
        delivery = self._apply(self.notifier, req, ts)
        if self.deliver_later is None:
            return [await delivery]
        if self.deliver_later(delivery):
            return []
        delivery.close()
        return [self._record(req, Outcome.failed, "notifier backlog full: delivery not attempted", 0, ts,
                             self.notifier.name)]

    async def _alert(self, req: ActionRequest, ts: float) -> ActionRecord:
        if self.notifier is not None:
            return await self._apply(self.notifier, req, ts)
        return self._record(req, Outcome.applied, "alert: the verdict is on the verdicts topic (no webhook configured)",
                            1, ts, "alerts")

    async def _escalate_hold(self, verdict: Verdict, req: ActionRequest, reason: str) -> list[ActionRecord]:
        if self.notifier is None:
            return []
        alert = ActionRequest(
            verdict_id=verdict.id,
            action=ActionName.escalate,
            target=req.target,
            params={"held": req.action.value, "reason": reason},
            reason=f"isolation held by the circuit breaker: {reason}",
        )
        return await self._notify(alert, verdict.ts)

    async def _apply(self, backend: Backend, req: ActionRequest, ts: float) -> ActionRecord:
        """A notifier delivery, retried with backoff until it settles (it runs off the
        stream's path: ``deliver_later``)."""
        if not backend.supports(req.action):
            return self._record(req, Outcome.failed, f"backend {backend.name} cannot {req.action.value}", 0, ts, backend.name)

        def on_retry(attempt: int, exc: BaseException, delay: float) -> None:
            log.warning("%s %s on %s: attempt %d failed (%s); retrying in %.2fs",
                        backend.name, req.action.value, req.target, attempt, exc, delay)

        try:
            result, attempts = await call_with_retry(lambda: backend.apply(req), self.retry, on_retry=on_retry,
                                                     sleep=self.sleep or asyncio.sleep)
        except PermanentError as exc:
            return self._record(req, Outcome.failed, f"permanent: {exc}", 1, ts, backend.name)
        except RetriesExhausted as exc:
            return self._record(req, Outcome.failed, str(exc), exc.attempts, ts, backend.name)
        except Exception as exc:  # a backend bug must not stop the pipeline
            log.exception("backend %s crashed on %s", backend.name, req.key)
            return self._record(req, Outcome.failed, f"backend error: {exc!r}", 1, ts, backend.name)
        assert isinstance(result, ActionResult)
        return self._record(req, result.outcome, result.detail, attempts, ts, backend.name)

    def _record(self, req: ActionRequest, outcome: Outcome, detail: str, attempts: int, ts: float,
                backend: str | None = None) -> ActionRecord:
        return ActionRecord(
            ts=ts,
            key=req.key,
            verdict_id=req.verdict_id,
            action=req.action,
            target=req.target,
            backend=backend or self.backend.name,
            outcome=outcome,
            detail=detail[:2000],
            attempts=max(attempts, 1),
        )


Report = Callable[[Work, "ActionRecord | Work"], Awaitable[None]]


#: which due work starts first when more is due than ``max_in_flight`` allows: keeping
#: new work off a faulty node, then moving the jobs it struck, then emptying the node,
#: then the rest (diagnostics, escalations, returns). In a burst of failures every node is
#: cordoned before the first drains and diagnostics take the backend's capacity.
URGENCY: dict[str, int] = {ActionName.isolate.value: 0, ActionName.requeue.value: 1, ActionName.retry.value: 1,
                           ActionName.restart.value: 1, ActionName.stop.value: 1, ActionName.drain.value: 2}


#: while an isolation is under way or due, only work of at most this urgency starts (the
#: isolations, and the requeues that move jobs off the failing nodes): in a burst the
#: nodes are contained first, and their drains and diagnostics follow
CONTAIN_FIRST = 1


def urgency(w: Work) -> int:
    """The rank of ``w``'s action in :data:`URGENCY` (3 for any other)."""
    try:
        action = str(w.verdict["actions"][w.index]["action"])
    except (KeyError, IndexError, TypeError):
        return 3
    return URGENCY.get(action, 3)


class ActionRunner:
    """Carries :class:`Work` out in the background, never in the stream's way.

    Per target one try at a time, in ``seq`` order (a node's isolation before its drain,
    an older verdict's actions before a newer one's); at most ``max_in_flight`` targets at
    once; each try when it is due. Across targets, the most urgent due work starts first
    (:data:`URGENCY`, then ``seq``), and while an isolation runs or is due nothing less
    urgent than :data:`CONTAIN_FIRST` starts. ``report`` hears every try's result (the worker writes
    it down and publishes the record); ``owns(partition)`` says whether this worker still
    carries out that partition's work (after a rebalance, the new owner does).

    ``durable()``, when given, is awaited before newly added work is first tried (the
    worker flushes its producer): the circuit breaker's count and the pending table that
    the work was planned with are then on the broker before the backend acts, so a worker
    killed in between cannot come back with a breaker that forgot an isolation it made.
    Work added while a flush is under way waits for the next one.

    The head of each idle target's queue is kept in heaps (by due time until it is due,
    then by urgency and ``seq``), so a pump round costs what it starts, not a walk over
    every queue: in a burst of a thousand nodes, each with its isolation, drain and
    diagnosis queued, a walk per finished try was most of the worker's time. An entry
    whose target has moved on (its head finished, was replaced by a retry or was
    dropped) is recognised when it comes up and skipped.
    """

    def __init__(self, actuation: Actuation, report: Report, *, max_in_flight: int = 64,
                 owns: Callable[[int], bool] | None = None, clock: Callable[[], float] = time.time,
                 durable: Callable[[], Awaitable[None]] | None = None, durable_timeout_s: float = 5.0,
                 contain_quiet_s: float = 0.0) -> None:
        self.actuation, self.report, self.max_in_flight = actuation, report, max_in_flight
        #: how long after the last isolation ran or was due less urgent work still waits:
        #: the isolations of a burst arrive over seconds, and drains and diagnostics
        #: started in the gaps between them would take the backend from containment
        self.contain_quiet_s = contain_quiet_s
        #: when an isolation last ran or was due; whether less urgent work is held back now
        self.contained_at = float("-inf")
        self.holding = False
        self.owns = owns or (lambda p: True)
        self.clock = clock
        self.durable, self.durable_timeout_s = durable, durable_timeout_s
        #: keys of work added since the last flush began (not yet known to be durable)
        self.fresh: set[str] = set()
        self.queues: dict[str, list[Work]] = {}
        self.keys: set[str] = set()
        self.busy: set[str] = set()
        self.tasks: set[asyncio.Task[None]] = set()
        self.tries = 0
        self._wake = asyncio.Event()
        #: each queued key's urgency, worked out once
        self._ranks: dict[str, int] = {}
        #: busy targets whose running try is an isolation
        self._isolating: set[str] = set()
        #: heads not yet due, (due, seq, target, key): [0] those that may start while containing, [1] the rest
        self._waiting: tuple[list[tuple[float, int, str, str]], list[tuple[float, int, str, str]]] = ([], [])
        #: heads due, (rank, seq, target, key, due), split the same way
        self._ready: tuple[list[tuple[int, int, str, str, float]], list[tuple[int, int, str, str, float]]] = ([], [])
        #: when every queue's head was last checked against ``owns``
        self._swept_at = float("-inf")

    @property
    def pending(self) -> int:
        return len(self.keys)

    def add(self, w: Work) -> bool:
        """Queue ``w`` behind the work on its target (by ``seq``); False if it is queued."""
        if w.key in self.keys:
            return False
        q = self.queues.setdefault(w.target, [])
        bisect.insort(q, w, key=lambda x: x.seq)
        self.keys.add(w.key)
        self._ranks[w.key] = urgency(w)
        if q[0] is w:
            self._index(w.target)
        if self.durable is not None:
            self.fresh.add(w.key)
        self._wake.set()
        return True

    # ------------------------------------------------------------------ the index

    def _index(self, target: str) -> None:
        """Enter ``target``'s head (if it has one and is idle) in the heap of work waiting for its time."""
        q = self.queues.get(target)
        if not q or target in self.busy:
            return
        w = q[0]
        heapq.heappush(self._waiting[self._ranks.get(w.key, 3) > CONTAIN_FIRST], (w.due, w.seq, target, w.key))

    def _head(self, target: str, key: str, due: float) -> Work | None:
        """The head an index entry stands for, if it still is one: its target idle, the same
        work at its head, due when the entry says. A head whose due time was changed in
        place is entered again."""
        q = self.queues.get(target)
        if not q or target in self.busy:
            return None
        w = q[0]
        if w.key != key:
            return None
        if w.due != due:
            self._index(target)
            return None
        return w

    def _forget(self, key: str) -> None:
        self.keys.discard(key)
        self._ranks.pop(key, None)
        self.fresh.discard(key)

    def _drop_head(self, target: str) -> None:
        """Drop ``target``'s head (its partition moved to another worker); enter the next one."""
        q = self.queues[target]
        self._forget(q.pop(0).key)
        if q:
            self._index(target)
        else:
            del self.queues[target]

    def _sweep(self, owns: Callable[[int], bool]) -> None:
        """Drop every head whose partition this worker no longer owns."""
        for target in list(self.queues):
            if target in self.busy:
                continue
            q = self.queues[target]
            dropped = False
            while q and not owns(q[0].partition):
                self._forget(q.pop(0).key)
                dropped = True
            if not q:
                del self.queues[target]
            elif dropped:
                self._index(target)

    def _ready_top(self, heap: list[tuple[int, int, str, str, float]],
                   owns: Callable[[int], bool]) -> tuple[int, int, str, str, float] | None:
        """The first live entry of a ready heap (stale ones, and work no longer owned, removed)."""
        while heap:
            rank, _, target, key, due = heap[0]
            w = self._head(target, key, due)
            if w is None:
                heapq.heappop(heap)
            elif not owns(w.partition):
                heapq.heappop(heap)
                self._drop_head(target)
            else:
                return heap[0]
        return None

    def _waiting_top(self, heap: list[tuple[float, int, str, str]]) -> float | None:
        """The due time of the first live entry of a waiting heap."""
        while heap:
            due, _, target, key = heap[0]
            if self._head(target, key, due) is not None:
                return due
            heapq.heappop(heap)
        return None

    # ------------------------------------------------------------------ the pump's steps

    def start_due(self, now: float) -> int:
        """Start the most urgent tries that are due, within ``max_in_flight``; how many started."""
        owned: dict[int, bool] = {}  # asked once per partition per call: the answer walks the assignment

        def owns(partition: int) -> bool:
            if partition not in owned:
                owned[partition] = self.owns(partition)
            return owned[partition]

        if now - self._swept_at >= 1.0:
            self._sweep(owns)
            self._swept_at = now
        for waiting, ready in zip(self._waiting, self._ready, strict=True):
            while waiting and waiting[0][0] <= now:
                due, seq, target, key = heapq.heappop(waiting)
                if self._head(target, key, due) is not None:
                    heapq.heappush(ready, (self._ranks.get(key, 3), seq, target, key, due))
        # an isolation in flight, or due now (the urgent heap holds ranks 0 and 1, 0 first)
        top = self._ready_top(self._ready[0], owns)
        containing = bool(self._isolating) or (top is not None and top[0] == 0)
        if containing:
            self.contained_at = now
        self.holding = containing or now - self.contained_at < self.contain_quiet_s
        room = self.max_in_flight - len(self.busy)
        started = 0
        aside: list[tuple[int, int, str, str, float]] = []
        for ready in self._ready[:1] if self.holding else self._ready:
            while started < room and self._ready_top(ready, owns) is not None:
                entry = heapq.heappop(ready)
                rank, _, target, key, _ = entry
                if key in self.fresh:  # not durable yet: the next round, after the flush
                    aside.append(entry)
                    continue
                self.busy.add(target)
                if rank == 0:
                    self._isolating.add(target)
                task = asyncio.ensure_future(self._one(self.queues[target][0]))
                self.tasks.add(task)
                task.add_done_callback(self.tasks.discard)
                started += 1
            for entry in aside:
                heapq.heappush(ready, entry)
            aside.clear()
        return started

    def next_due(self) -> float | None:
        """When the next try is due.  Work held back for containment is not counted: a
        finished isolation wakes the pump, and the end of the quiet window is counted
        in its place. Due work that waits for room is not counted either: a finished try
        wakes the pump."""
        urgent = self._waiting_top(self._waiting[0])
        rest = self._waiting_top(self._waiting[1])
        if not self.holding:
            return min((d for d in (urgent, rest) if d is not None), default=None)
        due = [] if urgent is None else [urgent]
        if (rest is not None or self._ready[1]) and self.contain_quiet_s > 0:
            due.append(self.contained_at + self.contain_quiet_s)
        return min(due, default=None)

    async def make_durable(self) -> bool:
        """Await ``durable()`` for the work added so far; False if it failed or timed out
        (that work waits, and the next round tries again)."""
        if not self.fresh or self.durable is None:
            return True
        batch = set(self.fresh)
        try:
            await asyncio.wait_for(self.durable(), self.durable_timeout_s)
        except Exception as exc:  # the broker is away: acting now could outrun the breaker's record
            log.warning("%d actions wait: the state they were planned with is not on the broker yet (%r)",
                        len(batch), exc)
            return False
        self.fresh -= batch
        return True

    async def _one(self, w: Work) -> None:
        got: ActionRecord | Work
        try:
            self.tries += 1
            got = await self.actuation.attempt(w, self.clock())
            await self.report(w, got)
        except Exception:  # not reported: tried again a little later (the backend is idempotent)
            log.exception("action %s: its result could not be reported; trying again", w.key)
            got = replace(w, due=self.clock() + 1.0)
        finally:
            self.busy.discard(w.target)
            self._isolating.discard(w.target)
            self._wake.set()
        q = self.queues.get(w.target) or []
        if q and q[0].key == w.key:
            if isinstance(got, Work):
                q[0] = got
            else:
                q.pop(0)
                self._forget(w.key)
            if not q:
                self.queues.pop(w.target, None)
        self._index(w.target)

    async def _flush(self) -> None:
        """:meth:`make_durable` beside the pump; after a failure, half a second before the next."""
        if not await self.make_durable():
            await asyncio.sleep(0.5)
        self._wake.set()

    async def run(self, should_stop: Callable[[], bool]) -> None:
        """The pump: start what is due, then wait for new work, a finished try, a flush
        done or the next due time (at most a second).

        New work is made durable by a flush that runs beside the pump, not in its way: in
        a burst, work keeps arriving, and a pump that awaited a flush of the producer
        before each round left the room of every finished try empty until the flush was
        done. Work still fresh does not start (:meth:`start_due`)."""
        flushing: asyncio.Future[None] | None = None
        try:
            while not should_stop():
                self._wake.clear()
                if self.fresh and (flushing is None or flushing.done()):
                    flushing = asyncio.ensure_future(self._flush())
                now = self.clock()
                self.start_due(now)
                nxt = self.next_due()
                timeout = 1.0 if nxt is None else min(1.0, max(0.01, nxt - now))
                try:
                    await asyncio.wait_for(self._wake.wait(), timeout)
                except asyncio.TimeoutError:
                    pass
        finally:
            if flushing is not None and not flushing.done():
                flushing.cancel()
