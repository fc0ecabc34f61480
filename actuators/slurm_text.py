"""Slurm's text: the one-line records of ``scontrol show ... -o``, hostlists, job ids,
and the step records of ``sacct --parsable2``.

Parsing only (no commands run here), shared by the Slurm backend (which acts) and the
Slurm job watcher (which observes, with its own ``scontrol`` and ``sacct`` client).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import datetime

__all__ = [
    "JOB_PREFIX", "SACCT_FIELDS", "SacctRow", "expand_hostlist", "job_attempt", "origin_node", "parse_oneliner",
    "parse_sacct",
]

#: job ids on ``telemetry.job`` are ``slurm-<id>``
JOB_PREFIX = "slurm-"
_FIELD = re.compile(r"(?:^|\s)([A-Za-z][A-Za-z0-9_:/]*)=")


def parse_oneliner(line: str) -> dict[str, str]:
    """Parse one ``scontrol show ... -o`` line (``Key=Value Key2=Value with spaces``)."""
    out: dict[str, str] = {}
    matches = list(_FIELD.finditer(line))
    for i, m in enumerate(matches):
        end = matches[i + 1].start() if i + 1 < len(matches) else len(line)
        out[m.group(1)] = line[m.end() : end].strip()
    return out


def expand_hostlist(expr: str) -> list[str]:
    """Expand a Slurm hostlist (``n[1-3,5],gpu7``) into names."""
    names: list[str] = []
    for part in re.findall(r"[^,\[]+(?:\[[^\]]*\])?[^,]*", expr or ""):
        m = re.fullmatch(r"(.*)\[([^\]]*)\](.*)", part)
        if not m:
            if part and part != "(null)":
                names.append(part)
            continue
        pre, ranges, post = m.groups()
        for r in ranges.split(","):
            if "-" in r:
                a, b = r.split("-", 1)
                width = len(a)
                names.extend(f"{pre}{i:0{width}d}{post}" for i in range(int(a), int(b) + 1))
            else:
                names.append(f"{pre}{r}{post}")
    return names


def job_attempt(info: dict[str, str]) -> int:
    """A job's attempt: Slurm's restart count + 1."""
    try:
        return int(info.get("Restarts", "0")) + 1
    except ValueError:
        return 1


# ---------------------------------------------------------------------------- sacct

#: the fields :func:`parse_sacct` reads, in this order:
#: ``sacct -j <id> --parsable2 --noheader --format=JobID,State,ExitCode,NodeList,Start,End``
SACCT_FIELDS = ("JobID", "State", "ExitCode", "NodeList", "Start", "End")
#: step states that mean the step itself failed where it ran; CANCELLED (a step killed
#: because another one failed, or the job was cancelled), TIMEOUT, DEADLINE and
#: PREEMPTED end every step at once and point at no node
STEP_FAILED_STATES = frozenset({"FAILED", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL"})
#: steps that Slurm makes itself; a numbered step is one ``srun`` of the job
SYSTEM_STEPS = frozenset({"batch", "extern", "interactive"})


@dataclass(frozen=True, slots=True)
class SacctRow:
    """One line of ``sacct --parsable2``: the job itself (``step`` None) or one step."""

    job: str
    step: str | None
    state: str
    exit_code: str
    nodes: tuple[str, ...]
    start: datetime | None
    end: datetime | None

    @property
    def ended(self) -> bool:
        return self.end is not None


def _when(text: str) -> datetime | None:
    # "2026-12-06T23:31:57"; "Unknown" while running, "None" before it started
    try:
        return datetime.fromisoformat(text)
    except ValueError:
        return None


def parse_sacct(text: str) -> list[SacctRow]:
    """The rows of ``sacct --parsable2 --noheader --format=JobID,State,ExitCode,NodeList,
    Start,End`` (:data:`SACCT_FIELDS`): ``|`` between fields, none at the end.

    ``State`` keeps its first word ("CANCELLED by 0" is CANCELLED); a step that never
    got nodes says "None assigned", which is no node.  Lines of another shape are skipped.
    """
    rows = []
    for line in text.splitlines():
        fields = line.strip().split("|")
        if len(fields) != len(SACCT_FIELDS) or not fields[0]:
            continue
        jobid, state, exit_code, nodelist, start, end = fields
        job, _, step = jobid.partition(".")
        nodes = () if nodelist.strip() in ("", "None assigned", "(null)") else tuple(expand_hostlist(nodelist))
        rows.append(SacctRow(job=job, step=step or None, state=(state.split() or [""])[0], exit_code=exit_code,
                             nodes=nodes, start=_when(start), end=_when(end)))
    return rows


def origin_node(rows: list[SacctRow]) -> tuple[str | None, str]:
    """The node whose step failed first, and why (or why none can be named).

    The first failed step is the one with the earliest ``End``; ``sacct`` keeps whole
    seconds, so a batch script that fails because its ``srun`` failed ends in the same
    second: on a tie a numbered step (an ``srun``) goes before ``batch``/``extern``.
    A step on one node names that node.  A step on several nodes names none: ``sacct``
    does not say which of its tasks failed first.  Steps of one second on different
    nodes name none either: which came first is not recorded.
    """
    failed = [r for r in rows if r.step is not None and r.state in STEP_FAILED_STATES]
    if not failed:
        return None, "no step failed"
    ended = [r for r in failed if r.end is not None]
    if not ended:
        return None, "no failed step has an end time"
    first_end = min(r.end for r in ended if r.end is not None)
    tied = [r for r in ended if r.end == first_end]
    srun_steps = [r for r in tied if r.step not in SYSTEM_STEPS]
    first = srun_steps or tied
    names = ", ".join(f"{r.job}.{r.step} ({','.join(r.nodes) or 'no node'})" for r in first)
    nodes = {n for r in first for n in r.nodes}
    if len(nodes) == 1 and all(len(r.nodes) == 1 for r in first):
        return next(iter(nodes)), f"step {names} failed first"
    if not nodes:
        return None, f"step {names} failed first with no node recorded"
    if len(first) == 1:
        return None, f"step {names} failed first on several nodes; sacct does not say which task failed"
    return None, f"steps {names} failed in the same second on different nodes"
