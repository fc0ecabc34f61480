"""The node cache (actuators.k8s_nodes) and how an isolation uses it: writes from the
cache are conditional, a lagging cache costs a read and no wrong write, "already so" is
confirmed on the server, and a burst's Events follow its containment."""

from __future__ import annotations

import asyncio
import copy
from datetime import datetime
from typing import Any

import pytest

from actuators.k8s_nodes import NodeCache, as_node, trim
from actuators.kubernetes import ANNOTATION_PREFIX, CONDITION_QUARANTINE, KubernetesBackend
from schemas import ActionName, Outcome

from tests.unit.actuators.test_kubernetes import TAINT, FakeBatchV1Api, FakeCoreV1Api, condition, req, taint_keys

FOREIGN = {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule", "timeAdded": "2026-11-30T08:00:00Z"}


def cache_of(core: FakeCoreV1Api) -> NodeCache:
    """A cache synced from the fake's nodes as a list would give them (no thread)."""
    cache = NodeCache(lambda **kw: None, conditions=(CONDITION_QUARANTINE,), annotation_prefix=ANNOTATION_PREFIX)
    cache.replace({"metadata": {"resourceVersion": "1"}, "items": copy.deepcopy(list(core.nodes.values()))})
    return cache


def backend_with(core: FakeCoreV1Api, cache: NodeCache | None) -> KubernetesBackend:
    return KubernetesBackend(core, FakeBatchV1Api(), node_cache=cache)  # type: ignore[arg-type]


def test_trim_keeps_what_an_isolation_compares_and_drops_the_rest() -> None:
    node = {"metadata": {"name": "n1", "uid": "u1", "resourceVersion": "7",
                         "annotations": {"fleetmedic.dev/verdict": "v-1", "kubeadm.alpha/cri": "x" * 500},
                         "labels": {"a": "b"}},
            "spec": {"unschedulable": True, "taints": [FOREIGN], "podCIDR": "10.0.0.0/24"},
            "status": {"conditions": [{"type": "Ready", "status": "True"},
                                      {"type": CONDITION_QUARANTINE, "status": "True", "reason": "FleetmedicIsolated"}],
                       "images": [{"names": ["big"], "sizeBytes": 1}]}}
    t = trim(node, conditions=(CONDITION_QUARANTINE,), annotation_prefix=ANNOTATION_PREFIX)
    assert t == {"name": "n1", "uid": "u1", "resourceVersion": "7", "annotations": {"fleetmedic.dev/verdict": "v-1"},
                 "unschedulable": True, "taints": [FOREIGN],
                 "conditions": [{"type": CONDITION_QUARANTINE, "status": "True", "reason": "FleetmedicIsolated"}]}
    model = as_node(t)
    assert model.metadata.resource_version == "7" and model.metadata.uid == "u1"
    assert [(x.key, x.value, x.effect) for x in model.spec.taints] == [("nvidia.com/gpu", "present", "NoSchedule")]
    assert [c.type for c in model.status.conditions] == [CONDITION_QUARANTINE]


def test_events_move_the_map_and_its_version() -> None:
    core = FakeCoreV1Api()
    core.add_node("n1")
    cache = NodeCache(lambda **kw: None, conditions=(CONDITION_QUARANTINE,), annotation_prefix=ANNOTATION_PREFIX)
    assert cache.get("n1") is None  # not synced: every lookup misses
    cache.replace({"metadata": {"resourceVersion": "10"}, "items": [copy.deepcopy(core.nodes["n1"])]})
    assert cache.get("n1") is not None and cache.version == "10"
    changed = copy.deepcopy(core.nodes["n1"])
    changed["metadata"]["resourceVersion"] = "11"
    changed["spec"]["unschedulable"] = True
    cache.apply("MODIFIED", changed)
    assert cache.get("n1").spec.unschedulable is True and cache.version == "11"
    cache.apply("BOOKMARK", {"kind": "Node", "metadata": {"resourceVersion": "15"}})
    assert cache.version == "15" and set(cache.nodes) == {"n1"}
    cache.apply("DELETED", {**changed, "metadata": {**changed["metadata"], "resourceVersion": "16"}})
    assert cache.get("n1") is None and cache.version == "16"


@pytest.mark.asyncio
async def test_an_isolation_from_the_cache_writes_without_reading_and_keeps_foreign_taints() -> None:
    core = FakeCoreV1Api()
    core.add_node("n1", taints=[FOREIGN])
    backend = backend_with(core, cache_of(core))
    got = await backend.apply(req(ActionName.isolate, "n1", fault_class="gpu_hardware"))
    assert got.outcome is Outcome.applied, got.detail
    assert core.calls_to("read_node") == []
    node = core.node("n1")
    assert node.spec.unschedulable is True
    assert taint_keys(node) == [("nvidia.com/gpu", "present"), (TAINT, "gpu_hardware")]
    sent = core.nodes["n1"]["spec"]["taints"][0]  # the foreign taint sent back as it was
    assert {k: sent[k] for k in ("key", "value", "effect")} == {k: FOREIGN[k] for k in ("key", "value", "effect")}
    assert datetime.fromisoformat(sent["timeAdded"]) == datetime.fromisoformat(FOREIGN["timeAdded"])
    assert condition(node) == "True"
    [event] = core.events.values()  # one isolation alone: its Event at once
    assert event["reason"] == "FleetmedicIsolate"


@pytest.mark.asyncio
async def test_a_lagging_cache_costs_a_read_and_no_lost_taint() -> None:
    core = FakeCoreV1Api()
    core.add_node("n1")
    cache = cache_of(core)
    # someone taints the node after the cache saw it; the watch has not caught up
    core.nodes["n1"]["spec"]["taints"] = [FOREIGN]
    core._bump(core.nodes["n1"])
    backend = backend_with(core, cache)
    got = await backend.apply(req(ActionName.isolate, "n1", fault_class="gpu_hardware"))
    assert got.outcome is Outcome.applied, got.detail
    assert len(core.calls_to("read_node")) == 1  # the 409 sent it to the server once
    assert taint_keys(core.node("n1")) == [("nvidia.com/gpu", "present"), (TAINT, "gpu_hardware")]


@pytest.mark.asyncio
async def test_already_so_is_never_taken_from_the_cache_alone() -> None:
    core = FakeCoreV1Api()
    core.add_node("n1")
    backend = backend_with(core, None)
    assert (await backend.apply(req(ActionName.isolate, "n1", fault_class="gpu_hardware"))).outcome is Outcome.applied
    cache = cache_of(core)  # sees n1 isolated
    # a person returns the node by hand; the cache has not seen it yet
    core.nodes["n1"]["spec"] = {"taints": []}
    core.nodes["n1"]["status"]["conditions"] = [c for c in core.nodes["n1"]["status"]["conditions"]
                                                if c["type"] != CONDITION_QUARANTINE]
    core._bump(core.nodes["n1"])
    again = backend_with(core, cache)
    got = await again.apply(req(ActionName.isolate, "n1", verdict="v-2", fault_class="gpu_hardware"))
    assert got.outcome is Outcome.applied, got.detail
    node = core.node("n1")
    assert node.spec.unschedulable is True and condition(node) == "True"


@pytest.mark.asyncio
async def test_the_events_of_a_burst_follow_its_containment() -> None:
    core = FakeCoreV1Api()
    names = [f"n{i}" for i in range(6)]
    for n in names:
        core.add_node(n)
    backend = backend_with(core, cache_of(core))
    order: list[str] = []
    real_patch, real_event = core.patch_node_status, core.create_namespaced_event

    def patch_status(name: str, body: Any, **kw: Any) -> Any:
        order.append(f"condition {name}")
        return real_patch(name, body, **kw)

    def create_event(namespace: str, body: Any, **kw: Any) -> Any:
        order.append(f"event {body.involved_object.name}")
        return real_event(namespace, body, **kw)

    core.patch_node_status, core.create_namespaced_event = patch_status, create_event  # type: ignore[method-assign]
    got = await asyncio.gather(*(backend.apply(req(ActionName.isolate, n, verdict=f"v-{n}")) for n in names))
    assert all(r.outcome is Outcome.applied for r in got)
    assert any("Event after the burst" in r.detail for r in got)
    await backend.close()  # sends what is still held back
    assert sorted(x for x in order if x.startswith("event")) == sorted(f"event {n}" for n in names)
    last_condition = max(i for i, x in enumerate(order) if x.startswith("condition"))
    deferred = [i for i, x in enumerate(order) if x.startswith("event")]
    # every Event held back went out after the last node of the burst was contained
    held = sum(1 for r in got if "Event after the burst" in r.detail)
    assert sum(1 for i in deferred if i > last_condition) >= held


@pytest.mark.parametrize("kind", ["ADDED", "MODIFIED"])
def test_a_foreign_condition_or_annotation_does_not_enter_the_cache(kind: str) -> None:
    cache = NodeCache(lambda **kw: None, conditions=(CONDITION_QUARANTINE,), annotation_prefix=ANNOTATION_PREFIX)
    cache.replace({"metadata": {"resourceVersion": "1"}, "items": []})
    cache.apply(kind, {"metadata": {"name": "n9", "resourceVersion": "2", "annotations": {"other/x": "1"}},
                       "status": {"conditions": [{"type": "MemoryPressure", "status": "False"}]}})
    assert cache.nodes["n9"]["annotations"] == {} and cache.nodes["n9"]["conditions"] == []
