"""Slurm job watcher: job state changes become ``telemetry.job`` records.

The watcher polls the controller (``scontrol show job -o``: every job it still holds,
pending, running and recently finished, without needing slurmdbd), compares each job's
state and restart count with the previous poll, and emits:

* ``started`` when a job (or a new attempt of it, after a requeue) is running, with its
  nodes;
* ``failed`` when it ends FAILED, NODE_FAIL, TIMEOUT, OUT_OF_MEMORY or BOOT_FAIL, with
  the exit code, Slurm's reason, the tail of its stderr file when that file is readable
  here, and ``origin_node``: the node whose step failed first, from the accounting
  database (``sacct``; see :func:`actuators.slurm_text.origin_node` for what names a
  node and what names none);
* ``completed`` when it ends COMPLETED.

``origin_node`` needs accounting (slurmdbd). Without it ``sacct`` answers "Slurm
accounting storage is disabled"; the watcher says so once and leaves ``origin_node``
empty, as it does whenever ``sacct`` cannot tell. The controller sends a job's end to
the database as it ends, and it can arrive after ``scontrol`` shows the end, so a
failure whose end ``sacct`` does not show yet is held to the next polls,
``origin_wait_s`` at most, then sent without an origin: the poll loop asks again, it
never waits inside a poll.

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

from actuators.slurm_text import (
    JOB_PREFIX,
    SACCT_FIELDS,
    expand_hostlist,
    job_attempt,
    origin_node,
    parse_oneliner,
    parse_sacct,
)
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


class AccountingDisabled(RuntimeError):
    """``sacct`` says the cluster keeps no accounting (no slurmdbd), or there is no ``sacct``."""


class Scontrol:
    """The watcher's own client of the controller: ``scontrol show job -o`` and ``sacct``,
    each with a timeout.

    ``slurm_conf`` names the cluster's ``slurm.conf`` (else Slurm's default), ``bin_dir``
    where the Slurm commands are (else ``PATH``)."""

    def __init__(self, *, slurm_conf: str | None = None, bin_dir: str | None = None, timeout_s: float = 20.0) -> None:
        self.env = dict(os.environ)
        if slurm_conf:
            self.env["SLURM_CONF"] = slurm_conf
        self.bin_dir = bin_dir
        self.cmd = [self._bin("scontrol"), "show", "job", "-o"]
        self.timeout_s = timeout_s

    def _bin(self, name: str) -> str:
        return os.path.join(self.bin_dir, name) if self.bin_dir else name

    async def _run(self, cmd: list[str]) -> tuple[int, str, str]:
        try:
            proc = await asyncio.create_subprocess_exec(
                *cmd, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE, env=self.env)
        except FileNotFoundError as exc:
            raise RuntimeError(f"{cmd[0]} not found: is Slurm installed?") from exc
        try:
            out, err = await asyncio.wait_for(proc.communicate(), self.timeout_s)
        except TimeoutError:
            proc.kill()
            await proc.wait()
            raise RuntimeError(f"{' '.join(cmd)} timed out after {self.timeout_s:.0f}s") from None
        return proc.returncode or 0, out.decode(errors="replace"), err.decode(errors="replace")

    async def show_jobs(self) -> str:
        rc, out, err = await self._run(self.cmd)
        if rc:
            raise RuntimeError(f"{' '.join(self.cmd)} failed ({rc}): {(err or out).strip()[:500]}")
        return out

    async def sacct(self, jid: str) -> str:
        """The job's accounting rows, its steps included (:data:`SACCT_FIELDS`, ``|``
        between fields); :class:`AccountingDisabled` without accounting."""
        cmd = [self._bin("sacct"), "-j", jid, "--parsable2", "--noheader", f"--format={','.join(SACCT_FIELDS)}"]
        try:
            rc, out, err = await self._run(cmd)
        except RuntimeError as exc:
            if "not found" in str(exc):
                raise AccountingDisabled(str(exc)) from exc
            raise
        text = (err or out).strip()
        if "accounting storage is disabled" in text.lower():
            raise AccountingDisabled(text[:500])
        if rc:
            raise RuntimeError(f"{' '.join(cmd)} failed ({rc}): {text[:500]}")
        return out


class SlurmJobWatcher:
    """Turns the controller's view of jobs into job events, one poll at a time."""

    def __init__(self, client: Scontrol | None = None, *, clock: Callable[[], float] = time.time,
                 origin_wait_s: float = 10.0) -> None:
        self.client = client or Scontrol()
        self.clock = clock
        #: how long a failure waits for the accounting database to record the job's end
        self.origin_wait_s = origin_wait_s
        self.seen: dict[str, tuple[str, int]] = {}
        #: failures whose end ``sacct`` did not show yet, by job: the event, when first held
        self.held: dict[str, tuple[JobEvent, float]] = {}
        #: False once ``sacct`` said that the cluster keeps no accounting
        self.accounting = True

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
        """This poll's events; each failure with its ``origin_node`` from ``sacct`` (a
        failure that ``sacct`` has not recorded yet comes with a later poll)."""
        fresh = self.diff(await self.jobs())
        now = self.clock()
        out: list[JobEvent] = []
        held, self.held = self.held, {}
        for job, (ev, since) in held.items():
            # a newer event of the same job goes out after this one, whatever sacct knows
            await self._with_origin(ev, since, now, out, last=any(e.job == job for e in fresh))
        for ev in fresh:
            if ev.event is JobEventKind.failed:
                await self._with_origin(ev, now, now, out, last=False)
            else:
                out.append(ev)
        return out

    async def _with_origin(self, ev: JobEvent, since: float, now: float, out: list[JobEvent], *, last: bool) -> None:
        """Append ``ev`` with its origin to ``out``, or hold it for the next poll while
        ``sacct`` has not recorded the job's end and ``origin_wait_s`` has not passed."""
        node, why, settled = await self.origin(ev)
        if not settled and not last and now - since < self.origin_wait_s:
            self.held[ev.job] = (ev, since)
            return
        if not settled:
            log.info("%s failed; no origin node: %s", ev.job, why)
        else:
            log.debug("%s failed; origin node %s: %s", ev.job, node, why)
        out.append(ev.model_copy(update={"origin_node": node}) if node else ev)

    async def origin(self, ev: JobEvent) -> tuple[str | None, str, bool]:
        """The node where the failed job ``ev`` failed first (or None), why, and whether
        that is settled (False: ``sacct`` has not recorded the job's end yet, or failed)."""
        if not self.accounting:
            return None, "the cluster keeps no accounting", True
        jid = ev.job.removeprefix(JOB_PREFIX)
        try:
            rows = parse_sacct(await self.client.sacct(jid))
        except AccountingDisabled as exc:
            self.accounting = False
            log.warning("sacct: %s; failed Slurm jobs will carry no origin_node (it needs slurmdbd)", exc)
            return None, "the cluster keeps no accounting", True
        except RuntimeError as exc:
            return None, str(exc), False
        whole = [r for r in rows if r.step is None]
        if not whole or not whole[0].ended:
            return None, "sacct has not recorded the job's end yet", False
        node, why = origin_node(rows)
        if node is not None and node not in ev.nodes:
            return None, f"sacct names {node}, not one of the job's nodes {','.join(ev.nodes)}", True
        return node, why, True

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
