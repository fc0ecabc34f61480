"""The Helm chart (``deploy/helm/fleetmedic``) with Helm v4 built from the Go module proxy
(``deploy/helm.sh``): ``helm lint --strict`` is clean, the values schema refuses bad
values naming them (fleetmedic's own settings schema included), the rendered config is
one fleetmedic loads, and what ``helm template`` renders is accepted by the real API
server (server-side dry-run) in a namespace that enforces Pod Security ``restricted``."""

from __future__ import annotations

import copy
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest
import yaml

from .k8s_helpers import Cluster

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy" / "helm" / "fleetmedic"
RENDERED = ROOT / "deploy" / "kubernetes" / "fleetmedic.yaml"
WORKLOADS = ("Deployment", "DaemonSet", "StatefulSet", "Job")
#: every optional part switched on (the ServiceMonitor's CRD is not on the test API server)
EVERYTHING = ["--set", "diagnostics.createNamespace=true", "--set", "networkPolicy.enabled=true",
              "--set", "worker.podDisruptionBudget.enabled=true", "--set", "watch.enabled=true",
              "--set", "collector.enabled=true", "--set", "worker.replicas=2",
              "--set-json", 'secretEnv=[{"name": "FLEETMEDIC_AUTH__ISSUER", "secretName": "fm", "key": "issuer"}]',
              "--set-json", 'networkPolicy.ingressFrom=[{"namespaceSelector": {"matchLabels": '
                            '{"kubernetes.io/metadata.name": "monitoring"}}}]']


def helm(*args: str, timeout: float = 1800) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", str(ROOT / "deploy" / "helm.sh"), *args], capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL, cwd=ROOT)


def render(release: str, namespace: str, *extra: str) -> list[dict[str, Any]]:
    out = helm("template", release, str(CHART), "--namespace", namespace, *extra)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


@pytest.fixture(scope="module", autouse=True)
def built() -> None:
    out = helm("build")
    assert out.returncode == 0, out.stderr[-3000:]


def test_helm_lint_is_clean_with_the_defaults_and_with_every_part_on() -> None:
    for extra in ([], EVERYTHING, ["--set", "serviceMonitor.enabled=true"]):
        out = helm("lint", "--strict", str(CHART), *extra)
        assert out.returncode == 0, out.stdout + out.stderr
        assert "0 chart(s) failed" in out.stdout and "[WARNING]" not in out.stdout and "[ERROR]" not in out.stdout, \
            out.stdout


@pytest.mark.parametrize("value,named", [
    ("config.kafka.partitions=0", "partitions"),                 # fleetmedic's own bound (ge=1)
    ("config.safety.max_fractoin=0.2", "max_fractoin"),           # a misspelt field
    ("config.nosuchsection.x=1", "nosuchsection"),
    ("config.actuators.backend=nomad", "backend"),
    ("worker.port=70000", "port"),
    ("image.pullPolicy=Sometimes", "pullPolicy"),
    ("serviceMonitor.interval=often", "interval"),
])
def test_the_values_schema_refuses_a_bad_value_and_names_it(value: str, named: str) -> None:
    out = helm("template", "fleetmedic", str(CHART), "--set", value)
    assert out.returncode != 0, f"{value} was accepted"
    assert "schema" in out.stderr.lower() and named in out.stderr, out.stderr


def test_the_values_schema_is_current_with_the_settings() -> None:
    out = subprocess.run([sys.executable, "-m", "pipeline", "chart-schema", "--check"], capture_output=True,
                         text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr


def test_the_rendered_config_is_one_fleetmedic_loads(tmp_path: Path) -> None:
    from pipeline.config import load_settings

    docs = render("fleetmedic", "fleetmedic", "--set", "config.kafka.partitions=12", "--set", "worker.port=7070",
                  "--set", "diagnostics.namespace=gpu-diag")
    cm = next(d for d in docs if d["kind"] == "ConfigMap")
    path = tmp_path / "fleetmedic.json"
    path.write_text(cm["data"]["fleetmedic.json"])
    assert '"partitions": 12,' in path.read_text() or '"partitions": 12\n' in path.read_text()  # an integer
    s = load_settings(environ={"FLEETMEDIC_CONFIG": str(path)})
    assert s.kafka.bootstrap == "kafka.kafka.svc:9092" and s.kafka.partitions == 12
    assert s.worker.web_port == 7070 and s.actuators.backend == "kubernetes"
    assert s.actuators.kube_diag_namespace == "gpu-diag" and s.safety.dry_run is True
    worker = next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "fleetmedic-worker")
    c = worker["spec"]["template"]["spec"]["containers"][0]
    assert c["ports"][0]["containerPort"] == 7070
    # a changed config rolls the pods (the checksum annotation)
    again = render("fleetmedic", "fleetmedic", "--set", "config.kafka.partitions=16")
    w2 = next(d for d in again if d["kind"] == "Deployment" and d["metadata"]["name"] == "fleetmedic-worker")
    assert (w2["spec"]["template"]["metadata"]["annotations"]["checksum/config"]
            != worker["spec"]["template"]["metadata"]["annotations"]["checksum/config"])


def test_the_chart_holds_every_part() -> None:
    docs = render("fleetmedic", "fleetmedic", *EVERYTHING, "--set", "serviceMonitor.enabled=true")
    kinds = {(d["kind"], d["metadata"]["name"]) for d in docs}
    for want in [("ServiceAccount", "fleetmedic"), ("ServiceAccount", "fleetmedic-collector"),
                 ("ClusterRole", "fleetmedic"), ("ClusterRoleBinding", "fleetmedic"), ("ConfigMap", "fleetmedic"),
                 ("Deployment", "fleetmedic-worker"), ("Service", "fleetmedic-worker"),
                 ("Deployment", "fleetmedic-watch"), ("DaemonSet", "fleetmedic-collector"),
                 ("PodDisruptionBudget", "fleetmedic-worker"), ("NetworkPolicy", "fleetmedic-worker"),
                 ("NetworkPolicy", "fleetmedic-no-ingress"), ("ServiceMonitor", "fleetmedic-worker"),
                 ("Namespace", "fleetmedic-diag")]:
        assert want in kinds, f"missing {want}"
    off = render("fleetmedic", "fleetmedic", "--set", "collector.enabled=false", "--set", "watch.enabled=false",
                 "--set", "networkPolicy.enabled=false", "--set", "worker.podDisruptionBudget.enabled=false")
    assert {d["kind"] for d in off} == {"ServiceAccount", "ClusterRole", "ClusterRoleBinding", "ConfigMap",
                                        "Deployment", "Service"}


def test_the_manifests_in_deploy_kubernetes_are_the_chart_rendered_with_its_defaults() -> None:
    out = helm("template", "fleetmedic", str(CHART), "--namespace", "fleetmedic")
    assert out.returncode == 0, out.stderr
    body = RENDERED.read_text().split("\n", 2)[2]  # after the two header lines
    assert body == out.stdout, "deploy/kubernetes/fleetmedic.yaml is stale: run make manifests"


def test_what_the_chart_renders_is_admitted_by_the_api_server_under_restricted(kubeconfig: str) -> None:
    c = Cluster(kubeconfig)
    ns = f"fm-helm-{uuid.uuid4().hex[:6]}"
    c.core.create_namespace({"metadata": {"name": ns, "labels": {
        "pod-security.kubernetes.io/enforce": "restricted", "pod-security.kubernetes.io/enforce-version": "latest"}}})
    try:
        release = f"r{uuid.uuid4().hex[:6]}"
        docs = render(release, ns, *EVERYTHING, "--set", f"diagnostics.namespace={ns}-diag")
        import kubernetes.utils

        for d in docs:
            target = d["metadata"].get("namespace", ns)
            # the ServiceAccounts for real: a pod's admission looks its account up
            dry = {} if d["kind"] == "ServiceAccount" else {"dry_run": "All"}
            kubernetes.utils.create_from_dict(c.api, d, namespace=target, apply=True, **dry)
        pods = [d for d in docs if d["kind"] in WORKLOADS]
        assert len(pods) == 3
        for d in pods:
            tpl = d["spec"]["template"]
            pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": f"dry-{d['metadata']['name']}",
                                                                   "labels": tpl["metadata"]["labels"]},
                   "spec": tpl["spec"]}
            c.core.create_namespaced_pod(ns, pod, dry_run="All")
        # and the namespace does refuse what restricted forbids: the check above could fail
        from kubernetes.client.exceptions import ApiException

        spec = copy.deepcopy(pods[0]["spec"]["template"]["spec"])
        spec.pop("securityContext")
        for ctr in spec["containers"] + spec.get("initContainers", []):
            ctr.pop("securityContext")
        bad = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "unhardened"}, "spec": spec}
        with pytest.raises(ApiException) as e:
            c.core.create_namespaced_pod(ns, bad, dry_run="All")
        assert e.value.status == 403 and "restricted" in e.value.body, e.value.body
    finally:
        c.core.delete_namespace(ns)
