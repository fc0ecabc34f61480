"""``make bench``: throughput, latency, scale-out and memory, measured in one run.

1. **Load**: realistic samples of a fleet (8 GPUs per node, every field of the GPU record,
   and network samples) are written into Kafka as fast as the producer can.
2. **Baseline**: a bare aiokafka consumer reads the same messages and decodes them with
   the pipeline's codec: the practical limit of one Python consumer here.
3. **Pipeline**: one ``fleetmedic worker`` (decode, validate, detectors, correlator,
   verdicts, actuation) consumes the same messages from the start; its sustained rate
   is read from its own counters.
4. **Scale-out**: the same with two worker processes sharing the partitions.
5. **Latency**: the fleet streams at half the measured capacity; after a warm-up at that
   rate, faults (Xid 79) are injected. Latency runs from a fault sample's production to
   the simulated cluster's API applying its node's isolation (the backend's own request
   log, not the pipeline's report of it), with the stages on the way: the anomaly, the
   verdict, the isolation applied, and its ``actions`` record.
6. **Memory**: the worker's resident memory after it holds the whole fleet's state, less
   its resident memory when idle, per 1,000 nodes.

Results go to ``bench/results/throughput.json`` and a printed table.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import multiprocessing
import os
import platform
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import orjson
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer

from schemas import GpuSample, NetworkSample, decode

from pipeline.config import load_settings
from pipeline.detect.glue import decode_each, decode_gpu
from pipeline.worker.procs import WorkerProcess, free_port, machine_cpu_seconds, wait_ready
from pipeline.sim.cluster import GPUS, gpu_record
from pipeline.worker.topics import ensure_topics



def machine() -> dict[str, Any]:
    model = platform.processor() or "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cores": os.cpu_count(), "cpu": model, "python": platform.python_version(),
            "platform": platform.platform()}


# ------------------------------------------------------------------------------ load


class FleetLoad:
    """Realistic telemetry for ``nodes`` nodes, one round (one sample per node) at a time."""

    def __init__(self, nodes: int, seed: int = 7) -> None:
        self.nodes = [f"node-{i:05d}" for i in range(nodes)]
        self.rng = np.random.default_rng(seed)
        self.sbe = np.zeros((nodes, GPUS), dtype=np.int64)
        self.t0 = time.time() - 86400

    def gpu_round(self, k: int, ts: float | None = None) -> list[tuple[str, bytes]]:
        n = len(self.nodes)
        r = self.rng
        util = np.round(r.normal(96, 2, (n, GPUS)).clip(0, 100), 1)
        temp = np.round(r.normal(66, 1.5, (n, GPUS)), 1)
        power = np.round(r.normal(650, 12, (n, GPUS)).clip(0), 1)
        self.sbe += r.poisson(2e-4, (n, GPUS))
        ts = self.t0 + k if ts is None else ts
        out = []
        for i, name in enumerate(self.nodes):
            rec = gpu_record(name, ts, util=util[i], temp=temp[i], power=power[i], ecc_sbe=self.sbe[i])
            out.append((name, orjson.dumps(rec)))
        return out

    def network_round(self, k: int) -> list[tuple[str, bytes]]:
        out = []
        b = int(2.5e10 * (k + 1))
        for i, name in enumerate(self.nodes):
            ports = [{"port": f"mlx5_{p}", "switch": f"leaf-{i // 32:03d}", "state": "up", "symbol_errors": 0,
                      "link_error_recovery": 0, "link_downed": 0, "rcv_errors": 0, "xmit_discards": 0,
                      "xmit_wait": 2000 * k, "xmit_bytes": b, "rcv_bytes": b} for p in range(4)]
            out.append((name, orjson.dumps({"schema": "network/1", "ts": self.t0 + k, "node": name, "ports": ports})))
        return out


def fault_sample(node: str, ts: float) -> bytes:
    """GPU 3 fell off the bus (Xid 79)."""
    lost = [False] * GPUS
    lost[3] = True
    return orjson.dumps(gpu_record(node, ts, util=0.0, temp=40.0, power=70.0, sm_clock=0.0, lost=lost,
                                   xids=[(3, 79)]))


async def produce_all(bootstrap: str, items: list[tuple[str, str, bytes]]) -> float:
    p = AIOKafkaProducer(bootstrap_servers=bootstrap, linger_ms=50, max_batch_size=1024 * 1024, acks=1)
    await p.start()
    t = time.perf_counter()
    try:
        pending = []
        for topic, key, value in items:
            pending.append(await p.send(topic, key=key.encode(), value=value))
            if len(pending) >= 20000:
                await asyncio.gather(*pending)
                pending.clear()
        await asyncio.gather(*pending)
    finally:
        await p.stop()
    return time.perf_counter() - t


async def baseline(bootstrap: str, topics: dict[str, Any], total: int) -> float:
    """Seconds for a bare aiokafka consumer to read and decode ``total`` messages, with the
    collector set as a worker sets it. ``topics`` maps each topic to the worker's decoder
    of a batch of its messages (for GPU samples, into the columns detection reads)."""
    c = AIOKafkaConsumer(*topics, bootstrap_servers=bootstrap, group_id=None, auto_offset_reset="earliest",
                         enable_auto_commit=False, max_partition_fetch_bytes=4 * 1024 * 1024,
                         fetch_max_bytes=32 * 1024 * 1024)
    await c.start()
    n = 0
    t = None
    try:
        with _collector_as_in_a_worker():
            while n < total:
                batch = await c.getmany(timeout_ms=1000, max_records=5000)
                if t is None and batch:
                    t = time.perf_counter()
                for tp, msgs in batch.items():
                    topics[tp.topic]([m.value for m in msgs])
                    n += len(msgs)
    finally:
        await c.stop()
    return time.perf_counter() - (t or time.perf_counter())


# ------------------------------------------------------------------------------ workers


def run_workers(env: dict[str, str], count: int, total: int, logdir: Path, timeout: float) -> dict[str, Any]:
    """Start ``count`` workers on a backlog of ``total`` telemetry records; measure their rate."""
    app = f"fleetmedic-bench-{uuid.uuid4().hex[:6]}"
    # held until every worker has its share of the partitions: otherwise the first one up
    # reads most of the backlog alone while the next is still starting and joining
    wenv = {**env, "FLEETMEDIC_KAFKA__APP_ID": app, "FLEETMEDIC_WORKER__HOLD_TELEMETRY": "true"}
    asyncio.run(ensure_topics(load_settings(environ=wenv)))
    workers = [WorkerProcess(wenv, logdir / f"{app}-{i}.log") for i in range(count)]
    try:
        wait_ready(workers)
        idle_rss = [w.stats()["rss_bytes"] for w in workers]
        cpu0, machine0 = [w.cpu_seconds() for w in workers], machine_cpu_seconds()
        for w in workers:
            w.release()
        done = 0
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            done = sum(s["telemetry"] for s in (w.stats() for w in workers))
            if done >= total:
                break
            time.sleep(0.2)
        stats = [w.stats() for w in workers]
        cpu1, machine1 = [w.cpu_seconds() for w in workers], machine_cpu_seconds()
        wall = max(machine1[1] - machine0[1], 1e-9)
        # the workers' own clocks: first batch received to last batch processed
        t_first = min(s["first_telemetry_at"] for s in stats if s["first_telemetry_at"]) if done else 0.0
        t_last = max(s["last_telemetry_at"] for s in stats)
        elapsed = max(t_last - t_first, 1e-9)
        return {
            "workers": count, "records": done, "seconds": elapsed, "samples_per_s": done / elapsed if elapsed else 0.0,
            "complete": done >= total, "idle_rss_bytes": idle_rss, "rss_bytes": [s["rss_bytes"] for s in stats],
            "detector_state_bytes": [s["detector_state_bytes"] for s in stats],
            "nodes_seen": [s["nodes_seen"] for s in stats],
            # where the cores went while they read: the workers' own CPU seconds, and the
            # share of the machine's cores busy with anything (the broker included)
            "worker_cpu_s": [b - a for a, b in zip(cpu0, cpu1, strict=True)],
            "machine_busy": (machine1[0] - machine0[0]) / wall,
            "samples_per_worker_cpu_s": done / max(sum(cpu1) - sum(cpu0), 1e-9),
        }
    finally:
        for w in workers:
            w.stop()


def stream_rounds(bootstrap: str, topic: str, template: list[tuple[bytes, bytes]], marker: bytes, ts0: float,
                  rate: float, seconds: float, conn: Any) -> None:
    """The latency run's load, in a process of its own: round after round of ``template``
    (each value's ``marker`` replaced by the round's timestamp) at ``rate`` messages/s for
    ``seconds``.  Says ``("started", wall time)`` on ``conn`` once the first round begins
    and ``("done", messages, seconds)`` at the end, or ``("failed", why)``."""
    try:
        conn.send(asyncio.run(_stream_rounds(bootstrap, topic, template, marker, ts0, rate, seconds, conn)))
    except Exception as exc:  # reported to the parent, which fails the run with it
        conn.send(("failed", repr(exc)))


async def _stream_rounds(bootstrap: str, topic: str, template: list[tuple[bytes, bytes]], marker: bytes, ts0: float,
                         rate: float, seconds: float, conn: Any) -> tuple[str, int, float]:
    from aiokafka.partitioner import DefaultPartitioner

    p = AIOKafkaProducer(bootstrap_servers=bootstrap, linger_ms=5, acks=1)
    await p.start()
    try:
        parts = sorted(await p.partitions_for(topic))
        choose = DefaultPartitioner()
        # records are batched per partition by hand (the partition a producer would pick
        # for the key): the per-record send path would make the generator the busiest
        # process on the machine
        where = [choose(key, parts, parts) for key, _ in template]
        n = len(template)
        start = time.perf_counter()
        conn.send(("started", time.time()))
        produced = k = 0
        sending: list[Any] = []
        while time.perf_counter() - start < seconds:
            k += 1
            ts_bytes = b'"ts":' + repr(ts0 + k).encode() + b","
            for j in range(0, n, 500):
                batches: dict[int, Any] = {}
                for (key, value), part in zip(template[j : j + 500], where[j : j + 500], strict=True):
                    b = batches.get(part)
                    if b is None:
                        b = batches[part] = p.create_batch()
                    v = value.replace(marker, ts_bytes, 1)
                    if b.append(key=key, value=v, timestamp=None) is None:  # full: send it, start another
                        sending.append(await p.send_batch(b, topic, partition=part))
                        b = batches[part] = p.create_batch()
                        b.append(key=key, value=v, timestamp=None)
                for part, b in batches.items():
                    sending.append(await p.send_batch(b, topic, partition=part))
                produced += min(500, n - j)
                delay = start + produced / rate - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                if len(sending) > 1000:
                    await asyncio.gather(*sending)
                    sending.clear()
        await asyncio.gather(*sending)
        return "done", produced, time.perf_counter() - start
    finally:
        await p.stop()


async def latency_run(bootstrap: str, env: dict[str, str], load: FleetLoad, rate: float, seconds: float,
                      faults: int, logdir: Path, *, warmup_s: float = 5.0, tag: str = "live") -> dict[str, Any]:
    """Stream at ``rate`` samples/s for ``warmup_s`` + ``seconds``, injecting ``faults``
    spread over the last ``seconds``; fault-to-action latencies.  The warm-up lets the
    worker reach its steady state at that rate (its first fetches, the first isolation's
    connections) before anything is timed."""
    from pipeline.sim.run import SimRunner
    from pipeline.sim.cluster import SimConfig

    # topics of its own: the throughput backlog must not sit in front of the live stream
    env = {**env, "FLEETMEDIC_KAFKA__TOPIC_PREFIX": env["FLEETMEDIC_KAFKA__TOPIC_PREFIX"] + tag + "."}
    s = load_settings(environ=env)
    await ensure_topics(s)
    api_port = free_port()
    runner = SimRunner(s, SimConfig(nodes=0, faults="none"), api_port=api_port)
    fault_nodes = [load.nodes[(i * 7919) % len(load.nodes)] for i in range(faults)]
    from pipeline.sim.cluster import Node

    for n in fault_nodes:
        runner.cluster.nodes[n] = Node(name=n, leaf="leaf-0", rng=np.random.default_rng(0))
    # The simulated cluster's API and the follower that timestamps anomalies, verdicts and
    # actions run on a loop of their own, so the load generator (this loop, busy sending
    # thousands of messages a second) delays neither the backend's answers nor the clock.
    side = asyncio.new_event_loop()
    side_thread = threading.Thread(target=side.run_forever, name="bench-side", daemon=True)
    side_thread.start()

    def on_side(coro: Any) -> Any:
        return asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, side))

    await on_side(runner.start_api())
    app = f"fleetmedic-bench-lat-{uuid.uuid4().hex[:6]}"
    # every fault's isolation is timed: the breaker (50 nodes an hour by default) must not hold any
    wenv = {**env, "FLEETMEDIC_KAFKA__APP_ID": app, "FLEETMEDIC_ACTUATORS__BACKEND": "sim",
            "FLEETMEDIC_ACTUATORS__SIM_URL": f"http://127.0.0.1:{api_port}",
            "FLEETMEDIC_SAFETY__MAX_ABSOLUTE": str(max(50, 2 * faults))}
    await ensure_topics(load_settings(environ=wenv))
    worker = WorkerProcess(wenv, logdir / f"{app}.log")
    stages: dict[str, dict[str, float]] = {"anomaly": {}, "verdict": {}}
    sent_wall: dict[str, float] = {}
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, linger_ms=5, acks=1)
    sent: dict[str, float] = {}
    seen: dict[str, float] = {}
    stop = threading.Event()
    following = threading.Event()

    async def follow() -> None:
        consumer = AIOKafkaConsumer(s.topic("actions"), s.topic("verdicts"), s.topic("anomalies"),
                                    bootstrap_servers=bootstrap, group_id=None, fetch_max_wait_ms=50,
                                    auto_offset_reset="latest", enable_auto_commit=False)
        await consumer.start()
        await consumer.seek_to_end()
        following.set()
        try:
            while not stop.is_set():
                batch = await consumer.getmany(timeout_ms=100)
                now = time.perf_counter()
                for tp, msgs in batch.items():
                    for m in msgs:
                        a = orjson.loads(m.value)
                        if tp.topic == s.topic("anomalies"):
                            if a.get("node") in sent:
                                stages["anomaly"].setdefault(a["node"], now)
                        elif tp.topic == s.topic("verdicts"):
                            if a.get("subject") in sent:
                                stages["verdict"].setdefault(a["subject"], now)
                        elif a.get("action") == "isolate" and a["target"] in sent and a["target"] not in seen:
                            seen[a["target"]] = now
        finally:
            await consumer.stop()

    follower = None
    try:
        await asyncio.to_thread(wait_ready, [worker])
        follower = on_side(follow())
        await asyncio.to_thread(following.wait, 30)
        await producer.start()
        gpu_topic = s.topic("telemetry.gpu")
        n = len(load.nodes)
        k0 = 10_000
        # one round rendered up front; each later round only rewrites the timestamp
        marker = b'"ts":1.0,'
        template = [(key.encode(), value.replace(b'"ts":' + repr(load.t0 + k0).encode() + b",", marker, 1))
                    for key, value in load.gpu_round(k0, ts=load.t0 + k0)]
        # The fleet's stream comes from a process of its own: in this one it would hold the
        # interpreter lock against the clock that stamps each stage and the backend that
        # logs each isolation
        ctx = multiprocessing.get_context("spawn")
        ours, theirs = ctx.Pipe()
        streamer = ctx.Process(target=stream_rounds, name="bench-load",
                               args=(bootstrap, gpu_topic, template, marker, load.t0 + k0, rate, warmup_s + seconds,
                                     theirs), daemon=True)
        streamer.start()
        try:
            hello = await asyncio.to_thread(ours.recv)
            if hello[0] != "started":
                raise RuntimeError(f"bench load stream failed: {hello[1]}")
            start = time.perf_counter() - (time.time() - hello[1])  # the stream's start on this clock
            for i, node in enumerate(fault_nodes):
                delay = start + warmup_s + (i + 1) * seconds / (faults + 1) - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                # stamped a round ahead of the stream, so that no sample of the node's is newer
                k = int((time.perf_counter() - start) * rate / n) + 2
                t_sent, t_wall = time.perf_counter(), time.time()  # before the send: no credit for its ack
                await producer.send_and_wait(gpu_topic, key=node.encode(), value=fault_sample(node, load.t0 + k0 + k + 0.5))
                sent[node], sent_wall[node] = t_sent, t_wall
            done = await asyncio.to_thread(ours.recv)
            if done[0] != "done":
                raise RuntimeError(f"bench load stream failed: {done[1]}")
            achieved = done[1] / done[2]
        finally:
            streamer.join(30)
            if streamer.is_alive():
                streamer.kill()
        deadline = time.perf_counter() + 30
        while len(seen) < len(sent) and time.perf_counter() < deadline:
            await asyncio.sleep(0.1)
    finally:
        stop.set()
        if follower is not None:
            await follower
        await producer.stop()
        worker.stop()
        if runner._runner is not None:
            await on_side(runner._runner.cleanup())
        side.call_soon_threadsafe(side.stop)
        side_thread.join(5)
    # the isolation as the backend applied it, from its own request log (wall clock),
    # put on the same clock as the other stages
    applied: dict[str, float] = {}
    for r in list(runner.cluster.requests):
        n = r.get("target")
        if r.get("action") == "isolate" and r.get("outcome") == "applied" and n in sent_wall and n not in applied:
            applied[n] = sent[n] + (r["wall"] - sent_wall[n])
    lat = sorted(applied[n] - sent[n] for n in applied)
    arr = np.array(lat) if lat else np.array([np.nan])
    named = (("anomaly", stages["anomaly"]), ("verdict", stages["verdict"]), ("action", applied), ("reported", seen))

    def pct(d: dict[str, float], q: float) -> float | None:
        v = [d[n] - sent[n] for n in d if n in sent]
        return float(np.percentile(v, q)) if v else None

    return {"stage_p50_s": {st: pct(d, 50) for st, d in named},
            "stage_p99_s": {st: pct(d, 99) for st, d in named},
            "per_fault_s": [{st: (None if n not in d else round(d[n] - sent[n], 4)) for st, d in named}
                            for n in sorted(sent, key=sent.__getitem__)],
            "warmup_s": warmup_s, "applied": len(applied),
            "rate_target": rate, "rate_achieved": achieved, "faults": len(sent), "actions_seen": len(seen),
            "method": "fault sample handed to the producer to the isolation applied by the "
                      "simulated cluster's API, from its request log; faults start after the warm-up",
            "p50_s": float(np.percentile(arr, 50)), "p99_s": float(np.percentile(arr, 99)),
            "max_s": float(arr.max())}


# ------------------------------------------------------------------------------ main


async def actuation_run(bootstrap: str, env: dict[str, str], logdir: Path, *, verdicts: int = 300,
                        repeat: int = 3, say=print) -> dict[str, Any]:
    """How fast verdicts are carried out while a drain waits on a disruption budget, as a
    ratio to the same run without it. Pairs of runs on one worker (simulated cluster
    backend): ``verdicts`` isolations of fresh nodes alone, then again while a drain of
    another node is refused (HTTP 429) and retried; rate = verdicts / (first sent to last
    applied)."""
    from pipeline.sim.run import SimRunner
    from pipeline.sim.cluster import Node, SimConfig

    env = {**env, "FLEETMEDIC_KAFKA__TOPIC_PREFIX": env["FLEETMEDIC_KAFKA__TOPIC_PREFIX"] + "act."}
    api_port = free_port()
    app = f"fleetmedic-bench-act-{uuid.uuid4().hex[:6]}"
    wenv = {**env, "FLEETMEDIC_KAFKA__APP_ID": app, "FLEETMEDIC_ACTUATORS__BACKEND": "sim",
            "FLEETMEDIC_ACTUATORS__SIM_URL": f"http://127.0.0.1:{api_port}",
            "FLEETMEDIC_SAFETY__FLEET_SIZE": "100000", "FLEETMEDIC_SAFETY__MAX_FRACTION": "1.0",
            "FLEETMEDIC_SAFETY__MAX_ABSOLUTE": "100000", "FLEETMEDIC_ACTUATORS__MAX_DELAY_S": "2"}
    s = load_settings(environ=wenv)
    await ensure_topics(s)
    runner = SimRunner(s, SimConfig(nodes=0, faults="none"), api_port=api_port)
    side = asyncio.new_event_loop()
    side_thread = threading.Thread(target=side.run_forever, name="bench-act", daemon=True)
    side_thread.start()

    def on_side(fn: Any) -> Any:
        async def call() -> Any:
            return fn()
        return asyncio.wrap_future(asyncio.run_coroutine_threadsafe(call(), side))

    await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(runner.start_api(), side))
    worker = WorkerProcess(wenv, logdir / f"{app}.log")
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, linger_ms=5, acks=1)
    consumer = AIOKafkaConsumer(s.topic("actions"), bootstrap_servers=bootstrap, group_id=None,
                                auto_offset_reset="latest", enable_auto_commit=False, fetch_max_wait_ms=50)

    def verdict(vid: str, node: str, action: str) -> bytes:
        return orjson.dumps({"schema": "verdict/1", "ts": time.time(), "id": vid, "incident": vid, "scope": "node",
                             "subject": node, "fault_class": "gpu_hardware", "confidence": 0.9, "nodes": [node],
                             "actions": [{"action": action, "target": node, "params": {}}]})

    async def until(pred: Any, timeout: float) -> bool:
        deadline = time.perf_counter() + timeout
        while time.perf_counter() < deadline:
            batch = await consumer.getmany(timeout_ms=100)
            for msgs in batch.values():
                for m in msgs:
                    a = orjson.loads(m.value)
                    seen.append(a)
                    if a["outcome"] == "applied":
                        applied.add(a["target"])
            if pred():
                return True
        return False

    seen: list[dict[str, Any]] = []
    applied: set[str] = set()
    pairs: list[dict[str, float]] = []
    try:
        await asyncio.to_thread(wait_ready, [worker])
        await producer.start()
        await consumer.start()
        await consumer.seek_to_end()
        for rep in range(repeat):
            rates: dict[str, float] = {}
            # the order alternates between pairs, so a drift (a warming worker, a neighbour)
            # favours neither side
            for mode in (("alone", "drain_blocked") if rep % 2 == 0 else ("drain_blocked", "alone")):
                tag = f"r{rep}-{mode}"
                names = [f"ba-{tag}-{i:03d}" for i in range(verdicts)]
                blocked = f"bb-{tag}"

                def add(names: list[str] = names, blocked: str = blocked, mode: str = mode) -> None:
                    for n in names + [blocked]:
                        runner.cluster.nodes[n] = Node(name=n, leaf="leaf-0", rng=np.random.default_rng(0),
                                                       drain_blocked=(n == blocked and mode == "drain_blocked"))

                await on_side(add)
                if mode == "drain_blocked":
                    await producer.send_and_wait(s.topic("verdicts"), key=blocked.encode(),
                                                 value=verdict(f"bd-{tag}", blocked, "drain"))
                    await asyncio.to_thread(lambda: time.sleep(2.0))  # refused and retrying by now
                t0 = time.perf_counter()
                for i, n in enumerate(names):
                    await producer.send(s.topic("verdicts"), key=n.encode(), value=verdict(f"bv-{tag}-{i}", n, "isolate"))
                await producer.flush()
                want = set(names)
                ok = await until(lambda: want <= applied, 120)
                took = time.perf_counter() - t0
                if not ok:
                    raise RuntimeError(f"actuation bench: {mode} run {rep + 1} did not complete within 120 s")
                rates[mode] = verdicts / took
                if mode == "drain_blocked":
                    waiting = not any(a["target"] == blocked for a in seen)

                    def unblock(blocked: str = blocked) -> None:
                        runner.cluster.nodes[blocked].drain_blocked = False

                    await on_side(unblock)
                    await until(lambda: blocked in applied, 60)
                    if not waiting:
                        raise RuntimeError("actuation bench: the blocked drain settled while it was blocked")
            pairs.append({"alone_per_s": rates["alone"], "drain_blocked_per_s": rates["drain_blocked"],
                          "ratio": rates["drain_blocked"] / rates["alone"]})
            say(f"  run {rep + 1}/{repeat}: {rates['alone']:.0f} verdicts/s alone, "
                f"{rates['drain_blocked']:.0f} with a drain waiting ({pairs[-1]['ratio']:.2f})")
    finally:
        await producer.stop()
        await consumer.stop()
        worker.stop()
        if runner._runner is not None:
            await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(runner._runner.cleanup(), side))
        side.call_soon_threadsafe(side.stop)
        side_thread.join(5)
    return {"verdicts": verdicts, "runs": pairs, **spread("ratio", [p["ratio"] for p in pairs]),
            "alone_per_s": float(np.median([p["alone_per_s"] for p in pairs])),
            "drain_blocked_per_s": float(np.median([p["drain_blocked_per_s"] for p in pairs]))}


def per_sample_costs(nodes: int = 4000, rounds: int = 12, batch: int = 200, repeat: int = 3) -> dict[str, Any]:
    """Microseconds per GPU sample of the steps that decide the ratio, in this process, on
    batches of ``batch`` messages: the worker's decoding into the columns detection reads
    (``decode``; the bare consumer of the ratio does the same), and its parts: the
    record's own validation by pydantic, one message at a time (what a message outside the
    fast path costs), msgspec's mirror of the record alone, and parsing the same JSON with
    orjson alone (the floor any JSON decoder starts from); then GPU detection on the
    decoded batches. The collector as in a worker. Each the median of ``repeat`` passes,
    with min and max."""
    from pipeline.detect.glue import GpuDetection
    from schemas.columns import MIRROR

    load = FleetLoad(nodes)
    raw = [[v for _, v in load.gpu_round(k)] for k in range(rounds)]
    cfg = load_settings(environ={}).detectors
    runs: dict[str, list[float]] = {"decode": [], "pydantic": [], "mirror": [], "orjson_parse": [],
                                    "gpu_detection": []}
    n = nodes * rounds
    with _collector_as_in_a_worker():
        for _ in range(repeat):
            t = time.perf_counter()
            batches = [decode_gpu(r[j : j + batch]).samples for r in raw for j in range(0, len(r), batch)]
            runs["decode"].append((time.perf_counter() - t) / n * 1e6)
            t = time.perf_counter()
            for r in raw:
                for v in r:
                    decode(GpuSample, v)
            runs["pydantic"].append((time.perf_counter() - t) / n * 1e6)
            t = time.perf_counter()
            for r in raw:
                for v in r:
                    MIRROR.decode(v)
            runs["mirror"].append((time.perf_counter() - t) / n * 1e6)
            t = time.perf_counter()
            for r in raw:
                for v in r:
                    orjson.loads(v)
            runs["orjson_parse"].append((time.perf_counter() - t) / n * 1e6)
            det = GpuDetection(cfg, capacity=nodes + nodes // 10)
            t = time.perf_counter()
            for b in batches:
                det.process(b)
            runs["gpu_detection"].append((time.perf_counter() - t) / n * 1e6)
            del batches, det
            gc.collect()
    out: dict[str, Any] = {"nodes": nodes, "rounds": rounds, "batch": batch,
                           "message_bytes": float(np.mean([len(v) for v in raw[0]]))}
    for k, v in runs.items():
        out.update(spread(f"{k}_us", v))
    return out


@contextlib.contextmanager
def _collector_as_in_a_worker() -> Iterator[None]:
    """The garbage collector as a worker's telemetry loop sets it (what is alive now frozen,
    young objects collected every ``worker.gc_threshold`` allocations), so what is timed in
    this process is not a walk over the bench's own heap, over and over."""
    before = gc.get_threshold()
    gc.collect()
    gc.freeze()
    gc.set_threshold(load_settings(environ={}).worker.gc_threshold, 20, 100)
    try:
        yield
    finally:
        gc.set_threshold(*before)
        gc.unfreeze()


def spread(name: str, values: list[float]) -> dict[str, float | None]:
    """``name`` as the median of ``values``, with ``name_min`` and ``name_max`` (all None
    without values): how every benchmark figure of several runs is reported."""
    if not values:
        return {name: None, f"{name}_min": None, f"{name}_max": None}
    return {name: float(np.median(values)), f"{name}_min": float(min(values)), f"{name}_max": float(max(values))}


def _above_idle(run: dict[str, Any]) -> float:
    """The largest worker's resident memory above its own idle footprint, in bytes."""
    return float(max(max(r - i for r, i in zip(run["rss_bytes"], run["idle_rss_bytes"], strict=True)), 1))


def _median_run(runs: list[dict[str, Any]], key: str) -> dict[str, Any]:
    """The run whose ``key`` is the median (the lower middle one for an even count)."""
    return sorted(runs, key=lambda r: r[key])[(len(runs) - 1) // 2]


def run(*, bootstrap: str, nodes: int, rounds: int, net_every: int, latency_seconds: float, faults: int,
        two_workers: bool, out: Path, logdir: Path, repeat: int = 3, say=print) -> dict[str, Any]:
    prefix = f"bench{uuid.uuid4().hex[:6]}."
    env = {**os.environ, "FLEETMEDIC_KAFKA__BOOTSTRAP": bootstrap, "FLEETMEDIC_KAFKA__TOPIC_PREFIX": prefix,
           "FLEETMEDIC_ACTUATORS__BACKEND": "dryrun", "FLEETMEDIC_SAFETY__FLEET_SIZE": str(nodes),
           "FLEETMEDIC_WORKER__LOG_LEVEL": "warning"}
    s = load_settings(environ=env)
    asyncio.run(ensure_topics(s))
    load = FleetLoad(nodes)
    gpu_t, net_t = s.topic("telemetry.gpu"), s.topic("telemetry.network")
    say(f"generating {nodes} nodes x {rounds} rounds of GPU samples (+ network every {net_every} rounds)")
    items: list[tuple[str, str, bytes]] = []
    for k in range(rounds):
        items.extend((gpu_t, key, v) for key, v in load.gpu_round(k))
        if net_every and k % net_every == 0:
            items.extend((net_t, key, v) for key, v in load.network_round(k))
    total = len(items)
    gpu_total = sum(1 for t, _, _ in items if t == gpu_t)
    size = sum(len(v) for _, _, v in items)
    say(f"producing {total} messages ({size / 1e6:.0f} MB) into Kafka at {bootstrap}")
    produce_s = asyncio.run(produce_all(bootstrap, items))
    del items
    say(f"  produced at {total / produce_s:,.0f} msg/s")
    # Baseline and pipeline are measured in pairs, back to back, `repeat` times: a busy
    # neighbour on a shared machine then slows both sides of a pair, and the medians
    # are robust to one disturbed run. Every run is kept in the results.
    pairs = []
    for rep in range(repeat):
        tag = f" (run {rep + 1}/{repeat})" if repeat > 1 else ""
        say(f"baseline: bare aiokafka consumer + the pipeline's decoder{tag}")
        base_s = asyncio.run(baseline(bootstrap, {gpu_t: decode_gpu, net_t: decode_each(NetworkSample)}, total))
        say(f"  {total / base_s:,.0f} samples/s")
        say(f"fleetmedic: one worker, full pipeline, from the start of the topics{tag}")
        run1 = run_workers(env, 1, total, logdir, timeout=max(120, total / 2000))
        say(f"  {run1['samples_per_s']:,.0f} samples/s ({'complete' if run1['complete'] else 'INCOMPLETE'})")
        pair = {"baseline_samples_per_s": total / base_s, "pipeline_samples_per_s": run1["samples_per_s"],
                "ratio": run1["samples_per_s"] * base_s / total, "worker": run1}
        if two_workers:
            # right after the one-worker run of the same pair, so both see the same machine
            say(f"fleetmedic: two workers sharing the partitions{tag}")
            run2 = run_workers(env, 2, total, logdir, timeout=max(120, total / 2000))
            say(f"  {run2['samples_per_s']:,.0f} samples/s ({'complete' if run2['complete'] else 'INCOMPLETE'}; "
                f"{run2['samples_per_s'] / run1['samples_per_s']:.2f}x one worker)")
            pair.update(two_worker_samples_per_s=run2["samples_per_s"],
                        two_worker_speedup=run2["samples_per_s"] / run1["samples_per_s"], workers2=run2)
        pairs.append(pair)
    mid = sorted(pairs, key=lambda p: p["ratio"])[len(pairs) // 2]  # the pair with the median ratio
    one = mid["worker"]
    base_rate = float(np.median([p["baseline_samples_per_s"] for p in pairs]))
    one_rate = float(np.median([p["pipeline_samples_per_s"] for p in pairs]))
    two = None
    if two_workers:  # the two-worker run with the median speedup, for its memory and CPU figures
        two = sorted(pairs, key=lambda p: p["two_worker_speedup"])[len(pairs) // 2]["workers2"]
    speedups = [p["two_worker_speedup"] for p in pairs] if two_workers else []
    lats = []
    for rep in range(repeat):
        say(f"latency: streaming at half capacity ({one_rate / 2:,.0f} samples/s) with {faults} faults "
            f"(run {rep + 1}/{repeat})")
        one_lat = asyncio.run(latency_run(bootstrap, env, load, one_rate / 2, latency_seconds, faults, logdir,
                                          tag=f"live{rep}"))
        say(f"  p50 {one_lat['p50_s'] * 1000:.0f} ms, p99 {one_lat['p99_s'] * 1000:.0f} ms "
            f"({one_lat['applied']}/{one_lat['faults']} isolations applied); p99 by stage (ms): "
            + ", ".join(f"{k} {v * 1000:.0f}" for k, v in one_lat["stage_p99_s"].items() if v is not None))
        lats.append(one_lat)
    lat = _median_run(lats, "p99_s")
    say("per-sample costs: decoding into columns, pydantic alone, the mirror alone, parsing alone, GPU detection")
    costs = per_sample_costs(repeat=repeat)
    say("  " + ", ".join(f"{k[:-3]} {costs[k]:.1f} us" for k in ("decode_us", "pydantic_us", "mirror_us", "orjson_parse_us",
                                                                  "gpu_detection_us")))
    say("actuation: 300 verdicts alone and while a drain waits on a disruption budget")
    act = asyncio.run(actuation_run(bootstrap, env, logdir, repeat=repeat, say=say))
    result = {
        "machine": machine(),
        "nodes": nodes, "rounds": rounds, "messages": total, "gpu_samples": gpu_total,
        "message_bytes": size, "produce_msgs_per_s": total / produce_s,
        "baseline_samples_per_s": base_rate,
        "pipeline_samples_per_s": one_rate,
        **spread("ratio", [p["ratio"] for p in pairs]),
        "ratio_runs": [p["ratio"] for p in pairs],
        "runs": [{k: v for k, v in p.items() if k not in ("worker", "workers2")} for p in pairs],
        "gpus_per_worker_at_1hz": one_rate * GPUS,
        # medians over the runs, each with its spread; "latency" is the run with the median p99
        **spread("latency_p50_s", [x["p50_s"] for x in lats]),
        **spread("latency_p99_s", [x["p99_s"] for x in lats]),
        **spread("latency_max_s", [x["max_s"] for x in lats]),
        "latency_stage_p99_s": {st: float(np.median([x["stage_p99_s"][st] for x in lats
                                                     if x["stage_p99_s"][st] is not None] or [np.nan]))
                                for st in lats[0]["stage_p99_s"]},
        "latency": lat, "latency_runs": lats,
        "two_worker_samples_per_s": float(np.median([p["two_worker_samples_per_s"] for p in pairs])) if two else None,
        # each pair's two-worker rate over its own one-worker rate; median, min, max
        **spread("two_worker_speedup", speedups),
        # scale-out without the machine's limit: samples per CPU second the workers used
        # (two workers against one); and how busy all cores were in each run
        **spread("two_worker_cpu_efficiency", [p["workers2"]["samples_per_worker_cpu_s"]
                                                / p["worker"]["samples_per_worker_cpu_s"] for p in pairs] if two else []),
        "machine_busy_one_two": [float(np.median([p["worker"]["machine_busy"] for p in pairs])),
                                 float(np.median([p["workers2"]["machine_busy"] for p in pairs])) if two else None],
        "actuation": act,
        "per_sample_us": costs,
        **spread("mem_mb_per_1k_nodes", [(p["worker"]["rss_bytes"][0] - p["worker"]["idle_rss_bytes"][0])
                                          / 1e6 / nodes * 1000 for p in pairs]),
        # memory per worker (resident, whole process) when two workers share the fleet, as a
        # share of one worker's (the larger of the two, against the one worker of its pair)
        **spread("mem_per_worker_mb_one", [p["worker"]["rss_bytes"][0] / 1e6 for p in pairs]),
        **spread("mem_per_worker_mb_two", [max(p["workers2"]["rss_bytes"]) / 1e6 for p in pairs] if two else []),
        **spread("mem_per_worker_ratio_two_vs_one",
                  [max(p["workers2"]["rss_bytes"]) / p["worker"]["rss_bytes"][0] for p in pairs] if two else []),
        # the same above each process's own idle footprint (the interpreter, its libraries,
        # the clients: about 115 MB that no sharing of partitions can divide)
        **spread("mem_above_idle_ratio_two_vs_one", [_above_idle(p["workers2"]) / _above_idle(p["worker"])
                                                      for p in pairs] if two else []),
        **spread("mem_idle_mb", [p["worker"]["idle_rss_bytes"][0] / 1e6 for p in pairs]),
        "detector_state_ratio_two_vs_one": (max(two["detector_state_bytes"]) / one["detector_state_bytes"][0])
        if two and one["detector_state_bytes"][0] else None,
        "detector_state_mb_per_1k_nodes": one["detector_state_bytes"][0] / 1e6 / nodes * 1000,
        "one_worker": one, "two_workers": two,
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    say(table(result))
    say(f"results: {out}")
    return result


def table(r: dict[str, Any]) -> str:
    m = r["machine"]
    rows = [
        ("machine", f"{m['cores']} cores, {m['cpu']}"),
        ("fleet", f"{r['nodes']:,} nodes x 8 GPUs, {r['messages']:,} messages"),
        ("baseline (aiokafka + decode)", f"{r['baseline_samples_per_s']:,.0f} samples/s"),
        ("fleetmedic, 1 worker", f"{r['pipeline_samples_per_s']:,.0f} samples/s"),
        ("ratio to baseline", f"{r['ratio']:.2f} (median of {', '.join(f'{x:.2f}' for x in r['ratio_runs'])})"),
        ("GPUs per worker at 1 Hz", f"{r['gpus_per_worker_at_1hz']:,.0f}"),
        ("fleetmedic, 2 workers", "-" if r["two_worker_samples_per_s"] is None
         else f"{r['two_worker_samples_per_s']:,.0f} samples/s ({r['two_worker_speedup']:.2f}x, min "
              f"{r['two_worker_speedup_min']:.2f}, max {r['two_worker_speedup_max']:.2f}; per worker CPU "
              f"second {r['two_worker_cpu_efficiency']:.2f}x; all cores busy {r['machine_busy_one_two'][1]:.0%}, "
              f"{r['machine_busy_one_two'][0]:.0%} with one)"),
        ("fault-to-action latency", f"p50 {r['latency_p50_s'] * 1000:.0f} ms, p99 {r['latency_p99_s'] * 1000:.0f} ms "
                                    f"(min {r['latency_p99_s_min'] * 1000:.0f}, max {r['latency_p99_s_max'] * 1000:.0f})"),
        ("p99 by stage", ", ".join(f"{k} {v * 1000:.0f} ms" for k, v in r["latency_stage_p99_s"].items())),
        ("per GPU sample (µs)", "-" if not r.get("per_sample_us") else
         ", ".join(f"{k[:-3].replace('_', ' ')} {r['per_sample_us'][k]:.1f}"
                   for k in ("decode_us", "pydantic_us", "mirror_us", "orjson_parse_us", "gpu_detection_us"))),
        ("verdicts/s while a drain waits", "-" if not r.get("actuation") else
         f"{r['actuation']['drain_blocked_per_s']:.0f} vs {r['actuation']['alone_per_s']:.0f} alone: ratio "
         f"{r['actuation']['ratio']:.2f} (min {r['actuation']['ratio_min']:.2f}, max {r['actuation']['ratio_max']:.2f})"),
        ("memory per 1,000 nodes", f"{r['mem_mb_per_1k_nodes']:.1f} MB RSS "
                                   f"({r['detector_state_mb_per_1k_nodes']:.1f} MB detector state)"),
        ("memory per worker, 2 vs 1", "-" if r.get("mem_per_worker_ratio_two_vs_one") is None else
         f"{r['mem_per_worker_mb_two']:.0f} MB vs {r['mem_per_worker_mb_one']:.0f} MB: ratio "
         f"{r['mem_per_worker_ratio_two_vs_one']:.2f} (min {r['mem_per_worker_ratio_two_vs_one_min']:.2f}, max "
         f"{r['mem_per_worker_ratio_two_vs_one_max']:.2f}); above the idle {r['mem_idle_mb']:.0f} MB "
         f"{r['mem_above_idle_ratio_two_vs_one']:.2f}; detector state {r['detector_state_ratio_two_vs_one']:.2f}"),
    ]
    w = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{w}}  {v}" for k, v in rows)
