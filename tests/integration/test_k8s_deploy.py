"""deploy/kubernetes on the real API server: every manifest passes server-side dry-run,
and every pod it would run is admitted by Pod Security ``restricted``."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml
from kubernetes.client.exceptions import ApiException

from .k8s_helpers import DEPLOY_K8S, Cluster

pytestmark = pytest.mark.integration

MANIFESTS = sorted(DEPLOY_K8S.glob("*.yaml"))
WORKLOADS = ("Deployment", "DaemonSet", "StatefulSet", "Job")


def docs(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def pod_templates() -> list[tuple[str, dict]]:
    out = []
    for path in MANIFESTS:
        for d in docs(path):
            if d["kind"] in WORKLOADS:
                out.append((f"{path.name}:{d['kind']}/{d['metadata']['name']}", d))
    return out


def test_there_are_manifests_for_every_part() -> None:
    kinds = {(d["kind"], d["metadata"]["name"]) for p in MANIFESTS for d in docs(p)}
    for want in [("Namespace", "fleetmedic"), ("ServiceAccount", "fleetmedic"), ("ClusterRole", "fleetmedic"),
                 ("ClusterRoleBinding", "fleetmedic"), ("ConfigMap", "fleetmedic"),
                 ("Deployment", "fleetmedic-worker"), ("Deployment", "fleetmedic-watch"),
                 ("DaemonSet", "fleetmedic-collector")]:
        assert want in kinds, f"missing {want}"


@pytest.mark.parametrize("path", MANIFESTS, ids=[p.name for p in MANIFESTS])
def test_manifest_passes_server_side_dry_run(k8s_deployed: str, path: Path) -> None:
    c = Cluster(k8s_deployed)
    assert c.core.read_namespace("fleetmedic").metadata.labels["pod-security.kubernetes.io/enforce"] == "restricted"
    c.apply_manifest(path, dry_run=True)


@pytest.mark.parametrize("name,workload", pod_templates(), ids=[n for n, _ in pod_templates()])
def test_every_pod_is_admitted_under_restricted(k8s_deployed: str, name: str, workload: dict) -> None:
    c = Cluster(k8s_deployed)
    tpl = workload["spec"]["template"]
    pod = {"apiVersion": "v1", "kind": "Pod",
           "metadata": {"name": f"dryrun-{workload['metadata']['name']}", "labels": tpl["metadata"].get("labels", {})},
           "spec": tpl["spec"]}
    c.core.create_namespaced_pod(workload["metadata"]["namespace"], pod, dry_run="All")


def test_the_namespace_really_enforces_restricted(k8s_deployed: str) -> None:
    """Control: the same pod without its hardening is refused, so the test above means something."""
    c = Cluster(k8s_deployed)
    _name, workload = next(w for w in pod_templates() if w[1]["kind"] == "Deployment")
    spec = copy.deepcopy(workload["spec"]["template"]["spec"])
    spec.pop("securityContext", None)
    for ctr in spec.get("containers", []) + spec.get("initContainers", []):
        ctr.pop("securityContext", None)
    with pytest.raises(ApiException) as err:
        c.core.create_namespaced_pod("fleetmedic", {"metadata": {"name": "unhardened"}, "spec": spec}, dry_run="All")
    assert err.value.status == 403 and "restricted" in err.value.body


@pytest.mark.parametrize("name,workload", pod_templates(), ids=[n for n, _ in pod_templates()])
def test_containers_are_hardened_beyond_restricted(name: str, workload: dict) -> None:
    """What Pod Security does not check: read-only root, resource limits, a fixed non-root uid."""
    spec = workload["spec"]["template"]["spec"]
    assert spec["securityContext"]["runAsNonRoot"] is True
    assert spec["securityContext"]["runAsUser"] > 0
    assert spec["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault"
    for ctr in spec.get("containers", []) + spec.get("initContainers", []):
        sc = ctr["securityContext"]
        assert sc["readOnlyRootFilesystem"] is True, ctr["name"]
        assert sc["allowPrivilegeEscalation"] is False, ctr["name"]
        assert sc["capabilities"]["drop"] == ["ALL"], ctr["name"]
        limits = ctr["resources"]["limits"]
        assert {"cpu", "memory"} <= set(limits), ctr["name"]
    assert not [v for v in spec.get("volumes", []) if "hostPath" in v]
