"""Carrying a verdict out: guards, idempotency, retries, one audit record per action.

For every planned action, in the verdict's order:

1. **idempotency**: the action's key (verdict id + action + target) is looked up in the
   ledger; an action already carried out is not done twice (a replayed verdict after a
   crash changes nothing), it is recorded as ``already_so``;
2. **guards**: an isolation asks the circuit breaker; beyond the budget it is *held*
   (``held_by_budget``), the node's other actions in that verdict are held too, and the
   hold is escalated for a human;
3. **act**: the backend observes, compares and acts, retried with backoff on temporary
   errors;
4. **report**: an :class:`ActionRecord` for the ``actions`` topic, and the ledger entry.

Escalations also go to the notifier (``actuators.webhook_url``).  With ``deliver_later``
set (the worker sets it) those deliveries run in the background, so a webhook that is down
delays no later action; their records are reported when each delivery settles.
"""

from __future__ import annotations

import fnmatch
import logging
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, Protocol

from actuators import (
    ActionRequest,
    ActionResult,
    Backend,
    CircuitBreaker,
    PermanentError,
    RetriesExhausted,
    RetryPolicy,
    call_with_retry,
)
from actuators.dryrun import DryRun, DryRunBackend
from schemas import JOB_ACTIONS, ActionName, ActionRecord, Outcome, Verdict

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


@dataclass
class Actuation:
    backend: Backend
    breaker: CircuitBreaker
    fleet_size: Callable[[], int]
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    notifier: Backend | None = None
    ledger: Ledger = field(default_factory=dict)
    sleep: Callable | None = None
    clock: Callable[[], float] = time.time
    router: Callable[[ActionRequest], Backend] | None = None
    #: switched at run time (the operator API): every backend answers dry_run while it is true
    dry_run: Callable[[], bool] | None = None
    #: takes a notifier delivery off the verdict's path and reports its record when it
    #: settles; returns False when it cannot take more.  None: deliveries run inline and
    #: their records come back with the verdict's.
    deliver_later: Callable[[Coroutine[Any, Any, ActionRecord]], bool] | None = None

    def backend_for(self, req: ActionRequest) -> Backend:
        b = self.router(req) if self.router is not None else self.backend
        if self.dry_run is not None and self.dry_run() and not isinstance(b, (DryRun, DryRunBackend)):
            return DryRun(b)
        return b

    async def carry_out(self, verdict: Verdict) -> list[ActionRecord]:
        records: list[ActionRecord] = []
        held_targets: set[str] = set()
        for planned in verdict.actions:
            req = ActionRequest(
                verdict_id=verdict.id,
                action=planned.action,
                target=planned.target,
                params=dict(planned.params),
                reason=f"{verdict.fault_class.value} ({verdict.scope} {verdict.subject}, incident {verdict.incident})",
            )
            prior = self.ledger.get(req.key)
            if prior is not None and Outcome(prior) in SETTLED:
                records.append(self._record(req, Outcome.already_so, f"replayed: already {prior}", 0, verdict.ts))
                continue
            if planned.params.get("alert_only"):
                # a shared component (a switch) is not ours to act on: alert a human
                records.append(await self._alert(req, verdict.ts))
                self.ledger[req.key] = records[-1].outcome.value
                continue
            if planned.target in held_targets:
                rec = self._record(req, Outcome.held_by_budget, "held with the isolation of this node", 0, verdict.ts)
                records.append(rec)
                self.ledger[req.key] = rec.outcome.value
                continue
            if planned.action is ActionName.isolate and not planned.params.get("operator"):
                # the breaker limits automation; a person's explicit hold or approval is not counted
                decision = self.breaker.check(planned.target, self.fleet_size(), verdict.ts)
                if not decision.allowed:
                    held_targets.add(planned.target)
                    rec = self._record(req, Outcome.held_by_budget, decision.reason, 0, verdict.ts)
                    records.append(rec)
                    self.ledger[req.key] = rec.outcome.value
                    records.extend(await self._escalate_hold(verdict, req, decision.reason))
                    continue
            rec = await self._apply(self.backend_for(req), req, verdict.ts)
            if planned.action is ActionName.isolate and rec.outcome is Outcome.failed:
                self.breaker.release(planned.target)
            records.append(rec)
            if rec.outcome in SETTLED:
                self.ledger[req.key] = rec.outcome.value
            if planned.action is ActionName.escalate and self.notifier is not None:
                records.extend(await self._notify(req, verdict.ts))
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
        if not backend.supports(req.action):
            return self._record(req, Outcome.failed, f"backend {backend.name} cannot {req.action.value}", 0, ts, backend.name)

        def on_retry(attempt: int, exc: BaseException, delay: float) -> None:
            log.warning("%s %s on %s: attempt %d failed (%s); retrying in %.2fs",
                        backend.name, req.action.value, req.target, attempt, exc, delay)

        kwargs = {"on_retry": on_retry}
        if self.sleep is not None:
            kwargs["sleep"] = self.sleep
        try:
            result, attempts = await call_with_retry(lambda: backend.apply(req), self.retry, **kwargs)
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
