"""AlertDispatcher against real aiohttp receivers on 127.0.0.1 (ephemeral ports)."""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import jsonschema
import pytest
import pytest_asyncio
import yaml
from aiohttp import web
from aiohttp.test_utils import TestServer

from actuators.alerts import (AlertDispatcher, Receiver, alertmanager_api_alerts, alertmanager_body, body_for,
                              cloudevent_body)
from actuators.retry import RetryPolicy
from actuators.webhook import IDEMPOTENCY_HEADER, SIGNATURE_HEADER, verify
from schemas import ActionName, ActionRecord, FaultClass, Outcome, PlannedAction, Verdict

SECRET = "hook-secret"
#: Alertmanager v0.35.0's own API document (tests/fixtures/alertmanager/README.md)
AM_OPENAPI = Path(__file__).resolve().parents[2] / "fixtures" / "alertmanager" / "openapi.yaml"
FAST = RetryPolicy(max_attempts=4, base_delay=0.01, max_delay=0.05, jitter=0.0)


def verdict(i: int = 1, fc: FaultClass = FaultClass.gpu_hardware) -> Verdict:
    return Verdict(ts=1_800_000_000.0 + i, id=f"v{i:04d}", incident=f"inc{i}", scope="node", subject=f"node-{i:03d}",
                   fault_class=fc, confidence=0.95, evidence={"kind": "xid", "xid": 79},
                   actions=[PlannedAction(action=ActionName.isolate, target=f"node-{i:03d}")],
                   job="train-7", nodes=[f"node-{i:03d}"])


@dataclass
class Sink:
    """A webhook receiver: what it got, and the statuses it answers next (default 200)."""

    server: TestServer
    received: list[tuple[dict[str, str], bytes]] = field(default_factory=list)
    answers: list[int] = field(default_factory=list)
    hold: asyncio.Event | None = None  # set: answer; unset: hang

    @property
    def url(self) -> str:
        return str(self.server.make_url("/hook"))

    def ok(self) -> list[bytes]:
        return [b for _, b in self.received]


async def _sink() -> Sink:
    app = web.Application()
    s = Sink(server=TestServer(app, host="127.0.0.1", port=0))

    async def hook(request: web.Request) -> web.Response:
        body = await request.read()
        if s.hold is not None:
            await s.hold.wait()
        status = s.answers.pop(0) if s.answers else 200
        if status == 200:
            s.received.append((dict(request.headers), body))
        return web.Response(status=status, text="ok" if status == 200 else "unavailable")

    app.router.add_post("/hook", hook)
    await s.server.start_server()
    return s


@pytest_asyncio.fixture
async def sink() -> AsyncIterator[Sink]:
    s = await _sink()
    try:
        yield s
    finally:
        await s.server.close()


def _closed_port() -> int:
    with socket.socket() as so:
        so.bind(("127.0.0.1", 0))
        return so.getsockname()[1]


async def _until(cond, timeout: float = 10.0) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not cond():
        if loop.time() > end:
            raise AssertionError("condition not reached")
        await asyncio.sleep(0.01)


# ------------------------------------------------------------------ payloads


def test_alertmanager_body_has_the_webhook_fields() -> None:
    b = alertmanager_body(verdict(3), source="fleetmedic-test", external_url="http://127.0.0.1:6066")
    assert b["version"] == "4" and b["status"] == "firing"
    a = b["alerts"][0]
    assert a["labels"]["alertname"] == "FleetmedicVerdict"
    assert a["labels"]["severity"] == "critical"
    assert a["labels"]["fault_class"] == "gpu_hardware" and a["labels"]["subject"] == "node-003"
    assert a["startsAt"] == "2027-01-15T08:00:03Z"
    assert a["annotations"]["verdict_id"] == "v0003"
    assert a["generatorURL"].endswith("/fleetmedic/verdicts/v0003")
    assert len(a["fingerprint"]) == 16


def test_cloudevent_body_is_a_cloudevent_with_the_verdict() -> None:
    v = verdict(4, FaultClass.transient_software)
    e = cloudevent_body(v, source="fleetmedic-test")
    assert {"specversion", "id", "source", "type", "time"} <= set(e)
    assert e["specversion"] == "1.0" and e["id"] == "v0004" and e["type"] == "io.fleetmedic.verdict"
    assert e["severity"] == "critical"  # it isolates a node
    assert Verdict.model_validate(e["data"]).id == v.id


def _postable_alerts_schema() -> dict:
    """``postableAlerts`` of Alertmanager's Swagger document, with its definitions, as a
    JSON Schema (Swagger 2.0 definitions are JSON Schema draft 4)."""
    doc = yaml.safe_load(AM_OPENAPI.read_text())
    return {"$ref": "#/definitions/postableAlerts", "definitions": doc["definitions"]}


def _returned(i: int) -> Verdict:
    v = verdict(i)
    return v.model_copy(update={"id": f"r{i:04d}", "ts": v.ts + 600.0, "fault_class": FaultClass.unknown,
                                "actions": [PlannedAction(action=ActionName.return_, target=v.subject)]})


def test_alertmanager_api_alerts_are_what_alertmanager_accepts() -> None:
    """Isolation, return and a job verdict, checked against Alertmanager's own API
    document; the return carries the same labels as the isolation (Alertmanager's
    identity of an alert), resolved at the verdict's time."""
    schema = _postable_alerts_schema()
    fmt = jsonschema.Draft4Validator.FORMAT_CHECKER
    job = verdict(5, FaultClass.user_error).model_copy(update={
        "scope": "job", "subject": "train-7", "actions": [PlannedAction(action=ActionName.stop, target="train-7")]})
    for v in (verdict(3), _returned(3), job):
        for url in ("", "http://127.0.0.1:6066"):
            alerts = alertmanager_api_alerts(v, source="fleetmedic-test", external_url=url)
            jsonschema.validate(alerts, schema, format_checker=fmt)
            assert all(isinstance(x, str) for a in alerts for x in a["annotations"].values())
    fired, = alertmanager_api_alerts(verdict(3), source="fm", hold_s=7200)
    resolved, = alertmanager_api_alerts(_returned(3), source="fm")
    assert fired["labels"] == resolved["labels"] == {"alertname": "FleetmedicNodeOutOfService", "node": "node-003",
                                                     "severity": "critical", "source": "fm"}
    assert (fired["startsAt"], fired["endsAt"]) == ("2027-01-15T08:00:03Z", "2027-01-15T10:00:03Z")
    assert resolved["endsAt"] == resolved["startsAt"] == "2027-01-15T08:10:03Z"
    assert fired["annotations"]["verdict_id"] == "v0003" and fired["annotations"]["fault_class"] == "gpu_hardware"
    event, = alertmanager_api_alerts(job, source="fm", event_s=60)
    assert event["labels"]["alertname"] == "FleetmedicVerdict" and event["labels"]["subject"] == "train-7"
    assert event["labels"]["fault_class"] == "user_error" and event["endsAt"] == "2027-01-15T08:01:05Z"


def test_an_alert_that_breaks_alertmanagers_schema_is_caught_by_the_check() -> None:
    """The check above can fail: a number among the annotations, or no labels, is refused."""
    schema = _postable_alerts_schema()
    good = alertmanager_api_alerts(verdict(3), source="fm")
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{**good[0], "annotations": {"confidence": 0.95}}], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{k: v for k, v in good[0].items() if k != "labels"}], schema)


def test_an_alertmanager_api_receiver_posts_to_its_alerts_api() -> None:
    r = Receiver("am", "http://127.0.0.1:9093", format="alertmanager-api")
    assert r.endpoint == "http://127.0.0.1:9093/api/v2/alerts"
    assert Receiver("am", "http://am:9093/api/v2/alerts/", format="alertmanager-api").endpoint == \
        "http://am:9093/api/v2/alerts/"
    assert Receiver("hook", "http://127.0.0.1:9/hook").endpoint == "http://127.0.0.1:9/hook"
    body = json.loads(body_for(r, verdict(2), source="fm"))
    assert isinstance(body, list) and body[0]["labels"]["node"] == "node-002"
    with pytest.raises(ValueError, match="hold_s"):
        Receiver("am", "http://127.0.0.1:9093", format="alertmanager-api", hold_s=0)


def test_bad_receiver_config_is_refused() -> None:
    with pytest.raises(ValueError, match="format"):
        Receiver("a", "http://127.0.0.1:1/hook", format="slack")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="url"):
        Receiver("a", "ftp://127.0.0.1/hook")
    with pytest.raises(ValueError, match="unique"):
        AlertDispatcher([Receiver("a", "http://127.0.0.1:1/"), Receiver("a", "http://127.0.0.1:2/")])


# ------------------------------------------------------------------ delivery


@pytest.mark.parametrize("fmt", ["alertmanager", "cloudevents"])
@pytest.mark.asyncio
async def test_signature_verifies_and_names_the_verdict(sink: Sink, fmt: str) -> None:
    outcomes: list[ActionRecord] = []

    async def on_outcome(r: ActionRecord) -> None:
        outcomes.append(r)

    d = AlertDispatcher([Receiver("ops", sink.url, format=fmt, secret=SECRET)], on_outcome=on_outcome, retry=FAST)
    d.submit(verdict(1))
    await _until(lambda: outcomes)
    await d.stop()
    (headers, body), = sink.received
    assert verify(SECRET, body, headers[SIGNATURE_HEADER])
    assert not verify("another-secret", body, headers[SIGNATURE_HEADER])
    assert headers[IDEMPOTENCY_HEADER] == "v0001"
    doc = json.loads(body)
    assert (doc["alerts"][0]["annotations"]["verdict_id"] if fmt == "alertmanager" else doc["id"]) == "v0001"
    rec, = outcomes
    assert rec.outcome is Outcome.applied and rec.backend == "webhook:ops" and rec.action is ActionName.escalate
    assert rec.verdict_id == "v0001" and rec.attempts == 1


@pytest.mark.asyncio
async def test_a_receiver_failing_twice_gets_exactly_one_delivery_per_verdict(sink: Sink) -> None:
    outcomes: list[ActionRecord] = []

    async def on_outcome(r: ActionRecord) -> None:
        outcomes.append(r)

    sink.answers = [503, 503]  # the first verdict's first two posts fail, then everything succeeds
    d = AlertDispatcher([Receiver("ops", sink.url, secret=SECRET)], on_outcome=on_outcome, retry=FAST)
    for i in (1, 2, 3):
        d.submit(verdict(i))
    d.submit(verdict(1))  # the same verdict again (a replay): not delivered twice
    d.submit(verdict(2))
    await _until(lambda: len(outcomes) == 3)
    await d.stop()
    ids = [json.loads(b)["alerts"][0]["annotations"]["verdict_id"] for b in sink.ok()]
    assert sorted(ids) == ["v0001", "v0002", "v0003"]
    by_verdict = {r.verdict_id: r for r in outcomes}
    assert by_verdict["v0001"].attempts == 3 and by_verdict["v0001"].outcome is Outcome.applied
    assert by_verdict["v0002"].attempts == 1
    assert d.stats["duplicates"] == 2 and d.stats["delivered"] == 3


@pytest.mark.asyncio
async def test_a_dead_receiver_delays_nothing(sink: Sink) -> None:
    outcomes: list[ActionRecord] = []

    async def on_outcome(r: ActionRecord) -> None:
        outcomes.append(r)

    hung = await _sink()
    hung.hold = asyncio.Event()  # accepts the connection and never answers
    dead = Receiver("dead", f"http://127.0.0.1:{_closed_port()}/hook")
    slow = Receiver("hung", hung.url, timeout_s=30.0)
    d = AlertDispatcher([dead, slow, Receiver("ops", sink.url)], on_outcome=on_outcome, retry=FAST)
    try:
        for i in range(1, 6):
            d.submit(verdict(i))  # returns at once: nothing here awaits a receiver
        # the healthy receiver gets all five while the hung one still holds its first post
        await _until(lambda: len(sink.received) == 5)
        assert len(hung.received) == 0 and d._queues["hung"].qsize() == 4
        # the dead receiver's deliveries are given up after the retries and reported, not dropped
        await _until(lambda: sum(1 for r in outcomes if r.backend == "webhook:dead") == 5)
        dead_recs = [r for r in outcomes if r.backend == "webhook:dead"]
        assert all(r.outcome is Outcome.failed and r.attempts == FAST.max_attempts for r in dead_recs)
        assert "gave up" in dead_recs[0].detail
    finally:
        hung.hold.set()
        await d.stop(drain_s=0.5)
        await hung.server.close()


@pytest.mark.asyncio
async def test_a_rejected_alert_is_not_retried(sink: Sink) -> None:
    outcomes: list[ActionRecord] = []

    async def on_outcome(r: ActionRecord) -> None:
        outcomes.append(r)

    sink.answers = [400]
    d = AlertDispatcher([Receiver("ops", sink.url)], on_outcome=on_outcome, retry=FAST)
    d.submit(verdict(9))
    await _until(lambda: outcomes)
    await d.stop()
    assert outcomes[0].outcome is Outcome.failed and outcomes[0].detail.startswith("permanent")
    assert sink.answers == [] and sink.received == []


@pytest.mark.asyncio
async def test_a_full_queue_is_reported_not_dropped(sink: Sink) -> None:
    outcomes: list[ActionRecord] = []

    async def on_outcome(r: ActionRecord) -> None:
        outcomes.append(r)

    sink.hold = asyncio.Event()
    d = AlertDispatcher([Receiver("ops", sink.url)], on_outcome=on_outcome, retry=FAST, queue_size=2)
    for i in range(1, 6):
        d.submit(verdict(i))  # two fit in the queue, three do not
    await _until(lambda: len(outcomes) >= 3)
    full = [r for r in outcomes if "full" in r.detail]
    assert sorted(r.verdict_id for r in full) == ["v0003", "v0004", "v0005"]
    assert all(r.outcome is Outcome.failed for r in full)
    sink.hold.set()
    await _until(lambda: len(sink.received) == 2)
    assert d.stats["queue_full"] == 3
    d.submit(verdict(3))  # a verdict refused for a full queue is not marked as seen: it can come again
    await _until(lambda: len(sink.received) == 3)
    await d.stop()


@pytest.mark.asyncio
async def test_only_wanted_verdicts_alert(sink: Sink) -> None:
    d = AlertDispatcher([Receiver("ops", sink.url)], retry=FAST,
                        want=lambda v: v.fault_class is not FaultClass.transient_software)
    d.submit(verdict(1, FaultClass.transient_software))
    d.submit(verdict(2, FaultClass.gpu_memory))
    await _until(lambda: len(sink.received) == 1)
    await d.stop()
    assert json.loads(sink.ok()[0])["alerts"][0]["labels"]["fault_class"] == "gpu_memory"
