"""Signing keys on a real worker: a removed key stops working, a slow or stalled identity
provider delays no request whose key is known, made-up kids cannot queue requests."""

from __future__ import annotations

import asyncio
import json
import threading
import time
import urllib.error
import urllib.request

import jwt
import pytest
from aiohttp import web
from cryptography.hazmat.primitives.asymmetric import rsa

from tests.integration.harness import ClusterAPI, JwksServer, Worker, auth_env

pytestmark = pytest.mark.integration

ISSUER = "http://127.0.0.1/realms/keys"
AUDIENCE = "fleetmedic"
KEYS = {kid: rsa.generate_private_key(public_exponent=65537, key_size=2048) for kid in ("k1", "k2")}


def token(kid: str) -> str:
    now = time.time()
    return jwt.encode({"sub": "u", "iss": ISSUER, "aud": AUDIENCE, "iat": int(now), "exp": int(now + 3600),
                       "realm_access": {"roles": ["viewer"]}}, KEYS.get(kid, KEYS["k1"]), algorithm="RS256",
                      headers={"kid": kid})


def get(port: int, tok: str) -> int:
    req = urllib.request.Request(f"http://127.0.0.1:{port}/api/v1/nodes", headers={"Authorization": f"Bearer {tok}"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


class Issuer:
    """A JWKS endpoint whose keys, max-age and answers the test steers."""

    def __init__(self) -> None:
        self.published = {"k1", "k2"}
        self.calls = 0
        self.open = threading.Event()
        self.open.set()

    async def certs(self, request: web.Request) -> web.Response:
        self.calls += 1
        while not self.open.is_set():  # a stalled identity provider
            await asyncio.sleep(0.05)
        keys = [{**json.loads(jwt.algorithms.RSAAlgorithm.to_jwk(KEYS[k].public_key())), "kid": k, "use": "sig",
                 "alg": "RS256"} for k in sorted(self.published)]
        return web.json_response({"keys": keys}, headers={"Cache-Control": "max-age=1"})


@pytest.fixture(scope="module")
def setup(kafka_bootstrap):
    from pipeline.config import load_settings

    issuer = Issuer()
    jwks = JwksServer(issuer.certs)
    api = ClusterAPI(load_settings(environ={}))
    worker = Worker(kafka_bootstrap, sim_url=api.url, env=auth_env(ISSUER, AUDIENCE, jwks.url)).start()
    yield worker, issuer
    issuer.open.set()
    worker.stop()
    api.close()
    jwks.close()


def test_4_a_key_removed_from_the_jwks_is_refused_after_the_next_refresh(setup):
    worker, issuer = setup
    port = int(worker.env["FLEETMEDIC_WORKER__WEB_PORT"])
    assert get(port, token("k2")) == 200
    issuer.published = {"k1"}
    # the set is kept as its max-age says (at least 30 s): then a request refreshes it
    time.sleep(31)
    get(port, token("k1"))  # starts the refresh behind the request
    deadline = time.time() + 20
    while time.time() < deadline and get(port, token("k2")) == 200:
        time.sleep(0.5)
    assert get(port, token("k2")) == 401
    assert get(port, token("k1")) == 200
    issuer.published = {"k1", "k2"}


def test_5_a_stalled_issuer_and_made_up_kids_delay_no_request_whose_key_is_known(setup):
    worker, issuer = setup
    port = int(worker.env["FLEETMEDIC_WORKER__WEB_PORT"])
    assert get(port, token("k1")) == 200
    issuer.open.clear()  # the identity provider stops answering
    calls = issuer.calls
    statuses: list[int] = []
    threads = [threading.Thread(target=lambda i=i: statuses.append(get(port, token(f"made-up-{i}")))) for i in range(12)]
    for t in threads:
        t.start()
    # while the issuer is stalled (every fetch to it still open), a known key is answered
    assert get(port, token("k1")) == 200
    assert not issuer.open.is_set()
    issuer.open.set()
    for t in threads:
        t.join(30)
    assert len(statuses) == 12 and set(statuses) <= {401, 503}, statuses
    assert issuer.calls - calls <= 2, "made-up kids each fetched the JWKS"
