"""Bad input on the operator's paths is refused with a clear reason before anything is
sent: an oversized or malformed body, an unknown node, a change its state does not allow."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from pipeline.api.auth import NoAuth
from pipeline.api.gate import GateConfig, check
from pipeline.api.views import BadBody, change_refused, read_body


class _Request:
    def __init__(self, raw: bytes) -> None:
        self.raw = raw

    async def read(self) -> bytes:
        return self.raw


def _body(raw: bytes, allowed: dict[str, type]) -> dict[str, Any]:
    return asyncio.run(read_body(_Request(raw), allowed))


def test_a_body_is_empty_or_an_object_of_the_routes_fields() -> None:
    assert _body(b"", {"reason": str}) == {}
    assert _body(b"  \n", {}) == {}
    assert _body(b'{"reason": "fan failed"}', {"reason": str}) == {"reason": "fan failed"}
    for raw, allowed, why in [
        (b"{not json", {"reason": str}, "body is not JSON"),
        (b"[1, 2]", {"reason": str}, "must be a JSON object, not list"),
        (b'{"reason": 3}', {"reason": str}, "'reason' must be str, not int"),
        (b'{"resaon": "x"}', {"reason": str}, "unknown field(s) 'resaon'; this route takes 'reason'"),
        (b'{"x": 1}', {}, "this route takes no body"),
        (b'{"reason": ""}', {"reason": str}, "1 to 500 characters"),
        (b'{"enabled": "yes"}', {"enabled": bool}, "'enabled' must be bool, not str"),
    ]:
        with pytest.raises(BadBody, match=None) as got:
            _body(raw, allowed)
        assert why in str(got.value), (raw, str(got.value))


def test_a_change_of_an_unknown_node_or_one_its_state_does_not_allow_is_refused() -> None:
    held = {"v1/isolate/n3": {"target": "n3", "verdict_id": "v1"}}
    assert change_refused("ghost", None, False, "return", held)[0] == 404
    assert "no node 'ghost'" in change_refused("ghost", None, False, "hold", held)[1]
    # known by its telemetry alone: healthy
    assert change_refused("n1", None, True, "return", held) == (409, "node 'n1' is healthy and in service: nothing to return")
    assert change_refused("n1", None, True, "hold", held) is None
    assert change_refused("n2", {"state": "isolated"}, True, "return", held) is None
    assert change_refused("n2", {"state": "diagnosing"}, True, "hold", held) == (
        409, "node 'n2' is already out of service (diagnosing)")
    status, why = change_refused("n3", {"state": "isolated"}, True, "hold", held)
    assert status == 409 and "POST /api/v1/held/v1/isolate/n3/approve" in why
    assert change_refused("n4", {"state": "suspect"}, True, "hold", held) is None


def test_the_gate_refuses_an_oversized_body_by_its_length() -> None:
    cfg = GateConfig(auth=NoAuth(), allowed_hosts=frozenset({"127.0.0.1"}), max_body=1000)
    base = {"Host": "127.0.0.1", "Content-Type": "application/json"}
    refusal, _ = check(cfg, "POST", "/api/v1/nodes/n1/hold", "/api/v1/nodes/{node}/hold",
                       {**base, "Content-Length": "1001"})
    assert refusal is not None and refusal.status == 413 and "1001 bytes is over the limit of 1000" in refusal.reason
    refusal, _ = check(cfg, "POST", "/api/v1/nodes/n1/hold", "/api/v1/nodes/{node}/hold",
                       {**base, "Content-Length": "many"})
    assert refusal is not None and refusal.status == 400
    assert check(cfg, "POST", "/api/v1/nodes/n1/hold", None, {**base, "Content-Length": "1000"})[0] is None


def test_with_several_workers_a_node_another_holds_is_not_refused_here() -> None:
    assert change_refused("elsewhere", None, False, "hold", {}, everyone=False) is None
    assert change_refused("elsewhere", None, False, "hold", {}, everyone=True)[0] == 404
