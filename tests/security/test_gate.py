"""Probes of a real worker's web server, with sign-in on and with it off.

Each test is one finding of the security review (the "let no one in" issue): it fails on
a worker without the gate (``pipeline/api/gate.py``) and passes with it.
"""

from __future__ import annotations

import asyncio
import base64
import json
import random
import socket
import time
import urllib.error
import urllib.request
from typing import Any

import jwt
import pytest
from aiohttp import web
from cryptography.hazmat.primitives.asymmetric import rsa

from tests.integration.harness import ClusterAPI, JwksServer, Worker, auth_env, collect, gpu_sample, produce, wait_for

pytestmark = pytest.mark.integration

ISSUER = "http://127.0.0.1/realms/gpu"
AUDIENCE = "fleetmedic"
KEY = rsa.generate_private_key(public_exponent=65537, key_size=2048)


def token(roles: list[str], *, alg: str = "RS256", kid: Any = "sec-key", typ: str = "Bearer",
          header: dict[str, Any] | None = None, sub: str = "u") -> str:
    now = time.time()
    claims = {"sub": sub, "iss": ISSUER, "aud": AUDIENCE, "iat": int(now), "exp": int(now + 6 * 3600), "typ": typ,
              "realm_access": {"roles": roles}}
    return jwt.encode(claims, KEY, algorithm=alg, headers={"kid": kid, **(header or {})})


def request(port: int, method: str, path: str, *, tok: str | None = None, body: bytes | None = None,
            headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
    """One raw HTTP request; (status, headers, body)."""
    if body is None and method in ("POST", "PUT", "PATCH"):
        body = b"{}"
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=body, method=method)
    for k, v in (headers if headers is not None else {"Content-Type": "application/json"}).items():
        req.add_header(k, v)
    if tok:
        req.add_header("Authorization", f"Bearer {tok}")
    try:
        with urllib.request.urlopen(req, timeout=15) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


def raw_request(port: int, data: bytes) -> int:
    """Send raw bytes (a Host header urllib would not send); the status code, or 0 if none."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(data)
        reply = s.recv(65536)
    try:
        return int(reply.split(b" ", 2)[1])
    except (IndexError, ValueError):
        return 0


@pytest.fixture(scope="module")
def workers(kafka_bootstrap):
    """Two workers on one broker: sign-in on (a local JWKS) and sign-in off."""
    from pipeline.config import load_settings

    pub = json.loads(jwt.algorithms.RSAAlgorithm.to_jwk(KEY.public_key()))

    async def certs(request: web.Request) -> web.Response:
        return web.json_response({"keys": [{**pub, "kid": "sec-key", "use": "sig", "alg": "RS256"}]})

    jwks = JwksServer(certs)
    api = ClusterAPI(load_settings(environ={}))
    on = Worker(kafka_bootstrap, sim_url=api.url,
                env=auth_env(ISSUER, AUDIENCE, jwks.url, FLEETMEDIC_AUTH__LEEWAY_S="0"))
    off = Worker(kafka_bootstrap, sim_url=api.url, env={})
    on.start()
    off.start()
    # fleetmedic knows a node by its telemetry: an operator may hold only a node it knows
    api.add_nodes(["sec-0", "sec-1"])
    produce(kafka_bootstrap, [(w.topic("telemetry.gpu"), n, gpu_sample(n, time.time()))
                              for w in (on, off) for n in ("sec-0", "sec-1")])
    viewer = token(["viewer"])
    for w in (on, off):
        assert wait_for(lambda w=w: request(_port(w), "GET", "/api/v1/nodes/sec-0", tok=viewer)[0] == 200, timeout=60)
    yield {"on": on, "off": off}
    on.stop()
    off.stop()
    api.close()
    jwks.close()


def _port(w: Worker) -> int:
    return int(w.env["FLEETMEDIC_WORKER__WEB_PORT"])


@pytest.mark.parametrize("mode", ["on", "off"])
def test_1_faust_table_and_router_views_are_gone(workers, mode):
    port = _port(workers[mode])
    for path in ("/table/node_to_health/op-0/", "/table/job_to_history/j/", "/table/breaker_state/isolations/",
                 "/router/", "/graph/"):
        status, _, body = request(port, "GET", path)
        assert status == 404, (path, status, body[:200])


def test_2_the_worker_listens_on_loopback_only(workers):
    for w in workers.values():
        port = _port(w)
        listening = []
        for table in ("/proc/net/tcp", "/proc/net/tcp6"):
            with open(table) as f:
                for line in f.readlines()[1:]:
                    local, state = line.split()[1], line.split()[3]
                    addr, p = local.split(":")
                    if state == "0A" and int(p, 16) == port:  # LISTEN
                        listening.append(addr)
        assert listening, f"nothing listens on {port}"
        assert all(a in ("0100007F", "00000000000000000000000001000000") for a in listening), listening


def test_3_cross_site_writes_are_refused_with_sign_in_off(workers):
    port = _port(workers["off"])
    # an HTML form on any site posts url-encoded or multipart bodies: refused
    for ctype in ("application/x-www-form-urlencoded", "multipart/form-data; boundary=x", "text/plain"):
        status, _, body = request(port, "POST", "/api/v1/nodes/sec-0/hold", body=b"a=b",
                                  headers={"Content-Type": ctype})
        assert status == 415, (ctype, status, body)
    # a script on another site sends its Origin: refused
    status, _, body = request(port, "POST", "/api/v1/nodes/sec-0/hold",
                              headers={"Content-Type": "application/json", "Origin": "https://evil.example"})
    assert status == 403, body
    # a name that resolves to loopback through DNS rebinding still carries its own Host: refused
    status = raw_request(port, b"POST /api/v1/nodes/sec-0/hold HTTP/1.1\r\nHost: rebind.evil.example\r\n"
                               b"Content-Type: application/json\r\nContent-Length: 2\r\n\r\n{}")
    assert status == 421
    assert raw_request(port, b"GET /api/v1/nodes HTTP/1.1\r\nHost: rebind.evil.example\r\n\r\n") == 421
    # the same change from this worker's own page (same origin, JSON) is accepted
    status, _, body = request(port, "POST", "/api/v1/nodes/sec-0/hold",
                              headers={"Content-Type": "application/json", "Origin": f"http://127.0.0.1:{port}"})
    assert status == 202, body


def test_7_a_bad_token_header_is_401_never_500(workers):
    port = _port(workers["on"])
    good = token(["viewer"])
    head, payload, sig = good.split(".")

    def with_header(h: dict[str, Any]) -> str:
        enc = base64.urlsafe_b64encode(json.dumps(h).encode()).rstrip(b"=").decode()
        return f"{enc}.{payload}.{sig}"

    for bad in (token(["viewer"], header={"crit": ["exp-unknown"], "exp-unknown": 1}),
                with_header({"alg": "RS256", "kid": 5}), with_header({"alg": "RS256", "kid": ["a"]}),
                with_header({"alg": "none", "kid": "sec-key"}), "a.b.c", "....", "x" * 5000):
        status, _, body = request(port, "GET", "/api/v1/nodes", tok=bad)
        assert status == 401, (bad[:40], status, body[:200])


def test_8_the_workers_own_routes_need_sign_in(workers):
    port = _port(workers["on"])
    for method, path in (("POST", "/fleetmedic/release"), ("GET", "/fleetmedic/stats"), ("GET", "/metrics")):
        assert request(port, method, path)[0] == 401, path
    viewer = token(["viewer"])
    assert request(port, "GET", "/fleetmedic/stats", tok=viewer)[0] == 200
    assert request(port, "GET", "/metrics", tok=viewer)[0] == 200
    assert request(port, "POST", "/fleetmedic/release", tok=viewer)[0] == 403
    # health stays public: the kubelet's probe carries no token
    assert request(port, "GET", "/fleetmedic/ready")[0] in (200, 503)


@pytest.mark.parametrize("mode", ["on", "off"])
def test_9_node_names_are_checked(workers, mode):
    port = _port(workers[mode])
    tok = token(["operator"]) if mode == "on" else None
    for name in ("%3Cimg%20src=x%3E", "n1,n2", "n%5B1-2048%5D", "n" * 7000, "-lead", "a%20b"):
        for method, path in (("GET", f"/api/v1/nodes/{name}"), ("POST", f"/api/v1/nodes/{name}/hold")):
            status, _, body = request(port, method, path, tok=tok)
            assert status == 400 or (len(name) > 4000 and status in (400, 414)), (name[:20], method, status, body[:200])


@pytest.mark.parametrize("mode", ["on", "off"])
def test_10_every_response_carries_security_headers(workers, mode):
    port = _port(workers[mode])
    for method, path in (("GET", "/dashboard"), ("GET", "/api/v1/auth"), ("GET", "/api/v1/nodes"),
                         ("GET", "/nope"), ("POST", "/api/v1/nodes/x/hold")):
        _, headers, _ = request(port, method, path)
        h = {k.lower(): v for k, v in headers.items()}
        assert h.get("x-content-type-options") == "nosniff", (path, h)
        assert h.get("x-frame-options") == "DENY" and "frame-ancestors 'none'" in h.get("content-security-policy", "")


def test_10_an_id_token_or_a_token_in_another_algorithm_does_not_sign_in(workers):
    port = _port(workers["on"])
    assert request(port, "GET", "/api/v1/nodes", tok=token(["viewer"]))[0] == 200
    assert request(port, "GET", "/api/v1/nodes", tok=token(["viewer"], typ="ID"))[0] == 401
    # the JWK publishes RS256: a PS256 signature by the same key is refused
    assert request(port, "GET", "/api/v1/nodes", tok=token(["viewer"], alg="PS256"))[0] == 401


def _open_stream(port: int, tok: str | None) -> tuple[int, Any]:
    """Open the event stream; (status, the open connection or None)."""
    s = socket.create_connection(("127.0.0.1", port), timeout=30)
    auth = f"Authorization: Bearer {tok}\r\n" if tok else ""
    s.sendall(f"GET /api/v1/stream HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n{auth}\r\n".encode())
    head = s.recv(4096)
    status = int(head.split(b" ", 2)[1])
    if status != 200:
        s.close()
        return status, None
    return status, s


def test_6_an_open_stream_ends_when_its_token_expires(workers):
    port = _port(workers["on"])
    now = time.time()
    short = jwt.encode({"sub": "brief", "iss": ISSUER, "aud": AUDIENCE, "iat": int(now), "exp": int(now + 4),
                        "realm_access": {"roles": ["viewer"]}}, KEY, algorithm="RS256", headers={"kid": "sec-key"})
    status, s = _open_stream(port, short)
    assert status == 200
    got = b""
    try:
        while True:  # the worker ends the stream; the socket timeout (30 s) fails the test otherwise
            chunk = s.recv(4096)
            if not chunk:
                break
            got += chunk
    finally:
        s.close()
    assert b"event: expired" in got


@pytest.mark.parametrize("mode", ["on", "off"])
def test_6_event_streams_are_capped_per_client(workers, mode):
    port = _port(workers[mode])
    tok = token(["viewer"], sub="stream-cap") if mode == "on" else None
    opened = []
    try:
        for _ in range(4):
            status, s = _open_stream(port, tok)
            assert status == 200
            opened.append(s)
        status, s = _open_stream(port, tok)
        assert status == 503
    finally:
        for s in opened:
            s.close()


def test_fuzz_ten_thousand_requests_without_credentials_or_with_a_viewer_change_nothing(workers):
    """Random and malformed requests over every route: no 500, no verdict from any of them."""
    on, off = workers["on"], workers["off"]
    rng = random.Random(18)
    routes = ["/api/v1/nodes", "/api/v1/nodes/{n}", "/api/v1/nodes/{n}/return", "/api/v1/nodes/{n}/hold",
              "/api/v1/held", "/api/v1/held/{k}/approve", "/api/v1/held/{k}/reject", "/api/v1/dry-run",
              "/api/v1/verdicts", "/api/v1/actions", "/api/v1/jobs", "/api/v1/switches", "/api/v1/auth",
              "/api/v1/stream", "/dashboard", "/metrics", "/fleetmedic/stats", "/fleetmedic/release",
              "/fleetmedic/ready", "/table/x/", "/router/", "/", "/api/v1/../../etc/passwd"]
    junk = ["", "x", "%00", "%ff%fe", "..%2f..", "a" * 300, "<script>", "n1,n2", "' OR 1=1 --", "\u00e9"]
    viewer = token(["viewer"])
    ctypes = [None, "application/json", "text/plain", "application/x-www-form-urlencoded", "multipart/form-data"]
    since = time.time()

    async def one(session: Any, w: Worker, i: int) -> int:
        path = rng.choice(routes).replace("{n}", rng.choice(junk + ["sec-1"])).replace("{k}", rng.choice(junk))
        method = rng.choice(["GET", "POST", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS"])
        headers = {}
        ct = rng.choice(ctypes)
        if ct:
            headers["Content-Type"] = ct
        if w is on and rng.random() < 0.5:
            headers["Authorization"] = rng.choice([f"Bearer {viewer}", "Bearer x", "Basic eA==", "Bearer " + "a" * 900])
        if rng.random() < 0.2:
            headers["Origin"] = rng.choice(["https://evil.example", "null", f"http://127.0.0.1:{_port(w)}"])
        if method in ("POST", "PUT", "PATCH") and w is off:
            # sign-in off lets anyone act: only the refusals (wrong type, foreign origin) are fuzzed
            headers["Content-Type"] = rng.choice(["text/plain", "application/x-www-form-urlencoded"])
        body = rng.choice([None, b"{}", b"{", b"\xff\xfe", json.dumps({"reason": "x" * 500}).encode(), b"a=b"])
        url = f"http://127.0.0.1:{_port(w)}{path}"
        try:
            async with session.request(method, url, data=body, headers=headers, allow_redirects=False) as r:
                if "stream" in path and r.status == 200:
                    return r.status  # an open event stream: not read further
                await r.read()
                return r.status
        except Exception:
            return -1

    async def run() -> list[int]:
        import aiohttp

        timeout = aiohttp.ClientTimeout(total=20)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            out: list[int] = []
            for start in range(0, 10_000, 200):
                out += await asyncio.gather(*(one(session, on if i % 2 else off, i)
                                              for i in range(start, start + 200)))
            return out

    statuses = asyncio.run(run())
    assert len(statuses) == 10_000
    assert statuses.count(500) == 0, sorted(set(statuses))
    assert statuses.count(-1) < 50, sorted(set(statuses))
    # no change reached the pipeline: no operator verdict since the fuzz began
    for w in (on, off):
        vs = collect(w.settings.kafka.bootstrap, w.topic("verdicts"), lambda rs: False, timeout=3)
        assert not [v for v in vs if v["id"].startswith("op-") and v["ts"] >= since], "a fuzzed request acted"
