"""Helpers for integration tests: a real worker process, a simulated cluster API, records.

Every test module gets its own topic prefix and consumer group, so tests never see each
other's records on the shared broker.
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np
import orjson
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer

from pipeline.config import Settings, load_settings
from pipeline.worker.procs import ROOT, WorkerProcess, free_port, wait_ready  # noqa: F401 (ROOT for the tests)
from pipeline.sim.cluster import GPUS, Cluster, Job, Node, SimConfig, gpu_record
from pipeline.sim.run import SimRunner
from pipeline.worker.topics import ensure_topics



class BackgroundLoop:
    """An asyncio loop in a thread, for servers that must run while a test waits."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro: Any, timeout: float = 30) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def call(self, fn: Callable[[], Any]) -> Any:
        async def wrap() -> Any:
            return fn()

        return self.run(wrap())

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


def serve(bg: BackgroundLoop, routes: list[tuple[str, str, Callable[[Any], Any]]]) -> tuple[Any, int]:
    """Serve ``routes`` (method, path, aiohttp handler) on a free loopback port from
    ``bg``'s loop: ``(runner, port)``; ``bg.run(runner.cleanup())`` ends it."""
    from aiohttp import web

    port = free_port()

    async def start() -> Any:
        app = web.Application()
        for method, path, handler in routes:
            app.router.add_route(method, path, handler)
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        return runner

    return bg.run(start()), port


class JwksServer:
    """An identity provider's key endpoint on loopback (``GET /certs``), served by ``certs``
    (an aiohttp handler) in a background loop."""

    def __init__(self, certs: Callable[[Any], Any]) -> None:
        self.bg = BackgroundLoop()
        self.runner, self.port = serve(self.bg, [("GET", "/certs", certs)])

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/certs"

    def close(self) -> None:
        self.bg.run(self.runner.cleanup())
        self.bg.stop()


def auth_env(issuer: str, audience: str, jwks_url: str, **extra: str) -> dict[str, str]:
    """A worker's environment with sign-in on against ``jwks_url``."""
    return {"FLEETMEDIC_AUTH__ENABLED": "true", "FLEETMEDIC_AUTH__ISSUER": issuer,
            "FLEETMEDIC_AUTH__AUDIENCE": audience, "FLEETMEDIC_AUTH__JWKS_URL": jwks_url, **extra}


class ClusterAPI:
    """The simulator's cluster API on loopback, over a cluster the test populates."""

    def __init__(self, settings: Settings) -> None:
        self.bg = BackgroundLoop()
        self.port = free_port()
        self.runner = SimRunner(settings, SimConfig(nodes=0, faults="none"), api_port=self.port)
        self.cluster: Cluster = self.runner.cluster
        self.bg.run(self.runner.start_api())

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def add_nodes(self, names: Iterable[str], leaf: str = "leaf-00") -> None:
        def add() -> None:
            for n in names:
                self.cluster.nodes[n] = Node(name=n, leaf=leaf, rng=np.random.default_rng(len(self.cluster.nodes)))

        self.bg.call(add)

    def add_job(self, job: str, nodes: list[str], status: str = "running") -> None:
        def add() -> None:
            j = Job(id=job, size=len(nodes), steps_total=10**6, step_time=1.0, nodes=list(nodes), status=status)
            self.cluster.jobs[job] = j
            for n in nodes:
                self.cluster.nodes[n].job = job

        self.bg.call(add)

    def state(self, fn: Callable[[Cluster], Any]) -> Any:
        return self.bg.call(lambda: fn(self.cluster))

    def close(self) -> None:
        if self.runner._runner is not None:
            self.bg.run(self.runner._runner.cleanup())
        self.bg.stop()


class Worker:
    """``python -m pipeline worker`` as a subprocess with its own prefix and group."""

    def __init__(self, bootstrap: str, *, sim_url: str, env: dict[str, str] | None = None) -> None:
        tag = uuid.uuid4().hex[:8]
        self.env = {
            **os.environ,
            "FLEETMEDIC_KAFKA__BOOTSTRAP": bootstrap,
            "FLEETMEDIC_KAFKA__TOPIC_PREFIX": f"it{tag}.",
            "FLEETMEDIC_KAFKA__APP_ID": f"fleetmedic-it-{tag}",
            "FLEETMEDIC_WORKER__WEB_PORT": str(free_port()),
            "FLEETMEDIC_WORKER__LOG_LEVEL": "info",
            "FLEETMEDIC_ACTUATORS__BACKEND": "sim",
            "FLEETMEDIC_ACTUATORS__SIM_URL": sim_url,
            "FLEETMEDIC_POLICY__CORRELATION_GRACE_S": "1.5",
            # job events without telemetry after them are judged on the wall clock this soon
            "FLEETMEDIC_POLICY__CORRELATION_WAIT_MAX_S": "4",
            **(env or {}),
        }
        self.settings = load_settings(environ=self.env)
        self.log_path = Path(os.environ.get("TMPDIR", "/tmp")) / f"fleetmedic-worker-{tag}.log"
        self.proc: WorkerProcess | None = None

    def start(self, timeout: float = 90, *, wait: bool = True) -> "Worker":
        """Start the process; with ``wait``, return once it is ready (else while it starts)."""
        asyncio.run(ensure_topics(self.settings))
        self.proc = WorkerProcess(self.env, self.log_path)
        if wait:
            wait_ready([self.proc], timeout)
        return self

    def ready(self) -> bool:
        return self.proc is not None and self.proc.ready()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.alive()

    def stats(self) -> dict[str, Any]:
        assert self.proc is not None
        return self.proc.stats()

    def log_tail(self, n: int = 60) -> str:
        return self.proc.log_tail(n) if self.proc is not None else ""

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.stop()

    def topic(self, short: str) -> str:
        return self.settings.topic(short)


# ------------------------------------------------------------------------------ records


def gpu_sample(node: str, ts: float, *, sbe: list[int] | None = None, dbe: list[int] | None = None,
               lost: list[bool] | None = None, xids: list[tuple[int, int]] | None = None,
               busy: bool = True, rng: np.random.Generator | None = None) -> dict[str, Any]:
    r = rng or np.random.default_rng(int(ts) % 1000)
    return gpu_record(node, ts, util=np.round(r.normal(96 if busy else 1, 1.5, GPUS).clip(0, 100), 1),
                      temp=np.round(r.normal(66, 1.5, GPUS), 1), power=np.round(r.normal(650, 10, GPUS), 1),
                      ecc_sbe=sbe or 0, ecc_dbe=dbe or 0, lost=lost or False, xids=xids or ())


def job_event(job: str, event: str, ts: float, nodes: list[str], attempt: int = 1, **extra: Any) -> dict[str, Any]:
    return {"schema": "job/1", "ts": ts, "job": job, "event": event, "scheduler": "sim", "nodes": nodes,
            "attempt": attempt, **extra}


async def _produce(bootstrap: str, items: list[tuple[str, str | None, bytes]]) -> None:
    p = AIOKafkaProducer(bootstrap_servers=bootstrap, linger_ms=5, max_request_size=4 * 1024 * 1024)
    await p.start()
    try:
        for topic, key, value in items:
            await p.send(topic, key=key.encode() if key is not None else None, value=value)
        await p.flush()
    finally:
        await p.stop()


def produce(bootstrap: str, items: list[tuple[str, str | None, Any]]) -> None:
    """Send (topic, key, value) triples; dict values are JSON-encoded."""
    encoded = [(t, k, v if isinstance(v, bytes) else orjson.dumps(v)) for t, k, v in items]
    asyncio.run(_produce(bootstrap, encoded))


def collect(bootstrap: str, topic: str, until: Callable[[list[dict[str, Any]]], bool], timeout: float = 60,
            raw: bool = False) -> list[Any]:
    """Read ``topic`` from the beginning until ``until(records)`` holds or ``timeout`` passes."""

    async def run() -> list[Any]:
        c = AIOKafkaConsumer(topic, bootstrap_servers=bootstrap, auto_offset_reset="earliest",
                             group_id=None, enable_auto_commit=False)
        await c.start()
        out: list[Any] = []
        try:
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                batch = await c.getmany(timeout_ms=300)
                for msgs in batch.values():
                    for m in msgs:
                        out.append(m if raw else orjson.loads(m.value))
                if until(out):
                    break
        finally:
            await c.stop()
        return out

    return asyncio.run(run())


def lose_gpus(bootstrap: str, worker: Worker, nodes: list[str], now: float | None = None) -> None:
    """Node i loses GPU i (Xid 79, off the bus): a hardware verdict and an isolation each."""
    now = time.time() if now is None else now
    items = []
    for i, n in enumerate(nodes):
        lost = [False] * GPUS
        lost[i % GPUS] = True
        items.append((worker.topic("telemetry.gpu"), n, gpu_sample(n, now + i, lost=lost, xids=[(i % GPUS, 79)])))
    produce(bootstrap, items)


# ------------------------------------------------------------------------------ the API


def api_call(worker: Worker, method: str, path: str, token: str | None = None, body: Any = None) -> tuple[int, Any]:
    """One request to a worker's HTTP API: (status, decoded JSON body)."""
    port = worker.env["FLEETMEDIC_WORKER__WEB_PORT"]
    data = json.dumps(body).encode() if body is not None else (b"" if method in ("POST", "PUT") else None)
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=data, method=method)
    req.add_header("Content-Type", "application/json")
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=15) as r:
            return r.status, json.loads(r.read() or b"null")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"null")


def wait_for(fn: Callable[[], Any], timeout: float = 20.0) -> Any:
    """Poll ``fn`` until it answers something true or ``timeout`` passes; its last answer."""
    end = time.time() + timeout
    while True:
        v = fn()
        if v or time.time() > end:
            return v
        time.sleep(0.3)
