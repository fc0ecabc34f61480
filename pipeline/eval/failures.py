"""Replay real failure output through the job and node tracks, and score the decisions.

Each excerpt of the failure corpus (``tests/data/failures/``: real output from public
threads, documentation and other projects' fixtures, with the root cause its source
settled) becomes a job that fails with that output, through
:class:`pipeline.eval.replay.LocalPipeline`, which runs the very policy functions the Faust
worker calls (``pipeline.correlate.policy``: the job track, the node track and the triage of
``pipeline.correlate.triage``).

The world the replay plays, per excerpt, a 4-node job (rank 0 on the first node):

* a **user error** fails every attempt the same way, wherever it runs;
* a **transient** fault fails the first attempt only;
* a **hardware** fault (``gpu_hardware``, ``gpu_memory``, ``nvlink``, ``node_network``,
  ``fabric_switch``) lives on the first node: every attempt that runs there fails the
  same way, one placed elsewhere succeeds.

``retry`` and ``restart`` run the next attempt on the same nodes, ``requeue`` on new
ones (the nodes it excludes are never reused), ``stop`` ends the job; at most
``MAX_ATTEMPTS`` attempts.  Two variants: **no origin** (the scheduler does not say which
worker failed first) and **origin = rank 0** (it always names the first node, as
Kubernetes does when rank 0's pod is the first to fail).

What is scored (per variant):

* ``user_errors_stopped_within_2``: user errors (not NCCL watchdog timeouts) stopped by
  the second attempt;
* ``hardware_recall``: hardware faults handled as hardware: the first verdict moves the
  job to new nodes (or, for a contained error, names its hardware class and restarts it),
  and the job is never stopped.  ``hardware_named_at_once`` is the stricter share whose
  first verdict also names a hardware class: text that names no cause (a bare
  ``Connection refused``, a command's usage line) is moved as ``unknown``, which is the
  right action but not a hardware verdict; ``hardware_node_isolated``, the share whose
  faulty node was isolated from the text alone;
* ``transient_retried``: transient faults run again (retry, restart or requeue), not stopped;
* ``false_isolations``: nodes isolated that were not the faulty node;
* per class precision, recall and a confusion matrix over the first verdict's class
  (``unknown`` is a column of its own);
* the NCCL watchdog timeouts whose cause lies elsewhere, apart: the text names no
  cause, so they are retried once and judged by their history.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import tomllib
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from schemas import INFRASTRUCTURE_CLASSES, JobEvent, JobEventKind, Verdict

from pipeline import paths
from pipeline.config import Settings
from pipeline.eval.replay import LocalPipeline

REPO = paths.CHECKOUT
#: the corpus fleetmedic ships (``tests/data/failures`` in a checkout)
CORPUS = paths.failure_corpus()
HARDWARE = INFRASTRUCTURE_CLASSES
CLASSES = ("user_error", "transient_software", "gpu_hardware", "gpu_memory", "nvlink", "node_network",
           "fabric_switch", "unknown")
NODES_PER_JOB = 4
MAX_ATTEMPTS = 4
VARIANTS = ("no_origin", "origin_rank0")
TARGETS = {"user_errors_stopped_within_2": 0.90, "hardware_recall": 0.90, "transient_retried": 0.90}


@dataclass(frozen=True)
class Case:
    """One corpus excerpt."""

    id: str
    fault_class: str
    log: str
    source: str
    exit_code: int | None = None
    signal: str | None = None
    reason: str | None = None
    produced_by: str = ""
    watchdog_elsewhere: bool = False

    @property
    def hardware(self) -> bool:
        return self.fault_class in HARDWARE

    def failed_fields(self) -> dict[str, Any]:
        """The fields of a ``failed`` job record that carry this excerpt: the exit code
        (the reported code, else the reported signal as 128+N, a container's status), the
        scheduler's reason, and the log tail (its last 8 KiB)."""
        out: dict[str, Any] = {"log_tail": self.log[-8192:]}
        if self.exit_code is not None:
            out["exit_code"] = max(-255, min(255, int(self.exit_code)))
        elif self.signal and self.signal.upper() in _SIGNALS:
            out["exit_code"] = 128 + _SIGNALS[self.signal.upper()]
        if self.reason:
            out["reason"] = self.reason
        return out


_SIGNALS = {"SIGHUP": 1, "SIGINT": 2, "SIGQUIT": 3, "SIGILL": 4, "SIGTRAP": 5, "SIGABRT": 6, "SIGBUS": 7,
            "SIGFPE": 8, "SIGKILL": 9, "SIGUSR1": 10, "SIGSEGV": 11, "SIGUSR2": 12, "SIGPIPE": 13, "SIGTERM": 15}


def load(split: str, corpus: Path = CORPUS) -> list[Case]:
    """The excerpts of one split (``tune``, ``eval``, or ``all``)."""
    dirs = ["tune", "eval"] if split == "all" else [split]
    cases = []
    for d in dirs:
        folder = corpus / d
        if not folder.is_dir():
            raise FileNotFoundError(f"no failure corpus split at {folder}")
        for path in sorted(folder.glob("*.toml")):
            raw = tomllib.loads(path.read_text(encoding="utf-8"))
            cases.append(Case(
                id=raw["id"], fault_class=raw["fault_class"], log=raw["log"].strip("\n"), source=raw["source"],
                exit_code=raw.get("exit_code"), signal=raw.get("signal"), reason=raw.get("reason"),
                produced_by=raw.get("produced_by", ""), watchdog_elsewhere=bool(raw.get("watchdog_elsewhere")),
            ))
    return cases


def excerpt(case_id: str, split: str = "tune", corpus: Path = CORPUS) -> Case:
    """One excerpt by id (tests and the simulator read the tune split only)."""
    path = corpus / split / f"{case_id}.toml"
    if not path.is_file():
        raise LookupError(f"no excerpt {case_id!r} in {corpus / split}")
    return next(c for c in load(split, corpus) if c.id == case_id)


def replay(case: Case, variant: str, settings: Settings | None = None) -> dict[str, Any]:
    """Play one excerpt's job through the pipeline's decisions; its outcome."""
    settings = settings or Settings()
    lp = LocalPipeline(settings)
    scheduler = "slurm" if case.produced_by == "slurm" else "kubernetes"
    job = f"job-{case.id}"
    spare = (f"{case.id}-n{k}" for k in range(10_000))
    faulty = next(spare)
    nodes = [faulty] + [next(spare) for _ in range(NODES_PER_JOB - 1)]
    excluded: set[str] = set()
    t = 1_000_000.0
    steps: list[dict[str, Any]] = []
    verdicts: list[Verdict] = []
    outcome = "running"
    for attempt in range(1, MAX_ATTEMPTS + 1):
        lp.feed([JobEvent(ts=t, job=job, event=JobEventKind.started, scheduler=scheduler, nodes=nodes,
                          attempt=attempt)])
        fails = (case.fault_class == "user_error" or (case.fault_class == "transient_software" and attempt == 1)
                 or (case.hardware and faulty in nodes))
        if not fails:
            lp.feed([JobEvent(ts=t + 600, job=job, event=JobEventKind.completed, scheduler=scheduler,
                              nodes=nodes, attempt=attempt)])
            outcome = "completed"
            break
        failed = JobEvent(ts=t + 60, job=job, event=JobEventKind.failed, scheduler=scheduler, nodes=nodes,
                          attempt=attempt, origin_node=nodes[0] if variant == "origin_rank0" else None,
                          **case.failed_fields())
        new = lp.feed([failed]) + lp.finish(t + 60 + settings.policy.correlation_grace_s + 1)
        verdicts += new
        job_v = [v for v in new if v.scope == "job" and v.subject == job]
        if not job_v:
            outcome = "no_verdict"
            break
        v = job_v[-1]
        a = v.actions[0]
        steps.append({"attempt": attempt, "action": a.action.value, "class": v.fault_class.value,
                      "rule": v.evidence.get("decided_by"), "exclude": a.params.get("exclude", [])})
        if a.action.value == "stop":
            outcome = "stopped"
            break
        if a.action.value == "requeue":
            excluded |= set(a.params.get("exclude") or [])
            nodes = [next(spare) for _ in range(NODES_PER_JOB)]
        t += 3600
    else:
        outcome = "gave_up"
    isolated = sorted({v.subject for v in verdicts if v.scope == "node"
                       and any(a.action.value == "isolate" for a in v.actions)})
    escalated = sorted({v.subject for v in verdicts if any(a.action.value == "escalate" for a in v.actions)})
    return {
        "id": case.id, "class": case.fault_class, "watchdog_elsewhere": case.watchdog_elsewhere,
        "variant": variant, "steps": steps, "outcome": outcome,
        "first_class": steps[0]["class"] if steps else None,
        "first_action": steps[0]["action"] if steps else None,
        "first_rule": steps[0]["rule"] if steps else None,
        "stopped_at": next((s["attempt"] for s in steps if s["action"] == "stop"), None),
        "isolated": isolated, "faulty": faulty, "escalated": escalated,
        "false_isolations": [n for n in isolated if not (case.hardware and n == faulty)],
    }


def _ratio(num: int, den: int) -> float | None:
    return round(num / den, 4) if den else None


def score(results: list[dict[str, Any]]) -> dict[str, Any]:
    """The figures of one variant (see the module docstring)."""
    plain = [r for r in results if not r["watchdog_elsewhere"]]
    user = [r for r in plain if r["class"] == "user_error"]
    hw = [r for r in plain if r["class"] in HARDWARE]
    transient = [r for r in plain if r["class"] == "transient_software"]
    user_ok = [r for r in user if r["stopped_at"] is not None and r["stopped_at"] <= 2]
    hw_ok = [r for r in hw if r["stopped_at"] is None
             and (r["first_action"] == "requeue" or r["first_class"] in HARDWARE)]
    hw_named = [r for r in hw if r["first_class"] in HARDWARE and r["stopped_at"] is None]
    tr_ok = [r for r in transient if r["first_action"] in ("retry", "restart", "requeue") and r["stopped_at"] is None
             and not r["isolated"]]
    confusion: dict[str, Counter] = defaultdict(Counter)
    for r in plain:
        confusion[r["class"]][r["first_class"] or "none"] += 1
    per_class = {}
    for c in CLASSES:
        tp = confusion[c][c]
        predicted = sum(confusion[k][c] for k in confusion)
        n = sum(confusion[c].values())
        per_class[c] = {"n": n, "precision": _ratio(tp, predicted), "recall": _ratio(tp, n)}
    wd = [r for r in results if r["watchdog_elsewhere"]]
    wd_user = [r for r in wd if r["class"] == "user_error"]
    return {
        "cases": len(plain),
        "user_errors": len(user),
        "user_errors_stopped_within_2": _ratio(len(user_ok), len(user)),
        "user_errors_stopped_at_all": _ratio(sum(r["stopped_at"] is not None for r in user), len(user)),
        "hardware_faults": len(hw),
        "hardware_recall": _ratio(len(hw_ok), len(hw)),
        "hardware_named_at_once": _ratio(len(hw_named), len(hw)),
        "hardware_moved_at_once": _ratio(sum(r["first_action"] == "requeue" for r in hw), len(hw)),
        "hardware_node_isolated": _ratio(sum(r["faulty"] in r["isolated"] for r in hw), len(hw)),
        "transient_faults": len(transient),
        "transient_retried": _ratio(len(tr_ok), len(transient)),
        "false_isolations": sum(len(r["false_isolations"]) for r in results),
        "false_isolation_cases": sorted({r["id"] for r in results if r["false_isolations"]}),
        "stopped_wrongly": sorted(r["id"] for r in results if r["stopped_at"] is not None
                                  and r["class"] != "user_error"),
        "per_class": per_class,
        "confusion": {c: dict(confusion[c]) for c in sorted(confusion)},
        "watchdog_elsewhere": {
            "cases": len(wd),
            "user_errors": len(wd_user),
            "user_errors_stopped": _ratio(sum(r["stopped_at"] is not None for r in wd_user), len(wd_user)),
            "user_errors_stopped_within_3": _ratio(sum(r["stopped_at"] is not None and r["stopped_at"] <= 3
                                                       for r in wd_user), len(wd_user)),
            "first_retried": _ratio(sum(r["first_action"] in ("retry", "restart", "requeue") for r in wd), len(wd)),
            "isolations": sum(len(r["isolated"]) for r in wd),
        },
        "misses": {
            "user_not_stopped_within_2": sorted(r["id"] for r in user if r not in user_ok),
            "hardware_missed": sorted(r["id"] for r in hw if r not in hw_ok),
            "transient_not_retried": sorted(r["id"] for r in transient if r not in tr_ok),
        },
    }


def run(split: str = "eval", *, corpus: Path = CORPUS, settings: Settings | None = None) -> dict[str, Any]:
    cases = load(split, corpus)
    t0 = time.perf_counter()
    out: dict[str, Any] = {"split": split, "corpus": str(corpus.relative_to(REPO) if corpus.is_relative_to(REPO)
                                                            else corpus),
                           "excerpts": len(cases), "by_class": dict(Counter(c.fault_class for c in cases)),
                           "targets": {**TARGETS, "false_isolations": 0}, "variants": {}, "cases": {}}
    for variant in VARIANTS:
        results = [replay(c, variant, settings) for c in cases]
        out["variants"][variant] = score(results)
        out["cases"][variant] = results
    out["seconds"] = round(time.perf_counter() - t0, 2)
    out["missed"] = missed(out)
    return out


def missed(result: dict[str, Any]) -> list[str]:
    """The targets a result misses, as sentences."""
    out = []
    for variant, s in result["variants"].items():
        for key, want in TARGETS.items():
            got = s[key]
            if got is None or got < want:
                out.append(f"{variant}: {key} = {got} (wanted >= {want})")
        if s["false_isolations"]:
            out.append(f"{variant}: false_isolations = {s['false_isolations']} (wanted 0): "
                       f"{', '.join(s['false_isolation_cases'])}")
    return out


def table(result: dict[str, Any]) -> str:
    rows = [("figure", *result["variants"])]
    for key in ("user_errors_stopped_within_2", "hardware_recall", "transient_retried", "false_isolations",
                "hardware_named_at_once", "hardware_node_isolated", "user_errors_stopped_at_all"):
        rows.append((key, *(str(s[key]) for s in result["variants"].values())))
    rows.append(("watchdog: user errors stopped within 3",
                 *(str(s["watchdog_elsewhere"]["user_errors_stopped_within_3"]) for s in result["variants"].values())))
    width = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, width)) for r in rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="fleetmedic eval-failures",
        description="Replay the failure corpus's real excerpts through the job and node tracks (the worker's own "
                    "policy code) in two variants, no origin and origin = rank 0, and score stopping, retrying, "
                    "requeueing and isolating against the root cause each source settled. Writes JSON.")
    ap.add_argument("--split", choices=("eval", "tune", "all"), default="eval",
                    help="which part of the corpus to replay (default eval; rules are tuned on tune only)")
    ap.add_argument("--corpus", type=Path, default=CORPUS, help=f"corpus directory (default {CORPUS})")
    ap.add_argument("--out", type=Path, default=None,
                    help="JSON to write (default bench/results/failures.json in a checkout, else "
                         "./fleetmedic-results/failures.json, for the eval split; else nothing)")
    ap.add_argument("--check", action="store_true", help="exit 1 when a target is missed")
    ap.add_argument("--show", action="store_true", help="print every case's decisions")
    args = ap.parse_args(argv)
    try:
        result = run(args.split, corpus=args.corpus)
    except FileNotFoundError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    out = args.out if args.out is not None else (paths.result("failures.json") if args.split == "eval" else None)
    if args.show:
        for variant, results in result["cases"].items():
            for r in results:
                print(variant, r["id"], r["class"], r["outcome"],
                      " ".join(f"{s['action']}:{s['class']}:{s['rule']}" for s in r["steps"]), r["isolated"])
    print(f"{result['excerpts']} excerpts ({args.split}), {result['seconds']} s")
    print(table(result))
    for m in result["missed"]:
        print(f"target missed: {m}")
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1, sort_keys=False) + "\n")
        print(f"wrote {out}")
    return 1 if args.check and result["missed"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
