"""Sign-in against a real Keycloak (``deploy/keycloak.sh``: 26.7.3 from Maven Central, dev
mode, the realm of ``deploy/keycloak/realm.json``).  Every token here is issued by
Keycloak: the password grant for the users ada (operator) and vic (viewer), the client
credentials grant for the ``fleetmedic`` client's service account.  The worker finds the
keys where Keycloak publishes them (no ``jwks_url`` is configured).

The last test stops Keycloak and starts it again."""

from __future__ import annotations

import time

import jwt
import pytest
from cryptography.hazmat.primitives.asymmetric import rsa

from .harness import ClusterAPI, Worker, api_call, collect, gpu_sample, produce, wait_for
from .keycloak_helpers import Keycloak, script

pytestmark = pytest.mark.integration


def _claims(token: str) -> dict:
    return jwt.decode(token, options={"verify_signature": False})


@pytest.fixture(scope="module")
def setup(kafka_bootstrap, keycloak: Keycloak):
    from pipeline.config import load_settings

    api = ClusterAPI(load_settings(environ={}))
    api.add_nodes(["kc-1", "kc-2", "kc-3"])
    worker = Worker(kafka_bootstrap, sim_url=api.url, env={
        "FLEETMEDIC_AUTH__ENABLED": "true", "FLEETMEDIC_AUTH__ISSUER": keycloak.issuer,
        "FLEETMEDIC_AUTH__AUDIENCE": "fleetmedic", "FLEETMEDIC_AUTH__LEEWAY_S": "0",
        "FLEETMEDIC_AUTH__JWKS_CACHE_S": "30", "FLEETMEDIC_AUTH__DASHBOARD_CLIENT": "fleetmedic-dashboard",
        "FLEETMEDIC_SAFETY__FLEET_SIZE": "40"})
    worker.start()
    # fleetmedic knows its nodes by their telemetry (an operator may hold only a known node)
    produce(kafka_bootstrap, [(worker.topic("telemetry.gpu"), n, gpu_sample(n, time.time())) for n in ("kc-1", "kc-2", "kc-3")])
    tok = keycloak.token(user="vic")
    assert wait_for(lambda: api_call(worker, "GET", "/api/v1/nodes", tok)[1].get("count", 0) >= 3, timeout=60)
    yield kafka_bootstrap, worker, api
    worker.stop()
    api.close()


def test_real_tokens_read_and_change_with_the_right_roles(setup, keycloak: Keycloak):
    bootstrap, worker, api = setup
    ada, vic = keycloak.token(user="ada"), keycloak.token(user="vic")
    service = keycloak.token("client_credentials")
    assert _claims(service)["preferred_username"] == "service-account-fleetmedic"
    for tok in (ada, vic, service):
        status, body = api_call(worker, "GET", "/api/v1/nodes", tok)
        assert status == 200 and "nodes" in body, (status, body)
    status, body = api_call(worker, "POST", "/api/v1/nodes/kc-1/hold", vic)
    assert status == 403 and "lacks the operator role" in body["error"], body
    assert api_call(worker, "POST", "/api/v1/nodes/kc-1/hold", None)[0] == 401
    status, held = api_call(worker, "POST", "/api/v1/nodes/kc-1/hold", ada)
    assert status == 202, held
    status, held2 = api_call(worker, "POST", "/api/v1/nodes/kc-2/hold", service)
    assert status == 202, held2
    actions = collect(bootstrap, worker.topic("actions"),
                      lambda rs: {a["verdict_id"] for a in rs} >= {held["verdict"], held2["verdict"]}, timeout=60)
    assert {a["action"] for a in actions if a["verdict_id"] in (held["verdict"], held2["verdict"])} >= {"isolate"}
    # each change names who made it: the subject of the Keycloak token
    verdicts = collect(bootstrap, worker.topic("verdicts"),
                       lambda rs: {v["id"] for v in rs} >= {held["verdict"], held2["verdict"]}, timeout=60)
    by = {v["id"]: v for v in verdicts}
    assert by[held["verdict"]]["evidence"]["operator"] == _claims(ada)["sub"]
    assert by[held2["verdict"]]["evidence"]["operator"] == _claims(service)["sub"]
    assert wait_for(lambda: api.state(lambda c: c.nodes["kc-1"].cordoned and c.nodes["kc-2"].cordoned))
    # the viewer's refused change left kc-3 alone
    assert api.state(lambda c: c.nodes["kc-3"].cordoned) is False
    # the page learns where to sign in, and may call Keycloak's token endpoint
    status, info = api_call(worker, "GET", "/api/v1/auth")
    assert info["sign_in"]["client_id"] == "fleetmedic-dashboard"
    assert info["sign_in"]["token_endpoint"] == f"{keycloak.issuer}/protocol/openid-connect/token"


def test_a_token_keycloak_issued_for_another_audience_is_refused(setup, keycloak: Keycloak):
    _, worker, _ = setup
    # admin-cli exists in every realm: a real token of the right issuer, roles and user, but
    # without the fleetmedic audience mapper
    tok = keycloak.token(user="ada", client="admin-cli")
    assert "fleetmedic" not in (_claims(tok).get("aud") or [])
    status, body = api_call(worker, "GET", "/api/v1/nodes", tok)
    assert status == 401 and "aud" in body["error"].lower(), body


def test_an_expired_keycloak_token_is_refused(setup, keycloak: Keycloak):
    _, worker, _ = setup
    keycloak.update_client("fleetmedic", attributes={"access.token.lifespan": "2"})
    try:
        tok = keycloak.token(user="ada")
    finally:
        keycloak.update_client("fleetmedic", attributes={"access.token.lifespan": ""})
    c = _claims(tok)
    assert c["exp"] - c["iat"] <= 2
    assert api_call(worker, "GET", "/api/v1/nodes", tok)[0] in (200, 401)  # good for at most 2 s
    time.sleep(max(0.0, c["exp"] + 1.5 - time.time()))
    status, body = api_call(worker, "GET", "/api/v1/nodes", tok)
    assert status == 401 and body["error"] == "token expired", body


def test_a_key_rotated_in_keycloak_is_taken_up_and_a_removed_key_is_refused(setup, keycloak: Keycloak):
    _, worker, _ = setup
    old_key = keycloak.active_key()
    old = keycloak.token(user="ada")
    assert jwt.get_unverified_header(old)["kid"] == old_key["kid"]
    assert api_call(worker, "GET", "/api/v1/nodes", old)[0] == 200
    keycloak.add_signing_key("rotated", priority=old_key["providerPriority"] + 100)
    new = keycloak.token(user="ada")
    new_kid = jwt.get_unverified_header(new)["kid"]
    assert new_kid != old_key["kid"]
    # an unknown kid makes the worker refetch Keycloak's keys (at most every 30 s)
    seen: list[int] = []
    assert wait_for(lambda: seen.append(api_call(worker, "GET", "/api/v1/nodes", new)[0]) or seen[-1] == 200,
                    timeout=90), seen
    assert set(seen) <= {401, 200}
    assert api_call(worker, "GET", "/api/v1/nodes", old)[0] == 200  # the old key is still published
    keycloak.remove_key_provider(old_key["providerId"])
    # once the key set the worker holds lapses (auth.jwks_cache_s = 30), the old key is gone
    answers: list[tuple[int, str]] = []

    def refused() -> bool:
        status, body = api_call(worker, "GET", "/api/v1/nodes", old)
        answers.append((status, (body or {}).get("error", "")))
        return status == 401
    assert wait_for(refused, timeout=90), answers[-3:]
    assert "unknown signing key" in answers[-1][1]
    assert api_call(worker, "GET", "/api/v1/nodes", new)[0] == 200


def test_with_keycloak_stopped_sign_in_fails_closed_with_a_clear_reason(setup, keycloak: Keycloak):
    _, worker, _ = setup
    held = keycloak.token(user="vic")
    assert api_call(worker, "GET", "/api/v1/nodes", held)[0] == 200
    forged_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    claims = _claims(held)
    forged = jwt.encode({**claims, "realm_access": {"roles": ["operator"]}}, forged_key, algorithm="RS256",
                        headers={"kid": "not-a-keycloak-key"})
    stopped = script("stop", timeout=120)
    assert stopped.returncode == 0, stopped.stderr
    try:
        assert script("status", timeout=30).returncode != 0
        # a key nobody can vouch for: refused, first as unknown, then (once the worker may
        # refetch) as unverifiable with Keycloak's error; never accepted, never a hang
        # (api_call gives up after 15 s)
        answers: list[tuple[int, str]] = []

        def unavailable() -> bool:
            status, body = api_call(worker, "POST", "/api/v1/nodes/kc-3/hold", forged)
            answers.append((status, body["error"]))
            return status == 503
        assert wait_for(unavailable, timeout=90), answers[-3:]
        assert {s for s, _ in answers} <= {401, 503}
        reason = answers[-1][1]
        assert "cannot be fetched" in reason and keycloak.issuer in reason, reason
        # a token Keycloak signed with a key the worker holds is still checked offline
        # (signature, issuer, audience, expiry); it stays good at most until it expires
        status, body = api_call(worker, "GET", "/api/v1/nodes", held)
        assert status == 200, body
        assert api_call(worker, "POST", "/api/v1/nodes/kc-3/hold", held)[0] == 403
        # the page still loads and says where sign-in would go
        assert api_call(worker, "GET", "/api/v1/auth")[0] == 200
    finally:
        started = script("start", timeout=600)
        assert started.returncode == 0, started.stderr[-3000:]
