"""Talking to the local Slurm cluster from tests: commands, job records, waiting, and a
second cluster with accounting (slurmdbd) for what needs ``sacct``."""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TypeVar

from actuators.slurm import parse_oneliner
from actuators.slurm_text import expand_hostlist

T = TypeVar("T")


def sh(conf: str, *argv: str, check: bool = True, cwd: Path | None = None) -> str:
    """Run a Slurm command against the cluster of ``conf``; its stdout."""
    res = subprocess.run(argv, env={**os.environ, "SLURM_CONF": conf}, capture_output=True, text=True, timeout=60,
                         check=False, cwd=cwd, stdin=subprocess.DEVNULL)
    if check and res.returncode != 0:
        raise AssertionError(f"{' '.join(argv)} failed (rc={res.returncode}):\n{res.stdout}\n{res.stderr}")
    return res.stdout


def job(conf: str, jid: str) -> dict[str, str]:
    """The controller's record of a job (``scontrol show job -o``), parsed as the backend parses it."""
    return parse_oneliner(sh(conf, "scontrol", "show", "job", jid, "-o").strip().splitlines()[0])


def wait_for(what: str, probe: Callable[[], T | None], timeout: float = 60, every: float = 0.3) -> T:
    """Poll ``probe`` until it returns something truthy; fail naming ``what`` otherwise."""
    deadline = time.monotonic() + timeout
    last: T | None = None
    while time.monotonic() < deadline:
        last = probe()
        if last:
            return last
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout}s waiting for {what} (last: {last!r})")


SLURM_SH = Path(__file__).resolve().parents[2] / "deploy" / "slurm.sh"


@contextmanager
def accounting_cluster(state: Path, nodes: int = 2) -> Iterator[str]:
    """A Slurm cluster of its own in ``state`` with job accounting (``deploy/slurm.sh``
    with ``FLEETMEDIC_SLURM_ACCOUNTING=1``: MariaDB and slurmdbd beside slurmctld), beside
    the session's cluster; yields its ``slurm.conf`` and deletes it afterwards."""
    env = {**os.environ, "FLEETMEDIC_STATE": str(state), "FLEETMEDIC_SLURM_ACCOUNTING": "1",
           "FLEETMEDIC_SLURM_NODES": str(nodes)}

    def script(cmd: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["bash", str(SLURM_SH), cmd], env=env, capture_output=True, text=True, timeout=900,
                              check=False, stdin=subprocess.DEVNULL)

    started = script("start")
    lines = started.stdout.strip().splitlines()
    if started.returncode != 0 or not lines or not lines[-1].startswith("SLURM_CONF="):
        script("reset")
        raise AssertionError(f"deploy/slurm.sh start with accounting failed (rc={started.returncode}):\n"
                             f"{started.stdout}\n{started.stderr}")
    try:
        yield lines[-1].removeprefix("SLURM_CONF=")
    finally:
        script("reset")


def running_nodes(conf: str, jid: str) -> list[str] | None:
    """The nodes job ``jid`` runs on, or None while it is not running."""
    info = job(conf, jid)
    return expand_hostlist(info["NodeList"]) if info.get("JobState") == "RUNNING" else None


def reset_cluster(conf: str, *, no_job_left: bool = False) -> None:
    """No jobs, every node in service, no fleetmedic reservation: each test starts clean.

    ``no_job_left`` also waits until the controller holds no finished job either (they
    stay for MinJobAge, deploy/slurm.sh: 120 s, and a new watcher reports the failed ones
    with their nodes)."""
    sh(conf, "scancel", "--user=root", check=False)
    for line in sh(conf, "scontrol", "show", "reservation", "-o", check=False).splitlines():
        name = line.split()[0].removeprefix("ReservationName=") if line.startswith("ReservationName=") else ""
        if name.startswith("fleetmedic-diag-"):
            sh(conf, "scontrol", "delete", f"ReservationName={name}", check=False)
    for n in ("n1", "n2", "n3", "n4"):
        sh(conf, "scontrol", "update", f"NodeName={n}", "State=RESUME", check=False)
    wait_for("all nodes idle", lambda: set(sh(conf, "sinfo", "-h", "-o", "%T").split()) <= {"idle"}, 30)
    if no_job_left:
        wait_for("no job left in the controller",
                 lambda: not sh(conf, "squeue", "-h", "-t", "all", "-o", "%i").strip() or None, 300)
