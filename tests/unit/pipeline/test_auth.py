"""OIDC bearer tokens: a locally generated key pair, its JWKS served on loopback."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import jwt
import pytest
import pytest_asyncio
from aiohttp import web
from aiohttp.test_utils import TestServer
from cryptography.hazmat.primitives.asymmetric import rsa

from pipeline.api.auth import AuthError, KeyStore, NoAuth, OidcAuth, authorize

ISSUER = "http://127.0.0.1/realms/fleet"
AUDIENCE = "fleetmedic"


def _key() -> rsa.RSAPrivateKey:
    return rsa.generate_private_key(public_exponent=65537, key_size=2048)


KEY, OTHER = _key(), _key()


def token(roles: list[str] | None = None, *, key: rsa.RSAPrivateKey = KEY, kid: str = "k1", exp_in: float = 300,
          iss: str = ISSUER, aud: str = AUDIENCE, **extra: Any) -> str:
    now = time.time()
    claims = {"sub": "alice", "iss": iss, "aud": aud, "iat": int(now), "exp": int(now + exp_in),
              "realm_access": {"roles": roles or []}, **extra}
    return jwt.encode(claims, key, algorithm="RS256", headers={"kid": kid})


@pytest_asyncio.fixture
async def jwks() -> AsyncIterator[str]:
    pub = json.loads(jwt.algorithms.RSAAlgorithm.to_jwk(KEY.public_key()))
    doc = {"keys": [{**pub, "kid": "k1", "use": "sig", "alg": "RS256"}]}
    async def certs(request: web.Request) -> web.Response:
        return web.json_response(doc)

    app = web.Application()
    app.router.add_get("/certs", certs)
    server = TestServer(app, host="127.0.0.1", port=0)
    await server.start_server()
    try:
        yield str(server.make_url("/certs"))
    finally:
        await server.close()


def auth(url: str) -> OidcAuth:
    return OidcAuth(issuer=ISSUER, audience=AUDIENCE, jwks_url=url, leeway_s=0)


@pytest.mark.asyncio
async def test_viewer_reads_operator_changes(jwks: str) -> None:
    a = auth(jwks)
    v = await authorize(a, f"Bearer {token(['viewer'])}", "viewer")
    assert v.subject == "alice" and v.roles == {"viewer"}
    op = await authorize(a, f"Bearer {token(['operator', 'offline_access'])}", "operator")
    assert op.roles == {"operator"} and op.allows("viewer")
    with pytest.raises(AuthError) as e:
        await authorize(a, f"Bearer {token(['viewer'])}", "operator")
    assert e.value.status == 403 and "operator" in e.value.reason
    with pytest.raises(AuthError) as e:
        await authorize(a, f"Bearer {token(['uma_authorization'])}", "viewer")
    assert e.value.status == 403


@pytest.mark.asyncio
@pytest.mark.parametrize("header, reason", [
    (None, "no bearer token"),
    ("Basic YWxpY2U6cHc=", "must be 'Bearer"),
    ("Bearer not-a-jwt", "unreadable token header"),
])
async def test_missing_or_malformed_tokens_are_401(jwks: str, header: str | None, reason: str) -> None:
    with pytest.raises(AuthError) as e:
        await authorize(auth(jwks), header, "viewer")
    assert e.value.status == 401 and reason in e.value.reason


@pytest.mark.asyncio
@pytest.mark.parametrize("make, reason", [
    (lambda: token(["operator"], exp_in=-60), "expired"),
    (lambda: token(["operator"], key=OTHER), "invalid token"),  # right kid, wrong key: bad signature
    (lambda: token(["operator"], key=OTHER, kid="k2"), "unknown signing key"),
    (lambda: token(["operator"], aud="another-app"), "audience"),
    (lambda: token(["operator"], iss="http://127.0.0.1/realms/other"), "issuer"),
    (lambda: token(["operator"], nbf=int(time.time()) + 600), "not yet valid"),
])
async def test_bad_tokens_are_401(jwks: str, make, reason: str) -> None:
    with pytest.raises(AuthError) as e:
        await authorize(auth(jwks), f"Bearer {make()}", "viewer")
    assert e.value.status == 401
    assert reason in e.value.reason.lower()


@pytest.mark.asyncio
async def test_unreachable_jwks_is_503_not_a_pass() -> None:
    a = OidcAuth(issuer=ISSUER, audience=AUDIENCE, jwks_url="http://127.0.0.1:9/certs", timeout_s=1)
    with pytest.raises(AuthError) as e:
        await authorize(a, f"Bearer {token(['operator'])}", "viewer")
    assert e.value.status == 503


@pytest.mark.asyncio
async def test_auth_off_lets_everyone_in_and_says_so() -> None:
    p = await authorize(NoAuth(), None, "operator")
    assert not p.authenticated and p.allows("operator")
    assert NoAuth().describe()["enabled"] is False


def test_keycloak_default_jwks_url_and_required_fields() -> None:
    a = OidcAuth(issuer="https://kc.example/realms/gpu/", audience="fleetmedic")
    assert a.jwks_url == "https://kc.example/realms/gpu/protocol/openid-connect/certs"
    with pytest.raises(ValueError, match="audience"):
        OidcAuth(issuer=ISSUER, audience="")


# ------------------------------------------------------------------ the key store


class _Issuer:
    """An identity provider's JWKS endpoint as the key store sees it: a document, its
    max-age, how long an answer takes, and a count of the fetches."""

    def __init__(self, keys: dict[str, Any], max_age: float | None = 300.0, delay: float = 0.0) -> None:
        self.keys, self.max_age, self.delay, self.calls = keys, max_age, delay, 0

    async def __call__(self, url: str, timeout: float) -> tuple[dict[str, Any], float | None]:
        self.calls += 1
        await asyncio.sleep(self.delay)
        return {"keys": [{**jwk, "kid": kid} for kid, jwk in self.keys.items()]}, self.max_age


def _jwk(key: Any) -> dict[str, Any]:
    return {**json.loads(jwt.algorithms.RSAAlgorithm.to_jwk(key.public_key())), "use": "sig", "alg": "RS256"}


@pytest.mark.asyncio
async def test_a_key_removed_from_the_jwks_is_refused_after_the_next_refresh() -> None:
    now = [0.0]
    issuer = _Issuer({"k1": _jwk(KEY), "k2": _jwk(OTHER)}, max_age=60)
    store = KeyStore("u", fetch=issuer, clock=lambda: now[0])
    assert (await store.key("k2")).key_id == "k2"
    issuer.keys.pop("k2")
    now[0] = 61.0  # stale: the next request is served from memory and refreshes behind it
    assert (await store.key("k2")).key_id == "k2"
    await asyncio.sleep(0)
    await store._inflight
    with pytest.raises(AuthError) as e:
        await store.key("k2")
    assert e.value.status == 401 and issuer.calls == 2


@pytest.mark.asyncio
async def test_keys_live_as_the_cache_headers_say_but_never_longer_than_ten_minutes() -> None:
    now = [0.0]
    store = KeyStore("u", fetch=_Issuer({"k1": _jwk(KEY)}, max_age=86400), clock=lambda: now[0])
    await store.key("k1")
    assert store.fresh_until == 600.0
    store2 = KeyStore("u", fetch=_Issuer({"k1": _jwk(KEY)}, max_age=None), clock=lambda: now[0])
    await store2.key("k1")
    assert store2.fresh_until == 600.0


@pytest.mark.asyncio
async def test_a_slow_issuer_never_delays_a_request_whose_key_is_known_and_unknown_kids_cannot_queue() -> None:
    now = [0.0]
    issuer = _Issuer({"k1": _jwk(KEY)}, max_age=60)
    store = KeyStore("u", fetch=issuer, clock=lambda: now[0], timeout_s=3.0)
    await store.key("k1")
    issuer.delay = 2.5
    now[0] = 61.0
    t0 = time.monotonic()
    await store.key("k1")  # stale: refreshed behind, answered at once
    assert time.monotonic() - t0 < 0.5
    await store._inflight
    # twelve made-up kids at once: one refetch at most, the rest refused without waiting
    now[0] = 62.0
    issuer.delay = 0.0
    calls = issuer.calls
    results = await asyncio.gather(*(store.key(f"made-up-{i}") for i in range(12)), return_exceptions=True)
    assert all(isinstance(r, AuthError) and r.status == 401 for r in results)
    assert issuer.calls - calls <= 1


@pytest.mark.asyncio
async def test_fetches_are_single_flight() -> None:
    issuer = _Issuer({"k1": _jwk(KEY)}, delay=0.2)
    store = KeyStore("u", fetch=issuer)
    keys = await asyncio.gather(*(store.key("k1") for _ in range(20)))
    assert {k.key_id for k in keys} == {"k1"} and issuer.calls == 1


@pytest.mark.asyncio
async def test_a_token_issued_to_another_client_or_in_another_algorithm_is_refused(jwks: str) -> None:
    a = OidcAuth(issuer=ISSUER, audience=AUDIENCE, jwks_url=jwks, leeway_s=0, client_id="fleetmedic")
    assert (await authorize(a, f"Bearer {token(['viewer'], azp='fleetmedic')}", "viewer")).subject == "alice"
    with pytest.raises(AuthError) as e:
        await authorize(a, f"Bearer {token(['viewer'], azp='grafana')}", "viewer")
    assert e.value.status == 401 and "azp" in e.value.reason
    # the JWK publishes RS256: the same key signing PS256 is refused
    now = time.time()
    ps = jwt.encode({"sub": "alice", "iss": ISSUER, "aud": AUDIENCE, "exp": int(now + 60),
                     "realm_access": {"roles": ["viewer"]}}, KEY, algorithm="PS256", headers={"kid": "k1"})
    with pytest.raises(AuthError):
        await authorize(a, f"Bearer {ps}", "viewer")
    # an ID token (Keycloak's typ claim) does not sign in
    with pytest.raises(AuthError) as e:
        await authorize(a, f"Bearer {token(['viewer'], typ='ID')}", "viewer")
    assert "ID token" in e.value.reason


@pytest.mark.asyncio
async def test_with_the_issuer_down_a_held_key_serves_until_it_is_too_stale_then_every_check_fails_closed() -> None:
    now = [0.0]
    issuer = _Issuer({"k1": _jwk(KEY)}, max_age=60)
    store = KeyStore("http://kc/certs", fetch=issuer, clock=lambda: now[0], max_stale_s=600)
    await store.key("k1")

    async def down(url: str, timeout: float) -> tuple[dict[str, Any], float | None]:
        raise ConnectionRefusedError("Connect call failed ('127.0.0.1', 8080)")

    store.fetch = down
    now[0] = 100.0  # stale: served from memory, the refresh behind it fails
    assert (await store.key("k1")).key_id == "k1"
    with pytest.raises(ConnectionRefusedError):
        await store._inflight
    assert "Connect call failed" in store.last_error
    now[0] = 131.0  # a kid it does not hold cannot be checked: 503 with the issuer's error
    with pytest.raises(AuthError) as e:
        await store.key("k9")
    assert e.value.status == 503 and "Connect call failed" in e.value.reason and "http://kc/certs" in e.value.reason
    now[0] = 60.0 + 600.0 + 1  # past freshness plus max_stale_s: the held key is no longer trusted
    with pytest.raises(AuthError) as e:
        await store.key("k1")
    assert e.value.status == 503 and "past its freshness" in e.value.reason
    store.fetch = issuer  # the issuer is back: the key is good again
    assert (await store.key("k1")).key_id == "k1" and store.last_error == ""
