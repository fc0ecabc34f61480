"""What fleetmedic knows of Kubernetes workload kinds: owners, templates, exclusions."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

from actuators import k8s_workloads as wk

#: upstream's own PyTorchJob example (tests/fixtures/kubeflow/README.md)
SIMPLE = yaml.safe_load((Path(__file__).parents[2] / "fixtures" / "kubeflow" / "pytorch-simple.yaml").read_text())


def test_a_pytorchjobs_pod_templates_are_one_per_replica_type() -> None:
    assert wk.template_paths(wk.PYTORCH_JOB, SIMPLE) == [
        ("spec", "pytorchReplicaSpecs", "Master", "template"), ("spec", "pytorchReplicaSpecs", "Worker", "template")]
    assert wk.restart_policies(wk.PYTORCH_JOB, SIMPLE) == {"Master": "OnFailure", "Worker": "OnFailure"}
    assert wk.template_paths(wk.JOB, {"spec": {"template": {}}}) == [("spec", "template")]


def test_excluding_nodes_adds_a_hostname_not_in_to_every_template_and_keeps_the_rest() -> None:
    job = copy.deepcopy(SIMPLE)
    patch = wk.exclusion_patch(wk.PYTORCH_JOB, job, ["gpu-7", "gpu-3"])
    assert patch is not None
    for rtype in ("Master", "Worker"):
        aff = patch["spec"]["pytorchReplicaSpecs"][rtype]["template"]["spec"]["affinity"]
        [term] = aff["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
        assert term["matchExpressions"] == [{"key": "kubernetes.io/hostname", "operator": "NotIn",
                                             "values": ["gpu-3", "gpu-7"]}]
        # the merge patch names only the affinity: containers, image, command stay as they are
        assert set(patch["spec"]["pytorchReplicaSpecs"][rtype]["template"]["spec"]) == {"affinity"}
    assert job == SIMPLE  # the object read is not changed


def test_every_ored_term_gets_the_exclusion_and_an_existing_not_in_is_extended() -> None:
    affinity = {
        "podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": []},
        "nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
            {"matchExpressions": [{"key": "nvidia.com/gpu.product", "operator": "In", "values": ["H100"]}]},
            {"matchExpressions": [{"key": "kubernetes.io/hostname", "operator": "NotIn", "values": ["gpu-1"]}]},
        ]}}}
    out = wk.exclude_nodes(affinity, ["gpu-2"])
    t1, t2 = out["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert t1["matchExpressions"] == [
        {"key": "nvidia.com/gpu.product", "operator": "In", "values": ["H100"]},
        {"key": "kubernetes.io/hostname", "operator": "NotIn", "values": ["gpu-2"]}]
    assert t2["matchExpressions"] == [{"key": "kubernetes.io/hostname", "operator": "NotIn",
                                       "values": ["gpu-1", "gpu-2"]}]
    assert out["podAntiAffinity"] == affinity["podAntiAffinity"]
    assert wk.excluded_by(out) == {"gpu-2"}  # gpu-1 is excluded by one term only
    assert affinity["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"][0][
        "matchExpressions"][-1]["key"] == "nvidia.com/gpu.product"


def test_no_patch_when_every_template_already_excludes_the_nodes() -> None:
    job = copy.deepcopy(SIMPLE)
    patch = wk.exclusion_patch(wk.PYTORCH_JOB, job, ["gpu-7"])
    for rtype, spec in patch["spec"]["pytorchReplicaSpecs"].items():
        job["spec"]["pytorchReplicaSpecs"][rtype]["template"]["spec"]["affinity"] = spec["template"]["spec"]["affinity"]
    assert wk.exclusion_patch(wk.PYTORCH_JOB, job, ["gpu-7"]) is None
    assert wk.exclusion_patch(wk.PYTORCH_JOB, job, ["gpu-7", "gpu-8"]) is not None


def test_suspend_fields_differ_by_kind() -> None:
    assert wk.suspend_patch(wk.JOB, True) == {"spec": {"suspend": True}}
    assert wk.suspend_patch(wk.PYTORCH_JOB, False) == {"spec": {"runPolicy": {"suspend": False}}}
    assert not wk.suspended(wk.PYTORCH_JOB, SIMPLE)
    assert wk.suspended(wk.PYTORCH_JOB, {"spec": {"runPolicy": {"suspend": True}}})
    with pytest.raises(ValueError):
        wk.suspend_patch(wk.WORKLOAD, True)


def test_owners_conditions_and_marks() -> None:
    pod = {"metadata": {"ownerReferences": [
        {"apiVersion": "v1", "kind": "Node", "name": "n", "controller": False},
        {"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob", "name": "llama", "controller": True}]}}
    ref = wk.controller_of(pod)
    assert ref is not None and (wk.group_of(ref["apiVersion"]), ref["kind"]) == ("kubeflow.org", "PyTorchJob")
    assert wk.KNOWN[("kubeflow.org", "PyTorchJob")] is wk.PYTORCH_JOB
    assert ("jobset.x-k8s.io", "JobSet") not in wk.KNOWN and wk.group_of("v1") == ""
    assert wk.finished({"status": {"conditions": [{"type": "Running", "status": "True"},
                                                  {"type": "Failed", "status": "True"}]}}) == "Failed"
    assert wk.finished({"status": {"conditions": [{"type": "Succeeded", "status": "False"}]}}) is None
    assert wk.kueue_managed({"metadata": {"labels": {"kueue.x-k8s.io/queue-name": "team-a"}}})
    assert not wk.kueue_managed(SIMPLE)
    marked = {"metadata": {"annotations": {"fleetmedic.io/requeue": "v-1:abc:suspended"}}}
    assert wk.requeue_mark(marked, "fleetmedic.io/requeue") == ("v-1:abc", "suspended")
    assert wk.requeue_mark(SIMPLE, "fleetmedic.io/requeue") == ("", "")
