"""WebhookNotifier against a real aiohttp server on 127.0.0.1 (ephemeral port)."""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import pytest_asyncio
from aiohttp import web
from aiohttp.test_utils import TestServer

from actuators.base import ActionRequest, Backend, PermanentError, TemporaryError
from actuators.retry import RetryPolicy, call_with_retry
from actuators.webhook import IDEMPOTENCY_HEADER, SIGNATURE_HEADER, WebhookNotifier, sign, verify
from schemas import ActionName, Outcome

pytestmark = pytest.mark.asyncio

SECRET = "s3cret"


@dataclass
class Receiver:
    """What the test server received, and what it answers next (default 200)."""

    server: TestServer
    received: list[tuple[dict[str, str], bytes]] = field(default_factory=list)
    answers: list[tuple[int, dict[str, str]]] = field(default_factory=list)
    delay_s: float = 0.0

    @property
    def url(self) -> str:
        return str(self.server.make_url("/hook"))


@pytest_asyncio.fixture
async def receiver() -> AsyncIterator[Receiver]:
    app = web.Application()
    rx = Receiver(server=TestServer(app, host="127.0.0.1", port=0))

    async def hook(request: web.Request) -> web.Response:
        body = await request.read()
        rx.received.append((dict(request.headers), body))
        if rx.delay_s:
            await asyncio.sleep(rx.delay_s)
        status, headers = rx.answers.pop(0) if rx.answers else (200, {})
        return web.Response(status=status, headers=headers, text="answer")

    app.router.add_post("/hook", hook)
    await rx.server.start_server()
    try:
        yield rx
    finally:
        await rx.server.close()


def escalation(verdict: str = "v-1", target: str = "n1") -> ActionRequest:
    return ActionRequest(verdict, ActionName.escalate, target, {"returns": 3}, reason="lemon")


async def test_posts_a_signed_payload(receiver: Receiver) -> None:
    notifier = WebhookNotifier(receiver.url, secret=SECRET, clock=lambda: 1234.5)
    try:
        assert isinstance(notifier, Backend)
        result = await notifier.apply(escalation())
    finally:
        await notifier.close()
    assert result.outcome is Outcome.applied
    [(headers, body)] = receiver.received
    assert verify(SECRET, body, headers[SIGNATURE_HEADER])
    assert not verify("wrong", body, headers[SIGNATURE_HEADER])
    assert headers[IDEMPOTENCY_HEADER] == "v-1:escalate:n1"
    assert headers["Content-Type"] == "application/json"
    assert json.loads(body) == {
        "key": "v-1:escalate:n1",
        "verdict_id": "v-1",
        "action": "escalate",
        "target": "n1",
        "reason": "lemon",
        "params": {"returns": 3},
        "ts": 1234.5,
    }


async def test_no_signature_without_a_secret(receiver: Receiver) -> None:
    notifier = WebhookNotifier(receiver.url)
    try:
        await notifier.apply(escalation())
    finally:
        await notifier.close()
    assert SIGNATURE_HEADER not in receiver.received[0][0]


async def test_a_repeat_key_is_already_so_without_posting(receiver: Receiver) -> None:
    notifier = WebhookNotifier(receiver.url)
    try:
        assert (await notifier.apply(escalation())).outcome is Outcome.applied
        assert (await notifier.apply(escalation())).outcome is Outcome.already_so
        assert (await notifier.apply(escalation(verdict="v-2"))).outcome is Outcome.applied
    finally:
        await notifier.close()
    assert len(receiver.received) == 2


async def test_concurrent_repeats_post_once(receiver: Receiver) -> None:
    receiver.delay_s = 0.05
    notifier = WebhookNotifier(receiver.url)
    try:
        results = await asyncio.gather(*(notifier.apply(escalation()) for _ in range(5)))
    finally:
        await notifier.close()
    assert sorted(r.outcome.value for r in results) == ["already_so"] * 4 + ["applied"]
    assert len(receiver.received) == 1


async def test_503_is_temporary_with_retry_after_and_is_not_remembered(receiver: Receiver) -> None:
    receiver.answers.append((503, {"Retry-After": "3"}))
    notifier = WebhookNotifier(receiver.url)
    try:
        with pytest.raises(TemporaryError, match="503") as caught:
            await notifier.apply(escalation())
        assert caught.value.delay == 3.0
        assert (await notifier.apply(escalation())).outcome is Outcome.applied
    finally:
        await notifier.close()
    assert len(receiver.received) == 2


@pytest.mark.parametrize(
    ("status", "outcome", "error"),
    [(202, Outcome.applied, None), (409, Outcome.already_so, None), (429, None, TemporaryError),
     (500, None, TemporaryError), (400, None, PermanentError), (404, None, PermanentError),
     (302, None, PermanentError)],
)
async def test_status_codes(receiver: Receiver, status: int, outcome: Outcome | None, error: Any) -> None:
    receiver.answers.append((status, {"Location": "/elsewhere"} if status == 302 else {}))
    notifier = WebhookNotifier(receiver.url)
    try:
        if error is None:
            assert (await notifier.apply(escalation())).outcome is outcome
        else:
            with pytest.raises(error):
                await notifier.apply(escalation())
    finally:
        await notifier.close()
    assert len(receiver.received) == 1


async def test_call_with_retry_rides_out_a_503(receiver: Receiver) -> None:
    receiver.answers.append((503, {}))
    notifier = WebhookNotifier(receiver.url)

    async def no_sleep(delay: float) -> None:
        return None

    try:
        result, attempts = await call_with_retry(lambda: notifier.apply(escalation()), RetryPolicy(), sleep=no_sleep)
    finally:
        await notifier.close()
    assert result.outcome is Outcome.applied and attempts == 2


async def test_a_refused_connection_is_temporary() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    notifier = WebhookNotifier(f"http://127.0.0.1:{port}/hook")
    try:
        with pytest.raises(TemporaryError):
            await notifier.apply(escalation())
    finally:
        await notifier.close()


async def test_a_slow_receiver_times_out_as_temporary(receiver: Receiver) -> None:
    receiver.delay_s = 1.0
    notifier = WebhookNotifier(receiver.url, timeout_s=0.1)
    try:
        with pytest.raises(TemporaryError):
            await notifier.apply(escalation())
    finally:
        await notifier.close()


async def test_supports_escalate_only_unless_told_otherwise(receiver: Receiver) -> None:
    only = WebhookNotifier(receiver.url)
    every = WebhookNotifier(receiver.url, notify_all=True)
    chosen = WebhookNotifier(receiver.url, actions=[ActionName.escalate, ActionName.isolate])
    try:
        assert [a for a in ActionName if only.supports(a)] == [ActionName.escalate]
        assert all(every.supports(a) for a in ActionName)
        assert chosen.supports(ActionName.isolate) and not chosen.supports(ActionName.drain)
        with pytest.raises(PermanentError):
            await only.apply(ActionRequest("v-1", ActionName.isolate, "n1"))
        assert (await every.apply(ActionRequest("v-1", ActionName.isolate, "n1"))).outcome is Outcome.applied
    finally:
        for n in (only, every, chosen):
            await n.close()
    assert len(receiver.received) == 1


async def test_remember_keeps_the_newest_keys_and_forgets_the_oldest() -> None:
    from collections import OrderedDict

    from actuators.webhook import remember

    seen: OrderedDict[str, None] = OrderedDict()
    for k in ("a", "b", "c"):
        remember(seen, k, 3)
    remember(seen, "a", 3)  # seen again: now the newest
    remember(seen, "d", 3)
    assert list(seen) == ["c", "a", "d"]


async def test_a_signature_carries_its_time_and_a_replay_later_is_refused() -> None:
    body = b'{"verdict": "x"}'
    sig = sign(SECRET, body, ts=1_700_000_000)
    assert sig.startswith("t=1700000000,sha256=")
    assert verify(SECRET, body, sig, now=1_700_000_100)
    assert not verify(SECRET, body, sig, now=1_700_000_000 + 301)  # replayed six minutes later
    assert not verify(SECRET, body + b" ", sig, now=1_700_000_100)
    # the time is signed too: moving it forward breaks the signature
    assert not verify(SECRET, body, sig.replace("t=1700000000", "t=1700000200"), now=1_700_000_200)


async def test_malformed_signatures_are_refused_not_raised() -> None:
    body = b"{}"
    for bad in ("", "sha256=abc", "t=x,sha256=abc", "t=1,sha256=é", "ünïcode", None, "t=1", ",,,"):
        assert verify(SECRET, body, bad) is False  # type: ignore[arg-type]
