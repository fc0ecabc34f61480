"""The backend protocol: one operation is observe, compare, act, report.

Every operation is keyed by a deterministic idempotency key (verdict id + action +
target).  A backend first looks at the live state; when the target already is as the
action wants it, the outcome is ``already_so`` (a success).  Errors are typed: a
:class:`TemporaryError` is retried by :mod:`actuators.retry` after a delay, a
:class:`PermanentError` is reported as ``failed`` at once.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from schemas import ActionName, Outcome


class ActuatorError(Exception):
    """Base of the errors a backend may raise."""

    retryable = False


class TemporaryError(ActuatorError):
    """The backend is unreachable, slow, or refused for now (5xx, 429, timeouts)."""

    retryable = True

    def __init__(self, message: str, *, delay: float | None = None) -> None:
        super().__init__(message)
        self.delay = delay


class Waiting(TemporaryError):
    """The action is under way at its backend: a controller has still to act (a suspended
    job's pods to stop, Kueue to evict a workload).  Tried again after ``delay`` for as long
    as the actuation waits on its backends (``actuators.drain_wait_s``), however many tries
    that takes, and reported as failed only then."""


class PermanentError(ActuatorError):
    """The request can never succeed as asked (unknown target, forbidden, invalid)."""


@dataclass(frozen=True, slots=True)
class ActionRequest:
    """One action of one verdict, addressed to one target (a node name or a job id)."""

    verdict_id: str
    action: ActionName
    target: str
    params: dict[str, Any] = field(default_factory=dict)
    reason: str = ""

    @property
    def key(self) -> str:
        return idempotency_key(self.verdict_id, self.action, self.target)


def idempotency_key(verdict_id: str, action: ActionName | str, target: str) -> str:
    value = action.value if isinstance(action, ActionName) else str(action)
    return f"{verdict_id}:{value}:{target}"


@dataclass(frozen=True, slots=True)
class ActionResult:
    outcome: Outcome
    detail: str = ""


@runtime_checkable
class Backend(Protocol):
    """What every backend implements.  Backends never import each other."""

    #: short name recorded on the ``actions`` topic ("kubernetes", "slurm", "sim", ...)
    name: str

    def supports(self, action: ActionName) -> bool:
        """Whether this backend can carry out ``action`` at all."""

    async def apply(self, request: ActionRequest) -> ActionResult:
        """Observe the target, compare with the wanted state, act if needed.

        Returns ``applied`` or ``already_so``; raises :class:`TemporaryError` for a
        retryable failure and :class:`PermanentError` otherwise.
        """

    async def close(self) -> None:
        """Release connections."""
