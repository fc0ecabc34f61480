"""SimBackend against the simulator's real cluster API on loopback."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
import pytest_asyncio

from actuators.base import ActionRequest, PermanentError, TemporaryError
from actuators.sim import SimBackend
from pipeline.config import load_settings
from pipeline.worker.procs import free_port
from pipeline.sim.run import SimRunner
from pipeline.sim.cluster import SimConfig
from schemas import ActionName, Outcome

pytestmark = pytest.mark.asyncio


@pytest_asyncio.fixture
async def sim() -> AsyncIterator[tuple[SimRunner, SimBackend]]:
    port = free_port()
    runner = SimRunner(load_settings(environ={}), SimConfig(nodes=4, faults="none"), api_port=port)
    await runner.start_api()
    backend = SimBackend(f"http://127.0.0.1:{port}/", timeout=5.0)
    try:
        yield runner, backend
    finally:
        await backend.close()
        if runner._runner is not None:
            await runner._runner.cleanup()


async def test_isolating_a_node_cordons_it_once(sim) -> None:
    runner, backend = sim
    request = ActionRequest("v-1", ActionName.isolate, "node-0001", reason="xid 79")
    first = await backend.apply(request)
    again = await backend.apply(request)
    assert first.outcome is Outcome.applied
    assert again.outcome is Outcome.already_so
    assert runner.cluster.nodes["node-0001"].cordoned
    assert not runner.cluster.nodes["node-0002"].cordoned


async def test_isolating_an_already_cordoned_node_under_another_key_is_already_so(sim) -> None:
    runner, backend = sim
    await backend.apply(ActionRequest("v-1", ActionName.isolate, "node-0001"))
    other = await backend.apply(ActionRequest("v-2", ActionName.isolate, "node-0001"))
    assert other.outcome is Outcome.already_so
    assert "already cordoned" in other.detail


async def test_acting_on_an_unknown_node_is_a_permanent_error(sim) -> None:
    _, backend = sim
    with pytest.raises(PermanentError, match="404"):
        await backend.apply(ActionRequest("v-1", ActionName.isolate, "node-9999"))


async def test_an_unreachable_simulator_is_a_temporary_error() -> None:
    backend = SimBackend(f"http://127.0.0.1:{free_port()}", timeout=2.0)
    try:
        with pytest.raises(TemporaryError, match="unreachable"):
            await backend.apply(ActionRequest("v-1", ActionName.isolate, "node-0001"))
    finally:
        await backend.close()
