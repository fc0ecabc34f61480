"""Notify a human-facing system (alerting, ticketing, chat) over an HTTP webhook.

:class:`WebhookNotifier` POSTs one JSON document per action::

    {"key": ..., "verdict_id": ..., "action": ..., "target": ..., "reason": ...,
     "params": {...}, "ts": <unix seconds>}

with the headers ``Idempotency-Key`` (the action's idempotency key) and, when a secret is
configured, ``X-Fleetmedic-Signature: t=<Unix seconds>,sha256=<hex HMAC-SHA256 of
"<t>." + body>`` so the receiver can check who sent it, and when (:func:`verify` refuses a
signature older than 5 minutes: a captured request cannot be replayed later).

A key delivered once is not delivered again by this notifier (``already_so``, nothing
posted); receivers should still de-duplicate by ``Idempotency-Key`` since a restarted
worker forgets.  Answers: 2xx is ``applied``; 409 (the receiver already has this key) is
``already_so``; 408, 429 and 5xx, timeouts and connection errors are
:class:`~actuators.base.TemporaryError` (``Retry-After`` becomes the delay); any other
status is a :class:`~actuators.base.PermanentError`.  Redirects are not followed.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping

import aiohttp

from schemas import ActionName, Outcome

from .base import ActionRequest, ActionResult, PermanentError, TemporaryError

SIGNATURE_HEADER = "X-Fleetmedic-Signature"
IDEMPOTENCY_HEADER = "Idempotency-Key"


#: how old a signature a receiver accepts by default (seconds): a captured request cannot be
#: replayed later than this
MAX_SIGNATURE_AGE_S = 300.0


def sign(secret: str | bytes, body: bytes, ts: float | None = None) -> str:
    """The ``X-Fleetmedic-Signature`` value for ``body`` sent at ``ts`` (default now):
    ``t=<Unix seconds>,sha256=<hex HMAC-SHA256 of "<t>." + body>``."""
    key = secret.encode() if isinstance(secret, str) else secret
    t = str(int(time.time() if ts is None else ts))
    return f"t={t},sha256=" + hmac.new(key, t.encode() + b"." + body, hashlib.sha256).hexdigest()


def verify(secret: str | bytes, body: bytes, signature: str | None, *, now: float | None = None,
           max_age_s: float = MAX_SIGNATURE_AGE_S) -> bool:
    """Whether ``signature`` is a right ``X-Fleetmedic-Signature`` for ``body``, made within
    ``max_age_s`` of ``now``.  A malformed header (missing parts, not ASCII) is False."""
    if not isinstance(signature, str) or not signature.isascii():
        return False
    parts = dict(p.split("=", 1) for p in signature.split(",") if "=" in p)
    t, mac = parts.get("t", ""), parts.get("sha256")
    if not t.isdigit() or mac is None:
        return False
    if abs((time.time() if now is None else now) - int(t)) > max_age_s:
        return False
    return hmac.compare_digest(sign(secret, body, int(t)), signature)


def remember(seen: OrderedDict[str, None], key: str, limit: int) -> None:
    """Mark ``key`` in ``seen`` as newest; beyond ``limit`` keys the oldest are forgotten."""
    seen[key] = None
    seen.move_to_end(key)
    while len(seen) > limit:
        seen.popitem(last=False)


def _retry_after(value: str | None) -> float | None:
    if value is None:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        return None


async def post_signed(session: aiohttp.ClientSession, url: str, body: bytes, *, key: str,
                      secret: str | bytes | None, timeout_s: float, content_type: str = "application/json",
                      headers: Mapping[str, str] | None = None) -> int:
    """POST ``body`` with ``Idempotency-Key: key`` (and its signature when ``secret`` is
    set); returns the status of an answer that took it (2xx, or 409: already had it).

    408, 429, 5xx, timeouts and connection errors raise :class:`TemporaryError`
    (``Retry-After`` as its delay); any other status a :class:`PermanentError`.
    Redirects are not followed.
    """
    h = {**(headers or {}), "Content-Type": content_type, IDEMPOTENCY_HEADER: key}
    if secret:
        h[SIGNATURE_HEADER] = sign(secret, body)
    try:
        async with session.post(url, data=body, headers=h, allow_redirects=False,
                                timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
            status = resp.status
            retry_after = _retry_after(resp.headers.get("Retry-After"))
            text = (await resp.text(errors="replace"))[:200]
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
        raise TemporaryError(f"webhook {url}: {type(exc).__name__}: {exc}") from exc
    if 200 <= status < 300 or status == 409:
        return status
    detail = f"webhook {url}: HTTP {status} {text}".rstrip()
    if status in (408, 429) or status >= 500:
        raise TemporaryError(detail, delay=retry_after)
    raise PermanentError(detail)


class WebhookNotifier:
    """POST actions to ``url`` as JSON.

    ``actions`` are the actions this notifier supports (default: ``escalate`` only);
    ``notify_all=True`` supports every action, making the webhook an audit feed.
    ``timeout_s`` bounds each request.  ``session`` may be passed in (it is then not
    closed here); otherwise one :class:`aiohttp.ClientSession` is created on first use.
    ``clock`` gives the payload's ``ts``.  At most ``remember`` delivered keys are kept.
    """

    name = "webhook"

    def __init__(
        self,
        url: str,
        *,
        secret: str | bytes | None = None,
        actions: Iterable[ActionName] = (ActionName.escalate,),
        notify_all: bool = False,
        timeout_s: float = 10.0,
        headers: Mapping[str, str] | None = None,
        session: aiohttp.ClientSession | None = None,
        clock: Callable[[], float] = time.time,
        remember: int = 100_000,
    ) -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        if remember < 1:
            raise ValueError(f"remember must be >= 1, got {remember}")
        self.url = url
        self.secret = secret
        self.actions = frozenset(ActionName) if notify_all else frozenset(actions)
        self.timeout_s = timeout_s
        self.headers = dict(headers or {})
        self.clock = clock
        self.remember = remember
        self._session = session
        self._owns_session = session is None
        self._delivered: OrderedDict[str, None] = OrderedDict()
        #: per key: the lock that serialises its deliveries and how many callers hold or await it
        self._locks: dict[str, tuple[asyncio.Lock, int]] = {}

    def supports(self, action: ActionName) -> bool:
        return action in self.actions

    def payload(self, request: ActionRequest) -> bytes:
        """The body posted for ``request`` (compact JSON, sorted keys)."""
        doc = {
            "key": request.key,
            "verdict_id": request.verdict_id,
            "action": request.action.value,
            "target": request.target,
            "reason": request.reason,
            "params": request.params,
            "ts": self.clock(),
        }
        return json.dumps(doc, sort_keys=True, separators=(",", ":"), default=str).encode()

    def _session_now(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.timeout_s))
            self._owns_session = True
        return self._session

    async def apply(self, request: ActionRequest) -> ActionResult:
        """Observe: was this key delivered already?  Act: POST it.  Report the answer."""
        if not self.supports(request.action):
            raise PermanentError(f"webhook: action {request.action.value} not enabled")
        key = request.key
        lock, users = self._locks.get(key, (asyncio.Lock(), 0))
        self._locks[key] = (lock, users + 1)
        try:
            async with lock:
                if key in self._delivered:
                    return ActionResult(Outcome.already_so, f"notification {key} already delivered")
                result = await self._post(request)
                remember(self._delivered, key, self.remember)
                return result
        finally:
            lock, users = self._locks[key]
            if users <= 1:
                del self._locks[key]
            else:
                self._locks[key] = (lock, users - 1)

    async def _post(self, request: ActionRequest) -> ActionResult:
        status = await post_signed(self._session_now(), self.url, self.payload(request), key=request.key,
                                   secret=self.secret, timeout_s=self.timeout_s, headers=self.headers)
        if status == 409:
            return ActionResult(Outcome.already_so, f"{self.url} already has {request.key} (HTTP 409)")
        return ActionResult(Outcome.applied, f"notified {self.url} (HTTP {status})")

    async def close(self) -> None:
        if self._session is not None and self._owns_session and not self._session.closed:
            await self._session.close()
        self._session = None
