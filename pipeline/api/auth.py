"""Sign-in for the operator API and the dashboard: OIDC bearer tokens (as Keycloak issues
them), checked against the issuer's JWKS with PyJWT.

A request carries ``Authorization: Bearer <JWT>``.  :class:`OidcAuth` takes the signing
key named by the token's ``kid`` from the issuer's JWKS (:class:`KeyStore`: kept as the
JWKS's cache headers say, at most 10 minutes, refreshed in the background, an unknown
``kid`` refetched at most every 30 s), then checks the signature, ``iss``,
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
import re
import time
from collections.abc import Awaitable, Callable
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
    #: when the token stops being good (Unix seconds); None without sign-in
    expires_at: float | None = None

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


class KeyStore:
    """The issuer's signing keys, fetched from its JWKS and kept as its cache headers say.

    * A key is served from memory while the key set is fresh: ``Cache-Control: max-age``,
      at most ``max_ttl_s`` (10 minutes), at least ``min_ttl_s``.
    * After that, the next request starts one refresh in the background and is served from
      memory meanwhile: a slow identity provider never delays a request whose key is known.
      A key the refreshed set no longer holds is refused from then on.
    * An unknown ``kid`` triggers a refetch at most once per ``unknown_every_s``; every other
      request with an unknown ``kid`` in between is refused at once (401), so tokens with made-up
      kids cannot queue requests behind the issuer.
    * Fetches are single-flight (one at a time, shared by every waiter) with ``timeout_s``.
    * Fail closed: when the issuer cannot be reached, a token signed by a key already held
      is still checked (its signature and expiry do not need the issuer), for at most
      ``max_stale_s`` past the key set's freshness; after that, and for any key not held,
      the answer is 503 naming the issuer's error.  Nothing waits longer than ``timeout_s``.

    ``fetch`` is injected (tests pass one; the worker's default uses aiohttp).
    """

    def __init__(self, url: str, *, fetch: Callable[[str, float], Awaitable[tuple[dict[str, Any], float | None]]] | None = None,
                 timeout_s: float = 3.0, max_ttl_s: float = 600.0, min_ttl_s: float = 30.0,
                 unknown_every_s: float = 30.0, max_stale_s: float = 3600.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.url = url
        self.fetch = fetch or _fetch_jwks
        self.timeout_s = timeout_s
        self.max_ttl_s = max_ttl_s
        self.min_ttl_s = min_ttl_s
        self.unknown_every_s = unknown_every_s
        self.max_stale_s = max_stale_s
        self.clock = clock
        self.keys: dict[str, jwt.PyJWK] = {}
        self.fresh_until = 0.0
        self.last_fetch = -1e18
        self._inflight: asyncio.Task[None] | None = None
        self.fetches = 0
        #: the last failed fetch's error ("" after a success)
        self.last_error = ""

    async def _refresh(self) -> None:
        self.fetches += 1
        self.last_fetch = self.clock()
        try:
            doc, max_age = await asyncio.wait_for(self.fetch(self.url, self.timeout_s), self.timeout_s + 0.5)
        except Exception as exc:
            self.last_error = f"{type(exc).__name__}: {exc}".rstrip(": ")
            raise
        self.last_error = ""
        keys: dict[str, jwt.PyJWK] = {}
        for jwk in doc.get("keys", []) if isinstance(doc, dict) else []:
            if not isinstance(jwk, dict) or not isinstance(jwk.get("kid"), str) or jwk.get("use", "sig") != "sig":
                continue
            try:
                keys[jwk["kid"]] = jwt.PyJWK(jwk)
            except Exception:  # a key type PyJWT cannot use: skipped, not fatal
                continue
        ttl = min(self.max_ttl_s, max(self.min_ttl_s, max_age if max_age is not None else self.max_ttl_s))
        self.keys, self.fresh_until = keys, self.clock() + ttl

    def _start(self) -> asyncio.Task[None]:
        if self._inflight is None or self._inflight.done():
            self._inflight = asyncio.ensure_future(self._refresh())
        return self._inflight

    async def key(self, kid: str) -> jwt.PyJWK:
        """The signing key ``kid``; :class:`AuthError` when there is none (401) or the issuer
        cannot be reached and nothing is known (503)."""
        now = self.clock()
        if kid in self.keys and now < self.fresh_until + self.max_stale_s:
            if now >= self.fresh_until:
                task = self._start()  # refresh behind the request
                task.add_done_callback(lambda t: t.exception())
            return self.keys[kid]
        if kid not in self.keys and self.keys and now - self.last_fetch < self.unknown_every_s \
                and now < self.fresh_until:
            raise AuthError(401, f"unknown signing key {kid!r}")
        try:
            await asyncio.shield(self._start())
        except Exception as exc:
            what = f"key {kid!r}" if kid not in self.keys else f"key {kid!r} (held, but past its freshness)"
            raise AuthError(503, f"cannot check {what}: the issuer's keys at {self.url} cannot be fetched "
                                 f"({self.last_error or type(exc).__name__})") from exc
        if kid not in self.keys:
            raise AuthError(401, f"unknown signing key {kid!r}")
        return self.keys[kid]


async def _fetch_jwks(url: str, timeout_s: float) -> tuple[dict[str, Any], float | None]:
    import aiohttp

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as session:
        async with session.get(url, headers={"Accept": "application/json"}) as r:
            r.raise_for_status()
            doc = await r.json(content_type=None)
            m = re.search(r"max-age=(\d+)", r.headers.get("Cache-Control", ""))
            return doc, float(m.group(1)) if m else None


class OidcAuth:
    """Bearer tokens from ``issuer`` for ``audience``, keys from ``jwks_url``."""

    enabled = True

    def __init__(self, *, issuer: str, audience: str, jwks_url: str | None = None,
                 roles_claim: str = "realm_access.roles", viewer_role: str = "viewer",
                 operator_role: str = "operator", leeway_s: float = 30.0,
                 algorithms: tuple[str, ...] = ("RS256", "RS384", "RS512", "ES256", "ES384", "PS256"),
                 jwks_cache_s: float = 300.0, timeout_s: float = 5.0, client_id: str | None = None,
                 max_stale_s: float = 3600.0, dashboard_client: str | None = None,
                 authorization_url: str | None = None, token_url: str | None = None,
                 logout_url: str | None = None) -> None:
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
        self.keys = KeyStore(self.jwks_url, timeout_s=min(timeout_s, 5.0), max_ttl_s=min(jwks_cache_s, 600.0),
                             min_ttl_s=min(30.0, jwks_cache_s), max_stale_s=max_stale_s)
        # the dashboard's sign-in (authorization code with PKCE); Keycloak's endpoints by default
        oidc = f"{self.issuer}/protocol/openid-connect"
        self.sign_in = None if not dashboard_client else {
            "client_id": dashboard_client,
            "authorization_endpoint": authorization_url or f"{oidc}/auth",
            "token_endpoint": token_url or f"{oidc}/token",
            "end_session_endpoint": logout_url or f"{oidc}/logout",
        }

    def describe(self) -> dict[str, Any]:
        return {"enabled": True, "issuer": self.issuer, "audience": self.audience, "roles_claim": self.roles_claim,
                "roles": {"viewer": [k for k, v in self.role_map.items() if v == "viewer"],
                          "operator": [k for k, v in self.role_map.items() if v == "operator"]},
                "sign_in": self.sign_in}

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
        key = await self.keys.key(header["kid"])
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
        return Principal(str(claims["sub"]), roles, expires_at=float(claims["exp"]))


async def authorize(auth: NoAuth | OidcAuth, authorization: str | None, need: Role) -> Principal:
    """The request's principal if it may do what needs ``need``; else :class:`AuthError`."""
    p = await auth.principal(authorization)
    if not p.allows(need):
        raise AuthError(403, f"{p.subject} lacks the {need} role")
    return p
