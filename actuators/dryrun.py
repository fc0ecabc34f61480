"""Dry-run backends: decide and record, never act.

:class:`DryRunBackend` stands in for a whole cluster: it supports every action and
answers every request with ``dry_run``.  :class:`DryRun` wraps a real backend so that the
pipeline keeps the real backend's name and its notion of which actions it supports,
while the real backend's :meth:`apply` is never called.

Both keep what they would have done in :attr:`planned`, oldest first, for tests and for
an operator looking at what a new policy would do before it is allowed to act.
"""

from __future__ import annotations

from schemas import ActionName, Outcome

from .base import ActionRequest, ActionResult, Backend


def _would(request: ActionRequest) -> ActionResult:
    detail = f"would {request.action.value} {request.target}"
    if request.reason:
        detail = f"{detail}: {request.reason}"
    return ActionResult(Outcome.dry_run, detail)


class DryRunBackend:
    """A backend that supports every action and never acts.

    ``apply`` observes nothing, changes nothing and returns
    ``ActionResult(Outcome.dry_run, "would <action> <target>: <reason>")``.
    """

    name = "dryrun"

    def __init__(self) -> None:
        #: every request seen, in arrival order
        self.planned: list[ActionRequest] = []

    def supports(self, action: ActionName) -> bool:
        return True

    async def apply(self, request: ActionRequest) -> ActionResult:
        self.planned.append(request)
        return _would(request)

    async def close(self) -> None:
        return None


class DryRun:
    """Wrap ``inner`` so that nothing is ever applied through it.

    The wrapper carries the inner backend's ``name`` (the audit record shows which
    backend *would* have acted) and delegates :meth:`supports`, so an action the real
    backend cannot carry out is still reported as unsupported.  :meth:`close` closes the
    inner backend: the wrapper owns it.
    """

    def __init__(self, inner: Backend) -> None:
        self.inner = inner
        self.name: str = f"{inner.name}"
        #: every request seen, in arrival order
        self.planned: list[ActionRequest] = []

    def supports(self, action: ActionName) -> bool:
        return self.inner.supports(action)

    async def apply(self, request: ActionRequest) -> ActionResult:
        self.planned.append(request)
        return _would(request)

    async def close(self) -> None:
        await self.inner.close()
