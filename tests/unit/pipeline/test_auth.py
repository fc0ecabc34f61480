"""OIDC bearer tokens: a locally generated key pair, its JWKS served on loopback."""

from __future__ import annotations

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

from pipeline.auth import AuthError, NoAuth, OidcAuth, authorize

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
    (lambda: token(["operator"], key=OTHER, kid="k2"), "no signing key"),
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
