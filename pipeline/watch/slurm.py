"""Slurm job watcher: job state changes become ``telemetry.job`` records.

The watcher polls the controller (``scontrol show job -o``: every job it still holds,
pending, running and recently finished, without needing slurmdbd), compares each job's
state and restart count with the previous poll, and emits:

* ``started`` when a job (or a new attempt of it, after a requeue) is running, with its
  nodes;
* ``failed`` when it ends FAILED, NODE_FAIL, TIMEOUT, OUT_OF_MEMORY or BOOT_FAIL, with
  the exit code, Slurm's reason and the tail of its stderr file when that file is
  readable here;
* ``completed`` when it ends COMPLETED.

Jobs submitted by the Slurm backend for diagnostics carry ``diagnostics_for=<node>`` in
their comment; their records carry ``diagnostics_for`` so that the node track can return
or fail the node.  Job ids on the topic are ``slurm-<id>``; attempts are Slurm's restart
count + 1.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from actuators.slurm_text import JOB_PREFIX, expand_hostlist, job_attempt, parse_oneliner
from schemas import JobEvent, JobEventKind

log = logging.getLogger(__name__)

FAILED_STATES = frozenset({"FAILED", "NODE_FAIL", "TIMEOUT", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"})
LOG_TAIL_BYTES = 4000


def _exit_code(text: str) -> int | None:
    # Slurm writes "code:signal"; a signal wins, reported as a negative code
    try:
        code, _, sig = text.partition(":")
        return -int(sig) if sig and int(sig) else int(code)
    except ValueError:
        return None


def _tail(path: str | None) -> str | None:
    if not path or path in ("(null)", "/dev/null"):
        return None
    try:
        p = Path(path)
        size = p.stat().st_size
        with p.open("rb") as f:
            f.seek(max(0, size - LOG_TAIL_BYTES))
            return f.read().decode(errors="replace").strip() or None
    except OSError:
        return None


def _diagnostics_for(info: dict[str, str]) -> str | None:
    comment = info.get("Comment", "")
    if comment.startswith("diagnostics_for="):
        return comment.split("=", 1)[1].strip() or None
    return None


class Scontrol:
    """The watcher's own client of the controller: ``scontrol show job -o``, with a timeout.

    ``slurm_conf`` names the cluster's ``slurm.conf`` (else Slurm's default), ``bin_dir``
    where the Slurm commands are (else ``PATH``)."""

    def __init__(self, *, slurm_conf: str | None = None, bin_dir: str | None = None, timeout_s: float = 20.0) -> None:
        self.env = dict(os.environ)
        if slurm_conf:
            self.env["SLURM_CONF"] = slurm_conf
        self.cmd = [os.path.join(bin_dir, "scontrol") if bin_dir else "scontrol", "show", "job", "-o"]
        self.timeout_s = timeout_s

    async def show_jobs(self) -> str:
        try:
            proc = await asyncio.create_subprocess_exec(
                *self.cmd, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE, env=self.env)
        except FileNotFoundError as exc:
            raise RuntimeError(f"{self.cmd[0]} not found: is Slurm installed?") from exc
        try:
            out, err = await asyncio.wait_for(proc.communicate(), self.timeout_s)
        except TimeoutError:
            proc.kill()
            await proc.wait()
            raise RuntimeError(f"{' '.join(self.cmd)} timed out after {self.timeout_s:.0f}s") from None
        if proc.returncode:
            text = (err or out).decode(errors="replace").strip()
            raise RuntimeError(f"{' '.join(self.cmd)} failed ({proc.returncode}): {text[:500]}")
        return out.decode(errors="replace")


class SlurmJobWatcher:
    """Turns the controller's view of jobs into job events, one poll at a time."""

    def __init__(self, client: Scontrol | None = None, *, clock: Callable[[], float] = time.time) -> None:
        self.client = client or Scontrol()
        self.clock = clock
        self.seen: dict[str, tuple[str, int]] = {}

    async def jobs(self) -> list[dict[str, str]]:
        out = []
        for line in (await self.client.show_jobs()).splitlines():
            line = line.strip()
            if line.startswith("JobId="):
                out.append(parse_oneliner(line))
        return out

    def diff(self, jobs: list[dict[str, str]]) -> list[JobEvent]:
        """Events for what changed since the previous call (pure: no I/O)."""
        events: list[JobEvent] = []
        now = self.clock()
        for info in jobs:
            jid = info.get("JobId", "")
            if not jid:
                continue
            state = info.get("JobState", "UNKNOWN")
            attempt = job_attempt(info)
            prev = self.seen.get(jid)
            self.seen[jid] = (state, attempt)
            if prev == (state, attempt):
                continue
            nodes = [n for n in expand_hostlist(info.get("NodeList", "")) if n]
            base: dict[str, Any] = dict(
                ts=now, job=f"{JOB_PREFIX}{jid}", scheduler="slurm", nodes=nodes, attempt=attempt,
                diagnostics_for=_diagnostics_for(info),
                exclude=[n for n in expand_hostlist(info.get("ExcNodeList", "")) if n],
            )
            if state == "RUNNING":
                events.append(JobEvent(event=JobEventKind.started, **base))
            elif state == "COMPLETED":
                if prev is None or prev[0] != "RUNNING" or prev[1] != attempt:
                    # a job we never saw running still gets its start, so history has a placement
                    events.append(JobEvent(event=JobEventKind.started, **{**base, "ts": now}))
                events.append(JobEvent(event=JobEventKind.completed, **base))
            elif state in FAILED_STATES:
                if prev is None or prev[1] != attempt:
                    events.append(JobEvent(event=JobEventKind.started, **base))
                reason = info.get("Reason", "") or state
                if reason in ("None", "(null)"):
                    reason = state
                events.append(JobEvent(
                    event=JobEventKind.failed, exit_code=_exit_code(info.get("ExitCode", "")),
                    reason=f"{state}: {reason}"[:500], log_tail=_tail(info.get("StdErr")), **base,
                ))
        known = {info.get("JobId") for info in jobs}
        for jid in list(self.seen):
            if jid not in known:
                del self.seen[jid]
        return events

    async def poll(self) -> list[JobEvent]:
        return self.diff(await self.jobs())

    async def run(self, emit: Callable[[JobEvent], Awaitable[None]], *, interval: float = 2.0,
                  stop: asyncio.Event | None = None) -> None:
        """Poll forever (or until ``stop``), sending each event through ``emit``."""
        stop = stop or asyncio.Event()
        delay = interval
        while not stop.is_set():
            try:
                for ev in await self.poll():
                    await emit(ev)
                delay = interval
            except Exception as exc:  # controller away: keep polling with backoff
                log.warning("Slurm poll failed (%s); next try in %.1fs", exc, delay)
                delay = min(delay * 2, 30.0)
            try:
                await asyncio.wait_for(stop.wait(), delay)
            except TimeoutError:
                pass
