"""Alert webhooks: one delivery per verdict, in the background, to Alertmanager-style or
CloudEvents receivers.

:class:`AlertDispatcher` takes verdicts from the actuation agent (:meth:`submit` never
waits on the network) and delivers each to every configured :class:`Receiver` from its
own queue and task, so a receiver that is slow or down delays neither the pipeline nor
the other receivers:

* ``format = "alertmanager"``: the JSON body Prometheus Alertmanager posts to its webhook
  receivers (``version: "4"``, ``status``, ``alerts: [{labels, annotations, startsAt,
  endsAt, generatorURL, fingerprint}]``, group labels), so tools that already take
  Alertmanager webhooks take fleetmedic's;
* ``format = "cloudevents"``: a CloudEvents 1.0 event in structured JSON mode
  (``specversion``, ``id`` = the verdict id, ``source``, ``type =
  io.fleetmedic.verdict``, ``time``, ``subject``, ``data`` = the verdict), sent with
  ``Content-Type: application/cloudevents+json``;
* ``format = "alertmanager-api"``: alerts posted to an Alertmanager itself, as Prometheus
  posts them (``POST <url>/api/v2/alerts``, a list of ``{labels, annotations, startsAt,
  endsAt, generatorURL}``), so that its routes, grouping, silences and inhibitions apply
  (see :func:`alertmanager_api_alerts`). A node that a verdict takes out of service is one
  alert, ``FleetmedicNodeOutOfService{node}``, firing until a verdict returns the node to
  service, which resolves it; any other verdict is a ``FleetmedicVerdict`` alert that
  resolves by itself after ``event_s``.

Every body is signed when the receiver has a secret: ``X-Fleetmedic-Signature:
t=<Unix seconds>,sha256=<hex HMAC-SHA256 of "<t>." + body>`` (see
:func:`actuators.webhook.verify`, which refuses a signature older than 5 minutes), and
carries ``Idempotency-Key: <verdict id>``.  A verdict is delivered once per receiver:
the dispatcher remembers delivered verdict ids (bounded), and a retry of one delivery
re-sends the same body.  Temporary failures (timeouts, refused connections, 408, 429,
5xx) are retried with exponential backoff (:class:`actuators.retry.RetryPolicy`,
``Retry-After`` honoured); the outcome of every delivery, delivered or given up, is
handed to ``on_outcome`` as an :class:`schemas.ActionRecord` (action ``escalate``,
backend ``webhook:<receiver name>``), which the worker sends to the ``actions`` topic.
A full queue (``queue_size`` verdicts waiting for one receiver) is reported the same way,
never dropped silently.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import hashlib
import json
import logging
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any, Literal

import aiohttp

from schemas import ActionName, ActionRecord, FaultClass, Outcome, Verdict

from .base import PermanentError
from .retry import RetriesExhausted, RetryPolicy, call_with_retry
from .webhook import post_signed, remember

log = logging.getLogger(__name__)

FORMATS = ("alertmanager", "cloudevents", "alertmanager-api")
#: Alertmanager's endpoint for posting alerts, under a receiver's base url
AM_ALERTS_PATH = "/api/v2/alerts"
#: fault classes whose verdicts are critical alerts (a node or a switch is out of order)
CRITICAL_CLASSES = frozenset({FaultClass.gpu_hardware, FaultClass.gpu_memory, FaultClass.nvlink,
                              FaultClass.node_network, FaultClass.fabric_switch})


@dataclass(frozen=True)
class Receiver:
    """One webhook receiver: where, in which format, signed with which secret."""

    name: str
    url: str
    format: Literal["alertmanager", "cloudevents", "alertmanager-api"] = "alertmanager"
    secret: str | None = None
    timeout_s: float = 10.0
    #: alertmanager-api: how long a node's out-of-service alert fires without a return
    #: (its ``endsAt``; Alertmanager resolves it then)
    hold_s: float = 7 * 86400.0
    #: alertmanager-api: how long any other verdict's alert fires
    event_s: float = 3600.0

    def __post_init__(self) -> None:
        if self.format not in FORMATS:
            raise ValueError(f"receiver {self.name}: format must be one of {', '.join(FORMATS)}, got {self.format!r}")
        if not self.url.startswith(("http://", "https://")):
            raise ValueError(f"receiver {self.name}: url must be http(s)://..., got {self.url!r}")
        if self.timeout_s <= 0:
            raise ValueError(f"receiver {self.name}: timeout_s must be > 0, got {self.timeout_s}")
        if self.hold_s <= 0 or self.event_s <= 0:
            raise ValueError(f"receiver {self.name}: hold_s and event_s must be > 0")

    @property
    def endpoint(self) -> str:
        """Where bodies are posted: the url, or for ``alertmanager-api`` its alerts API."""
        if self.format != "alertmanager-api" or self.url.rstrip("/").endswith(AM_ALERTS_PATH):
            return self.url
        return self.url.rstrip("/") + AM_ALERTS_PATH


def _rfc3339(ts: float) -> str:
    return dt.datetime.fromtimestamp(ts, dt.timezone.utc).isoformat().replace("+00:00", "Z")


def _severity(v: Verdict) -> str:
    if v.fault_class in CRITICAL_CLASSES or any(a.action is ActionName.isolate for a in v.actions):
        return "critical"
    if v.fault_class in (FaultClass.transient_software,):
        return "info"
    return "warning"


def _summary(v: Verdict) -> str:
    acts = ", ".join(f"{a.action.value} {a.target}" for a in v.actions) or "no action"
    return f"{v.fault_class.value} on {v.scope} {v.subject}: {acts}"


def alertmanager_body(v: Verdict, *, source: str, external_url: str = "") -> dict[str, Any]:
    """The Alertmanager webhook body (version 4) for one verdict: one firing alert."""
    labels = {"alertname": "FleetmedicVerdict", "severity": _severity(v), "fault_class": v.fault_class.value,
              "scope": v.scope, "subject": v.subject, "incident": v.incident}
    if v.job:
        labels["job_name"] = v.job
    annotations = {"summary": _summary(v), "confidence": f"{v.confidence:.2f}", "verdict_id": v.id,
                   "evidence": json.dumps(v.evidence, sort_keys=True, default=str)[:4000]}
    fingerprint = hashlib.sha256(json.dumps(labels, sort_keys=True).encode()).hexdigest()[:16]
    alert = {"status": "firing", "labels": labels, "annotations": annotations, "startsAt": _rfc3339(v.ts),
             "endsAt": "0001-01-01T00:00:00Z", "generatorURL": f"{external_url}/fleetmedic/verdicts/{v.id}"
             if external_url else "", "fingerprint": fingerprint}
    group = {"alertname": "FleetmedicVerdict", "subject": v.subject}
    return {"version": "4", "groupKey": f"{source}:{v.subject}:{v.incident}", "truncatedAlerts": 0,
            "status": "firing", "receiver": source, "groupLabels": group, "commonLabels": labels,
            "commonAnnotations": annotations, "externalURL": external_url, "alerts": [alert]}


def alertmanager_api_alerts(v: Verdict, *, source: str, external_url: str = "", hold_s: float = 7 * 86400.0,
                            event_s: float = 3600.0) -> list[dict[str, Any]]:
    """The alerts one verdict posts to Alertmanager's ``/api/v2/alerts``.

    * each node the verdict isolates: ``FleetmedicNodeOutOfService{node, severity=critical,
      source}``, firing from the verdict's time for ``hold_s``;
    * each node it returns to service: the same alert, resolved (``endsAt`` = the
      verdict's time). Alertmanager identifies an alert by its labels, so the return
      resolves the alert of the isolation without knowing which verdict raised it;
    * a verdict that does neither: ``FleetmedicVerdict{fault_class, scope, subject,
      incident, severity, source}``, firing for ``event_s``.

    Annotations carry the verdict (summary, fault class, incident, id, confidence,
    evidence), all as strings, as Alertmanager requires.
    """
    start = _rfc3339(v.ts)
    # generatorURL is a URI in Alertmanager's API: left out rather than empty
    link = {"generatorURL": f"{external_url}/fleetmedic/verdicts/{v.id}"} if external_url else {}
    notes = {"summary": _summary(v), "fault_class": v.fault_class.value, "incident": v.incident,
             "verdict_id": v.id, "confidence": f"{v.confidence:.2f}",
             "evidence": json.dumps(v.evidence, sort_keys=True, default=str)[:4000]}
    out: list[dict[str, Any]] = []
    isolated = list(dict.fromkeys(a.target for a in v.actions if a.action is ActionName.isolate))
    returned = list(dict.fromkeys(a.target for a in v.actions if a.action is ActionName.return_))
    for node in isolated:
        out.append({"labels": {"alertname": "FleetmedicNodeOutOfService", "node": node, "severity": "critical",
                               "source": source},
                    "annotations": {**notes, "summary": f"{node} out of service: {_summary(v)}"},
                    "startsAt": start, "endsAt": _rfc3339(v.ts + hold_s), **link})
    for node in returned:
        out.append({"labels": {"alertname": "FleetmedicNodeOutOfService", "node": node, "severity": "critical",
                               "source": source},
                    "annotations": {**notes, "summary": f"{node} back in service: {_summary(v)}"},
                    "startsAt": start, "endsAt": start, **link})
    if not isolated and not returned:
        labels = {"alertname": "FleetmedicVerdict", "severity": _severity(v), "fault_class": v.fault_class.value,
                  "scope": v.scope, "subject": v.subject, "incident": v.incident, "source": source}
        if v.job:
            labels["job_name"] = v.job
        out.append({"labels": labels, "annotations": notes, "startsAt": start, "endsAt": _rfc3339(v.ts + event_s),
                    **link})
    return out


def cloudevent_body(v: Verdict, *, source: str) -> dict[str, Any]:
    """A CloudEvents 1.0 event (structured JSON mode) carrying the verdict."""
    return {"specversion": "1.0", "id": v.id, "source": source, "type": "io.fleetmedic.verdict",
            "subject": f"{v.scope}/{v.subject}", "time": _rfc3339(v.ts), "datacontenttype": "application/json",
            "severity": _severity(v), "data": v.to_dict()}


def body_for(receiver: Receiver, v: Verdict, *, source: str, external_url: str = "") -> bytes:
    doc: Any
    if receiver.format == "alertmanager":
        doc = alertmanager_body(v, source=source, external_url=external_url)
    elif receiver.format == "alertmanager-api":
        doc = alertmanager_api_alerts(v, source=source, external_url=external_url, hold_s=receiver.hold_s,
                                      event_s=receiver.event_s)
    else:
        doc = cloudevent_body(v, source=source)
    return json.dumps(doc, sort_keys=True, separators=(",", ":"), default=str).encode()


OutcomeCallback = Callable[[ActionRecord], Awaitable[None]]


class AlertDispatcher:
    """Deliver verdicts to webhook receivers in the background (see the module docstring).

    ``want(verdict)`` picks the verdicts that alert (default: every verdict).  Call
    :meth:`start` inside the running event loop before :meth:`submit`, and :meth:`stop`
    at the end (it waits up to ``drain_s`` for queued deliveries, then cancels).
    """

    def __init__(self, receivers: Iterable[Receiver], *, on_outcome: OutcomeCallback | None = None,
                 retry: RetryPolicy | None = None, source: str = "fleetmedic", external_url: str = "",
                 want: Callable[[Verdict], bool] | None = None, queue_size: int = 10_000,
                 remember: int = 100_000, sleep: Callable[[float], Awaitable[None]] = asyncio.sleep) -> None:
        self.receivers = list(receivers)
        names = [r.name for r in self.receivers]
        if len(set(names)) != len(names):
            raise ValueError(f"receiver names must be unique, got {names}")
        self.on_outcome = on_outcome
        self.retry = retry or RetryPolicy(max_attempts=8, base_delay=0.5, max_delay=60.0)
        self.source = source
        self.external_url = external_url
        self.want = want or (lambda v: True)
        self.queue_size = queue_size
        self.remember = remember
        self.sleep = sleep
        self._queues: dict[str, asyncio.Queue[Verdict]] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self._seen: dict[str, OrderedDict[str, None]] = {r.name: OrderedDict() for r in self.receivers}
        self._session: aiohttp.ClientSession | None = None
        self.stats = {"submitted": 0, "delivered": 0, "failed": 0, "duplicates": 0, "queue_full": 0}

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        if self._tasks:
            return
        for r in self.receivers:
            q: asyncio.Queue[Verdict] = asyncio.Queue(self.queue_size)
            self._queues[r.name] = q
            self._tasks.append(asyncio.create_task(self._run(r, q), name=f"alerts:{r.name}"))

    async def stop(self, drain_s: float = 5.0) -> None:
        if self._queues:
            try:
                await asyncio.wait_for(asyncio.gather(*(q.join() for q in self._queues.values())), drain_s)
            except asyncio.TimeoutError:
                log.warning("alerts: %d deliveries still queued at stop",
                            sum(q.qsize() for q in self._queues.values()))
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()
        if self._session is not None and not self._session.closed:
            await self._session.close()

    # ------------------------------------------------------------------ intake

    def submit(self, v: Verdict) -> None:
        """Queue ``v`` for every receiver; returns at once (never waits on a receiver)."""
        if not self.want(v):
            return
        self.start()
        self.stats["submitted"] += 1
        for r in self.receivers:
            if v.id in self._seen[r.name]:
                self.stats["duplicates"] += 1
                continue
            remember(self._seen[r.name], v.id, self.remember)  # queued counts as seen: not queued twice
            try:
                self._queues[r.name].put_nowait(v)
            except asyncio.QueueFull:
                self.stats["queue_full"] += 1
                self._seen[r.name].pop(v.id, None)
                self._report(r, v, Outcome.failed, f"alert queue of {r.name} full ({self.queue_size}); not delivered", 0)

    # ------------------------------------------------------------------ delivery

    async def _run(self, r: Receiver, q: asyncio.Queue[Verdict]) -> None:
        while True:
            v = await q.get()
            try:
                await self._deliver(r, v)
            except Exception:  # a bug here must not kill the receiver's task
                log.exception("alerts: delivery of %s to %s crashed", v.id, r.name)
            finally:
                q.task_done()

    def _session_now(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession()
        return self._session

    async def _deliver(self, r: Receiver, v: Verdict) -> None:
        body = body_for(r, v, source=self.source, external_url=self.external_url)
        content_type = "application/cloudevents+json" if r.format == "cloudevents" else "application/json"

        async def post() -> str:
            status = await post_signed(self._session_now(), r.endpoint, body, key=v.id, secret=r.secret,
                                       timeout_s=r.timeout_s, content_type=content_type)
            return f"delivered to {r.name} (HTTP {status})"

        def on_retry(attempt: int, exc: BaseException, delay: float) -> None:
            log.warning("alerts: %s to %s, attempt %d failed (%s); retrying in %.1fs", v.id, r.name, attempt, exc, delay)

        try:
            detail, attempts = await call_with_retry(post, self.retry, sleep=self.sleep, on_retry=on_retry)
        except PermanentError as exc:
            self.stats["failed"] += 1
            await self._report_async(r, v, Outcome.failed, f"permanent: {exc}", 1)
            return
        except RetriesExhausted as exc:
            self.stats["failed"] += 1
            await self._report_async(r, v, Outcome.failed, str(exc), exc.attempts)
            return
        self.stats["delivered"] += 1
        await self._report_async(r, v, Outcome.applied, detail, attempts)

    # ------------------------------------------------------------------ outcomes

    def record(self, r: Receiver, v: Verdict, outcome: Outcome, detail: str, attempts: int) -> ActionRecord:
        return ActionRecord(ts=v.ts, key=f"{v.id}:alert:{r.name}", verdict_id=v.id, action=ActionName.escalate,
                            target=v.subject, backend=f"webhook:{r.name}", outcome=outcome, detail=detail[:2000],
                            attempts=max(1, attempts))

    async def _report_async(self, r: Receiver, v: Verdict, outcome: Outcome, detail: str, attempts: int) -> None:
        rec = self.record(r, v, outcome, detail, attempts)
        if self.on_outcome is None:
            return
        try:
            await self.on_outcome(rec)
        except Exception:
            log.exception("alerts: could not record the outcome of %s", rec.key)

    def _report(self, r: Receiver, v: Verdict, outcome: Outcome, detail: str, attempts: int) -> None:
        asyncio.get_running_loop().create_task(self._report_async(r, v, outcome, detail, attempts))
