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
