"""Smoke tests: the embedded broker works with the client stack we ship.

1. aiokafka: produce 100 records to a fresh 8-partition topic, read them all
   back in a consumer group and commit offsets.
2. Faust: a worker subprocess (agent -> Table -> output topic) processes
   records; results are checked with an aiokafka consumer. A second worker
   run must resume from the committed offsets and recover the table from its
   changelog topic.
3. The same restart on a slow machine (the seek to the committed offsets takes a
   second, the agent 50 ms a record): the backlog waiting for the second worker must
   not lose a record (``pipeline/worker/faust_fixes.py``).

Both use fresh topic/group names, so they can run against a long-lived broker.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from collections import Counter
from pathlib import Path

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient, NewTopic

from pipeline.worker.procs import free_port

PARTITIONS = 8


async def _create_topic(bootstrap: str, name: str, partitions: int = PARTITIONS) -> None:
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        await admin.create_topics(
            [NewTopic(name=name, num_partitions=partitions, replication_factor=1)]
        )
    finally:
        await admin.close()


async def _aiokafka_roundtrip(bootstrap: str) -> None:
    suffix = uuid.uuid4().hex[:8]
    topic, group = f"smoke-aiokafka-{suffix}", f"smoke-group-{suffix}"
    await _create_topic(bootstrap, topic)

    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all")
    await producer.start()
    try:
        sent = []
        for i in range(100):
            md = await producer.send_and_wait(topic, key=f"k{i % 13}".encode(), value=f"v{i}".encode())
            sent.append(md.partition)
    finally:
        await producer.stop()
    assert len(set(sent)) > 1, "records should spread over several partitions"

    consumer = AIOKafkaConsumer(
        topic,
        bootstrap_servers=bootstrap,
        group_id=group,
        auto_offset_reset="earliest",
        enable_auto_commit=False,
    )
    await consumer.start()
    try:
        got: list[bytes] = []
        deadline = time.monotonic() + 60
        while len(got) < 100 and time.monotonic() < deadline:
            batches = await consumer.getmany(timeout_ms=1000)
            for records in batches.values():
                got.extend(r.value for r in records)
        assert sorted(got) == sorted(f"v{i}".encode() for i in range(100))
        await consumer.commit()
        partitions = consumer.assignment()
        assert len(partitions) == PARTITIONS
        committed = {tp: await consumer.committed(tp) for tp in partitions}
    finally:
        await consumer.stop()
    assert sum(committed.values()) == 100, committed


def test_aiokafka_produce_consume_commit(kafka_bootstrap: str) -> None:
    asyncio.run(_aiokafka_roundtrip(kafka_bootstrap))


FAUST_APP = textwrap.dedent(
    """
    import os

    import asyncio

    import faust
    from faust.transport.consumer import Consumer

    import pipeline.worker.faust_fixes  # noqa: F401  (shipped with every fleetmedic worker)

    SUFFIX = os.environ["SMOKE_SUFFIX"]
    SEEK_DELAY = float(os.environ.get("SMOKE_SEEK_DELAY", "0"))
    PROCESS_DELAY = float(os.environ.get("SMOKE_PROCESS_DELAY", "0"))

    if SEEK_DELAY:
        # a slow machine: the seek to the committed offsets returns late
        _perform_seek = Consumer.perform_seek

        async def perform_seek(self):
            await _perform_seek(self)
            await asyncio.sleep(SEEK_DELAY)

        Consumer.perform_seek = perform_seek

    app = faust.App(
        f"smoke-faust-{SUFFIX}",
        broker=f"kafka://{os.environ['SMOKE_BOOTSTRAP']}",
        store="memory://",
        datadir=os.environ["SMOKE_DATADIR"],
        web_enabled=False,
        topic_partitions=8,
        topic_replication_factor=1,
        broker_commit_every=1,
        broker_commit_interval=0.5,
    )


    class Event(faust.Record, serializer="json"):
        key: str
        n: int


    source = app.topic(f"smoke-faust-in-{SUFFIX}", value_type=Event, partitions=8)
    sink = app.topic(f"smoke-faust-out-{SUFFIX}", partitions=8, value_serializer="json")
    counts = app.Table("counts", default=int, partitions=8)


    @app.agent(source)
    async def count(stream):
        async for event in stream:
            if PROCESS_DELAY:
                await asyncio.sleep(PROCESS_DELAY)
            counts[event.key] += 1
            await sink.send(
                key=event.key.encode(),
                value={"key": event.key, "n": event.n, "count": counts[event.key]},
            )


    if __name__ == "__main__":
        app.main()
    """
)


async def _produce_events(bootstrap: str, topic: str, events: list[dict]) -> None:
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all")
    await producer.start()
    try:
        for ev in events:
            await producer.send_and_wait(topic, key=ev["key"].encode(), value=json.dumps(ev).encode())
    finally:
        await producer.stop()


async def _collect(bootstrap: str, topic: str, want: int, proc: subprocess.Popen, timeout: float) -> list[dict]:
    consumer = AIOKafkaConsumer(
        topic,
        bootstrap_servers=bootstrap,
        group_id=None,
        auto_offset_reset="earliest",
        metadata_max_age_ms=1000,
    )
    await consumer.start()
    out: list[dict] = []
    try:
        deadline = time.monotonic() + timeout
        while len({r["n"] for r in out}) < want and time.monotonic() < deadline:
            if proc.poll() is not None:
                break
            batches = await consumer.getmany(timeout_ms=1000)
            for records in batches.values():
                out.extend(json.loads(r.value) for r in records)
    finally:
        await consumer.stop()
    return out


def _start_worker(app_py: Path, env: dict[str, str], log_path: Path) -> subprocess.Popen:
    # the worker command opens its web server even with web_enabled=False: on loopback,
    # on a free port, so that two workers (or a leftover one) never collide on 6066
    web = ["--web-port", str(free_port()), "--web-bind", "127.0.0.1", "--web-host", "127.0.0.1"]
    with log_path.open("w") as log:
        return subprocess.Popen(
            [sys.executable, str(app_py), "worker", "-l", "warn", *web],
            cwd=app_py.parent,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def _stop_worker(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _check_counts(out: list[dict], events: list[dict], log_path: Path, proc: subprocess.Popen) -> None:
    """Every event was processed and each key's table count reached its total.

    Faust is at-least-once: a restart may replay events whose offsets were not yet
    committed, so a result may repeat; none may be missing, and the recovered table
    must carry the counts on from where the changelog left them.
    """
    seen = {r["n"] for r in out}
    assert seen == {ev["n"] for ev in events}, (
        f"missing {sorted({ev['n'] for ev in events} - seen)}; worker rc={proc.returncode}; "
        f"worker log tail:\n{log_path.read_text()[-4000:]}"
    )
    for key, total in Counter(ev["key"] for ev in events).items():
        counts = sorted({r["count"] for r in out if r["key"] == key})
        assert counts[-1] >= total, (key, counts)
        assert counts == list(range(1, counts[-1] + 1)), (key, counts)


def _restart_scenario(bootstrap: str, tmp_path: Path, timeout: float, **knobs: str) -> None:
    """60 records through a worker; 30 more produced while it is down; a second worker
    must process them all, carrying the table's counts on from its changelog."""
    suffix = uuid.uuid4().hex[:8]
    source, sink = f"smoke-faust-in-{suffix}", f"smoke-faust-out-{suffix}"
    app_py = tmp_path / "smoke_app.py"
    app_py.write_text(FAUST_APP)
    env = dict(
        os.environ,
        SMOKE_SUFFIX=suffix,
        SMOKE_BOOTSTRAP=bootstrap,
        SMOKE_DATADIR=str(tmp_path / "faust-data"),
        **knobs,
    )
    events = [{"key": f"gpu-{i % 6}", "n": i} for i in range(60)]
    asyncio.run(_create_topic(bootstrap, source))
    asyncio.run(_produce_events(bootstrap, source, events))

    log1 = tmp_path / "worker1.log"
    proc = _start_worker(app_py, env, log1)
    try:
        out = asyncio.run(_collect(bootstrap, sink, len(events), proc, timeout=timeout))
    finally:
        _stop_worker(proc)
    _check_counts(out, events, log1, proc)

    more = [{"key": f"gpu-{i % 6}", "n": i} for i in range(60, 90)]
    asyncio.run(_produce_events(bootstrap, source, more))
    log2 = tmp_path / "worker2.log"
    proc = _start_worker(app_py, env, log2)
    try:
        out = asyncio.run(_collect(bootstrap, sink, len(events) + len(more), proc, timeout=timeout))
    finally:
        _stop_worker(proc)
    _check_counts(out, events + more, log2, proc)


def test_faust_worker_agent_table(kafka_bootstrap: str, tmp_path: Path) -> None:
    """Agent + Table + sink; then a restart must resume from committed
    offsets and recover the table from its changelog topic."""
    _restart_scenario(kafka_bootstrap, tmp_path, timeout=150)


def test_restart_with_a_slow_seek_loses_no_record(kafka_bootstrap: str, tmp_path: Path) -> None:
    """Without ``pipeline.worker.faust_fixes`` this loses about 20 of the 30 waiting records:
    they reach the stream queue after the seek and are cleared when recovery resumes
    the flow."""
    _restart_scenario(kafka_bootstrap, tmp_path, timeout=90, SMOKE_SEEK_DELAY="1", SMOKE_PROCESS_DELAY="0.05")
