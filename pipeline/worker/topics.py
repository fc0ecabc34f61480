"""Topic names and their creation on the broker (idempotent)."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from pipeline.config import Settings

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TopicSpec:
    name: str
    partitions: int
    compacted: bool = False


#: The worker's Faust tables and the partitions setting each is co-partitioned with.
TABLES = {
    "node_to_health": "partitions",
    "job_to_history": "partitions",
    "switch_to_state": "partitions",
    "action_to_outcome": "decision_partitions",
    "breaker_state": "decision_partitions",
    "action_pending": "decision_partitions",
}


def changelog_specs(s: Settings) -> dict[str, TopicSpec]:
    """The tables' changelog topics, named as Faust names them (``<app id>-<table>-changelog``).

    They are created up front with the partitions of their source topics: left to the
    broker's auto-creation (its default partition count) a table's first write could
    create a changelog that no longer matches its source topic.
    """
    return {
        f"changelog.{t}": TopicSpec(f"{s.kafka.app_id}-{t}-changelog", getattr(s.kafka, attr), compacted=True)
        for t, attr in TABLES.items()
    }


def faust_specs(s: Settings) -> dict[str, TopicSpec]:
    """Every topic the Faust app would otherwise declare itself: the tables' changelogs and
    the leader assignor's topic (``<app id>-__assignor-__leader``, one partition).

    The worker runs with Faust's topic declaration off (``topic_allow_declare=False``):
    Faust sends its CreateTopics to the broker that the metadata names as controller,
    without a retry, so a worker starting while that broker is down crashed.
    :func:`ensure_topics` creates them instead, retried with backoff."""
    return {**changelog_specs(s), "assignor.leader": TopicSpec(f"{s.kafka.app_id}-__assignor-__leader", 1)}


#: topics that keep the latest record of each key (operator decisions: pipeline.actuate.control)
COMPACTED = frozenset({"control"})


def topic_specs(s: Settings) -> dict[str, TopicSpec]:
    """Every topic fleetmedic reads or writes, by its short name."""
    p, d = s.kafka.partitions, s.kafka.decision_partitions
    return {
        short: TopicSpec(s.topic(short), parts, compacted=short in COMPACTED)
        for short, parts in {
            "telemetry.gpu": p,
            "telemetry.network": p,
            "telemetry.job": p,
            "anomalies": p,
            "verdicts": d,
            "actions": d,
            "internal.actions": d,
            "deadletter": 1,
            "internal.node-notices": p,
            "internal.job-notices": p,
            "internal.switch-notices": p,
            "control": 1,
        }.items()
    }


async def ensure_topics(s: Settings, *, timeout: float = 60.0) -> list[str]:
    """Create missing topics; return the names created.  Existing topics are left as they are.

    Retried with backoff until ``timeout``: while the broker starts, and while one broker of
    a cluster is down (the admin client may have picked it for its request)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    delay = 0.5
    while True:
        try:
            return await _ensure_topics_once(s, timeout, deadline)
        except Exception as exc:  # unreachable, or a broker of the cluster down: retry until the deadline
            if loop.time() + delay > deadline:
                raise ConnectionError(f"cannot create the topics on Kafka at {s.kafka.bootstrap}: {exc}") from exc
            log.warning("Kafka at %s not ready for the topics (%s); retrying in %.1fs", s.kafka.bootstrap,
                        exc or type(exc).__name__, delay)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 5.0)


async def _ensure_topics_once(s: Settings, timeout: float, deadline: float) -> list[str]:
    from aiokafka.admin import AIOKafkaAdminClient, NewTopic
    from aiokafka.errors import TopicAlreadyExistsError

    specs = {**topic_specs(s), **faust_specs(s)}
    admin = AIOKafkaAdminClient(bootstrap_servers=s.kafka.bootstrap, request_timeout_ms=int(timeout * 1000))
    try:
        await admin.start()
        existing = set(await admin.list_topics())
        new = [
            NewTopic(name=t.name, num_partitions=t.partitions, replication_factor=s.kafka.replication,
                     topic_configs={"cleanup.policy": "compact"} if t.compacted else {})
            for t in specs.values()
            if t.name not in existing
        ]
        if new:
            try:
                await admin.create_topics(new)
            except TopicAlreadyExistsError:
                pass
            await _wait_for_leaders(admin, [t.name for t in new], deadline)
        return [t.name for t in new]
    finally:
        await admin.close()


async def _wait_for_leaders(admin, names: list[str], deadline: float) -> None:
    """Wait until every partition of the new topics has a leader (clients then start cleanly)."""
    loop = asyncio.get_running_loop()
    while loop.time() < deadline:
        try:
            described = await admin.describe_topics(names)
        except Exception:  # metadata not there yet
            described = []
        ready = len(described) == len(names) and all(
            t.get("error_code", 0) == 0 and t.get("partitions")
            and all(p.get("leader", -1) >= 0 for p in t["partitions"])
            for t in described
        )
        if ready:
            return
        await asyncio.sleep(0.2)
