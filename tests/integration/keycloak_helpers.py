"""A running Keycloak (``deploy/keycloak.sh``) as the tests use it: real tokens from its
token endpoint, and its admin REST API for what an administrator would change (a
client's redirect URIs or token lifespan, a new signing key, a key removed)."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
REALM = "fleetmedic"


def state_dir() -> Path:
    return Path(os.environ.get("FLEETMEDIC_STATE") or Path.home() / ".cache" / "fleetmedic" / "run") / "keycloak"


def script(*args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", str(DEPLOY / "keycloak.sh"), *args], stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=timeout, check=False)


def _http(method: str, url: str, *, form: dict[str, str] | None = None, body: Any = None,
          token: str | None = None, timeout: float = 30) -> tuple[int, Any]:
    data, headers = None, {}
    if form is not None:
        data, headers["Content-Type"] = urllib.parse.urlencode(form).encode(), "application/x-www-form-urlencoded"
    elif body is not None:
        data, headers["Content-Type"] = json.dumps(body).encode(), "application/json"
    if token:
        headers["Authorization"] = f"Bearer {token}"
    req = urllib.request.Request(url, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            raw = r.read()
            return r.status, json.loads(raw) if raw else None
    except urllib.error.HTTPError as e:
        raw = e.read()
        try:
            return e.code, json.loads(raw) if raw else None
        except ValueError:
            return e.code, raw.decode(errors="replace")


class Keycloak:
    """The realm ``fleetmedic`` of the Keycloak that ``deploy/keycloak.sh start`` left running;
    its secrets are read from ``realm.env`` on each use (a restart makes new ones)."""

    @property
    def env(self) -> dict[str, str]:
        out: dict[str, str] = {}
        for line in (state_dir() / "realm.env").read_text().splitlines():
            k, _, v = line.partition("=")
            out[k] = shlex.split(v)[0] if v else ""
        return out

    @property
    def url(self) -> str:
        return self.env["KEYCLOAK_URL"]

    @property
    def issuer(self) -> str:
        return self.env["KEYCLOAK_ISSUER"]

    def password(self, user: str) -> str:
        return self.env[f"KEYCLOAK_{user.upper()}_PASSWORD"]

    def token_response(self, grant: str, *, user: str | None = None, client: str = "fleetmedic") -> tuple[int, Any]:
        form = {"grant_type": grant, "client_id": client}
        if client == "fleetmedic":
            form["client_secret"] = self.env["KEYCLOAK_CLIENT_SECRET"]
        if grant == "password":
            assert user is not None
            form |= {"username": user, "password": self.password(user), "scope": "openid"}
        return _http("POST", f"{self.issuer}/protocol/openid-connect/token", form=form)

    def token(self, grant: str = "password", *, user: str | None = None, client: str = "fleetmedic") -> str:
        status, body = self.token_response(grant, user=user, client=client)
        assert status == 200 and body.get("access_token"), (status, body)
        return str(body["access_token"])

    # -------------------------------------------------------------- the admin REST API

    def admin(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        status, tok = _http("POST", f"{self.url}/realms/master/protocol/openid-connect/token",
                            form={"grant_type": "password", "client_id": "admin-cli", "username": "admin",
                                  "password": self.env["KEYCLOAK_ADMIN_PASSWORD"]})
        assert status == 200, (status, tok)
        return _http(method, f"{self.url}/admin/realms/{REALM}{path}", body=body, token=tok["access_token"])

    def client(self, client_id: str) -> dict[str, Any]:
        status, found = self.admin("GET", f"/clients?clientId={urllib.parse.quote(client_id)}")
        assert status == 200 and len(found) == 1, (status, found)
        return dict(found[0])

    def update_client(self, client_id: str, **changes: Any) -> None:
        c = self.client(client_id)
        attrs = {**c.get("attributes", {}), **changes.pop("attributes", {})}
        status, body = self.admin("PUT", f"/clients/{c['id']}", {**c, **changes, "attributes": attrs})
        assert status == 204, (status, body)

    def active_key(self, alg: str = "RS256") -> dict[str, Any]:
        """The key that signs new tokens: the active one of ``alg`` with the highest priority."""
        status, keys = self.admin("GET", "/keys")
        assert status == 200, (status, keys)
        mine = [k for k in keys["keys"] if k.get("algorithm") == alg and k.get("status") == "ACTIVE"]
        return dict(max(mine, key=lambda k: int(k.get("providerPriority", 0))))

    def add_signing_key(self, name: str, priority: int) -> None:
        """A new generated RSA key provider, as an administrator rotates keys."""
        realm = self.admin("GET", "")[1]
        status, body = self.admin("POST", "/components", {
            "name": name, "providerId": "rsa-generated", "providerType": "org.keycloak.keys.KeyProvider",
            "parentId": realm["id"], "config": {"priority": [str(priority)], "keySize": ["2048"],
                                                "active": ["true"], "enabled": ["true"], "algorithm": ["RS256"]}})
        assert status == 201, (status, body)

    def remove_key_provider(self, provider_id: str) -> None:
        status, body = self.admin("DELETE", f"/components/{provider_id}")
        assert status == 204, (status, body)
