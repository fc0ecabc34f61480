"""One gate in front of every route of the worker's web server, deny by default.

Every request passes :func:`make_gate`'s middleware before any view sees it:

* **Host**: the ``Host`` header must name this worker (``worker.allowed_hosts``: loopback
  names, the canonical host, the bind address, and what a deployment adds); anything
  else is refused (421), which stops DNS rebinding.
* **Routes**: a route is served only when it is on the allow-list: public routes (health,
  the dashboard page, the sign-in description, ``/metrics`` when ``auth.metrics_public``),
  the operator API's views (each checks its role itself), and the worker's own routes
  with the role they need (``/fleetmedic/stats`` viewer, ``/fleetmedic/release``
  operator, ``/metrics`` viewer otherwise).  Faust's table, router and graph views are
  switched off in the app's options; any other route answers 404.
* **Writes** (POST, PUT, PATCH, DELETE) need ``Content-Type: application/json`` (415
  otherwise) and, when the browser sends an ``Origin``, one whose host is allowed (403):
  an HTML form or a script on another site cannot change anything, sign-in on or off.
* **Headers**: every response carries ``X-Content-Type-Options: nosniff``,
  ``X-Frame-Options: DENY``, ``Referrer-Policy: no-referrer``, a Content-Security-Policy,
  and ``Cache-Control: no-store`` on the API.
* **Errors**: an exception a view did not expect is a 500 with no traceback in the body,
  logged once; refusals are 4xx with the reason in JSON.

The rules are plain functions of the request's method, path, route and headers
(:func:`check`); the middleware only applies them.
"""

from __future__ import annotations

import ipaddress
import logging
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from aiohttp import web

from pipeline.api.auth import AuthError, authorize

log = logging.getLogger(__name__)

WRITES = frozenset({"POST", "PUT", "PATCH", "DELETE"})
#: routes anyone who reaches the port may read
PUBLIC = frozenset({("GET", "/fleetmedic/ready"), ("HEAD", "/fleetmedic/ready"), ("GET", "/dashboard"),
                    ("GET", "/api/v1/auth"), ("GET", "/healthz"), ("HEAD", "/healthz"), ("GET", "/readyz"),
                    ("HEAD", "/readyz")})
#: the worker's own routes and the role each needs when sign-in is on
WORKER_ROUTES = {"/fleetmedic/stats": "viewer", "/fleetmedic/release": "operator", "/metrics": "viewer"}
SECURITY_HEADERS = {
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",
}


def content_security_policy(connect: Iterable[str] = ()) -> str:
    """The pages' policy; ``connect``: origins besides this one the page may call (the
    issuer's token endpoint, for the dashboard's sign-in)."""
    extra = "".join(f" {o}" for o in sorted(set(connect)))
    return ("default-src 'self'; script-src 'self' 'unsafe-inline'; style-src 'self' 'unsafe-inline'; "
            f"img-src 'self' data:; connect-src 'self'{extra}; frame-ancestors 'none'; base-uri 'none'; "
            "form-action 'none'")


def _origin(url: str) -> str:
    u = urlsplit(url)
    return f"{u.scheme}://{u.netloc}"


def host_name(value: str | None) -> str | None:
    """The host of a ``Host`` header or an origin, lower-case, without port or brackets."""
    if not value:
        return None
    value = value.strip().lower()
    if "://" in value:
        value = urlsplit(value).netloc
    if value.startswith("["):
        return value[1:value.find("]")] if "]" in value else None
    return value.rsplit(":", 1)[0] if value.count(":") == 1 else value


def is_loopback(host: str) -> bool:
    if host in ("localhost", "localhost.localdomain"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@dataclass
class GateConfig:
    """What the gate allows: hosts, public routes, the API's routes (filled once the views are
    installed), and whether ``/metrics`` is public."""

    auth: Any
    allowed_hosts: frozenset[str]
    metrics_public: bool = False
    api_routes: set[str] = field(default_factory=set)
    csp: str = field(default_factory=content_security_policy)
    #: the largest request body a change may carry (the API's bodies are a few bytes)
    max_body: int = 16384

    @classmethod
    def for_worker(cls, auth: Any, *, web_host: str, web_bind: str, extra_hosts: Iterable[str] = (),
                   metrics_public: bool = False) -> GateConfig:
        hosts = {"localhost", "127.0.0.1", "::1", web_host.lower(), web_bind.lower()}
        hosts |= {h.lower() for h in extra_hosts}
        hosts.discard("0.0.0.0")
        hosts.discard("::")
        sign_in = getattr(auth, "sign_in", None) or {}
        connect = [_origin(sign_in["token_endpoint"])] if sign_in.get("token_endpoint") else []
        return cls(auth=auth, allowed_hosts=frozenset(hosts), metrics_public=metrics_public,
                   csp=content_security_policy(connect))

    def host_allowed(self, host: str | None) -> bool:
        h = host_name(host)
        return h is not None and (h in self.allowed_hosts or "*" in self.allowed_hosts)


@dataclass(frozen=True)
class Refusal:
    status: int
    reason: str


def check(cfg: GateConfig, method: str, path: str, route: str | None, headers: Any) -> tuple[Refusal | None, str | None]:
    """The gate's rules for one request: a refusal, or None and the role the gate itself
    must check (None when the route is public or a view checks its own role)."""
    if not cfg.host_allowed(headers.get("Host")):
        return Refusal(421, f"Host {headers.get('Host')!r} is not this worker (worker.allowed_hosts)"), None
    if method in WRITES:
        length = headers.get("Content-Length")
        if length is not None:
            try:
                size = int(length)
            except ValueError:
                return Refusal(400, f"Content-Length {length!r} is not a number"), None
            if size > cfg.max_body:
                return Refusal(413, f"request body of {size} bytes is over the limit of {cfg.max_body} bytes"), None
        ctype = (headers.get("Content-Type") or "").split(";")[0].strip().lower()
        if ctype != "application/json":
            return Refusal(415, "changes need Content-Type: application/json"), None
        origin = headers.get("Origin")
        if origin is not None and origin != "null" and not cfg.host_allowed(origin):
            return Refusal(403, f"Origin {origin!r} may not change this worker"), None
        if origin == "null":
            return Refusal(403, "an opaque Origin may not change this worker"), None
    if route is None:
        return None, None  # no such route: aiohttp answers 404/405
    if (method, route) in PUBLIC or (method == "HEAD" and ("GET", route) in PUBLIC):
        return None, None
    if route in cfg.api_routes:
        return None, None  # the view checks its role (pipeline.api.views's `needs`)
    if route in WORKER_ROUTES:
        if route == "/metrics" and cfg.metrics_public:
            return None, None
        return None, WORKER_ROUTES[route]
    return Refusal(404, "not found"), None


def make_gate(cfg: GateConfig) -> Callable[..., Awaitable[web.StreamResponse]]:
    """The aiohttp middleware that applies :func:`check` and adds the security headers."""

    @web.middleware
    async def gate(request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
                   ) -> web.StreamResponse:
        info = request.match_info
        route = None
        if info.http_exception is None and info.route is not None and info.route.resource is not None:
            route = info.route.resource.canonical
        refusal, role = check(cfg, request.method, request.path, route, request.headers)
        if refusal is None and role is not None:
            try:
                await authorize(cfg.auth, request.headers.get("Authorization"), role)  # type: ignore[arg-type]
            except AuthError as exc:
                refusal = Refusal(exc.status, exc.reason)
        if refusal is None and request.method in WRITES and request.content_length is None and request.body_exists:
            # a body without a length (chunked): read it here, bounded, so a view never
            # holds more than max_body (aiohttp keeps it for the view's request.json())
            try:
                size = len(await request.read())
            except web.HTTPRequestEntityTooLarge:
                size = cfg.max_body + 1
            if size > cfg.max_body:
                refusal = Refusal(413, f"request body over the limit of {cfg.max_body} bytes")
        if refusal is not None:
            resp: web.StreamResponse = web.json_response({"error": refusal.reason}, status=refusal.status)
            if refusal.status == 401:
                resp.headers["WWW-Authenticate"] = 'Bearer realm="fleetmedic"'
        else:
            try:
                resp = await handler(request)
            except web.HTTPException as exc:
                resp = exc
            except Exception:  # a view's bug: logged, never a traceback to the client
                log.exception("%s %s failed", request.method, request.path)
                resp = web.json_response({"error": "internal error"}, status=500)
        if not resp.prepared:
            for k, v in SECURITY_HEADERS.items():
                resp.headers.setdefault(k, v)
            resp.headers.setdefault("Content-Security-Policy", cfg.csp)
            if request.path.startswith("/api/"):
                resp.headers.setdefault("Cache-Control", "no-store")
        return resp

    return gate
