"""Slurm backend: drain, resume, requeue with exclusions, diagnostics, checkpoint-now,
through ``scontrol`` and ``scancel``.

Every operation observes the controller first (``scontrol show node|job -o``), compares
with what the action wants, and acts only if needed; "already so" is success.  Errors
from the commands are typed: an unreachable or busy controller is temporary (retried by
:mod:`actuators.retry`), an unknown node or job is permanent.

Node names are Slurm node names; job targets are Slurm job ids, bare (``"42"``) or with
the ``slurm-`` prefix used on ``telemetry.job`` (``"slurm-42"``).  A drain reason always
names the verdict: ``fleetmedic <verdict id>: <reason>``; ``return`` resumes only nodes
whose reason is ours, so a node drained by a person stays drained.

Drains that arrive together (a burst of failed nodes) are made together
(:class:`actuators.batch.Coalescer`): one ``scontrol show node <list>`` observes them
all, one ``scontrol`` process reads every node's ``update`` from its standard input
(each node keeps its own reason), a second ``show`` confirms each drain, and one ``show
reservation`` finds the diagnostics reservations to delete. A process per command per
node cost about 3 processes per node; a batch costs 4 whatever its size.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import shlex
import time
from collections.abc import Sequence
from dataclasses import dataclass

from schemas import ActionName, Outcome

from .base import ActionRequest, ActionResult, ActuatorError, PermanentError, TemporaryError
from .batch import Coalescer
from .slurm_text import JOB_PREFIX, expand_hostlist, job_attempt, parse_oneliner

log = logging.getLogger(__name__)

REASON_PREFIX = "fleetmedic"
TEMPORARY_MARKERS = (
    "unable to contact slurm controller",
    "socket timed out",
    "resource temporarily unavailable",
    "slurm_receive_msg",
    "connection refused",
    "communication connection failure",
    "try again",
    "slurmctld is busy",
    "job is pending execution",
)
PERMANENT_MARKERS = ("invalid node name", "invalid job id", "access/permission denied", "invalid user")
#: the signal that asks a job to checkpoint now (sites use it with ``--signal=B:USR1@N``)
CHECKPOINT_SIGNAL = "USR1"
#: marks a checkpoint request in a job's AdminComment: ``fleetmedic-checkpoint:<verdict>@<deadline>``
CHECKPOINT_MARK = "fleetmedic-checkpoint:"
#: checkpoint marks kept in one AdminComment (the oldest go first)
CHECKPOINT_MARKS_KEPT = 4
TERMINAL_JOB_STATES = frozenset(
    {"COMPLETED", "CANCELLED", "FAILED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "BOOT_FAIL", "DEADLINE", "OUT_OF_MEMORY"}
)


def job_id(target: str) -> str:
    jid = target[len(JOB_PREFIX) :] if target.startswith(JOB_PREFIX) else target
    if not jid.isdigit():
        raise PermanentError(f"not a Slurm job id: {target!r}")
    return jid


@dataclass
class CommandResult:
    rc: int
    out: str
    err: str


class SlurmBackend:
    """Acts on a Slurm cluster through its command-line tools."""

    name = "slurm"

    #: seconds between two looks at a diagnostics job that has not started yet
    DIAG_POLL_S = 0.5

    def __init__(
        self,
        *,
        slurm_conf: str | None = None,
        bin_dir: str | None = None,
        timeout_s: float = 20.0,
        diag_command: str = "dcgmi diag -r 2",
        diag_time_limit: str = "30:00",
        reservation_hours: int = 2,
        diag_start_wait_s: float = 15.0,
        max_batch: int = 500,
    ) -> None:
        self.env = dict(os.environ)
        if slurm_conf:
            self.env["SLURM_CONF"] = slurm_conf
        self.bin_dir = bin_dir
        self.timeout_s = timeout_s
        self.diag_command = diag_command
        self.diag_time_limit = diag_time_limit
        self.reservation_hours = reservation_hours
        #: looks at a diagnostics job that has not started, DIAG_POLL_S apart
        self.diag_start_polls = math.ceil(diag_start_wait_s / self.DIAG_POLL_S)
        self._drains: Coalescer[ActionRequest, ActionResult] = Coalescer(self._drain_many, max_batch=max_batch)

    def supports(self, action: ActionName) -> bool:
        return True

    async def close(self) -> None:
        return None

    # ------------------------------------------------------------------ commands

    def _bin(self, name: str) -> str:
        return os.path.join(self.bin_dir, name) if self.bin_dir else name

    async def run(self, *argv: str, check: bool = True, stdin: str | None = None) -> CommandResult:
        """``argv`` as a process (``stdin``, if given, written to it); a non-zero exit
        raises a typed error unless ``check`` is false."""
        cmd = [self._bin(argv[0]), *argv[1:]]
        try:
            proc = await asyncio.create_subprocess_exec(
                *cmd, stdin=asyncio.subprocess.DEVNULL if stdin is None else asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=self.env,
            )
        except FileNotFoundError as exc:
            raise PermanentError(f"{cmd[0]} not found: is Slurm installed?") from exc
        try:
            out, err = await asyncio.wait_for(
                proc.communicate(None if stdin is None else stdin.encode()), self.timeout_s)
        except TimeoutError:
            proc.kill()
            await proc.wait()
            raise TemporaryError(f"{shlex.join(cmd)} timed out after {self.timeout_s:.0f}s") from None
        res = CommandResult(proc.returncode or 0, out.decode(errors="replace"), err.decode(errors="replace"))
        if check and res.rc != 0:
            raise self._error(cmd, res)
        return res

    @staticmethod
    def _error(cmd: Sequence[str], res: CommandResult) -> Exception:
        text = (res.err or res.out).strip()
        low = text.lower()
        msg = f"{shlex.join(cmd)} failed ({res.rc}): {text[:500]}"
        if any(m in low for m in PERMANENT_MARKERS):
            return PermanentError(msg)
        if any(m in low for m in TEMPORARY_MARKERS):
            return TemporaryError(msg)
        return TemporaryError(msg) if res.rc in (-9, -15) else PermanentError(msg)

    async def show_node(self, node: str) -> dict[str, str]:
        res = await self.run("scontrol", "show", "node", node, "-o")
        line = res.out.strip().splitlines()[0] if res.out.strip() else ""
        info = parse_oneliner(line)
        if info.get("NodeName") != node:
            raise PermanentError(f"no Slurm node {node!r}")
        return info

    async def show_job(self, jid: str) -> dict[str, str]:
        res = await self.run("scontrol", "show", "job", jid, "-o")
        lines = [ln for ln in res.out.strip().splitlines() if ln.strip()]
        if not lines:
            raise PermanentError(f"no Slurm job {jid}")
        return parse_oneliner(lines[0])

    # ------------------------------------------------------------------ dispatch

    async def apply(self, request: ActionRequest) -> ActionResult:
        a = request.action
        if a in (ActionName.isolate, ActionName.drain, ActionName.escalate):
            return await self._drain(request)
        if a is ActionName.return_:
            return await self._resume(request)
        if a is ActionName.diagnose:
            return await self._diagnose(request)
        if a in (ActionName.retry, ActionName.restart, ActionName.requeue):
            return await self._requeue(request)
        if a is ActionName.stop:
            return await self._cancel(request)
        if a is ActionName.checkpoint:
            return await self._checkpoint(request)
        raise PermanentError(f"slurm backend cannot {a.value}")

    # ------------------------------------------------------------------ nodes

    @staticmethod
    def _states(info: dict[str, str]) -> set[str]:
        return set(info.get("State", "").upper().replace("*", "").split("+"))

    def _reason(self, req: ActionRequest) -> str:
        what = "escalated: " if req.action is ActionName.escalate else ""
        return f"{REASON_PREFIX} {req.verdict_id}: {what}{req.reason or req.action.value}"[:200]

    async def _drain(self, req: ActionRequest) -> ActionResult:
        """isolate / drain / escalate: the node takes no new jobs, with a reason naming the
        verdict; made together with the drains that arrive meanwhile."""
        return await self._drains.submit(req)

    async def show_nodes(self, nodes: Sequence[str]) -> dict[str, dict[str, str]]:
        """Each of ``nodes`` that the controller knows, by name (one ``scontrol show node``)."""
        res = await self.run("scontrol", "show", "node", ",".join(nodes), "-o", check=False)
        found = {}
        for line in res.out.splitlines():
            if line.startswith("NodeName="):
                info = parse_oneliner(line)
                found[info["NodeName"]] = info
        if res.rc != 0 and not found:
            low = (res.err + res.out).lower()
            if "not found" not in low and "invalid node name" not in low:
                raise self._error(["scontrol", "show", "node", f"<{len(nodes)} nodes>", "-o"], res)
        return found

    def _settled(self, req: ActionRequest, info: dict[str, str]) -> bool:
        """Whether ``info`` already shows the drain ``req`` asks for."""
        drained = bool(self._states(info) & {"DRAIN", "DRAINED", "DRAINING"})
        return drained and (req.action is not ActionName.escalate or req.verdict_id in info.get("Reason", ""))

    @staticmethod
    def _quoted(reason: str) -> str:
        """A reason as one quoted word on scontrol's standard input."""
        return '"' + " ".join(reason.replace('"', "'").split()) + '"'

    async def _drain_many(self, reqs: list[ActionRequest]) -> list[ActionResult | BaseException]:
        """Observe every node once, drain those not drained yet in one ``scontrol``
        process (a line per node, each with its own reason), observe again to confirm,
        and delete the diagnostics reservations of the nodes drained."""
        before = await self.show_nodes(sorted({r.target for r in reqs}))
        out: dict[int, ActionResult | BaseException] = {}
        todo: dict[str, ActionRequest] = {}
        for i, r in enumerate(reqs):
            info = before.get(r.target)
            if info is None:
                out[i] = PermanentError(f"no Slurm node {r.target}")
            elif self._settled(r, info):
                out[i] = ActionResult(Outcome.already_so, f"{r.target} already drained: {info.get('Reason', '')}")
            elif r.target in todo:  # two drains of one node in one batch: the first one's reason stands
                out[i] = ActionResult(Outcome.already_so, f"{r.target} drained in this batch")
            else:
                todo[r.target] = r
        if todo:
            lines = "".join(f"update NodeName={n} State=DRAIN Reason={self._quoted(self._reason(r))}\n"
                            for n, r in todo.items())
            res = await self.run("scontrol", stdin=lines, check=False)
            after = await self.show_nodes(sorted(todo))
            drained = [n for n, r in todo.items() if n in after and self._settled(r, after[n])]
            await self.delete_reservations(drained)
            for i, r in enumerate(reqs):
                if i in out or todo.get(r.target) is not r:
                    continue
                if r.target in drained:
                    out[i] = ActionResult(Outcome.applied, f"drained {r.target}: {self._reason(r)}")
                else:
                    state = after.get(r.target, {}).get("State", "gone")
                    error = " ".join((res.err or res.out).split())[:300]
                    out[i] = TemporaryError(f"drain of {r.target} not taken (state {state}): {error}")
        if len(reqs) > 1:
            log.info("%d drains in one batch: %d made, %d already so", len(reqs), len(todo),
                     sum(1 for o in out.values() if isinstance(o, ActionResult) and o.outcome is Outcome.already_so))
        return [out[i] for i in range(len(reqs))]

    async def delete_reservations(self, nodes: Sequence[str]) -> None:
        """Delete the diagnostics reservations of ``nodes`` that exist (one ``show``; a
        delete line per reservation found, in one process)."""
        if not nodes:
            return
        res = await self.run("scontrol", "show", "reservation", "-o", check=False)
        have = {ln.split()[0].removeprefix("ReservationName=") for ln in res.out.splitlines()
                if ln.startswith("ReservationName=")}
        gone = [name for name in (self.reservation_name(n) for n in nodes) if name in have]
        if not gone:
            return
        lines = "".join(f"delete ReservationName={name}\n" for name in gone)
        done = await self.run("scontrol", stdin=lines, check=False)
        if done.rc != 0:
            log.warning("could not delete every reservation of %s: %s", ",".join(gone), done.err.strip()[:300])

    async def _resume(self, req: ActionRequest) -> ActionResult:
        """return: resume a node fleetmedic drained; leave a person's drain alone."""
        info = await self.show_node(req.target)
        states = self._states(info)
        reason = info.get("Reason", "")
        await self._delete_reservation(req.target)
        if not states & {"DRAIN", "DRAINED", "DRAINING", "DOWN"}:
            return ActionResult(Outcome.already_so, f"{req.target} is in service ({info.get('State')})")
        if reason and not reason.startswith(REASON_PREFIX):
            return ActionResult(Outcome.already_so, f"{req.target} was drained by someone else ({reason}); left drained")
        await self.run("scontrol", "update", f"NodeName={req.target}", "State=RESUME")
        return ActionResult(Outcome.applied, f"resumed {req.target}")

    @staticmethod
    def reservation_name(node: str) -> str:
        return f"fleetmedic-diag-{node}"

    async def _delete_reservation(self, node: str) -> None:
        res = await self.run("scontrol", "delete", f"ReservationName={self.reservation_name(node)}", check=False)
        if res.rc != 0 and "not found" not in (res.err + res.out).lower() and "invalid" not in (res.err + res.out).lower():
            log.warning("could not delete reservation for %s: %s", node, res.err.strip())

    async def _diagnose(self, req: ActionRequest) -> ActionResult:
        """Run a diagnostics job on the node, alone, inside a maintenance reservation.

        The node is moved from DRAIN into a MAINT reservation that only fleetmedic's
        diagnostics job may use, so no user job lands on it meanwhile.  The job's outcome
        comes back through the Slurm job watcher (``diagnostics_for``).
        """
        node = req.target
        name = f"fleetmedic-diag-{node}-{req.verdict_id[:8]}"
        res = await self.run("squeue", "-h", "-t", "all", "-n", name, "-o", "%i %T", check=False)
        if res.rc == 0 and res.out.strip():
            return ActionResult(Outcome.already_so, f"diagnostics job already queued: {res.out.strip()}")
        resv = self.reservation_name(node)
        show = await self.run("scontrol", "show", "reservation", resv, check=False)
        if show.rc != 0 or resv not in show.out:
            await self.run(
                "scontrol", "create", "reservation", f"ReservationName={resv}", f"Nodes={node}",
                "StartTime=now", f"Duration={self.reservation_hours * 60}", "Users=root",
                "Flags=MAINT,IGNORE_JOBS",
            )
        info = await self.show_node(node)
        resumed = bool(self._states(info) & {"DRAIN", "DRAINED", "DRAINING"})
        if resumed:
            await self.run("scontrol", "update", f"NodeName={node}", "State=RESUME")
        # the node's own partitions: without one, sbatch uses the default partition, and a
        # node outside it fails with "Requested node configuration is not available"
        partitions = [f"--partition={info['Partitions']}"] if info.get("Partitions") else []
        try:
            out = await self.run(
                "sbatch", "--parsable", f"--job-name={name}", f"--reservation={resv}", f"--nodelist={node}",
                *partitions, "--nodes=1", "--exclusive", f"--time={self.diag_time_limit}",
                f"--comment=diagnostics_for={node}", "--no-requeue", "--output=/dev/null",
                f"--wrap={self.diag_command}",
            )
        except ActuatorError:
            if resumed:  # never leave a node that fleetmedic drained open after a failed submission
                await self.run("scontrol", "update", f"NodeName={node}", "State=DRAIN",
                               f"Reason={REASON_PREFIX} {req.verdict_id}: diagnostics could not be submitted")
            raise
        diag = out.out.strip().split(";")[0]
        # Once the diagnostics job runs, drain the node again: the running job carries on,
        # and the node stays out of the pool (and shows as drained) until it is returned.
        started = False
        for _ in range(self.diag_start_polls):
            info = await self.show_job(diag)
            if info.get("JobState") != "PENDING":
                started = True
                break
            await asyncio.sleep(self.DIAG_POLL_S)
        reason = f"{REASON_PREFIX} {req.verdict_id}: diagnostics (job {diag})"
        if started:
            await self.run("scontrol", "update", f"NodeName={node}", "State=DRAIN", f"Reason={reason}")
            return ActionResult(Outcome.applied, f"diagnostics job {diag} running on {node}; node drained meanwhile")
        return ActionResult(Outcome.applied, f"diagnostics job {diag} queued on {node} in maintenance reservation {resv}")

    # ------------------------------------------------------------------ jobs

    @staticmethod
    def attempt_of(info: dict[str, str]) -> int:
        return job_attempt(info)

    async def _requeue(self, req: ActionRequest) -> ActionResult:
        """retry / restart / requeue: back to the queue, excluding the named nodes."""
        jid = job_id(req.target)
        info = await self.show_job(jid)
        attempt = req.params.get("attempt")
        if attempt is not None and self.attempt_of(info) > int(attempt):
            return ActionResult(Outcome.already_so, f"job {jid} is already on attempt {self.attempt_of(info)}")
        state = info.get("JobState", "")
        if state in ("CANCELLED", "COMPLETED") and req.action is not ActionName.requeue:
            return ActionResult(Outcome.already_so, f"job {jid} is {state}")
        exclude = sorted(set(req.params.get("exclude") or []))
        if not exclude:
            await self.run("scontrol", "requeue", jid)
            await self._eligible_now(jid)
            return ActionResult(Outcome.applied, f"requeued job {jid}")
        current = set(expand_hostlist(info.get("ExcNodeList", "")))
        await self.run("scontrol", "requeuehold", jid)
        await self.run("scontrol", "update", f"JobId={jid}", f"ExcNodeList={','.join(sorted(current | set(exclude)))}")
        await self.run("scontrol", "release", jid)
        await self._eligible_now(jid)
        return ActionResult(Outcome.applied, f"requeued job {jid} excluding {','.join(exclude)}")

    async def _eligible_now(self, jid: str, tries: int = 10) -> None:
        """A requeued job is only eligible again after a delay; make it eligible now.

        The update is taken only once the requeue has been processed, so it is repeated
        until the job's eligible time is no longer in the future.
        """
        for _ in range(tries):
            await asyncio.sleep(0.3)
            info = await self.show_job(jid)
            if info.get("JobState") != "PENDING":
                return
            if info.get("Reason") != "BeginTime":
                return
            await self.run("scontrol", "update", f"JobId={jid}", "StartTime=now", check=False)
        log.warning("job %s still waits for its begin time after requeue", jid)

    async def _cancel(self, req: ActionRequest) -> ActionResult:
        """stop: cancel the job and keep it from being requeued."""
        jid = job_id(req.target)
        info = await self.show_job(jid)
        state = info.get("JobState", "")
        if state in TERMINAL_JOB_STATES:
            # ended already: stopping means fleetmedic will not requeue it again
            return ActionResult(Outcome.already_so, f"job {jid} has ended ({state}); it stays stopped")
        await self.run("scancel", jid)
        return ActionResult(Outcome.applied, f"cancelled job {jid} (was {state})")

    @staticmethod
    def checkpoint_mark(verdict_id: str, deadline: float) -> str:
        """The AdminComment word recording that ``verdict_id`` asked for a checkpoint
        (no spaces, no ``=``: ``scontrol show job -o`` stays one ``Key=Value`` line)."""
        vid = "".join("_" if c.isspace() or c in "=;" else c for c in verdict_id)
        return f"{CHECKPOINT_MARK}{vid}@{deadline:.0f}"

    async def _checkpoint(self, req: ActionRequest) -> ActionResult:
        """checkpoint: ask a running job to save its state now, with ``SIGUSR1`` to its
        batch shell (``scancel --signal=USR1 --batch``), by ``params["deadline"]``.

        Observe: the job (``scontrol show job``); an unknown job is a permanent error.
        Compare: a job that is not RUNNING has nothing to save, and one no longer on the
        degrading node (``params["node"]``) need not save for it: both ``already_so``, with
        why. A request this verdict already made is ``already_so`` too: the signal is
        recorded in the job's AdminComment (``fleetmedic-checkpoint:<verdict>@<deadline>``,
        the last few kept, anything else there left as it is). Signalling again is not
        harmless: each USR1 is a new request to the job (``fleetmedic.client`` reports
        every new signal), so a verdict replayed after a crash would cost a second
        checkpoint of a model that may take minutes to write. The AdminComment is the
        administrators' field (the user's Comment stays theirs, and the watcher reads
        ``diagnostics_for=`` there), it is kept across requeues, and it shows in
        ``scontrol show job`` for whoever wonders why the job saved.
        Act: signal first, record second: a failure between the two signals again on the
        retry (at least once), never records a signal that was not sent.

        ``--batch`` signals the batch shell alone; the script traps USR1 and forwards it
        (or ``exec``\\s the trainer). A shell that does not trap USR1 ends on it: the job
        fails and is requeued from its last checkpoint, which is what moving it off the
        node without checkpoint-now does, a little sooner.
        """
        jid = job_id(req.target)
        try:
            deadline = float(req.params["deadline"])
        except (KeyError, TypeError, ValueError):
            raise PermanentError(f"checkpoint of job {jid} needs a deadline (Unix seconds), "
                                 f"got {req.params.get('deadline')!r}") from None
        info = await self.show_job(jid)
        state = info.get("JobState", "")
        if state != "RUNNING":
            why = "it has ended" if state in TERMINAL_JOB_STATES else "it is not running"
            return ActionResult(Outcome.already_so, f"job {jid} is {state}: {why}, nothing to save")
        node = req.params.get("node")
        nodes = expand_hostlist(info.get("NodeList", ""))
        if node and node not in nodes:
            return ActionResult(Outcome.already_so, f"job {jid} no longer runs on {node} "
                                                    f"({info.get('NodeList', '')}); nothing to save for it")
        mark = self.checkpoint_mark(req.verdict_id, deadline)
        comment = info.get("AdminComment", "")
        # "; " between entries: what others wrote there stays as they wrote it
        words = [w for w in comment.split("; ") if w] if comment not in ("", "(null)") else []
        if any(w.startswith(f"{mark.rsplit('@', 1)[0]}@") for w in words):
            return ActionResult(Outcome.already_so, f"job {jid} was already asked to checkpoint by this verdict "
                                                    f"(AdminComment {comment})")
        sent = await self.run("scancel", f"--signal={CHECKPOINT_SIGNAL}", "--batch", jid, check=False)
        if sent.rc != 0:
            now = await self.show_job(jid)  # it may have ended since it was observed
            if now.get("JobState") != "RUNNING":
                return ActionResult(Outcome.already_so, f"job {jid} is {now.get('JobState')}: it ended before "
                                                        "the signal, nothing to save")
            raise self._error(["scancel", f"--signal={CHECKPOINT_SIGNAL}", "--batch", jid], sent)
        ours = [w for w in words if w.startswith(CHECKPOINT_MARK)]
        kept = [w for w in words if not w.startswith(CHECKPOINT_MARK)] + ours[-(CHECKPOINT_MARKS_KEPT - 1):] + [mark]
        res = await self.run("scontrol", "update", f"JobId={jid}", f"AdminComment={'; '.join(kept)}", check=False)
        noted = "" if res.rc == 0 else f" (not recorded in its AdminComment: {(res.err or res.out).strip()[:200]})"
        when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(deadline))
        return ActionResult(Outcome.applied, f"sent SIG{CHECKPOINT_SIGNAL} to job {jid}'s batch shell "
                                             f"on {info.get('BatchHost', '?')}: checkpoint by {when} "
                                             f"(deadline {deadline:.0f}){noted}")
