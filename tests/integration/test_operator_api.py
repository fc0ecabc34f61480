"""The operator API of a real worker with sign-in on: a locally generated key pair, its
JWKS served on loopback, tokens with and without the roles, expired, and signed by
another key.  Every endpoint is tried with each; only the right ones succeed, and what
an operator changes shows up on the ``actions`` topic."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from typing import Any

import jwt
import pytest
from aiohttp import web
from cryptography.hazmat.primitives.asymmetric import rsa

from .harness import ClusterAPI, JwksServer, Worker, api_call, auth_env, collect, gpu_sample, lose_gpus, produce, wait_for

pytestmark = pytest.mark.integration

ISSUER = "http://127.0.0.1/realms/gpu"
AUDIENCE = "fleetmedic"
KEY = rsa.generate_private_key(public_exponent=65537, key_size=2048)
OTHER = rsa.generate_private_key(public_exponent=65537, key_size=2048)


def _token(roles: list[str], *, key: Any = KEY, exp_in: float = 6 * 3600) -> str:
    now = time.time()
    return jwt.encode({"sub": f"u-{'-'.join(roles) or 'none'}", "iss": ISSUER, "aud": AUDIENCE, "iat": int(now) - 5,
                       "exp": int(now + exp_in), "realm_access": {"roles": roles}}, key, algorithm="RS256",
                      headers={"kid": "it-key"})


TOKENS = {
    "none": None,
    "viewer": _token(["viewer"]),
    "operator": _token(["operator"]),
    "expired": _token(["operator"], exp_in=-120),
    "other_key": _token(["operator"], key=OTHER),
}


@pytest.fixture(scope="module")
def setup(kafka_bootstrap):
    from pipeline.config import load_settings

    pub = json.loads(jwt.algorithms.RSAAlgorithm.to_jwk(KEY.public_key()))

    async def certs(request: web.Request) -> web.Response:
        return web.json_response({"keys": [{**pub, "kid": "it-key", "use": "sig", "alg": "RS256"}]})

    jwks = JwksServer(certs)
    api = ClusterAPI(load_settings(environ={}))
    worker = Worker(kafka_bootstrap, sim_url=api.url, env=auth_env(
        ISSUER, AUDIENCE, jwks.url, FLEETMEDIC_AUTH__LEEWAY_S="0", FLEETMEDIC_SAFETY__FLEET_SIZE="40",
        FLEETMEDIC_SAFETY__MAX_ABSOLUTE="1"))
    worker.start()
    nodes = ["op-0", "op-1", "op-2"]
    api.add_nodes(nodes)
    lose_gpus(kafka_bootstrap, worker, nodes)
    # breaker budget 1: one isolation applied, two held
    collect(kafka_bootstrap, worker.topic("actions"),
            lambda rs: sum(1 for a in rs if a["action"] == "isolate" and a["target"] in nodes) >= 3)
    yield kafka_bootstrap, worker, api, nodes
    worker.stop()
    api.close()
    jwks.close()


def call(worker: Worker, method: str, path: str, token: str | None, body: Any = None) -> tuple[int, Any]:
    return api_call(worker, method, path, token, body)


_wait = wait_for


READS = ["/api/v1/nodes", "/api/v1/nodes/op-0", "/api/v1/jobs", "/api/v1/verdicts", "/api/v1/actions",
         "/api/v1/held", "/api/v1/dry-run", "/api/v1/switches"]


def test_reads_need_a_valid_token_with_a_role(setup):
    _, worker, _, _ = setup
    for path in READS:
        got = {name: call(worker, "GET", path, tok)[0] for name, tok in TOKENS.items()}
        assert got == {"none": 401, "viewer": 200, "operator": 200, "expired": 401, "other_key": 401}, (path, got)
    status, body = call(worker, "GET", "/api/v1/nodes/op-0", TOKENS["viewer"])
    # op-0 lost a GPU in the setup: the node track isolated it (its diagnostics never start here)
    assert body["health"]["state"] in ("isolated", "diagnosing"), body
    assert body["health"]["fault_class"] == "gpu_hardware" and body["verdicts"], body
    status, body = call(worker, "GET", "/api/v1/nodes/nope", TOKENS["viewer"])
    assert status == 404
    # sign-in state is public, so the page can say whether it is on
    status, body = call(worker, "GET", "/api/v1/auth", None)
    assert status == 200 and body["enabled"] is True and body["issuer"] == ISSUER
    status, body = call(worker, "GET", "/api/v1/actions", TOKENS["none"])
    assert "no bearer token" in body["error"]
    status, body = call(worker, "GET", "/api/v1/actions", TOKENS["expired"])
    assert body["error"] == "token expired"


def test_changes_need_the_operator_role_and_are_actions_records(setup):
    bootstrap, worker, api, nodes = setup
    def two_held() -> list | None:
        got = call(worker, "GET", "/api/v1/held", TOKENS["viewer"])[1]["held"]
        return got if len(got) >= 2 else None

    held = _wait(two_held)
    assert held and len(held) == 2, held
    api.add_nodes(["op-9", "op-6"])
    # fleetmedic knows a node by its telemetry: an operator may hold only a node it knows
    produce(bootstrap, [(worker.topic("telemetry.gpu"), n, gpu_sample(n, time.time())) for n in ("op-9", "op-6")])
    _wait(lambda: all(call(worker, "GET", f"/api/v1/nodes/{n}", TOKENS["viewer"])[0] == 200 for n in ("op-9", "op-6")))
    keys = [h["key"] for h in held]
    writes = [("POST", "/api/v1/nodes/op-0/return", None), ("POST", "/api/v1/nodes/op-9/hold", None),
              ("POST", f"/api/v1/held/{keys[0]}/approve", None), ("POST", f"/api/v1/held/{keys[1]}/reject", None),
              ("PUT", "/api/v1/dry-run", {"enabled": True})]
    for method, path, body in writes:
        got = {name: call(worker, method, path, TOKENS[name], body)[0] for name in ("none", "viewer", "expired", "other_key")}
        assert got == {"none": 401, "viewer": 403, "expired": 401, "other_key": 401}, (path, got)
    verdict_ids = []
    for method, path, body in writes[:4]:
        status, out = call(worker, method, path, TOKENS["operator"], body)
        assert status in (200, 202), (path, status, out)
        verdict_ids.append(out["verdict"])
    # a held isolation is resolved once
    assert call(worker, "POST", f"/api/v1/held/{keys[0]}/approve", TOKENS["operator"])[0] == 404
    assert call(worker, "PUT", "/api/v1/dry-run", TOKENS["operator"], {"enabled": "yes"})[0] == 400
    collect(bootstrap, worker.topic("actions"), lambda rs: {a["verdict_id"] for a in rs} >= set(verdict_ids), timeout=60)
    # dry-run on only once the changes above are carried out (it applies from the next action on)
    status, out = call(worker, "PUT", "/api/v1/dry-run", TOKENS["operator"], {"enabled": True})
    assert status == 200 and out["dry_run"] is True
    verdict_ids.append(out["verdict"])
    actions = collect(bootstrap, worker.topic("actions"),
                      lambda rs: {a["verdict_id"] for a in rs} >= set(verdict_ids), timeout=60)
    mine = {a["verdict_id"]: a for a in actions if a["verdict_id"] in verdict_ids}
    ret, hold, approve, reject, dry = (mine[v] for v in verdict_ids)
    assert ret["action"] == "return" and ret["target"] == "op-0"
    assert hold["action"] in ("isolate", "drain") and hold["target"] == "op-9"
    by_v = [a for a in actions if a["verdict_id"] == verdict_ids[2]]
    iso = [a for a in by_v if a["action"] == "isolate"]
    assert iso and iso[0]["outcome"] in ("applied", "already_so")  # approved: past the breaker
    assert reject["action"] == "escalate"
    assert dry["action"] == "escalate"
    # an operator's hold is not counted by the breaker (budget 1 is used): op-9 is cordoned
    assert _wait(lambda: api.state(lambda c: c.nodes["op-9"].cordoned))
    assert call(worker, "GET", "/api/v1/dry-run", TOKENS["viewer"])[1]["dry_run"] is True
    # with dry-run on, a hold (which the breaker does not stop) is recorded but not carried out
    status, out = call(worker, "POST", "/api/v1/nodes/op-6/hold", TOKENS["operator"])
    assert status == 202
    acts = collect(bootstrap, worker.topic("actions"),
                   lambda rs: any(a["verdict_id"] == out["verdict"] and a["action"] == "isolate" for a in rs))
    iso6 = [a for a in acts if a["verdict_id"] == out["verdict"] and a["action"] == "isolate"]
    assert iso6[0]["outcome"] == "dry_run"
    assert api.state(lambda c: c.nodes["op-6"].cordoned) is False
    assert call(worker, "PUT", "/api/v1/dry-run", TOKENS["operator"], {"enabled": False})[1]["dry_run"] is False
    # the node page shows who returned op-0
    assert _wait(lambda: call(worker, "GET", "/api/v1/nodes/op-0", TOKENS["viewer"])[1]["health"].get("operator"))


def _stream_first_event(worker: Worker, token: str | None, *, query: bool = False) -> tuple[int, bytes]:
    port = worker.env["FLEETMEDIC_WORKER__WEB_PORT"]
    url = f"http://127.0.0.1:{port}/api/v1/stream" + (f"?access_token={token}" if query and token else "")
    req = urllib.request.Request(url)
    if token and not query:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=15) as r:
            first = b""
            while b"\n\n" not in first:  # the first event, however the server chunks it
                line = r.readline()
                if not line:
                    break
                first += line
            return r.status, first
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def test_the_event_stream_needs_a_viewer_token_in_the_header_or_the_query(setup):
    _, worker, _, _ = setup
    for name in ("none", "expired", "other_key"):
        assert _stream_first_event(worker, TOKENS[name])[0] == 401, name
        assert _stream_first_event(worker, TOKENS[name], query=True)[0] == 401, name
    for name in ("viewer", "operator"):
        status, first = _stream_first_event(worker, TOKENS[name])
        assert status == 200 and b"event: hello" in first, (name, first)
        status, first = _stream_first_event(worker, TOKENS[name], query=True)
        assert status == 200 and b"event: hello" in first, (name, first)


def _raw(worker: Worker, method: str, path: str, data: bytes, ctype: str = "application/json",
         chunked: bool = False) -> tuple[int, Any]:
    port = worker.env["FLEETMEDIC_WORKER__WEB_PORT"]
    body: Any = iter([data[i:i + 4096] for i in range(0, len(data), 4096)]) if chunked else data
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=body, method=method)
    req.add_header("Content-Type", ctype)
    req.add_header("Authorization", f"Bearer {TOKENS['operator']}")
    if chunked:
        req.add_header("Transfer-Encoding", "chunked")
    try:
        with urllib.request.urlopen(req, timeout=15) as r:
            return r.status, json.loads(r.read() or b"null")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"null")


def test_bad_input_gets_a_clear_4xx_with_a_reason_and_changes_nothing(setup):
    bootstrap, worker, api, _ = setup
    api.add_nodes(["op-5", "op-8"])
    produce(bootstrap, [(worker.topic("telemetry.gpu"), n, gpu_sample(n, time.time())) for n in ("op-5", "op-8")])
    assert _wait(lambda: all(call(worker, "GET", f"/api/v1/nodes/{n}", TOKENS["viewer"])[0] == 200 for n in ("op-5", "op-8")))
    hold = call(worker, "POST", "/api/v1/nodes/op-8/hold", TOKENS["operator"])  # a node out of service
    assert hold[0] == 202, hold
    assert _wait(lambda: call(worker, "GET", "/api/v1/nodes/op-8", TOKENS["viewer"])[1]["health"]["state"] == "isolated")

    def snapshot() -> dict[str, Any]:
        get = lambda path: call(worker, "GET", path, TOKENS["viewer"])[1]  # noqa: E731
        return {"held": get("/api/v1/held"), "dry_run": get("/api/v1/dry-run")["dry_run"],
                "op-5": get("/api/v1/nodes/op-5")["health"]["state"], "op-8": get("/api/v1/nodes/op-8")["health"]["state"],
                "verdicts": len(get("/api/v1/verdicts?limit=5000")["verdicts"]),
                "actions": len(get("/api/v1/actions?limit=5000")["actions"])}

    time.sleep(2)  # the hold's actions are recorded
    before = snapshot()
    bad = [
        # a malformed body
        (_raw(worker, "POST", "/api/v1/nodes/op-5/hold", b"{not json"), 400, "body is not JSON"),
        (_raw(worker, "POST", "/api/v1/nodes/op-5/hold", b'["op-5"]'), 400, "must be a JSON object"),
        (_raw(worker, "POST", "/api/v1/nodes/op-5/hold", b'{"resaon": "fan"}'), 400, "unknown field(s) 'resaon'"),
        (_raw(worker, "POST", "/api/v1/nodes/op-5/hold", b'{"reason": 7}'), 400, "'reason' must be str"),
        (_raw(worker, "POST", "/api/v1/nodes/op-5/hold", b"{}", ctype="text/plain"), 415, "Content-Type: application/json"),
        (_raw(worker, "PUT", "/api/v1/dry-run", b'{"enabled": "yes"}'), 400, "'enabled' must be bool"),
        (_raw(worker, "PUT", "/api/v1/dry-run", b'{"enabled": true, "for": "ever"}'), 400, "unknown field(s) 'for'"),
        (_raw(worker, "PUT", "/api/v1/dry-run", b"{}"), 400, "'enabled' is missing"),
        (_raw(worker, "POST", "/api/v1/held/x/approve", b'{"why": 1}'), 400, "this route takes no body"),
        # an unknown node, or held isolation
        (call(worker, "POST", "/api/v1/nodes/ghost-1/hold", TOKENS["operator"]), 404, "no node 'ghost-1'"),
        (call(worker, "POST", "/api/v1/nodes/ghost-1/return", TOKENS["operator"]), 404, "no node 'ghost-1'"),
        (call(worker, "POST", "/api/v1/held/no-such-key/approve", TOKENS["operator"]), 404, "no held isolation"),
        # a state change that is not allowed
        (call(worker, "POST", "/api/v1/nodes/op-5/return", TOKENS["operator"]), 409, "healthy and in service"),
        (call(worker, "POST", "/api/v1/nodes/op-8/hold", TOKENS["operator"]), 409, "already out of service (isolated)"),
        # an oversized request, with its length and without (chunked)
        (_raw(worker, "POST", "/api/v1/nodes/op-5/hold", b'{"reason": "' + b"x" * 20000 + b'"}'), 413, "over the limit"),
        (_raw(worker, "POST", "/api/v1/nodes/op-5/hold", b'{"reason": "' + b"x" * 20000 + b'"}', chunked=True), 413,
         "over the limit"),
    ]
    for (status, body), want, why in bad:
        assert status == want and why in body["error"], (status, body, want, why)
    time.sleep(2)  # anything wrongly sent would be carried out and recorded by now
    assert snapshot() == before
