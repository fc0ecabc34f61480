"""Slurm's text: the one-line records of ``scontrol show ... -o``, hostlists, job ids.

Parsing only (no commands run here), shared by the Slurm backend (which acts) and the
Slurm job watcher (which observes, with its own ``scontrol`` client).
"""

from __future__ import annotations

import re

__all__ = ["JOB_PREFIX", "expand_hostlist", "job_attempt", "parse_oneliner"]

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
