"""The burst bench's node watch: a bookmark moves the version on (it once read as an
error and made the watch list every node again), an ERROR event lists again, and a node
counts as done only when cordoned, tainted and conditioned."""

from __future__ import annotations

import time
from typing import Any

import orjson

from pipeline.eval.burst import CONDITION, TAINT_KEY, NodeWatch


def node(name: str, rv: str, *, done: bool) -> dict[str, Any]:
    return {"metadata": {"name": name, "resourceVersion": rv},
            "spec": {"unschedulable": True, "taints": [{"key": TAINT_KEY, "effect": "NoSchedule"}]} if done else {},
            "status": {"conditions": [{"type": CONDITION, "status": "True"}] if done else []}}


class Resp:
    def __init__(self, data: bytes = b"", lines: list[bytes] | None = None) -> None:
        self.data, self.lines = data, lines or []

    def __iter__(self):
        return iter(self.lines)

    def release_conn(self) -> None:
        return None


class FakeCore:
    """``list_node`` as the raw client answers it: a list, then one watch stream per call."""

    def __init__(self, streams: list[list[dict[str, Any]]]) -> None:
        self.streams = streams
        self.lists = 0
        self.watched_from: list[str] = []

    def list_node(self, **kw: Any) -> Resp:
        if kw.get("watch"):
            self.watched_from.append(kw["resource_version"])
            events = self.streams.pop(0) if self.streams else []
            if not self.streams:
                time.sleep(0.05)
            return Resp(lines=[orjson.dumps(e) + b"\n" for e in events])
        self.lists += 1
        return Resp(data=orjson.dumps({"metadata": {"resourceVersion": "10"},
                                       "items": [node("a", "9", done=False)]}))


def run(core: FakeCore, until: Any) -> NodeWatch:
    w = NodeWatch(core=core)
    with w:
        end = time.time() + 5
        while time.time() < end and not until(w):
            time.sleep(0.01)
    return w


def test_a_bookmark_moves_the_version_on_without_listing_again() -> None:
    core = FakeCore([
        [{"type": "BOOKMARK", "object": {"kind": "Node", "metadata": {"resourceVersion": "20"}}}],
        [{"type": "MODIFIED", "object": node("a", "21", done=True)}],
    ])
    w = run(core, lambda w: "a" in w.done)
    assert "a" in w.done
    assert core.lists == 1 and w.errors == []
    assert core.watched_from[:2] == ["10", "20"]


def test_an_error_event_lists_again_and_a_half_isolated_node_is_not_done() -> None:
    half = node("a", "11", done=True)
    half["status"]["conditions"] = []  # cordoned and tainted, the condition not yet set
    core = FakeCore([
        [{"type": "MODIFIED", "object": half}],
        [{"type": "ERROR", "object": {"kind": "Status", "code": 410, "message": "too old resource version"}}],
        [{"type": "MODIFIED", "object": node("a", "12", done=True)}],
    ])
    w = run(core, lambda w: "a" in w.done)
    assert "a" in w.done and core.lists == 2
    assert any("too old resource version" in e for e in w.errors)
