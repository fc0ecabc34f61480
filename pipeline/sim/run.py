"""Run the simulated cluster against a Kafka broker and a fleetmedic worker.

The runner produces the cluster's telemetry, serves its cluster API, follows the
``anomalies``, ``verdicts`` and ``actions`` topics as any consumer would (printing a
readable live log), and at the end scores the decisions against the ground truth.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from typing import Any, TextIO

import orjson
from aiohttp import web
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer

from pipeline.config import Settings
from pipeline.sim.cluster import Cluster, SimConfig, score

log = logging.getLogger("fleetmedic.sim")


class LiveLog:
    """One readable line per anomaly, verdict and action."""

    def __init__(self, out: TextIO, t0: float, *, anomalies: bool = True, repeat_after: float = 120.0) -> None:
        self.out, self.t0, self.show_anomalies = out, t0, anomalies
        self.repeat_after = repeat_after
        self._shown: dict[tuple[str, str], float] = {}
        self.suppressed = 0

    def line(self, ts: float, kind: str, text: str) -> None:
        self.out.write(f"[sim {ts - self.t0:7.0f}s] {kind:<8} {text}\n")
        self.out.flush()

    def anomaly(self, a: dict[str, Any]) -> None:
        key = (a["subject"], a["kind"])
        last = self._shown.get(key)
        if last is not None and a["ts"] - last < self.repeat_after:
            self.suppressed += 1  # the same finding again: shown once per repeat_after seconds
            return
        self._shown[key] = a["ts"]
        if self.show_anomalies:
            ev = a.get("evidence", {})
            detail = ", ".join(f"{k}={v}" for k, v in list(ev.items())[:3])
            self.line(a["ts"], "ANOMALY", f"{a['subject']:<18} {a['kind']:<18} {a['severity']:<8} {detail}")

    def verdict(self, v: dict[str, Any]) -> None:
        acts = ", ".join(f"{x['action']} {x['target']}" for x in v.get("actions", []))
        self.line(v["ts"], "VERDICT", f"{v['scope']:<4} {v['subject']:<18} {v['fault_class']:<18} -> {acts}")

    def action(self, a: dict[str, Any]) -> None:
        self.line(a["ts"], "ACTION", f"{a['action']:<8} {a['target']:<18} {a['outcome']:<14} {a.get('detail', '')[:80]}")


class SimRunner:
    def __init__(self, settings: Settings, cfg: SimConfig, *, api_host: str = "127.0.0.1", api_port: int = 7070,
                 out: TextIO = sys.stdout, show_anomalies: bool = True) -> None:
        self.s, self.cfg = settings, cfg
        self.api_host, self.api_port = api_host, api_port
        self.cluster = Cluster(cfg)
        self.out = out
        self.live = LiveLog(out, self.cluster.t0, anomalies=show_anomalies)
        self.verdicts: list[dict[str, Any]] = []
        self.actions: list[dict[str, Any]] = []
        self.anomalies: list[dict[str, Any]] = []
        self._runner: web.AppRunner | None = None

    # ---------------------------------------------------------------------- cluster API

    async def _post_action(self, request: web.Request) -> web.Response:
        try:
            body = await request.json()
        except Exception:
            return web.json_response({"error": "body is not JSON"}, status=400)
        status, data = self.cluster.act(body)
        return web.json_response(data, status=status)

    async def _get_node(self, request: web.Request) -> web.Response:
        n = self.cluster.nodes.get(request.match_info["name"])
        if n is None:
            return web.json_response({"error": "no such node"}, status=404)
        return web.json_response({"name": n.name, "cordoned": n.cordoned, "job": n.job,
                                  "diagnosing": n.diag_started is not None, "escalated": n.escalated})

    async def start_api(self) -> None:
        app = web.Application()
        app.router.add_post("/actions", self._post_action)
        app.router.add_get("/nodes/{name}", self._get_node)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.api_host, self.api_port)
        await site.start()

    # ---------------------------------------------------------------------- output follower

    async def _follow(self, consumer: AIOKafkaConsumer, stop: asyncio.Event) -> None:
        names = {self.s.topic("verdicts"): "verdicts", self.s.topic("actions"): "actions",
                 self.s.topic("anomalies"): "anomalies"}
        while not stop.is_set():
            batch = await consumer.getmany(timeout_ms=200)
            for tp, msgs in batch.items():
                kind = names[tp.topic]
                for m in msgs:
                    try:
                        rec = orjson.loads(m.value)
                    except orjson.JSONDecodeError:
                        continue
                    if rec.get("ts", 0) < self.cluster.t0 - 1:
                        continue  # an earlier run's record
                    if kind == "verdicts":
                        self.verdicts.append(rec)
                        self.live.verdict(rec)
                    elif kind == "actions":
                        self.actions.append(rec)
                        self.live.action(rec)
                    else:
                        self.anomalies.append(rec)
                        self.live.anomaly(rec)

    # ---------------------------------------------------------------------- main loop

    async def run(self, *, ready: Any = None, drain_s: float = 8.0) -> dict[str, Any]:
        await self.start_api()
        producer = AIOKafkaProducer(bootstrap_servers=self.s.kafka.bootstrap, linger_ms=20,
                                    max_batch_size=256 * 1024, acks=1)
        consumer = AIOKafkaConsumer(
            self.s.topic("verdicts"), self.s.topic("actions"), self.s.topic("anomalies"),
            bootstrap_servers=self.s.kafka.bootstrap, auto_offset_reset="latest", enable_auto_commit=False,
            group_id=None,
        )
        await producer.start()
        await consumer.start()
        stop = asyncio.Event()
        follower = asyncio.create_task(self._follow(consumer, stop))
        try:
            # make sure the follower has its positions before the first record is produced
            await consumer.seek_to_end()
            if ready is not None:
                await ready()
            c = self.cluster
            c.t0 = time.time()
            self.live.t0 = c.t0
            steps = int(self.cfg.duration * self.cfg.speed)
            interval = 1.0 / self.cfg.speed
            start = time.monotonic()
            self.out.write(f"simulating {self.cfg.nodes} nodes x 8 GPUs for {steps} simulated seconds "
                           f"({self.cfg.duration:.0f}s at {self.cfg.speed:g}x), {len(c.faults)} faults planned\n")
            for i in range(steps):
                c.tick()
                batch, c.out = c.out, []
                for topic, key, value in batch:
                    await producer.send(self.s.topic(topic), key=key.encode(), value=value)
                target = start + (i + 1) * interval
                delay = target - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)
                if (i + 1) % int(max(1, steps // 10)) == 0:
                    log.info("sim %d/%d s, %d verdicts, %d actions so far", i + 1, steps, len(self.verdicts), len(self.actions))
            await producer.flush()
            # let the pipeline finish what is in flight
            deadline = time.monotonic() + drain_s
            last = (len(self.verdicts), len(self.actions))
            while time.monotonic() < deadline:
                await asyncio.sleep(1.0)
                now = (len(self.verdicts), len(self.actions))
                if now == last and time.monotonic() > deadline - drain_s / 2:
                    break
                last = now
        finally:
            stop.set()
            await follower
            await consumer.stop()
            await producer.stop()
            if self._runner is not None:
                await self._runner.cleanup()
        return score(self.cluster, self.verdicts, self.actions)
