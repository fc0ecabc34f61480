"""Fixtures for integration tests that need the real services.

Each service is used from the environment when the test runner already started it
(``tests/run.sh`` does), or started here by the project's own script and stopped at
the end of the session if this session started it. A service that cannot start fails
the tests that need it; it never skips them.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"


def _script(name: str, *args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", str(DEPLOY / name), *args], stdin=subprocess.DEVNULL, capture_output=True,
                          text=True, timeout=timeout, check=False)


def _local_service(script: str, env_var: str | None, prefix: str = "", start_timeout: float = 900) -> Iterator[str]:
    """Yield the address the service's ``start`` prints last (less ``prefix``); ``env_var``
    names one already running (None: always the script's)."""
    external = os.environ.get(env_var) if env_var else None
    if external:
        yield external
        return
    already_running = _script(script, "status", timeout=60).returncode == 0
    started = _script(script, "start", timeout=start_timeout)
    lines = started.stdout.strip().splitlines()
    if started.returncode != 0 or not lines or not lines[-1].startswith(prefix):
        pytest.fail(f"deploy/{script} start failed (rc={started.returncode}):\n{started.stdout}\n{started.stderr}",
                    pytrace=False)
    try:
        yield lines[-1].removeprefix(prefix)
    finally:
        if not already_running:
            _script(script, "stop", timeout=120)


@pytest.fixture(scope="session")
def kafka_bootstrap() -> Iterator[str]:
    """``host:port`` of a Kafka broker: ``$FLEETMEDIC_BOOTSTRAP`` or ``deploy/kafka.sh``'s embedded KRaft broker."""
    yield from _local_service("kafka.sh", "FLEETMEDIC_BOOTSTRAP")


@pytest.fixture(scope="session")
def slurm_conf() -> Iterator[str]:
    """Path of the ``slurm.conf`` of a running local Slurm cluster (nodes n1..n4).

    ``$FLEETMEDIC_SLURM_CONF``, or ``deploy/slurm.sh`` (which installs slurm-wlm and
    munge with apt if missing). Pass it to Slurm commands as ``SLURM_CONF``.
    """
    yield from _local_service("slurm.sh", "FLEETMEDIC_SLURM_CONF", prefix="SLURM_CONF=")


@pytest.fixture(scope="session")
def kubeconfig() -> Iterator[str]:
    """Admin kubeconfig of a running local control plane (etcd, kube-apiserver,
    kube-controller-manager, kube-scheduler; no kubelet).

    ``$FLEETMEDIC_KUBECONFIG``, or ``deploy/k8s.sh`` (which builds the control plane from
    the Go module proxy on first use and caches it).
    """
    yield from _local_service("k8s.sh", "FLEETMEDIC_KUBECONFIG", prefix="KUBECONFIG=", start_timeout=3600)


@pytest.fixture(scope="session")
def k8s_deployed(kubeconfig: str) -> str:
    """The control plane with deploy/kubernetes' namespaces, ServiceAccounts, RBAC and
    config applied for real; yields the admin kubeconfig."""
    from .k8s_helpers import DEPLOY_K8S, Cluster

    c = Cluster(kubeconfig)
    c.apply_manifest(DEPLOY_K8S / "namespace.yaml")
    c.apply_manifest(DEPLOY_K8S / "fleetmedic.yaml",
                     kinds={"ServiceAccount", "ClusterRole", "ClusterRoleBinding", "ConfigMap"})
    return kubeconfig


@pytest.fixture(scope="session")
def keycloak() -> Iterator[Any]:
    """A Keycloak in dev mode with the realm ``fleetmedic`` (``deploy/keycloak.sh``: the
    distribution from Maven Central, cached), as a :class:`~.keycloak_helpers.Keycloak`."""
    from .keycloak_helpers import Keycloak

    for _ in _local_service("keycloak.sh", None, prefix="KEYCLOAK=", start_timeout=900):
        yield Keycloak()
