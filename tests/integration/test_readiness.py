"""Readiness while a worker starts: 503 until its consumers are assigned, never a 500."""

from __future__ import annotations

import asyncio
import time
import urllib.error
import urllib.request
from collections import Counter
from pathlib import Path

import pytest

from pipeline.worker.procs import WorkerProcess
from pipeline.worker.topics import ensure_topics

from .harness import ClusterAPI, Worker

pytestmark = pytest.mark.integration


def _status(port: int, path: str) -> int | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=2) as r:
            return r.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return None  # not listening yet


def test_readiness_answers_503_until_the_worker_is_assigned_then_200(kafka_bootstrap, tmp_path: Path):
    from pipeline.config import load_settings

    api = ClusterAPI(load_settings(environ={}))
    w = Worker(kafka_bootstrap, sim_url=api.url)
    asyncio.run(ensure_topics(w.settings))
    proc = WorkerProcess(w.env, tmp_path / "worker.log")
    seen: Counter[tuple[str, int | None]] = Counter()
    try:
        end = time.monotonic() + 120
        while time.monotonic() < end:
            for path in ("/readyz", "/fleetmedic/ready"):
                seen[(path, _status(proc.web_port, path))] += 1
            if seen[("/readyz", 200)] and seen[("/fleetmedic/ready", 200)]:
                break
            time.sleep(0)  # poll as fast as it answers: a starting consumer's window is short
        codes = {code for _, code in seen}
        assert codes <= {None, 200, 503}, (seen, proc.log_tail(40))
        assert seen[("/readyz", 503)] + seen[("/fleetmedic/ready", 503)] > 0, seen  # it was seen starting
        assert seen[("/readyz", 200)] and seen[("/fleetmedic/ready", 200)], (seen, proc.log_tail(40))
    finally:
        proc.stop()
        api.close()
