"""The simulated cluster and the pipeline's decisions in one process, in a closed loop.

:class:`InProcessLoop` ticks a :class:`pipeline.sim.cluster.Cluster`, decodes its records
exactly as the Faust agents do (:func:`schemas.codec.decode`), feeds them to
:class:`pipeline.eval.replay.LocalPipeline` (the detection glue and the correlator the agents
call) and carries every verdict out with :class:`pipeline.actuate.core.Actuation` (the
circuit breaker, idempotency ledger and audit records of the ``actuate`` agent) on a
backend that calls the simulator's cluster API in process.  No Kafka, no clock: it runs
as fast as the code does, so an evaluation can replay days of a cluster.
"""

from __future__ import annotations

import asyncio
from typing import Any

from actuators import ActionRequest, ActionResult, CircuitBreaker, PermanentError, RetryPolicy
from schemas import ActionRecord, GpuSample, JobEvent, NetworkSample, Outcome, Verdict
from schemas.codec import DecodeError, decode

from pipeline.actuate.core import Actuation
from pipeline.config import Settings
from pipeline.eval.replay import LocalPipeline
from pipeline.sim.cluster import Cluster

RECORD_OF = {"telemetry.gpu": GpuSample, "telemetry.network": NetworkSample, "telemetry.job": JobEvent}


class ClusterBackend:
    """The simulator's ``POST /actions`` without HTTP: the same observe-compare-act."""

    name = "sim"

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster

    def supports(self, action: Any) -> bool:
        return True

    async def apply(self, request: ActionRequest) -> ActionResult:
        status, data = self.cluster.act({"key": request.key, "verdict_id": request.verdict_id,
                                          "action": request.action.value, "target": request.target,
                                          "params": request.params, "reason": request.reason})
        if status >= 400:
            raise PermanentError(f"cluster refused {request.action.value} {request.target}: {status} {data}")
        return ActionResult(Outcome(data.get("outcome", "applied")), str(data.get("detail", "")))

    async def close(self) -> None:
        return None


class InProcessLoop:
    """One simulated cluster, the pipeline's decisions and actuation, stepped together."""

    def __init__(self, settings: Settings, cluster: Cluster) -> None:
        self.s = settings
        self.cluster = cluster
        self.pipe = LocalPipeline(settings)
        sf = settings.safety
        self.actuation = Actuation(
            backend=ClusterBackend(cluster),
            breaker=CircuitBreaker(max_fraction=sf.max_fraction, max_absolute=sf.max_absolute, window_s=sf.window_s),
            fleet_size=lambda: sf.fleet_size or len(cluster.nodes),
            retry=RetryPolicy(max_attempts=1, base_delay=0.0),
        )
        self.actions: list[ActionRecord] = []
        self.deadletters: list[str] = []
        self._loop = asyncio.new_event_loop()
        self._done = 0

    def _records(self, raw: list[tuple[str, str, bytes]]) -> list[Any]:
        out = []
        for topic, _key, value in raw:
            try:
                out.append(decode(RECORD_OF[topic], value))
            except DecodeError as exc:
                self.deadletters.append(exc.reason)
        return out

    def _act(self, verdicts: list[Verdict]) -> None:
        for v in verdicts:
            self.actions.extend(self._loop.run_until_complete(self.actuation.carry_out(v)))

    def step(self, seconds: int = 1) -> None:
        """Advance the cluster ``seconds`` simulated seconds; decide and act on what it emits."""
        for _ in range(seconds):
            self.cluster.tick()
            raw, self.cluster.out = self.cluster.out, []
            self.pipe.feed(self._records(raw))
            self._act(self.pipe.verdicts[self._done:])
            self._done = len(self.pipe.verdicts)

    def finish(self) -> None:
        self.pipe.finish()
        self._act(self.pipe.verdicts[self._done:])
        self._done = len(self.pipe.verdicts)

    @property
    def verdicts(self) -> list[Verdict]:
        return self.pipe.verdicts

    def close(self) -> None:
        self._loop.close()

    def verdict_dicts(self) -> list[dict[str, Any]]:
        return [v.model_dump(mode="json") for v in self.pipe.verdicts]

    def action_dicts(self) -> list[dict[str, Any]]:
        return [a.model_dump(mode="json") for a in self.actions]
