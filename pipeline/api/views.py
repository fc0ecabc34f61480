"""The operator API: JSON over HTTP on the worker's web server (``docs/openapi.yaml``).

Reading needs the ``viewer`` role, changing needs ``operator`` (see :mod:`pipeline.api.auth`).
Every change an operator makes is a verdict (id ``op-...``) on the ``verdicts`` topic,
carried out by the actuation agent like any other, so each one is also an ``actions``
record (who asked is in the verdict's evidence and the action's parameters); a change
to a node's state also tells the node track (``operator_return`` / ``operator_hold``):

* ``POST /api/v1/nodes/{node}/return``: return a node to service (uncordon / resume);
* ``POST /api/v1/nodes/{node}/hold``: hold a node out (isolate and drain); an operator's
  hold is not counted against the circuit breaker, which limits automation;
* ``POST /api/v1/held/{key}/approve`` and ``.../reject``: isolations the breaker held
  back: approve carries them out, reject records that a person said no;
* ``PUT /api/v1/dry-run`` ``{"enabled": true|false}``: switch dry-run on or off.

The lists (``nodes``, ``jobs``, ``verdicts``, ``actions``, ``held``) come from this
worker: its tables' partitions (all of them with one worker) and the verdicts and actions
its actuation agent saw (the decision topics have one partition, so one worker sees all).
"""

from __future__ import annotations

import asyncio
import json
import re
import time
import uuid
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import faust

from schemas import ActionName, FaultClass, NodeNotice, PlannedAction, Verdict

from pipeline.api.auth import AuthError, NoAuth, OidcAuth, authorize
from pipeline.api.gate import SECURITY_HEADERS
from pipeline.api.history import GpuHistory
from pipeline.api.kpi import fleet_counts, saved_vs_manual

API = "/api/v1"
DASHBOARD = Path(__file__).parent / "web" / "dashboard.html"


@dataclass
class ApiContext:
    auth: NoAuth | OidcAuth
    node_table: Any
    job_table: Any
    send_verdict: Callable[[Verdict], Awaitable[None]]
    send_node_notice: Callable[[NodeNotice], Awaitable[None]]
    dry_run: Callable[[], bool]
    #: switch dry-run (enabled, who, why); kept where every worker and a restart find it
    set_dry_run: Callable[[bool, str, str], Awaitable[None]]
    #: isolations the breaker held back for a person, by key (their action records)
    held: Callable[[], dict[str, dict[str, Any]]]
    #: a held isolation was approved or rejected: it awaits no one any more
    settle_held: Callable[[str], Awaitable[None]]
    #: who set dry-run as it stands, and when
    dry_run_origin: Callable[[], dict[str, Any]] | None = None
    switch_table: Any = None
    verdicts: deque = field(default_factory=lambda: deque(maxlen=2000))
    actions: deque = field(default_factory=lambda: deque(maxlen=5000))
    #: one queue per open event stream (the dashboard's Server-Sent Events)
    streams: set[asyncio.Queue] = field(default_factory=set)
    stream_queue: int = 2000
    #: open event streams allowed in all, and per client (its token's subject, else its address)
    max_streams: int = 64
    max_streams_per_client: int = 4
    stream_clients: dict[str, int] = field(default_factory=dict)
    #: nodes that sent telemetry to this worker (healthy unless the node table says otherwise)
    known: set[str] = field(default_factory=set)
    #: recent GPU telemetry of the nodes an operator looks at (the node page's plots)
    history: GpuHistory = field(default_factory=GpuHistory)
    #: the circuit breaker's window now: {used, budget, window_s}
    breaker: Callable[[], dict[str, Any]] | None = None
    #: the manual baseline's expected delay (hours) for GPU-hours saved; None: not shown
    human_hours: float | None = None
    gpus_per_node: int = 8
    #: each node's switches by port, from its fabric telemetry
    node_switches: Callable[[], dict[str, tuple[str, ...]]] | None = None
    #: whether this worker holds every partition of the node track (then a node missing
    #: from its table is unknown to fleetmedic; with several workers another may own it)
    owns_every_node: Callable[[], bool] = lambda: True

    def publish(self, kind: str, doc: dict[str, Any]) -> None:
        """Hand an event to every open stream; a stream too slow to keep up is closed
        (its page reconnects and reloads the fleet), never waited for."""
        for q in list(self.streams):
            try:
                q.put_nowait((kind, doc))
            except asyncio.QueueFull:
                self.streams.discard(q)
                q.overflow = True  # type: ignore[attr-defined]

    def saw_verdict(self, v: dict[str, Any]) -> None:
        self.verdicts.append(v)
        self.publish("verdict", v)

    def saw_node(self, node: str, state: str, h: dict[str, Any]) -> None:
        if state == "healthy":
            self.history.unwatch(node)
        else:
            self.history.watch(node)
        self.publish("node", {"node": node, "state": state, "since": h.get("since"), "fault_class": h.get("fault_class")})

    def node_list(self) -> list[dict[str, Any]]:
        out = []
        table = dict(self.node_table.items())
        wired = self.node_switches() if self.node_switches is not None else {}
        for node in set(table) | self.known | set(wired):
            h = table.get(node) or {}
            jobs = sorted(h.get("jobs") or {}) or ([h["job"]] if h.get("job") else [])
            sws = wired.get(node) or ()
            # the switch most of its ports hang off (a rail-optimised node names one per rail)
            leaf = max(sorted(set(sws)), key=sws.count) if sws else None
            out.append({"node": node, "state": h.get("state") or "healthy", "since": h.get("since"), "jobs": jobs,
                        "fault_class": h.get("fault_class"), "incident": h.get("incident"), "switch": leaf})
        out.sort(key=lambda x: x["node"])
        return out

    def saw_switch(self, switch: str, faulty: bool) -> None:
        self.publish("switch", {"switch": switch, "state": "faulty" if faulty else "ok"})

    def saw_action(self, a: dict[str, Any]) -> None:
        self.actions.append(a)
        self.publish("action", a)


def _limit(request: Any, default: int = 200, cap: int = 5000) -> int:
    try:
        return max(1, min(int(request.query.get("limit", default)), cap))
    except ValueError:
        return default


def operator_verdict(subject: str, actions: list[tuple[ActionName, str, dict[str, Any]]], who: str,
                     why: str, **evidence: Any) -> Verdict:
    """A verdict that records and carries out an operator's decision."""
    return Verdict(ts=time.time(), id=f"op-{uuid.uuid4().hex[:16]}", incident=f"operator-{uuid.uuid4().hex[:8]}",
                   scope="node", subject=subject, fault_class=FaultClass.unknown, confidence=1.0,
                   evidence={"operator": who, "request": why, **evidence},
                   actions=[PlannedAction(action=a, target=t, params={"operator": who, **p}) for a, t, p in actions],
                   nodes=[subject])


#: path parameters, by the same rules as the records: a node is a schema NodeName (one
#: node, not a hostlist), a held isolation's key is an idempotency key
_PARAMS = {"node": re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,252}$"), "key": re.compile(r"^[A-Za-z0-9._:@/-]{1,512}$")}


class BadBody(ValueError):
    """A change's body that is not what its route takes (answered 400 with the reason)."""


async def read_body(request: Any, allowed: dict[str, type]) -> dict[str, Any]:
    """A change's JSON body: empty (``{}``) or an object of ``allowed`` fields and types."""
    raw = await request.read()
    if not raw.strip():
        return {}
    try:
        body = json.loads(raw)
    except ValueError as exc:
        raise BadBody(f"body is not JSON: {exc}") from None
    if not isinstance(body, dict):
        raise BadBody(f"body must be a JSON object, not {type(body).__name__}")
    unknown = sorted(set(body) - set(allowed))
    if unknown:
        raise BadBody(f"unknown field(s) {', '.join(map(repr, unknown))}; this route takes "
                      f"{', '.join(map(repr, allowed)) or 'no body'}")
    for k, kind in allowed.items():
        if k in body and not isinstance(body[k], kind):
            raise BadBody(f"{k!r} must be {kind.__name__}, not {type(body[k]).__name__}")
    reason = body.get("reason")
    if isinstance(reason, str) and not 0 < len(reason) <= 500:
        raise BadBody("'reason' must be 1 to 500 characters")
    return body


def change_refused(node: str, h: dict[str, Any] | None, known: bool, change: str,
                   held: dict[str, dict[str, Any]], *, everyone: bool = True) -> tuple[int, str] | None:
    """Why an operator's ``change`` (``return`` or ``hold``) of ``node`` is not allowed, as
    (status, reason); None when it is.  ``h``: the node's state record, if any; ``known``:
    this worker has telemetry of it; ``everyone``: this worker holds every node's state
    (with several workers, a node it does not hold is another's: its change is not
    refused here)."""
    if h is None and not known:
        if not everyone:
            return None
        return 404, f"no node {node!r}: fleetmedic has no telemetry or state for it"
    state = (h or {}).get("state") or "healthy"
    waiting = next((k for k, a in held.items() if a.get("target") == node), None)
    if change == "return" and state == "healthy":
        return 409, f"node {node!r} is healthy and in service: nothing to return"
    if change == "hold":
        if waiting is not None:
            return 409, (f"node {node!r} waits for a decision on its held isolation: "
                         f"POST {API}/held/{waiting}/approve (or reject)")
        if state in ("isolated", "diagnosing", "failed"):
            return 409, f"node {node!r} is already out of service ({state})"
    return None


def _bad_params(params: dict[str, Any]) -> str | None:
    """Why a request's path parameters are refused, or None."""
    for name, value in params.items():
        rule = _PARAMS.get(name)
        if rule is not None and not (isinstance(value, str) and rule.match(value)):
            shown = value[:60] + "..." if isinstance(value, str) and len(value) > 60 else value
            return f"{name} {shown!r} is not a valid {name} (letters, digits and . _ : -, one name, at most 253)"
    return None


def install(app: faust.App, ctx: ApiContext) -> dict[str, set[str]]:
    """Register the API's views on ``app``; returns each path with its HTTP methods."""
    routes: dict[str, set[str]] = {}
    page_html = DASHBOARD.read_text()

    def page(path: str) -> Callable[[type], type]:
        def register(view: type) -> type:
            routes[path] = {m for m in ("get", "post", "put", "delete", "patch") if m in vars(view)}
            return app.page(path)(view)
        return register

    def needs(role: str, *, query_token: bool = False) -> Callable[[Callable[..., Awaitable[Any]]], Any]:
        """A view method that runs only for a principal with ``role`` (passed as ``who``);
        anyone else gets 401 or 403 with the reason."""
        def wrap(method: Callable[..., Awaitable[Any]]) -> Any:
            async def checked(self: faust.web.View, request: Any, **params: Any) -> Any:
                header = request.headers.get("Authorization")
                if header is None and query_token and request.query.get("access_token"):
                    # EventSource cannot send headers: the stream takes the token as a query parameter
                    header = f"Bearer {request.query['access_token']}"
                try:
                    who = await authorize(ctx.auth, header, role)  # type: ignore[arg-type]
                except AuthError as exc:
                    headers = {"WWW-Authenticate": 'Bearer realm="fleetmedic"'} if exc.status == 401 else {}
                    return self.json({"error": exc.reason}, status=exc.status, headers=headers)
                bad = _bad_params(params)
                if bad is not None:
                    return self.json({"error": bad}, status=400)
                return await method(self, request, who, **params)
            return checked
        return wrap

    @page(f"{API}/auth")
    class AuthInfo(faust.web.View):
        async def get(self, request: Any) -> Any:
            return self.json({**ctx.auth.describe(), "dry_run": ctx.dry_run()})

    @page("/dashboard")
    class Dashboard(faust.web.View):
        async def get(self, request: Any) -> Any:
            # the page holds no data: everything it shows comes from the API with the viewer's token
            return self.html(page_html)

    @page(f"{API}/stream")
    class Stream(faust.web.View):
        @needs("viewer", query_token=True)
        async def get(self, request: Any, who: Any) -> Any:
            from aiohttp import web

            client = who.subject if who.authenticated else f"addr:{request.remote}"
            if len(ctx.streams) >= ctx.max_streams or ctx.stream_clients.get(client, 0) >= ctx.max_streams_per_client:
                return self.json({"error": "too many open event streams"}, status=503, headers={"Retry-After": "10"})
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                               "X-Accel-Buffering": "no", **SECURITY_HEADERS})
            resp.force_close()  # a stream that ends closes its connection
            await resp.prepare(request)
            q: asyncio.Queue = asyncio.Queue(ctx.stream_queue)
            ctx.streams.add(q)
            ctx.stream_clients[client] = ctx.stream_clients.get(client, 0) + 1
            try:
                await resp.write(b"retry: 2000\nevent: hello\ndata: {}\n\n")
                quiet = 0.0
                while True:
                    left = who.expires_at - time.time() if who.expires_at is not None else 15.0
                    if left <= 0:
                        # the token expired: the page must sign in again to keep streaming
                        await resp.write(b"event: expired\ndata: {}\n\n")
                        break
                    if request.transport is None or request.transport.is_closing():
                        break  # the client went away: its place is free at once
                    try:
                        item = await asyncio.wait_for(q.get(), timeout=min(2.0, left))
                        quiet = 0.0
                    except asyncio.TimeoutError:
                        quiet += 2.0
                        if quiet >= 15.0:
                            quiet = 0.0
                            await resp.write(b": keep-alive\n\n")
                        continue
                    if getattr(q, "overflow", False):
                        break  # this client fell behind: it reconnects and reloads the fleet
                    kind, doc = item
                    await resp.write(f"event: {kind}\ndata: {json.dumps(doc, default=str)}\n\n".encode())
            except ConnectionResetError:
                pass  # the client went away
            finally:
                ctx.streams.discard(q)
                ctx.stream_clients[client] -= 1
                if ctx.stream_clients[client] <= 0:
                    del ctx.stream_clients[client]
            return resp

    @page(f"{API}/switches")
    class Switches(faust.web.View):
        @needs("viewer")
        async def get(self, request: Any, who: Any) -> Any:
            out = []
            for sw, st in list((ctx.switch_table or {}).items()):
                st = st or {}
                out.append({"switch": sw, "state": "faulty" if st.get("incident") else "ok",
                            "incident": st.get("incident"), "nodes": sorted(st.get("nodes") or {})})
            out.sort(key=lambda x: x["switch"])
            return self.json({"switches": out})

    @page(f"{API}/nodes")
    class Nodes(faust.web.View):
        @needs("viewer")
        async def get(self, request: Any, who: Any) -> Any:
            state = request.query.get("state")
            out = [n for n in ctx.node_list() if not state or n["state"] == state]
            return self.json({"nodes": out[: _limit(request, 100_000, 100_000)], "count": len(out)})

    @page(f"{API}/nodes/{{node}}")
    class NodeDetail(faust.web.View):
        @needs("viewer")
        async def get(self, request: Any, who: Any, node: str) -> Any:
            h = ctx.node_table.get(node)
            if h is None and node in ctx.known:
                if not ctx.owns_every_node():
                    # its telemetry came here, its state lives with another worker
                    return self.json({"error": f"node {node!r} is kept by another worker"}, status=404)
                h = {"state": "healthy", "anomalies": [], "failed_jobs": []}
            if h is None:
                return self.json({"error": f"no node {node!r}"}, status=404)
            verdicts = [v for v in ctx.verdicts if v.get("subject") == node or node in (v.get("nodes") or [])][-50:]
            ids = {v.get("id") for v in verdicts}
            actions = [a for a in ctx.actions if a.get("verdict_id") in ids or a.get("target") == node]
            return self.json({"node": node, "health": h, "verdicts": verdicts, "actions": actions[-100:]})

    @page(f"{API}/nodes/{{node}}/gpu")
    class NodeGpu(faust.web.View):
        @needs("viewer")
        async def get(self, request: Any, who: Any, node: str) -> Any:
            h = ctx.node_table.get(node)
            if h is None and node not in ctx.known:
                return self.json({"error": f"no node {node!r}"}, status=404)
            ctx.history.opened(node)  # recorded from now on while its page is open
            doc = ctx.history.of(node, last=_limit(request, ctx.history.keep))
            doc["anomalies"] = (h or {}).get("anomalies") or []
            doc["xids"] = (h or {}).get("xids") or []
            return self.json(doc)

    @page(f"{API}/summary")
    class Summary(faust.web.View):
        @needs("viewer")
        async def get(self, request: Any, who: Any) -> Any:
            held = ctx.held()
            doc: dict[str, Any] = {"nodes": fleet_counts(ctx.node_list(), (a.get("target") for a in held.values())),
                                   "held": len(held),
                                   "dry_run": ctx.dry_run()}
            if ctx.breaker is not None:
                b = ctx.breaker()
                doc["breaker"] = {**b, "left": max(0, b["budget"] - b["used"])}
            if ctx.human_hours is not None:
                doc["saved"] = saved_vs_manual(ctx.verdicts, ctx.actions, human_hours=ctx.human_hours,
                                               gpus_per_node=ctx.gpus_per_node)
            return self.json(doc)

    @page(f"{API}/jobs/{{job}}")
    class JobDetail(faust.web.View):
        @needs("viewer")
        async def get(self, request: Any, who: Any, job: str) -> Any:
            h = ctx.job_table.get(job)
            verdicts = [v for v in ctx.verdicts if v.get("job") == job or v.get("subject") == job]
            if h is None and not verdicts:
                return self.json({"error": f"no job {job!r}"}, status=404)
            h = h or {}
            ids = {v.get("id") for v in verdicts}
            actions = [a for a in ctx.actions if a.get("verdict_id") in ids or a.get("target") == job]
            excluded = sorted({n for a in actions for n in (a.get("params") or {}).get("exclude") or []}
                              | {n for v in verdicts for act in v.get("actions") or []
                                 for n in (act.get("params") or {}).get("exclude") or []})
            failures = [{"attempt": f.get("attempt"), "ts": f.get("ts"), "nodes": f.get("nodes"),
                         "reason": f.get("reason"), "exit_code": f.get("exit_code"),
                         "triage": (f.get("triage") or {}).get("kind")} for f in h.get("failures") or []]
            return self.json({"job": job, "status": h.get("status"), "attempt": h.get("attempt"),
                              "nodes": h.get("nodes") or [], "scheduler": h.get("scheduler"),
                              "failures": failures, "excluded": excluded, "node_faults": h.get("node_faults") or {},
                              "verdicts": verdicts[-50:], "actions": actions[-100:]})

    @page(f"{API}/jobs")
    class Jobs(faust.web.View):
        @needs("viewer")
        async def get(self, request: Any, who: Any) -> Any:
            out = [{"job": j, "status": (h or {}).get("status"), "nodes": (h or {}).get("nodes"),
                    "attempt": (h or {}).get("attempt"), "failures": len((h or {}).get("failures") or [])}
                   for j, h in list(ctx.job_table.items())]
            out.sort(key=lambda x: x["job"])
            return self.json({"jobs": out[: _limit(request, 100_000, 100_000)], "count": len(out)})

    @page(f"{API}/verdicts")
    class Verdicts(faust.web.View):
        @needs("viewer")
        async def get(self, request: Any, who: Any) -> Any:
            return self.json({"verdicts": list(ctx.verdicts)[-_limit(request):]})

    @page(f"{API}/actions")
    class Actions(faust.web.View):
        @needs("viewer")
        async def get(self, request: Any, who: Any) -> Any:
            return self.json({"actions": list(ctx.actions)[-_limit(request):]})

    @page(f"{API}/held")
    class Held(faust.web.View):
        @needs("viewer")
        async def get(self, request: Any, who: Any) -> Any:
            return self.json({"held": list(ctx.held().values())})

    async def decide(node: str, acts: list[tuple[ActionName, str, dict[str, Any]]], who: Any, why: str,
                     notice: str | None = None, **evidence: Any) -> Verdict:
        """Send the operator's verdict; with ``notice`` (a NodeNotice kind), tell the node
        track first, so the node's state has changed before the actions are carried out."""
        v = operator_verdict(node, acts, who.subject, why, **evidence)
        if notice is not None:
            await ctx.send_node_notice(NodeNotice(ts=v.ts, node=node, kind=notice, job="-",  # type: ignore[arg-type]
                                                  reason=f"{why} by {who.subject}", signature=v.id))
        await ctx.send_verdict(v)
        return v

    async def checked_change(view: faust.web.View, request: Any, node: str, change: str) -> tuple[Any, str | None]:
        """(a refusal to answer, None) or (None, the operator's reason or None)."""
        try:
            body = await read_body(request, {"reason": str})
        except BadBody as exc:
            return view.json({"error": str(exc)}, status=400), None
        refused = change_refused(node, ctx.node_table.get(node), node in ctx.known, change, ctx.held(),
                                 everyone=ctx.owns_every_node())
        if refused is not None:
            return view.json({"error": refused[1]}, status=refused[0]), None
        return None, body.get("reason")

    @page(f"{API}/nodes/{{node}}/return")
    class ReturnNode(faust.web.View):
        @needs("operator")
        async def post(self, request: Any, who: Any, node: str) -> Any:
            refusal, reason = await checked_change(self, request, node, "return")
            if refusal is not None:
                return refusal
            v = await decide(node, [(ActionName.return_, node, {})], who, reason or "return to service",
                             "operator_return")
            return self.json({"verdict": v.id, "node": node, "requested": "return"}, status=202)

    @page(f"{API}/nodes/{{node}}/hold")
    class HoldNode(faust.web.View):
        @needs("operator")
        async def post(self, request: Any, who: Any, node: str) -> Any:
            refusal, reason = await checked_change(self, request, node, "hold")
            if refusal is not None:
                return refusal
            v = await decide(node, [(ActionName.isolate, node, {"reason": reason or "held out by an operator"}),
                                    (ActionName.drain, node, {})], who, reason or "hold out", "operator_hold")
            return self.json({"verdict": v.id, "node": node, "requested": "hold"}, status=202)

    async def resolve(view: faust.web.View, request: Any, who: Any, key: str, approve: bool) -> Any:
        try:
            await read_body(request, {})
        except BadBody as exc:
            return view.json({"error": str(exc)}, status=400)
        a = ctx.held().get(key)
        if a is None:
            return view.json({"error": f"no held isolation {key!r}"}, status=404)
        await ctx.settle_held(key)
        node = a["target"]
        if approve:
            v = await decide(node, [(ActionName.isolate, node, {"reason": "held isolation approved"}),
                                    (ActionName.drain, node, {}), (ActionName.diagnose, node, {})],
                             who, "approve held isolation", "operator_hold", held=key, held_verdict=a.get("verdict_id"))
        else:
            v = await decide(node, [(ActionName.escalate, node, {"reason": "held isolation rejected", "alert_only": True})],
                             who, "reject held isolation", held=key, held_verdict=a.get("verdict_id"))
        return view.json({"verdict": v.id, "held": key, "approved": approve}, status=202)

    @page(f"{API}/held/{{key}}/approve")
    class Approve(faust.web.View):
        @needs("operator")
        async def post(self, request: Any, who: Any, key: str) -> Any:
            return await resolve(self, request, who, key, True)

    @page(f"{API}/held/{{key}}/reject")
    class Reject(faust.web.View):
        @needs("operator")
        async def post(self, request: Any, who: Any, key: str) -> Any:
            return await resolve(self, request, who, key, False)

    @page(f"{API}/dry-run")
    class DryRunSwitch(faust.web.View):
        @needs("viewer")
        async def get(self, request: Any, who: Any) -> Any:
            origin = ctx.dry_run_origin() if ctx.dry_run_origin is not None else {}
            return self.json({**origin, "dry_run": ctx.dry_run()})

        @needs("operator")
        async def put(self, request: Any, who: Any) -> Any:
            try:
                body = await read_body(request, {"enabled": bool})
                if "enabled" not in body:
                    raise BadBody("'enabled' is missing")
            except BadBody as exc:
                return self.json({"error": f'body must be {{"enabled": true|false}}: {exc}'}, status=400)
            enabled = body["enabled"]
            why = f"dry-run {'on' if enabled else 'off'}"
            await ctx.set_dry_run(enabled, who.subject, why)
            v = await decide("fleet", [(ActionName.escalate, "fleet", {"reason": why, "alert_only": True,
                                                                       "dry_run": enabled})], who, why)
            return self.json({"dry_run": enabled, "verdict": v.id})

    return routes
