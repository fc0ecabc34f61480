"""``make chaos``: a seeded fleet scenario on the real broker, under fire.

While the simulated cluster streams telemetry and injects its faults, the harness

* kills the worker with SIGKILL (``kills`` times) and starts a new one at once,
  measuring how long each takes to be ready again (table recovery from the changelogs
  included), in every phase of :data:`KILL_PHASES`: while it runs, while it starts,
  during a rebalance, during the backend outage, while a drain waits on a
  PodDisruptionBudget, and just after an operator switched dry-run on;
* on a 3-broker cluster (``deploy/kafka.sh`` with ``KAFKA_BROKERS=3``, replication
  factor 3, ``min.insync.replicas=2``, producers with ``acks=all``) kills a follower and
  then the leader of the ``verdicts`` topic's first partition with SIGKILL, under load,
  and restarts each; on a single broker it restarts that one;
* takes the backend (the simulated cluster's API) down for ``outage_s`` seconds: it
  answers 503, actions wait with backoff and are applied when it returns;
* writes ``hostile`` malformed messages from a grammar-based mutation fuzzer
  (:class:`Fuzzer`) over every telemetry topic, with a key of their own each (so across
  all partitions), mutated from real records of each topic.

Then it judges what happened from outside the pipeline:

* the backend's own request log (:mod:`pipeline.eval.groundtruth`): every faulty node
  cordoned or, if not, the breaker's or dry-run's record that says why
  (``effects_lost`` counts the others); no second effect on one target for one incident,
  whatever the key (``duplicate_effects``); no healthy node cordoned; no effect while
  dry-run was on (``effects_in_dry_run``); every drain the budget refused done once it
  was relaxed (``blocked_drains_not_done``);
* the dead-letter topic: every hostile input that the decoder refuses is there with its
  reason (``refused_not_dead_lettered``), and ``sent = dead_lettered + accepted``;
* every worker's log: tracebacks, crashed agents and unretrieved task exceptions
  (``crash_lines``), and workers that died on their own (``agent_crashes``).
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import os
import random
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import orjson
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.errors import KafkaError

from schemas import GpuSample, JobEvent, NetworkSample
from schemas.codec import DecodeError, decode

from pipeline.config import load_settings, state_dir
from pipeline.eval.groundtruth import blocked_drains, check, faults_of
from pipeline.sim.cluster import HARDWARE_KINDS, SimConfig, score
from pipeline.sim.run import SimRunner
from pipeline.worker.procs import KAFKA_SH, WorkerProcess, free_port, kafka_script
from pipeline.worker.topics import ensure_topics

#: when the backend outage begins, as a share of the scenario's duration (while the
#: demo's faults are still being injected, so that actions meet it)
OUTAGE_AT = 0.2
#: the moments a worker is killed at: while it runs, while it starts (before it is ready),
#: while a second worker joins its group (a rebalance), while the backend is down, while a
#: drain waits on a PodDisruptionBudget, and just after an operator switched dry-run on
KILL_PHASES = ("running", "starting", "rebalance", "outage", "drain_blocked", "dry_run")
#: when the windows of the last two phases open, as shares of the scenario's duration (one
#: of each per ten kills, at least one of each from six kills)
WINDOWS = {"drain_blocked": (0.38, 0.62), "dry_run": (0.5, 0.75)}
#: when a broker of the 3-broker cluster is killed (a follower of verdicts' first
#: partition, then its leader), as shares of the duration, and how long each stays down
BROKER_KILLS = (("follower", 0.4), ("leader", 0.65))
BROKER_DOWN_S = 20.0
#: the request log's effects this long after dry-run was switched on are its breaches (an
#: action already on its way when the switch came may land within it)
DRY_RUN_GRACE_S = 1.0
#: the breaker's share of the fleet in a chaos run
BREAKER_FRACTION = 0.5
#: the topics the fuzzer writes to, and the record each must hold
FUZZED = {"telemetry.gpu": GpuSample, "telemetry.network": NetworkSample, "telemetry.job": JobEvent}
#: lines in a worker's log that mean something crashed inside it
CRASH_MARKERS = ("Traceback (most recent call last)", "Task exception was never retrieved", "crashed", "CRASHED",
                 "Unhandled exception", "Fatal error")


class Fuzzer:
    """Malformed telemetry from valid records, by a grammar of mutations.

    Each message applies one production: invalid JSON (truncated, random bytes, bare
    values, deep nesting), a wrong type for a field, a missing required field, extra
    fields, NaN and infinities, absurd magnitudes, negative counters, lists of the
    wrong length, unknown schema versions, timestamps far in the past or future,
    oversized payloads, out-of-order and duplicated samples (valid, but late).
    """

    def __init__(self, seed: int, templates: dict[str, list[dict[str, Any]]] | None = None) -> None:
        self.rng = random.Random(seed)
        #: real records by topic (short name), the mutations' starting points
        self.templates: dict[str, list[dict[str, Any]]] = templates or {}
        self.kinds: Counter[str] = Counter()
        self.productions = [
            self._truncated, self._garbage, self._bare, self._deep, self._wrong_type, self._missing, self._extra,
            self._nan, self._huge, self._negative, self._length, self._schema, self._time, self._late,
        ]

    def ready(self) -> bool:
        return all(self.templates.get(t) for t in FUZZED)

    def keep(self, topic: str, rec: dict[str, Any]) -> None:
        """A real record of ``topic`` to mutate (the first few of each topic are kept)."""
        kept = self.templates.setdefault(topic, [])
        if len(kept) < 20:
            if topic == "telemetry.job":
                rec = {**rec, "job": f"fuzz-{rec.get('job')}"}  # never a real job's history
            kept.append(rec)

    def one(self, topic: str = "telemetry.gpu") -> bytes:
        if self.rng.random() < 0.0005:
            self.kinds["oversized"] += 1
            # over the decoder's limit, under the broker's (1 MiB): it reaches the worker
            return b'{"schema":"gpu/1","pad":"' + b"x" * 1_000_500 + b'"}'
        prod = self.rng.choice(self.productions)
        self.kinds[prod.__name__.strip("_")] += 1
        return prod(dict(self.rng.choice(self.templates[topic])))

    def _field(self, rec: dict[str, Any]) -> str:
        return self.rng.choice([k for k in rec if k != "schema"])

    def _truncated(self, rec: dict) -> bytes:
        raw = orjson.dumps(rec)
        return raw[: self.rng.randrange(1, len(raw))]

    def _garbage(self, rec: dict) -> bytes:
        return bytes(self.rng.getrandbits(8) for _ in range(self.rng.randrange(1, 200)))

    def _bare(self, rec: dict) -> bytes:
        return self.rng.choice([b"null", b"42", b'"gpu"', b"[]", b"true", b"", b"{}"])

    def _deep(self, rec: dict) -> bytes:
        depth = self.rng.randrange(50, 3000)
        return b"[" * depth + b"]" * depth

    def _wrong_type(self, rec: dict) -> bytes:
        rec[self._field(rec)] = self.rng.choice(["high", {"a": 1}, True, None, [[1]], 3.5])
        return orjson.dumps(rec)

    def _missing(self, rec: dict) -> bytes:
        for k in ("node", "ts", "util", "ports"):
            rec.pop(k, None) if self.rng.random() < 0.6 else None
        rec.pop("node", None)
        return orjson.dumps(rec)

    def _extra(self, rec: dict) -> bytes:
        rec[f"x{self.rng.randrange(10**6)}"] = "extra"
        rec["util"] = "bad"  # extra fields alone are ignored by design; this one is also wrong
        return orjson.dumps(rec)

    def _nan(self, rec: dict) -> bytes:
        raw = orjson.dumps(rec)
        token = self.rng.choice([b"NaN", b"Infinity", b"-Infinity"])
        return raw.replace(b"[", b"[" + token + b",", 1)

    def _huge(self, rec: dict) -> bytes:
        return json.dumps({**rec, self._field(rec): 10 ** self.rng.randrange(30, 400)}).encode()

    def _negative(self, rec: dict) -> bytes:
        for k in ("ecc_sbe", "ecc_dbe", "pcie_replay"):
            if k in rec:
                rec[k] = [-1] * len(rec[k])
        rec.setdefault("ts", -5.0)
        rec["ts"] = -abs(rec["ts"])
        return orjson.dumps(rec)

    def _length(self, rec: dict) -> bytes:
        if "util" in rec:
            rec["util"] = rec["util"][: self.rng.randrange(0, len(rec["util"]))] or [1.0] * 99
        elif "ports" in rec:
            rec["ports"] = []
        else:
            rec["nodes"] = ["n"] * self.rng.randrange(5000, 20000)
        return orjson.dumps(rec)

    def _schema(self, rec: dict) -> bytes:
        rec["schema"] = self.rng.choice(["gpu/99", "network/7", "gpu", "", "job/1/2"])
        return orjson.dumps(rec)

    def _time(self, rec: dict) -> bytes:
        rec["ts"] = self.rng.choice([1e300, 4.1e10, -1e9, "yesterday"])
        return orjson.dumps(rec)

    def _late(self, rec: dict) -> bytes:
        # valid but far in the past: ignored as late, never poisons a window
        rec["ts"] = 1_000_000_000.0 + self.rng.random()
        return orjson.dumps(rec)


async def _send(producer: AIOKafkaProducer, batch: list[tuple[str, bytes | None, bytes]], end: float) -> None:
    """Send a tick's records, retrying the tick through a broker restart until the monotonic
    time ``end`` (a retried tick may deliver some records twice, as a real producer would)."""
    while True:
        try:
            futures = [await producer.send(topic, key=key, value=value) for topic, key, value in batch]
            await asyncio.gather(*futures)
            return
        except KafkaError:
            if time.monotonic() > end:
                raise
            await asyncio.sleep(0.5)


def run(*, nodes: int = 96, duration: float = 400.0, speed: float = 3.0, kills: int = 22, outage_s: float = 60.0,
        hostile: int = 100_000, seed: int = 1, broker_restart: bool = True, brokers: int = 3, faults: int = 60,
        out: Path | None = None, bootstrap: str | None = None, say=print) -> dict[str, Any]:
    """Run the scenario; ``bootstrap`` uses that broker as it is (no broker kills then),
    else ``deploy/kafka.sh`` starts (and afterwards stops) an embedded one of ``brokers``
    nodes (1, or 3 and more for a replicated cluster).  ``faults``: how many faults the
    scenario injects, every kind of :data:`pipeline.sim.cluster.CHAOS_KINDS` in turn."""
    if brokers != 1 and brokers < 3:
        raise ValueError("chaos: brokers must be 1 or at least 3 (a quorum that survives one loss)")
    state = state_dir("chaos")
    env = {**os.environ, "FLEETMEDIC_STATE": str(state), "KAFKA_BROKERS": str(brokers)}
    # the harness's own clients would log every failed reconnect while the broker restarts
    # (hundreds of lines); the report carries the restart and its length instead
    logging.getLogger("aiokafka").setLevel(logging.CRITICAL)
    scenario = functools.partial(_run, env, nodes=nodes, duration=duration, speed=speed, kills=kills,
                                 outage_s=outage_s, hostile=hostile, seed=seed, broker_restart=broker_restart,
                                 brokers=brokers, faults=faults, out=out, say=say, state=state)
    if bootstrap:
        if broker_restart:
            raise ValueError("chaos: a broker given by its address cannot be restarted by the harness")
        return scenario(bootstrap)
    was_running = subprocess.run(["bash", str(KAFKA_SH), "status"], env=env, capture_output=True,
                                 stdin=subprocess.DEVNULL, timeout=60).returncode == 0
    try:
        return scenario(kafka_script("start", env))
    finally:
        if not was_running:
            kafka_script("stop", env)


def _run(env: dict[str, str], bootstrap: str, *, nodes: int, duration: float, speed: float, kills: int,
         outage_s: float, hostile: int, seed: int, broker_restart: bool, brokers: int, faults: int,
         out: Path | None, say: Any, state: Path) -> dict[str, Any]:
    api_port = free_port()
    tag = uuid.uuid4().hex[:6]
    wenv = {**env, "FLEETMEDIC_KAFKA__BOOTSTRAP": bootstrap, "FLEETMEDIC_KAFKA__TOPIC_PREFIX": f"chaos{tag}.",
            "FLEETMEDIC_KAFKA__APP_ID": f"fleetmedic-chaos-{tag}", "FLEETMEDIC_ACTUATORS__BACKEND": "sim",
            "FLEETMEDIC_ACTUATORS__SIM_URL": f"http://127.0.0.1:{api_port}",
            "FLEETMEDIC_ACTUATORS__MAX_ATTEMPTS": "100", "FLEETMEDIC_ACTUATORS__MAX_DELAY_S": "5",
            "FLEETMEDIC_SAFETY__FLEET_SIZE": str(nodes), "FLEETMEDIC_WORKER__LOG_LEVEL": "warning",
            # every topic on every broker of a cluster (its brokers ask two in-sync replicas)
            "FLEETMEDIC_KAFKA__REPLICATION": str(3 if brokers >= 3 else 1),
            # the scenario strikes a large share of a small fleet on purpose: the breaker lets
            # every isolation through (its cap is tested on its own), so that the backend is
            # called for each and the checker can judge each effect
            "FLEETMEDIC_SAFETY__MAX_FRACTION": str(BREAKER_FRACTION),
            # a killed worker's partitions come back after this (Kafka group session)
            "FLEETMEDIC_WORKER__SESSION_TIMEOUT_S": "8"}
    s = load_settings(environ=wenv)
    asyncio.run(ensure_topics(s))
    logdir = state / "logs"
    logdir.mkdir(parents=True, exist_ok=True)
    cfg = SimConfig(nodes=nodes, speed=speed, duration=duration, seed=seed, faults=f"chaos:{faults}")
    runner = SimRunner(s, cfg, api_port=api_port, out=open(os.devnull, "w"), show_anomalies=False)
    cluster = runner.cluster
    # the outage is armed at OUTAGE_AT of the run and begins with the next call to the
    # backend, so that it always meets actions; it lasts outage_s from then
    outage = {"armed": False, "until": 0.0, "refused": 0, "began": 0.0}
    original_act = cluster.act

    def act(body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        if outage["armed"] and not outage["until"]:
            outage["began"], outage["until"] = time.time(), time.time() + outage_s
        if time.time() < outage["until"]:
            outage["refused"] += 1
            # the backend's log keeps the refusals too: requests that changed nothing
            cluster.requests.append({"wall": time.time(), "t": cluster.now, "key": body.get("key"),
                                     "verdict_id": body.get("verdict_id"), "action": body.get("action"),
                                     "target": body.get("target"), "params": body.get("params") or {},
                                     "status": 503, "outcome": None, "changed": False, "before": {}})
            return 503, {"error": "backend down (chaos)"}
        return original_act(body)

    cluster.act = act  # type: ignore[method-assign]
    side = asyncio.new_event_loop()
    threading.Thread(target=side.run_forever, daemon=True).start()

    def on_side(fn: Any) -> Any:
        async def call() -> Any:
            return fn()
        return asyncio.run_coroutine_threadsafe(call(), side).result(60)

    asyncio.run_coroutine_threadsafe(runner.start_api(), side).result(30)
    stats: dict[str, Any] = {"kills": 0, "kills_by_phase": Counter(), "agent_crashes": 0, "recovery_s": [], "broker_restarts": 0,
                             "broker_down_s": 0.0, "hostile_inputs": 0, "broker_kills": [],
                             # (wall time dry-run was on, wall time it was switched off, held after the kill)
                             "dry_run_windows": [],
                             # (wall time the budget blocked drains, wall time relaxed, a drain met the block)
                             "drain_block_windows": [],
                             # operator API calls that failed (the harness goes on without them)
                             "operator_api_errors": []}
    broker_step = ("" if not broker_restart else "a broker restart, " if brokers == 1
                   else f"SIGKILL of a follower and of a leader of {brokers} brokers, ")
    say(f"chaos: {nodes} nodes for {duration:.0f} s at {speed:g}x, {faults} faults: {kills} worker kills, "
        f"{broker_step}a {outage_s:.0f} s backend outage, {hostile} hostile inputs (worker logs in {logdir})")
    worker = WorkerProcess(wenv, logdir / f"worker-{tag}-0.log")
    wait_ready_or_fail(worker, 120)
    fuzzer = Fuzzer(seed)
    rng = random.Random(seed)
    #: every hostile input by its key: (topic, whether the decoder accepts it)
    sent: dict[str, tuple[str, bool]] = {}
    #: hostile inputs in the dead-letter topic: key -> reason (a redelivery counts once)
    dead: dict[str, str] = {}

    async def main() -> None:
        producer = AIOKafkaProducer(bootstrap_servers=bootstrap, linger_ms=20, request_timeout_ms=15000,
                                    max_request_size=2 * 1024 * 1024, acks="all")
        await producer.start()
        follower = AIOKafkaConsumer(s.topic("verdicts"), s.topic("actions"), s.topic("deadletter"),
                                    bootstrap_servers=bootstrap, group_id=None, auto_offset_reset="earliest",
                                    enable_auto_commit=False, max_partition_fetch_bytes=4 * 1024 * 1024)
        await follower.start()
        stop = asyncio.Event()

        async def follow() -> None:
            while not stop.is_set():
                try:
                    batch = await follower.getmany(timeout_ms=300)
                except KafkaError:
                    await asyncio.sleep(0.5)
                    continue
                for tp, msgs in batch.items():
                    for m in msgs:
                        rec = orjson.loads(m.value)
                        if tp.topic == s.topic("deadletter"):
                            if str(rec.get("key") or "").startswith("fuzz-"):
                                dead.setdefault(rec["key"], rec.get("reason", ""))
                        else:
                            (runner.verdicts if tp.topic == s.topic("verdicts") else runner.actions).append(rec)

        clock = {"start": 0.0, "step": 0}

        async def step(give_up: float) -> None:
            """One simulated second: the cluster's telemetry and events, sent at ``speed``."""
            batch = on_side(lambda: (cluster.tick(), cluster.out.copy(), cluster.out.clear())[1])
            for topic, key, value in batch:
                if topic in FUZZED and len(fuzzer.templates.get(topic, ())) < 20:
                    fuzzer.keep(topic, orjson.loads(value))
            await _send(producer, [(s.topic(topic), key.encode(), value) for topic, key, value in batch], give_up)
            clock["step"] += 1
            delay = clock["start"] + clock["step"] / speed - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)

        async def simulate() -> None:
            cluster.t0 = time.time()
            steps = int(duration * speed)
            clock["start"] = time.monotonic()
            # a broker that never comes back must end the run with a report, not hang it
            give_up = clock["start"] + duration + 180
            for i in range(steps):
                if i and i % max(1, steps // 10) == 0:
                    say(f"chaos: scenario {100 * i // steps}% ({stats['kills']} kills, "
                        f"{stats['hostile_inputs']} hostile inputs, {len(runner.verdicts)} verdicts so far)")
                await step(give_up)

        async def keep_running(until: asyncio.Event) -> None:
            """The fleet goes on after the scenario: no new faults or kills, but every node
            still reports, so a degradation that began late (or whose detection window a
            worker kill restarted) is seen as it would be in service."""
            while not until.is_set():
                await step(time.monotonic() + 60)

        def kill(victim: WorkerProcess, *, planned: bool = True) -> None:
            """SIGKILL ``victim``'s process group; ``planned`` kills count as the run's kills."""
            if not victim.alive():
                stats["agent_crashes"] += 1  # it died on its own before we came
            os.killpg(victim.proc.pid, signal.SIGKILL)
            victim.proc.wait(10)
            stats["kills"] += planned

        async def operator(w: WorkerProcess, method: str, path: str,
                           body: dict[str, Any] | None = None) -> dict[str, Any] | None:
            """An operator's API call; a failure is recorded (and fails the run), not raised."""
            try:
                return await asyncio.to_thread(_api, w, method, path, body)
            except (urllib.error.URLError, TimeoutError, ConnectionError, ValueError) as exc:
                stats["operator_api_errors"].append(f"{method} {path}: {exc}")
                say(f"chaos: the operator API did not answer {method} {path}: {exc}")
                return None

        def set_drain_block(on: bool) -> None:
            on_side(lambda: [setattr(node, "drain_blocked", on) for node in cluster.nodes.values()])

        async def open_window(phase: str) -> None:
            """Before a window's kill: the budget blocks every drain until a drain meets it
            (or a minute passes), or an operator switches dry-run on through the API."""
            if phase == "drain_blocked":
                since = time.time()
                set_drain_block(True)
                stats["drain_block_windows"].append([since, None, False])
                say("chaos: every drain now meets a PodDisruptionBudget (429)")
                while time.time() < since + 60:
                    if any(r["action"] == "drain" and r["status"] == 429 and r["wall"] >= since
                           for r in list(cluster.requests)):
                        stats["drain_block_windows"][-1][2] = True
                        break
                    await asyncio.sleep(0.2)
                await asyncio.sleep(rng.uniform(1.0, 3.0))
            elif phase == "dry_run":
                if not await operator(worker, "PUT", "/api/v1/dry-run", {"enabled": True}):
                    return
                stats["dry_run_windows"].append([time.time(), None, None])
                say("chaos: an operator switched dry-run on")
                await asyncio.sleep(rng.uniform(0.2, 1.5))

        async def close_window(phase: str) -> None:
            """After the new worker is ready: dry-run must still be on; then both windows
            stay open a little longer (the drain keeps waiting) and close."""
            if phase == "dry_run" and stats["dry_run_windows"] and stats["dry_run_windows"][-1][1] is None:
                state = await operator(worker, "GET", "/api/v1/dry-run")
                stats["dry_run_windows"][-1][2] = bool(state.get("dry_run")) if state is not None else None
                await asyncio.sleep(10.0)
                stats["dry_run_windows"][-1][1] = time.time()
                while await operator(worker, "PUT", "/api/v1/dry-run", {"enabled": False}) is None \
                        and time.time() < stats["dry_run_windows"][-1][1] + 120:
                    await asyncio.sleep(2.0)  # dry-run must not stay on for the rest of the run
                held = stats["dry_run_windows"][-1][2]
                say(f"chaos: dry-run {'held' if held else 'unknown' if held is None else 'WAS LOST'} across the kill; "
                    "switched off")
            elif phase == "drain_blocked":
                await asyncio.sleep(10.0)
                set_drain_block(False)
                window = stats["drain_block_windows"][-1]
                window[1] = time.time()
                # the next window opens once the drains that waited are done (or a minute
                # passed: the checker then reports them), so that no dry-run overtakes them
                left = blocked_drains(list(cluster.requests), [(window[0], window[1])])["not_done"]
                while left and time.time() < window[1] + 60:
                    await asyncio.sleep(0.5)
                    left = blocked_drains(list(cluster.requests), [(window[0], window[1])])["not_done"]
                say(f"chaos: the PodDisruptionBudget is relaxed; the drains that waited are "
                    f"{'done' if not left else f'NOT done ({len(left)})'} {time.time() - window[1]:.1f} s later")

        async def kill_loop() -> None:
            nonlocal worker
            plan = kill_plan(kills, duration, duration * OUTAGE_AT, outage_s, rng)
            t0 = spawned = time.monotonic()
            for n, (at, phase) in enumerate(plan, 1):
                await asyncio.sleep(max(0.0, t0 + at - time.monotonic()))
                await open_window(phase)
                if phase == "outage":
                    # strike while the backend is down: once the outage has begun, at a random
                    # moment of what is left of it
                    while not outage["until"] and time.monotonic() < t0 + duration:
                        await asyncio.sleep(0.2)
                    left = outage["until"] - time.time()
                    if left > 1.0:
                        await asyncio.sleep(rng.uniform(0.0, left - 1.0))
                if phase == "starting":
                    # the worker spawned by the kill before is importing or joining its group
                    await asyncio.sleep(max(0.0, spawned + rng.uniform(0.5, 3.0) - time.monotonic()))
                stats["kills_by_phase"][phase] += 1
                if phase == "rebalance":
                    # a second worker joins the group; the first is killed while the partitions
                    # move, and the newcomer takes over all of them
                    newcomer = WorkerProcess(wenv, logdir / f"worker-{tag}-{n}.log")
                    await asyncio.sleep(rng.uniform(1.0, 4.0))
                    kill(worker)
                    killed = time.monotonic()
                    worker = newcomer
                else:
                    kill(worker)
                    killed = time.monotonic()
                    worker = WorkerProcess(wenv, logdir / f"worker-{tag}-{n}.log")
                spawned = time.monotonic()
                if n < len(plan) and plan[n][1] == "starting":
                    # the next kill strikes this worker while it starts (no wait for ready)
                    say(f"chaos: kill {n}/{kills} ({phase}); the next one strikes the new worker while it starts")
                    continue
                ready = await asyncio.to_thread(_wait_ready, worker, 180)
                stats["recovery_s"].append(time.monotonic() - killed if ready else None)
                say(f"chaos: kill {n}/{kills} ({phase}): " +
                    (f"a worker was ready {time.monotonic() - killed:.1f} s later" if ready
                     else ("the new worker DIED while starting" if not worker.alive()
                           else "the new worker was NOT ready within 180 s")))
                if not ready:
                    # counted as a failed recovery; the run goes on with a fresh worker, as the
                    # worker's supervisor (a Deployment, systemd) would start one
                    kill(worker, planned=False)
                    worker = WorkerProcess(wenv, logdir / f"worker-{tag}-{n}-restart.log")
                    await asyncio.to_thread(_wait_ready, worker, 180)
                await close_window(phase)

        async def broker_kills() -> None:
            """A follower, then the leader, of the verdicts topic's first partition: SIGKILL
            under load, down for BROKER_DOWN_S, then started again."""
            t0 = time.monotonic()
            for role, share in BROKER_KILLS:
                await asyncio.sleep(max(0.0, t0 + duration * share - time.monotonic()))
                leader, replicas = await _placement(bootstrap, s.topic("verdicts"))
                victim = leader if role == "leader" else next(r for r in replicas if r != leader)
                say(f"chaos: SIGKILL of broker {victim}, the {role} of {s.topic('verdicts')}[0]")
                t = time.monotonic()
                await asyncio.to_thread(kafka_script, "kill", env, str(victim))
                await asyncio.sleep(BROKER_DOWN_S)
                await asyncio.to_thread(kafka_script, "start", env)
                after, _ = await _placement(bootstrap, s.topic("verdicts"))
                stats["broker_kills"].append({"broker": victim, "role": role, "was_leader": leader,
                                              "leader_after": after, "down_s": round(time.monotonic() - t, 1)})
                say(f"chaos: broker {victim} back after {time.monotonic() - t:.1f} s (leader now {after})")

        async def broker_restart_once() -> None:
            if not broker_restart:
                return
            if brokers > 1:
                await broker_kills()
                return
            await asyncio.sleep(duration * 0.4)
            t = time.monotonic()
            say("chaos: restarting the broker")
            await asyncio.to_thread(kafka_script, "stop", env)
            await asyncio.to_thread(kafka_script, "start", env)
            stats["broker_restarts"] += 1
            stats["broker_down_s"] = time.monotonic() - t
            say(f"chaos: broker back after {stats['broker_down_s']:.1f} s")

        async def backend_outage() -> None:
            await asyncio.sleep(duration * OUTAGE_AT)
            outage["armed"] = True
            say(f"chaos: the backend will answer 503 for {outage_s:.0f} s from its next request")
            while not outage["until"]:
                await asyncio.sleep(0.2)
            await asyncio.sleep(max(0.0, outage["until"] - time.time()))
            say(f"chaos: the backend is back ({outage['refused']} requests refused meanwhile)")

        async def hostile_input() -> None:
            await asyncio.sleep(3)
            while not fuzzer.ready():
                await asyncio.sleep(0.5)
            topics = list(FUZZED)
            chunk = max(1, hostile // max(1, int(duration * 0.8)))
            # never past the scenario (plus a minute): a producer that cannot deliver after
            # the broker restart must not keep the run from reporting what got in
            give_up = time.monotonic() + duration + 60
            while stats["hostile_inputs"] < hostile and time.monotonic() < give_up:
                n = min(chunk, hostile - stats["hostile_inputs"])
                for _ in range(n):
                    topic = rng.choice(topics)
                    key, value = f"fuzz-{len(sent)}", fuzzer.one(topic)
                    try:
                        await producer.send(s.topic(topic), key=key.encode(), value=value)
                    except KafkaError:
                        await asyncio.sleep(0.5)
                        continue
                    sent[key] = (topic, _accepted(FUZZED[topic], value))
                    stats["hostile_inputs"] += 1
                    if stats["hostile_inputs"] % 20_000 == 0:
                        say(f"chaos: {stats['hostile_inputs']} hostile inputs sent")
                await asyncio.sleep(1.0)

        fol = asyncio.create_task(follow())
        await asyncio.gather(simulate(), kill_loop(), broker_restart_once(), backend_outage(), hostile_input())
        try:
            await asyncio.wait_for(producer.flush(), 60)
        except TimeoutError:
            say("warning: the harness's producer did not flush within 60 s")
        # drain: every applied fault gets its verdict, every verdict its actions
        say("chaos: scenario over; the fleet keeps reporting while the pipeline settles")
        settled = asyncio.Event()
        fleet = asyncio.create_task(keep_running(settled))
        deadline = time.monotonic() + 180
        last_say = 0.0
        while time.monotonic() < deadline:
            expected, decided = _verdicts(score(cluster, runner.verdicts, runner.actions))
            refused = sum(1 for ok in sent.values() if not ok[1])
            refused_dead = sum(1 for k, ok in sent.items() if not ok[1] and k in dead)
            if decided >= expected and refused_dead >= refused and (not outage["armed"] or outage["until"]) \
                    and time.time() > outage["until"] + 15:
                break
            if time.monotonic() - last_say > 15:
                last_say = time.monotonic()
                say(f"chaos: {decided}/{expected} injected faults have their verdict; "
                    f"{refused_dead}/{refused} refused hostile inputs dead-lettered")
            await asyncio.sleep(2)
        await asyncio.sleep(5)
        settled.set()
        await asyncio.wait_for(fleet, 90)
        stop.set()
        await asyncio.wait_for(fol, 30)
        # shutting the harness's own clients down must not hang the report (a producer
        # can keep retrying batches addressed to a leader from before the broker restart)
        for client in (follower, producer):
            try:
                await asyncio.wait_for(client.stop(), 30)
            except TimeoutError:
                say(f"warning: {type(client).__name__} did not stop within 30 s")

    started = time.monotonic()
    try:
        asyncio.run(main())
        if not worker.alive():
            stats["agent_crashes"] += 1
    finally:
        worker.stop()
        side.call_soon_threadsafe(side.stop)
    sc = score(cluster, runner.verdicts, runner.actions)
    truth = check(cluster.requests, faults_of(cluster, HARDWARE_KINDS), runner.actions)
    crashes = crash_lines(sorted(logdir.glob(f"worker-{tag}-*.log")))
    rec = [x for x in stats["recovery_s"] if x is not None]
    expected, decided = _verdicts(sc)
    refused = [k for k, (_, ok) in sent.items() if not ok]
    by_topic: Counter[str] = Counter(t for t, _ in sent.values())
    dry = [(on, off) for on, off, _ in stats["dry_run_windows"] if off is not None]
    in_dry = [r for r in cluster.requests if r.get("changed")
              and any(on + DRY_RUN_GRACE_S < r["wall"] < off for on, off in dry)]
    blocked = blocked_drains(cluster.requests, [(a, b) for a, b, _ in stats["drain_block_windows"]])
    result = {
        "brokers": brokers,
        "kills": stats["kills"], "kills_by_phase": dict(stats["kills_by_phase"]), "broker_restarts": stats["broker_restarts"],
        "broker_down_s": round(stats["broker_down_s"], 1),
        "broker_kills": len(stats["broker_kills"]), "broker_kill_log": stats["broker_kills"],
        "faults_injected": sc["faults_injected"],
        "faults_by_kind": dict(Counter(f.kind for f in cluster.faults if f.applied_ts is not None)),
        # operator dry-run: switched on, a worker killed just after, still on in its successor
        "dry_run_windows": len(stats["dry_run_windows"]),
        "dry_run_lost_across_kill": sum(1 for *_, held in stats["dry_run_windows"] if held is False),
        "effects_in_dry_run": len(in_dry), "effects_in_dry_run_samples": in_dry[:5],
        # drains refused by a PodDisruptionBudget while a worker was killed
        "drain_block_windows": len(stats["drain_block_windows"]),
        "drain_blocks_met": sum(1 for *_, met in stats["drain_block_windows"] if met),
        "blocked_drains": len(blocked["blocked"]), "blocked_drains_not_done": blocked["not_done"],
        "operator_api_errors": stats["operator_api_errors"],
        "backend_outage_s": outage_s, "backend_refusals": outage["refused"],
        "breaker_max_fraction": BREAKER_FRACTION,
        # the backend's own log: what happened to the cluster
        "backend_requests": truth["requests"], "backend_effects": truth["effects"],
        "faulty_nodes": truth["faulty_nodes"],
        "faulty_nodes_not_isolated": truth["faulty_nodes_not_isolated"],
        "effects_lost": truth["effects_lost"],
        "duplicate_effects": truth["duplicate_effects"], "duplicates": truth["duplicates"],
        "healthy_nodes_touched": truth["healthy_nodes_touched"],
        "jobs_moved_twice_or_more": {j: a for j, a in truth["job_moves"].items() if len(a) > 1},
        # the hostile inputs, accounted for from the dead-letter topic
        "hostile_inputs": stats["hostile_inputs"], "hostile_by_topic": dict(by_topic),
        "hostile_keys": len(sent), "hostile_kinds": dict(fuzzer.kinds),
        "sent": len(sent), "dead_lettered": sum(1 for k in sent if k in dead),
        "accepted": sum(1 for k in sent if k not in dead),
        "refused_by_decoder": len(refused),
        "refused_not_dead_lettered": sum(1 for k in refused if k not in dead),
        "dead_letter_reasons": dict(Counter(r.split(":")[0][:60] for r in dead.values()).most_common(12)),
        # crashes seen from inside
        "crash_lines": len(crashes), "crash_samples": crashes[:10],
        "agent_crashes": stats["agent_crashes"],
        # the pipeline's own view, for comparison
        "verdicts_expected": expected, "verdicts_decided": decided,
        "max_recovery_s": round(max(rec), 2) if rec else None,
        "median_recovery_s": round(sorted(rec)[len(rec) // 2], 2) if rec else None,
        "recoveries_failed": sum(1 for x in stats["recovery_s"] if x is None),
        "false_isolations": sc["false_isolations"], "scenario": sc,
        "seconds": round(time.monotonic() - started, 1),
    }
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2) + "\n")
    for k in ("kills", "broker_restarts", "broker_kills", "backend_outage_s", "faults_injected", "backend_effects",
              "faulty_nodes", "effects_lost", "duplicate_effects", "effects_in_dry_run", "dry_run_lost_across_kill",
              "drain_blocks_met", "blocked_drains", "hostile_inputs", "sent", "dead_lettered", "accepted",
              "refused_not_dead_lettered", "crash_lines", "agent_crashes", "median_recovery_s", "max_recovery_s"):
        say(f"{k:<26} {result[k]}")
    for m in result["faulty_nodes_not_isolated"]:
        say(f"  not isolated: {m['node']} ({m['fault']}): {m['explained_by'] or 'NOT EXPLAINED'}")
    return result


def _api(worker: WorkerProcess, method: str, path: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
    """A call to the worker's operator API, as an operator's client makes it (retried while
    the worker is briefly unreachable)."""
    data = orjson.dumps(body) if body is not None else None
    req = urllib.request.Request(f"http://127.0.0.1:{worker.web_port}{path}", data=data, method=method,
                                 headers={"Content-Type": "application/json"})
    for attempt in range(20):
        try:
            with urllib.request.urlopen(req, timeout=10) as r:
                return json.loads(r.read())
        except (urllib.error.URLError, TimeoutError, ConnectionError):
            if attempt == 19:
                raise
            time.sleep(0.5)
    raise AssertionError("unreachable")


async def _placement(bootstrap: str, topic: str) -> tuple[int, list[int]]:
    """The leader and the replicas of ``topic``'s partition 0, from the cluster's metadata
    (asked again while a leader election is under way)."""
    from aiokafka.admin import AIOKafkaAdminClient

    for _ in range(60):
        admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap, request_timeout_ms=10000)
        try:
            await admin.start()
            for t in await admin.describe_topics([topic]):
                for part in t.get("partitions", []):
                    if part["partition"] == 0 and part["leader"] >= 0:
                        return int(part["leader"]), [int(r) for r in part["replicas"]]
        except KafkaError:
            pass
        finally:
            await admin.close()
        await asyncio.sleep(1.0)
    raise RuntimeError(f"chaos: no leader for {topic}[0] within a minute")


def _verdicts(sc: dict[str, Any]) -> tuple[int, int]:
    """(expected, decided): every injected fault calls for a verdict, an isolation for a
    hardware fault, a retry for a transient one, a stop for a user error."""
    expected = sc["hardware_faults"] + sc["transient_faults"] + sc["user_errors"]
    decided = sc["hardware_faults_detected"] + sc["transient_faults_retried"] + sc["user_errors_stopped"]
    return expected, decided


def _wait_ready(worker: WorkerProcess, timeout: float) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if worker.ready():
            return True
        if not worker.alive():
            return False
        time.sleep(0.2)
    return False


def wait_ready_or_fail(worker: WorkerProcess, timeout: float) -> None:
    if not _wait_ready(worker, timeout):
        raise RuntimeError(f"worker not ready within {timeout}s:\n{worker.log_tail()}")


def kill_plan(kills: int, duration: float, outage_at: float, outage_s: float,
              rng: random.Random) -> list[tuple[float, str]]:
    """When to kill, and in which phase.  From six kills, one kill per ten (at least one)
    each opens a PodDisruptionBudget window and a dry-run window (:data:`WINDOWS`); of
    the rest a quarter each strike while starting, during a rebalance and during the
    backend outage, and the others while running.  A ``starting`` kill follows the kill
    before it at once (it strikes the worker that replaced it)."""
    n_win = max(1, kills // 10) if kills >= 6 else 0
    windows = [(duration * WINDOWS[ph][i % len(WINDOWS[ph])], ph) for ph in ("drain_blocked", "dry_run")
               for i in range(n_win)]
    rest = kills - len(windows)
    n_start = n_reb = n_out = rest // 4
    n_run = rest - n_start - n_reb - n_out
    lo, hi = 5.0, max(6.0, duration - 15.0)
    out_lo, out_hi = outage_at + 1.0, max(outage_at + 1.5, outage_at + outage_s - 1.0)

    def outside() -> float:
        while True:
            t = rng.uniform(lo, hi)
            if not out_lo - 3.0 <= t <= out_hi + 3.0 or outage_s <= 0:
                return t

    timed = sorted([(outside(), "running") for _ in range(n_run)] + [(outside(), "rebalance") for _ in range(n_reb)]
                   + [(rng.uniform(out_lo, out_hi), "outage") for _ in range(n_out)] + windows)
    # each starting kill right after a kill that starts a new worker at once (not a
    # rebalance's, nor a window's: those wait for the new worker)
    hosts = [i for i, (_, p) in enumerate(timed) if p in ("running", "outage")]
    after = set(rng.sample(hosts, min(n_start, len(hosts))))
    plan: list[tuple[float, str]] = []
    for i, (t, p) in enumerate(timed):
        plan.append((t, p))
        if i in after:
            plan.append((t + rng.uniform(0.5, 3.0), "starting"))  # the new worker is importing, joining
    return plan


def _accepted(model: Any, value: bytes) -> bool:
    """Whether the worker's decoder takes ``value`` as a ``model`` record."""
    try:
        decode(model, value)
    except DecodeError:
        return False
    return True


def crash_lines(logs: list[Path]) -> list[str]:
    """Lines of the worker logs that say something crashed inside a worker (a traceback's
    first line, a crashed agent, an exception no task retrieved), as ``file: line``."""
    out = []
    for path in logs:
        try:
            text = path.read_text(errors="replace")
        except OSError:
            continue
        out += [f"{path.name}: {line.strip()[:300]}" for line in text.splitlines()
                if any(m in line for m in CRASH_MARKERS)]
    return out


def failures(r: dict[str, Any]) -> list[str]:
    """What makes a chaos run fail, judged from the backend's log, the dead-letter topic and
    the worker logs."""
    checks = [
        (r["effects_lost"] == 0, f"{r['effects_lost']} faulty nodes left in service with no breaker or dry-run record"),
        (r["duplicate_effects"] == 0, f"{r['duplicate_effects']} duplicate effects on the backend"),
        (not r["healthy_nodes_touched"], f"{len(r['healthy_nodes_touched'])} healthy nodes cordoned"),
        (r["crash_lines"] == 0, f"{r['crash_lines']} crash lines in the worker logs"),
        (r["agent_crashes"] == 0, f"{r['agent_crashes']} workers died on their own"),
        (r["refused_not_dead_lettered"] == 0,
         f"{r['refused_not_dead_lettered']} refused hostile inputs missing from the dead-letter topic"),
        (r["sent"] == r["dead_lettered"] + r["accepted"], "hostile inputs do not add up"),
        (r["recoveries_failed"] == 0, f"{r['recoveries_failed']} restarted workers never became ready"),
        (r.get("effects_in_dry_run", 0) == 0, f"{r.get('effects_in_dry_run')} backend effects while dry-run was on"),
        (r.get("dry_run_lost_across_kill", 0) == 0,
         f"dry-run was off after {r.get('dry_run_lost_across_kill')} worker kills that followed its switch"),
        (not r.get("blocked_drains_not_done"),
         f"{len(r.get('blocked_drains_not_done') or [])} drains refused by the budget never done after it relaxed"),
        (not r.get("operator_api_errors"), f"{len(r.get('operator_api_errors') or [])} operator API calls unanswered"),
    ]
    return [why for ok, why in checks if not ok]
