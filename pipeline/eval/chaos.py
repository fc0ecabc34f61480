"""``make chaos``: a seeded fleet scenario on the real broker, under fire.

While the simulated cluster streams telemetry and injects its faults, the harness

* kills the worker with SIGKILL at random moments (``kills`` times) and starts a new
  one at once, measuring how long each takes to be ready again (table recovery from
  the changelogs included);
* restarts the broker once (``deploy/kafka.sh stop`` / ``start``, same port);
* takes the backend (the simulated cluster's API) down for ``outage_s`` seconds: it
  answers 503, actions wait with backoff and are applied when it returns;
* writes ``hostile`` malformed messages from a grammar-based mutation fuzzer
  (:class:`Fuzzer`) into the telemetry topics.

Then it compares what happened with the ground truth: every fault the cluster
injected must have its verdict (``verdicts_lost``: a hardware fault its isolation, a
transient fault its retry, a user error its stop), no action may
change the cluster twice (``duplicate_actuations``: an isolation of a node already
isolated by the same incident, or a second requeue or retry of the same job attempt),
and no worker may die on its own (``agent_crashes``).
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
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import orjson
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.errors import KafkaError

from pipeline.config import load_settings, state_dir
from pipeline.worker.procs import KAFKA_SH, WorkerProcess, free_port, kafka_script
from pipeline.sim.run import SimRunner
from pipeline.sim.cluster import SimConfig, score
from pipeline.worker.topics import ensure_topics



class Fuzzer:
    """Malformed telemetry from valid records, by a grammar of mutations.

    Each message applies one production: invalid JSON (truncated, random bytes, bare
    values, deep nesting), a wrong type for a field, a missing required field, extra
    fields, NaN and infinities, absurd magnitudes, negative counters, lists of the
    wrong length, unknown schema versions, timestamps far in the past or future,
    oversized payloads, out-of-order and duplicated samples (valid, but late).
    """

    def __init__(self, seed: int, templates: list[dict[str, Any]]) -> None:
        self.rng = random.Random(seed)
        self.templates = templates
        self.kinds: Counter[str] = Counter()
        self.productions = [
            self._truncated, self._garbage, self._bare, self._deep, self._wrong_type, self._missing, self._extra,
            self._nan, self._huge, self._negative, self._length, self._schema, self._time, self._late,
        ]

    def one(self) -> bytes:
        if self.rng.random() < 0.0005:
            self.kinds["oversized"] += 1
            # over the decoder's limit, under the broker's (1 MiB): it reaches the worker
            return b'{"schema":"gpu/1","pad":"' + b"x" * 1_000_500 + b'"}'
        prod = self.rng.choice(self.productions)
        self.kinds[prod.__name__.strip("_")] += 1
        return prod(dict(self.rng.choice(self.templates)))

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
        else:
            rec["ports"] = []
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


def run(*, nodes: int = 32, duration: float = 400.0, speed: float = 3.0, kills: int = 22, outage_s: float = 60.0,
        hostile: int = 100_000, seed: int = 1, broker_restart: bool = True, out: Path | None = None,
        bootstrap: str | None = None, say=print) -> dict[str, Any]:
    """Run the scenario; ``bootstrap`` uses that broker as it is (no broker restart then),
    else ``deploy/kafka.sh`` starts (and afterwards stops) the embedded one."""
    state = state_dir("chaos")
    env = {**os.environ, "FLEETMEDIC_STATE": str(state)}
    # the harness's own clients would log every failed reconnect while the broker restarts
    # (hundreds of lines); the report carries the restart and its length instead
    logging.getLogger("aiokafka").setLevel(logging.CRITICAL)
    scenario = functools.partial(_run, env, nodes=nodes, duration=duration, speed=speed, kills=kills,
                                 outage_s=outage_s, hostile=hostile, seed=seed, broker_restart=broker_restart,
                                 out=out, say=say, state=state)
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
         outage_s: float, hostile: int, seed: int, broker_restart: bool, out: Path | None, say: Any,
         state: Path) -> dict[str, Any]:
    api_port = free_port()
    tag = uuid.uuid4().hex[:6]
    wenv = {**env, "FLEETMEDIC_KAFKA__BOOTSTRAP": bootstrap, "FLEETMEDIC_KAFKA__TOPIC_PREFIX": f"chaos{tag}.",
            "FLEETMEDIC_KAFKA__APP_ID": f"fleetmedic-chaos-{tag}", "FLEETMEDIC_ACTUATORS__BACKEND": "sim",
            "FLEETMEDIC_ACTUATORS__SIM_URL": f"http://127.0.0.1:{api_port}",
            "FLEETMEDIC_ACTUATORS__MAX_ATTEMPTS": "100", "FLEETMEDIC_ACTUATORS__MAX_DELAY_S": "5",
            "FLEETMEDIC_SAFETY__FLEET_SIZE": str(nodes), "FLEETMEDIC_WORKER__LOG_LEVEL": "warning",
            # a killed worker's partitions come back after this (Kafka group session)
            "FLEETMEDIC_WORKER__SESSION_TIMEOUT_S": "8"}
    s = load_settings(environ=wenv)
    asyncio.run(ensure_topics(s))
    logdir = state / "logs"
    logdir.mkdir(parents=True, exist_ok=True)
    cfg = SimConfig(nodes=nodes, speed=speed, duration=duration, seed=seed, faults="demo")
    runner = SimRunner(s, cfg, api_port=api_port, out=open(os.devnull, "w"), show_anomalies=False)
    cluster = runner.cluster
    outage = {"until": 0.0, "refused": 0}
    applied: list[dict[str, Any]] = []
    original_act = cluster.act

    def act(body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        if time.time() < outage["until"]:
            outage["refused"] += 1
            return 503, {"error": "backend down (chaos)"}
        job = cluster.jobs.get(body.get("target"))
        attempt = job.attempt if job is not None else None  # the attempt the action is about
        status, data = original_act(body)
        if data.get("outcome") == "applied":
            applied.append({"key": body.get("key"), "action": body.get("action"), "target": body.get("target"),
                            "attempt": attempt, "t": cluster.now})
        return status, data

    cluster.act = act  # type: ignore[method-assign]
    side = asyncio.new_event_loop()
    threading.Thread(target=side.run_forever, daemon=True).start()

    def on_side(fn: Any) -> Any:
        async def call() -> Any:
            return fn()
        return asyncio.run_coroutine_threadsafe(call(), side).result(60)

    asyncio.run_coroutine_threadsafe(runner.start_api(), side).result(30)
    stats: dict[str, Any] = {"kills": 0, "agent_crashes": 0, "recovery_s": [], "broker_restarts": 0,
                             "broker_down_s": 0.0, "hostile_inputs": 0}
    say(f"chaos: {nodes} nodes for {duration:.0f} s at {speed:g}x: {kills} worker kills, "
        f"{'a broker restart, ' if broker_restart else ''}a {outage_s:.0f} s backend outage, {hostile} hostile inputs "
        f"(worker logs in {logdir})")
    worker = WorkerProcess(wenv, logdir / f"worker-{tag}-0.log")
    wait_ready_or_fail(worker, 120)
    fuzzer = Fuzzer(seed, [])
    rng = random.Random(seed)

    async def main() -> None:
        producer = AIOKafkaProducer(bootstrap_servers=bootstrap, linger_ms=20, request_timeout_ms=15000,
                                    max_request_size=2 * 1024 * 1024)
        await producer.start()
        follower = AIOKafkaConsumer(s.topic("verdicts"), s.topic("actions"), bootstrap_servers=bootstrap,
                                    group_id=None, auto_offset_reset="earliest", enable_auto_commit=False)
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
                        (runner.verdicts if tp.topic == s.topic("verdicts") else runner.actions).append(rec)

        async def simulate() -> None:
            cluster.t0 = time.time()
            steps = int(duration * speed)
            start = time.monotonic()
            # a broker that never comes back must end the run with a report, not hang it
            give_up = start + duration + 180
            for i in range(steps):
                if i and i % max(1, steps // 10) == 0:
                    say(f"chaos: scenario {100 * i // steps}% ({stats['kills']} kills, "
                        f"{stats['hostile_inputs']} hostile inputs, {len(runner.verdicts)} verdicts so far)")
                batch = on_side(lambda: (cluster.tick(), cluster.out.copy(), cluster.out.clear())[1])
                for topic, key, value in batch:
                    if topic == "telemetry.gpu" and not fuzzer.templates:
                        fuzzer.templates.append(orjson.loads(value))
                await _send(producer, [(s.topic(topic), key.encode(), value) for topic, key, value in batch], give_up)
                delay = start + (i + 1) / speed - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)

        async def kill_loop() -> None:
            nonlocal worker
            wall = duration
            times = sorted(rng.uniform(5, wall - 15) for _ in range(kills))
            t0 = time.monotonic()
            for n, at in enumerate(times, 1):
                await asyncio.sleep(max(0.0, t0 + at - time.monotonic()))
                if not worker.alive():
                    stats["agent_crashes"] += 1
                os.killpg(worker.proc.pid, signal.SIGKILL)
                worker.proc.wait(10)
                stats["kills"] += 1
                killed = time.monotonic()
                worker = WorkerProcess(wenv, logdir / f"worker-{tag}-{n}.log")
                ready = await asyncio.to_thread(_wait_ready, worker, 180)
                stats["recovery_s"].append(time.monotonic() - killed if ready else None)
                say(f"chaos: kill {n}/{kills}: " + (f"a new worker was ready {time.monotonic() - killed:.1f} s later"
                                                     if ready else "the new worker was not ready within 180 s"))

        async def broker_restart_once() -> None:
            if not broker_restart:
                return
            await asyncio.sleep(duration * 0.4)
            t = time.monotonic()
            say("chaos: restarting the broker")
            await asyncio.to_thread(_kafka, "stop", env)
            await asyncio.to_thread(_kafka, "start", env)
            stats["broker_restarts"] += 1
            stats["broker_down_s"] = time.monotonic() - t
            say(f"chaos: broker back after {stats['broker_down_s']:.1f} s")

        async def backend_outage() -> None:
            await asyncio.sleep(duration * 0.6)
            say(f"chaos: the backend answers 503 for {outage_s:.0f} s")
            outage["until"] = time.time() + outage_s
            await asyncio.sleep(outage_s)
            say(f"chaos: the backend is back ({outage['refused']} requests refused meanwhile)")

        async def hostile_input() -> None:
            await asyncio.sleep(3)
            while not fuzzer.templates:
                await asyncio.sleep(0.5)
            topics = [s.topic("telemetry.gpu"), s.topic("telemetry.network")]
            chunk = max(1, hostile // max(1, int(duration * 0.8)))
            # never past the scenario (plus a minute): a producer that cannot deliver after
            # the broker restart must not keep the run from reporting what got in
            give_up = time.monotonic() + duration + 60
            while stats["hostile_inputs"] < hostile and time.monotonic() < give_up:
                n = min(chunk, hostile - stats["hostile_inputs"])
                for _ in range(n):
                    try:
                        await producer.send(rng.choice(topics), key=b"fuzz", value=fuzzer.one())
                    except KafkaError:
                        await asyncio.sleep(0.5)
                        continue
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
        say("chaos: scenario over; waiting for the pipeline to settle")
        deadline = time.monotonic() + 180
        last_say = 0.0
        while time.monotonic() < deadline:
            expected, decided = _verdicts(score(cluster, runner.verdicts, runner.actions))
            if decided >= expected and time.time() > outage["until"] + 15:
                break
            if time.monotonic() - last_say > 15:
                last_say = time.monotonic()
                say(f"chaos: {decided}/{expected} injected faults have their verdict")
            await asyncio.sleep(2)
        await asyncio.sleep(5)
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
    dup = _duplicates(applied)
    rec = [x for x in stats["recovery_s"] if x is not None]
    expected, decided = _verdicts(sc)
    result = {
        "kills": stats["kills"], "broker_restarts": stats["broker_restarts"],
        "broker_down_s": round(stats["broker_down_s"], 1),
        "backend_outage_s": outage_s, "backend_refusals": outage["refused"],
        "hostile_inputs": stats["hostile_inputs"], "hostile_kinds": dict(fuzzer.kinds),
        "verdicts_expected": expected, "verdicts_lost": expected - decided,
        "duplicate_actuations": len(dup), "duplicates": dup[:20],
        "agent_crashes": stats["agent_crashes"],
        "max_recovery_s": round(max(rec), 2) if rec else None,
        "median_recovery_s": round(sorted(rec)[len(rec) // 2], 2) if rec else None,
        "recoveries_failed": sum(1 for x in stats["recovery_s"] if x is None),
        "false_isolations": sc["false_isolations"], "scenario": sc,
        "seconds": round(time.monotonic() - started, 1),
    }
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2) + "\n")
    for k in ("kills", "broker_restarts", "backend_outage_s", "hostile_inputs", "verdicts_expected", "verdicts_lost",
              "duplicate_actuations", "agent_crashes", "max_recovery_s", "false_isolations"):
        say(f"{k:<22} {result[k]}")
    return result


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


def _duplicates(applied: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """State changes that happened twice: the same key applied twice, a node isolated again
    without a return in between, a job attempt requeued or retried twice."""
    dups = []
    keys: Counter[str] = Counter(a["key"] for a in applied)
    dups += [{"key": k, "times": n} for k, n in keys.items() if n > 1]
    isolated: set[str] = set()
    job_moves: Counter[tuple[str, int]] = Counter()
    for a in applied:
        if a["action"] == "isolate":
            if a["target"] in isolated:
                dups.append({"isolated_again": a["target"], "key": a["key"]})
            isolated.add(a["target"])
        elif a["action"] == "return":
            isolated.discard(a["target"])
        elif a["action"] in ("requeue", "retry", "restart") and a["attempt"] is not None:
            job_moves[(a["target"], a["attempt"])] += 1
    dups += [{"job": j, "attempt": n, "moved": c} for (j, n), c in job_moves.items() if c > 1]
    return dups
