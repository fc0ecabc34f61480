"""Fixtures for integration tests that need a real Kafka broker.

``kafka_bootstrap`` gives a ``host:port`` string. It uses ``$FLEETMEDIC_BOOTSTRAP``
when set (an externally managed broker); otherwise it runs
``deploy/kafka.sh start`` (embedded single-node KRaft broker, jars cached
outside the repo) and, if this session started the broker, stops it at the end.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
KAFKA_SH = REPO_ROOT / "deploy" / "kafka.sh"


def _kafka_sh(*args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(KAFKA_SH), *args],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


@pytest.fixture(scope="session")
def kafka_bootstrap() -> Iterator[str]:
    external = os.environ.get("FLEETMEDIC_BOOTSTRAP")
    if external:
        yield external
        return
    if shutil.which(os.environ.get("JAVA", "java")) is None:
        pytest.skip("no java on PATH: cannot run the embedded Kafka broker (deploy/kafka.sh)")

    already_running = _kafka_sh("status", timeout=60).returncode == 0
    started = _kafka_sh("start")
    if started.returncode != 0:
        pytest.fail(
            f"deploy/kafka.sh start failed (rc={started.returncode}):\n"
            f"{started.stdout}\n{started.stderr}",
            pytrace=False,
        )
    bootstrap = started.stdout.strip().splitlines()[-1]
    try:
        yield bootstrap
    finally:
        if not already_running:
            _kafka_sh("stop", timeout=120)


SLURM_SH = REPO_ROOT / "deploy" / "slurm.sh"


def _slurm_sh(*args: str, timeout: float = 900) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(SLURM_SH), *args],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


@pytest.fixture(scope="session")
def slurm_conf() -> Iterator[str]:
    """Path of the ``slurm.conf`` of a running local Slurm cluster (nodes n1..n4).

    Uses ``$FLEETMEDIC_SLURM_CONF`` when set (an externally managed cluster);
    otherwise runs ``deploy/slurm.sh start`` (installs slurm-wlm + munge with apt
    if missing) and, if this session started the cluster, stops it at the end.
    Pass it to Slurm commands as ``SLURM_CONF`` in their environment.
    """
    external = os.environ.get("FLEETMEDIC_SLURM_CONF")
    if external:
        yield external
        return
    already_running = _slurm_sh("status", timeout=60).returncode == 0
    started = _slurm_sh("start")
    lines = started.stdout.strip().splitlines()
    if started.returncode != 0 or not lines or not lines[-1].startswith("SLURM_CONF="):
        pytest.fail(
            f"deploy/slurm.sh start failed (rc={started.returncode}):\n"
            f"{started.stdout}\n{started.stderr}",
            pytrace=False,
        )
    conf = lines[-1].removeprefix("SLURM_CONF=")
    try:
        yield conf
    finally:
        if not already_running:
            _slurm_sh("stop", timeout=120)
