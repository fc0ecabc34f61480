"""Sign-in for the operator API and the dashboard: OIDC bearer tokens (as Keycloak issues
them), checked against the issuer's JWKS with PyJWT.

A request carries ``Authorization: Bearer <JWT>``.  :class:`OidcAuth` fetches the signing
key named by the token's ``kid`` from the JWKS (cached, refetched for an unknown ``kid``,
in a thread so the event loop never waits on it), then checks the signature, ``iss``,
``aud``, ``exp`` (and ``nbf``/``iat`` when present, with ``leeway_s``) and reads the roles
from ``roles_claim`` (Keycloak: ``realm_access.roles``).  Roles: ``viewer`` reads,
``operator`` reads and changes (an operator is a viewer too).  Every refusal says why:
401 for no token or a bad one (expired, wrong issuer or audience, unknown key, bad
signature), 403 for a good token without the role.

:class:`NoAuth` (``auth.enabled = false``, the demo's default) lets every request in as
an anonymous operator; the API and the dashboard say that sign-in is off.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any, Literal

import jwt

Role = Literal["viewer", "operator"]


class AuthError(Exception):
    """A refused request: ``status`` 401 (who are you?) or 403 (not allowed)."""

    def __init__(self, status: int, reason: str) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason


@dataclass(frozen=True)
class Principal:
    subject: str
    roles: frozenset[str]
    authenticated: bool = True

    def allows(self, need: Role) -> bool:
        return "operator" in self.roles or (need == "viewer" and "viewer" in self.roles)


def _claim(claims: dict[str, Any], path: str) -> Any:
    cur: Any = claims
    for part in path.split("."):
        if not isinstance(cur, dict):
            return None
        cur = cur.get(part)
    return cur


class NoAuth:
    """Sign-in off: every request is an anonymous operator."""

    enabled = False

    async def principal(self, authorization: str | None) -> Principal:
        return Principal("anonymous", frozenset({"viewer", "operator"}), authenticated=False)

    def describe(self) -> dict[str, Any]:
        return {"enabled": False, "note": "sign-in is off: anyone who reaches this port can read and act"}


class OidcAuth:
    """Bearer tokens from ``issuer`` for ``audience``, keys from ``jwks_url``."""

    enabled = True

    def __init__(self, *, issuer: str, audience: str, jwks_url: str | None = None,
                 roles_claim: str = "realm_access.roles", viewer_role: str = "viewer",
                 operator_role: str = "operator", leeway_s: float = 30.0,
                 algorithms: tuple[str, ...] = ("RS256", "RS384", "RS512", "ES256", "ES384", "PS256"),
                 jwks_cache_s: float = 300.0, timeout_s: float = 5.0, client_id: str | None = None) -> None:
        if not issuer:
            raise ValueError("issuer is required")
        if not audience:
            raise ValueError("audience is required")
        self.issuer = issuer.rstrip("/")
        self.audience = audience
        # Keycloak publishes its keys here; other issuers name theirs in the discovery document
        self.jwks_url = jwks_url or f"{self.issuer}/protocol/openid-connect/certs"
        self.roles_claim = roles_claim
        self.role_map = {viewer_role: "viewer", operator_role: "operator"}
        self.leeway_s = leeway_s
        self.client_id = client_id
        self.algorithms = list(algorithms)
        self.jwks = jwt.PyJWKClient(self.jwks_url, cache_keys=True, lifespan=int(jwks_cache_s), timeout=int(timeout_s))

    def describe(self) -> dict[str, Any]:
        return {"enabled": True, "issuer": self.issuer, "audience": self.audience, "roles_claim": self.roles_claim}

    async def principal(self, authorization: str | None) -> Principal:
        if not authorization:
            raise AuthError(401, "no bearer token (Authorization: Bearer <token>)")
        scheme, _, token = authorization.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise AuthError(401, "the Authorization header must be 'Bearer <token>'")
        token = token.strip()
        try:
            header = jwt.get_unverified_header(token)
        except Exception as exc:  # any malformed header is the client's problem, never a 500
            raise AuthError(401, f"unreadable token header: {type(exc).__name__}") from exc
        if not isinstance(header.get("kid"), str) or not header["kid"]:
            raise AuthError(401, "the token's header names no key (kid)")
        if header.get("typ") not in (None, "JWT", "at+jwt", "application/at+jwt"):
            raise AuthError(401, f"not an access token (typ {header.get('typ')!r})")
        try:
            key = await asyncio.to_thread(self.jwks.get_signing_key_from_jwt, token)
        except jwt.PyJWKClientConnectionError as exc:
            raise AuthError(503, f"cannot fetch the issuer's keys: {exc}") from exc
        except Exception as exc:
            raise AuthError(401, f"no signing key for this token: {type(exc).__name__}") from exc
        # a key that names its algorithm is used with that algorithm only
        published = (getattr(key, "_jwk_data", None) or {}).get("alg")  # PyJWK keeps the JWK it was built from
        algorithms = [published] if published in self.algorithms else self.algorithms
        try:
            claims = jwt.decode(token, key.key, algorithms=algorithms, audience=self.audience,
                                issuer=self.issuer, leeway=self.leeway_s,
                                options={"require": ["exp", "iss", "aud", "sub"]})
        except jwt.ExpiredSignatureError as exc:
            raise AuthError(401, "token expired") from exc
        except jwt.InvalidTokenError as exc:
            raise AuthError(401, f"invalid token: {exc}") from exc
        except Exception as exc:
            raise AuthError(401, f"invalid token: {type(exc).__name__}") from exc
        if str(claims.get("typ", "Bearer")).lower() not in ("bearer", "at+jwt"):
            raise AuthError(401, f"not an access token (typ {claims.get('typ')!r}): an ID token does not sign in")
        if self.client_id and claims.get("azp") not in (None, self.client_id):
            raise AuthError(401, f"issued to another client (azp {claims.get('azp')!r})")
        raw = _claim(claims, self.roles_claim)
        names = raw if isinstance(raw, list) else []
        roles = frozenset(self.role_map[r] for r in names if isinstance(r, str) and r in self.role_map)
        return Principal(str(claims["sub"]), roles)


async def authorize(auth: NoAuth | OidcAuth, authorization: str | None, need: Role) -> Principal:
    """The request's principal if it may do what needs ``need``; else :class:`AuthError`."""
    p = await auth.principal(authorization)
    if not p.allows(need):
        raise AuthError(403, f"{p.subject} lacks the {need} role")
    return p
