"""Worker processes run by the demo, the benchmark and the integration tests.

One place for starting ``python -m pipeline worker`` with its own web port, waiting
until it is ready (its consumers have partitions), reading its counters, and stopping it.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

from pipeline import paths

#: the repository root (in a checkout; see :mod:`pipeline.paths`)
ROOT = paths.CHECKOUT


def free_port() -> int:
    """A free TCP port on 127.0.0.1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def process_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` (Linux ``/proc``); 0 if it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


def machine_cpu_seconds() -> tuple[float, float]:
    """``(busy, total)`` CPU seconds of the whole machine since boot, all cores (``/proc/stat``)."""
    try:
        first = Path("/proc/stat").read_text().splitlines()[0].split()
    except OSError:
        return 0.0, 0.0
    ticks = [int(x) for x in first[1:]]
    idle = ticks[3] + (ticks[4] if len(ticks) > 4 else 0)  # idle + iowait
    hz = os.sysconf("SC_CLK_TCK")
    return (sum(ticks[:8]) - idle) / hz, sum(ticks[:8]) / hz


class WorkerProcess:
    """``python -m pipeline worker`` in its own session, its output in ``log``."""

    def __init__(self, env: dict[str, str], log: Path, *, argv: Sequence[str] = ()) -> None:
        self.web_port = int(env.get("FLEETMEDIC_WORKER__WEB_PORT") or free_port())
        self.env = {**env, "FLEETMEDIC_WORKER__WEB_PORT": str(self.web_port)}
        self.log = Path(log)
        self._out: TextIO = open(self.log, "w")
        self.proc = subprocess.Popen([sys.executable, "-m", "pipeline", *argv, "worker"],
                                     cwd=ROOT if paths.in_checkout() else None, env=self.env,
                                     stdout=self._out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     start_new_session=True)

    def _get(self, path: str, timeout: float) -> Any:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.web_port}{path}", timeout=timeout) as r:
            return json.loads(r.read())

    def ready(self) -> bool:
        try:
            return bool(self._get("/fleetmedic/ready", 2).get("ready"))
        except Exception:  # not listening yet, or 503 while partitions are assigned
            return False

    def release(self) -> None:
        """Let a worker started with ``worker.hold_telemetry`` read telemetry."""
        req = urllib.request.Request(f"http://127.0.0.1:{self.web_port}/fleetmedic/release", data=b"{}", method="POST",
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=10) as r:
            r.read()

    def stats(self) -> dict[str, Any]:
        return self._get("/fleetmedic/stats", 5)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def cpu_seconds(self) -> float:
        """CPU time (user + system) the worker process has used so far; 0 once it is gone."""
        return process_cpu_seconds(self.proc.pid)

    def log_tail(self, n: int = 60) -> str:
        try:
            return "".join(self.log.read_text().splitlines(True)[-n:])
        except OSError:
            return ""

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._out.close()


def wait_ready(workers: Sequence[WorkerProcess], timeout: float = 120) -> None:
    """Block until every worker answers ready; fail early when one exits."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for w in workers:
            if not w.alive():
                raise RuntimeError(f"worker exited with {w.proc.returncode}; its log ({w.log}) ends:\n{w.log_tail()}")
        if all(w.ready() for w in workers):
            return
        time.sleep(0.3)
    raise RuntimeError(f"worker not ready within {timeout:.0f}s; logs: {', '.join(str(w.log) for w in workers)}")


KAFKA_SH = paths.deploy_script("kafka.sh")
K8S_SH = paths.deploy_script("k8s.sh")
SLURM_SH = paths.deploy_script("slurm.sh")


def deploy_script(script: Path, cmd: str, env: dict[str, str], *args: str, timeout: float = 300,
                  progress: bool = False) -> str:
    """Run ``deploy/<script> cmd [args]``; the last line of its output (the bootstrap or
    ``KUBECONFIG=...`` after ``start``), or RuntimeError. Quiet, with the end of its error
    output in the error; with ``progress`` its progress goes to our standard error (a first
    build takes minutes)."""
    # the scripts' Python helpers run under this interpreter (an installed fleetmedic has no .venv)
    env = {"FLEETMEDIC_PYTHON": sys.executable, **env}
    res = subprocess.run(["bash", str(script), cmd, *args], env=env, stdout=subprocess.PIPE,
                         stderr=None if progress else subprocess.PIPE, text=True, timeout=timeout,
                         stdin=subprocess.DEVNULL)
    if res.returncode != 0:
        why = "its log is above" if progress else res.stderr[-2000:]
        raise RuntimeError(f"deploy/{script.name} {' '.join([cmd, *args])} failed (exit {res.returncode}):\n{why}")
    return res.stdout.strip().splitlines()[-1] if res.stdout.strip() else ""


def kafka_script(cmd: str, env: dict[str, str], *args: str) -> str:
    """``deploy/kafka.sh cmd [args]``, quietly (:func:`deploy_script`)."""
    return deploy_script(KAFKA_SH, cmd, env, *args)
