"""Dry-run backends: every request is recorded, nothing is applied."""

from __future__ import annotations

import pytest

from actuators.base import ActionRequest, ActionResult, Backend
from actuators.dryrun import DryRun, DryRunBackend
from schemas import ActionName, Outcome

pytestmark = pytest.mark.asyncio


class RecordingBackend:
    """A backend that fails the test if it is ever asked to act."""

    name = "slurm"

    def __init__(self) -> None:
        self.closed = False

    def supports(self, action: ActionName) -> bool:
        return action in (ActionName.requeue, ActionName.isolate)

    async def apply(self, request: ActionRequest) -> ActionResult:
        raise AssertionError("a dry run must never reach the real backend")

    async def close(self) -> None:
        self.closed = True


async def test_dry_run_backend_supports_everything_and_only_plans() -> None:
    backend = DryRunBackend()
    assert isinstance(backend, Backend)
    assert all(backend.supports(a) for a in ActionName)
    request = ActionRequest("v-1", ActionName.isolate, "n1", reason="xid 79")
    result = await backend.apply(request)
    assert result == ActionResult(Outcome.dry_run, "would isolate n1: xid 79")
    assert backend.planned == [request]
    await backend.close()


async def test_dry_run_wrapper_keeps_the_inner_name_and_support_but_never_applies() -> None:
    inner = RecordingBackend()
    wrapped = DryRun(inner)
    assert isinstance(wrapped, Backend)
    assert wrapped.name == "slurm"
    assert wrapped.supports(ActionName.requeue) and not wrapped.supports(ActionName.drain)
    request = ActionRequest("v-1", ActionName.requeue, "ml/train", {"exclude": ["n1"]}, reason="nvlink")
    result = await wrapped.apply(request)
    assert result.outcome is Outcome.dry_run and result.detail == "would requeue ml/train: nvlink"
    assert wrapped.planned == [request]
    await wrapped.close()
    assert inner.closed
