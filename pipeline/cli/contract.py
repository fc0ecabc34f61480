"""The integration contract, ``docs/contract.md``, generated from the code.

What a producer or consumer written from ``schemas/json/`` alone still needs to know:
which rules run on event time and which on the wall clock, what each action's
``params`` and each finding's ``evidence`` hold, the classification rules and what each
gives, every metric, the health endpoints and the circuit breaker's arithmetic.

The parts that the code holds as data are read from it: the metrics from the worker's
registry, the triage rules from :func:`pipeline.correlate.triage.classify`'s source, the settings
and their defaults from :mod:`pipeline.config`, the breaker's budgets from
:class:`actuators.CircuitBreaker`.  The parts that live in code paths (action params,
evidence keys, clocks) are the registries below; ``tests/unit/test_contract.py`` runs
real inputs through the pipeline and fails when they emit a param, a key, a rule or a
metric that the registries do not name, or when ``docs/contract.md`` is not what this
module generates (``fleetmedic contract`` writes it).
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path
from typing import Any

DOC = Path(__file__).resolve().parents[2] / "docs" / "contract.md"

#: every action's params (``PlannedAction.params``, also on ``ActionRecord``s), by action
ACTION_PARAMS: dict[str, dict[str, str]] = {
    "retry": {
        "attempt": "the attempt that failed (int)",
        "scheduler": "the job's scheduler: slurm, kubernetes or sim",
    },
    "restart": {
        "attempt": "the attempt that failed (int)",
        "scheduler": "the job's scheduler",
        "from_checkpoint": "resume from the job's last checkpoint (bool)",
    },
    "requeue": {
        "attempt": "the attempt that failed (or that runs on a degrading node)",
        "scheduler": "the job's scheduler",
        "exclude": "nodes the job must not be placed on again (list of node names; may be empty)",
        "from_checkpoint": "resume from the job's last checkpoint (bool)",
    },
    "stop": {
        "attempt": "the attempt that failed",
        "scheduler": "the job's scheduler",
        "escalate": "a person should look (bool; the same unexplained failure repeated)",
        "reason": "why the job is stopped, in words",
    },
    "isolate": {
        "reason": "the fault class that takes the node out, or the operator's words",
        "operator": "who asked (an operator decision: not counted by the circuit breaker)",
    },
    "drain": {
        "operator": "who asked (operator decisions only)",
        "after": "a degrading node's jobs moved off it at their checkpoint (or its deadline): why it is drained now",
    },
    "checkpoint": {
        "attempt": "the attempt running on the degrading node",
        "scheduler": "the job's scheduler",
        "deadline": "Unix seconds (event time) by which the job should have saved its state; after it the job is "
                    "moved from its last checkpoint (docs/checkpoint-now.md)",
        "node": "the degrading node the job is asked to leave",
    },
    "diagnose": {
        "remedy": "NVIDIA's catalog remedy for the Xid that isolated the node (e.g. RESET_GPU, field_diagnostics)",
        "when": "'free': run diagnostics once the running job has left the node",
        "operator": "who asked (operator decisions only)",
    },
    "return": {
        "diagnostics": "the diagnostics job whose pass returns the node",
        "operator": "who asked (operator decisions only)",
    },
    "escalate": {
        "reason": "what a person should look at, in words",
        "gpu": "the GPU index concerned (int or null)",
        "advisory": "the node stays in the pool: a network finding with network.enforce off (bool)",
        "diagnostics": "the diagnostics job that failed",
        "returns": "how often the node came back within lemon_window_s (a lemon)",
        "nodes": "a degrading switch: the nodes under it with port anomalies",
        "alert_only": "nothing of ours to act on (a switch, a held isolation, a fleet-wide switch): alert only",
        "dry_run": "the fleet-wide dry-run switch was turned on or off (bool)",
        "operator": "who asked (operator decisions only)",
    },
}

_RATE = {
    "p_value": "the rate test's p-value (conditional binomial test of recent against baseline)",
    "baseline_count": "events in the baseline part of the window",
    "recent_count": "events in the recent part",
    "baseline_rate": "events per bucket with a reading, baseline part",
    "recent_rate": "events per bucket with a reading, recent part",
    "rate_ratio": "recent rate / baseline rate",
    "window": "buckets with a reading in the whole window",
    "recent": "buckets in the recent part",
    "window_s": "detectors.window_s: event-time seconds of the window",
    "recent_s": "detectors.recent_s",
    "bucket_s": "detectors.bucket_s",
}
_PORT = {"port": "the port (device/port, e.g. mlx5_0/1)", "switch": "the switch the port is cabled to"}
_UNIVARIATE = {
    "value": "the reading judged", "baseline_mean": "its streaming baseline's mean",
    "baseline_sd": "the baseline's standard deviation", "z_point": "z-score of the reading",
    "z_short": "z-score of the short-term mean", "p_value": "two-sided tail probability", "score": "the score",
    "direction": "'high' or 'low'", "repeat": "consecutive deviating readings",
    "util": "the GPU's utilisation (GPU readings)", "busy_s": "seconds the GPU has been busy (GPU readings)",
    "job": "the job (step times)",
}
_PEER = {"value": "this node's value", "median": "the job's median", "ratio_to_median": "value / median",
         "scale": "robust scale (MAD) among the job's nodes", "peers": "nodes compared",
         "direction": "'high' or 'low'", "job": "the job"}
_XID = {
    "action": "the catalog action: isolate, restart_app, app_unless_repeated, escalate or record",
    "remedy": "NVIDIA's resolution bucket (RESET_GPU, RESTART_APP, ...)", "degrade": "counts toward degradation",
    "hardware": "the node's hardware is at fault (action isolate)", "rule": "the catalog rule, in words",
    "detail": "the driver's text (first 300 characters)", "count": "events of a windowed count (dcgm-exporter)",
}

#: every finding kind's ``evidence`` keys (``Anomaly.evidence``), by ``Anomaly.kind``
EVIDENCE: dict[str, dict[str, str]] = {
    "gpu_lost": {"lost": "true: the GPU no longer answers"},
    "ecc_dbe": {"dbe_delta": "new uncorrectable (double-bit) ECC errors since the last sample"},
    "row_remap_failure": {"remap_failure": "true: a row remap failed"},
    "xid": {"xid": "the Xid code", "mnemonic": "NVIDIA's name for it",
            "nvidia_immediate_action": "the catalog's immediate action",
            "nvidia_investigatory_action": "the catalog's investigatory action", **_XID},
    "sxid": {"sxid": "the NVSwitch SXid code", "switch_pci": "the NVSwitch's PCI bus id", **_XID},
    "ecc_sbe_rate": _RATE,
    "nvlink_error_rate": _RATE,
    "pcie_replay_rate": _RATE,
    "symbol_error_rate": {**_RATE, **_PORT},
    "thermal_throttle": {"fraction": "share of samples with thermal throttling in the window",
                         "samples": "samples in the window", "max_temp": "hottest throttled reading (C) or null",
                         "window_s": "detectors.throttle_window_s"},
    "temp_drift": _UNIVARIATE,
    "power_drift": _UNIVARIATE,
    "step_time_drift": _UNIVARIATE,
    "peer_step_time": _PEER,
    "peer_power": _PEER,
    "link_down": {**_PORT, "link_downed_delta": "link-down events since the last sample", "state": "'down' or 'up'"},
    "link_flap": {**_PORT, "link_downed_delta": "link-down events since the last sample", "state": "'down' or 'up'"},
    "link_degraded": {**_PORT, "rate_gbps": "the rate the link trained to", "expected_gbps": "the rate expected",
                      "width": "link width (e.g. 4X)", "speed": "lane speed text", "basis":
                      "what it was compared with: rated (network.rated_gbps), peers (alike ports of the node) or "
                      "past (the port's own best)"},
    "port_errors": {**_PORT, "model": "the fabric model's name", "threshold": "its score threshold",
                    "features": "the port window's features", "windows": "port windows scored"},
}

#: (rule, clock, settings, what happens): every time-based rule and the clock it runs on
CLOCKS: list[tuple[str, str, tuple[str, ...], str]] = [
    ("GPU and port rate tests (ECC, NVLink, PCIe replay, symbol errors)", "event",
     ("detectors.window_s", "detectors.recent_s", "detectors.bucket_s"),
     "windows count event-time buckets; a telemetry gap counts neither for nor against a rate"),
    ("thermal throttling", "event", ("detectors.throttle_window_s",),
     "share of throttled samples over the last throttle_window_s"),
    ("one finding per subject and kind", "event", ("detectors.anomaly_cooldown_s",), "repeats within it are dropped"),
    ("late and redelivered telemetry", "event", (),
     "a sample not after its node's last used one is refused (result=duplicate or late)"),
    ("job failure correlation", "event", ("policy.correlation_grace_s",),
     "node evidence stamped up to grace after the failure counts; judged when the telemetry watermark (every GPU "
     "and network partition) passes it"),
    ("... its propagation allowance", "wall", ("policy.correlation_lag_s",),
     "the watermark used is the one of this long ago, and below every anomaly this worker sent that its node "
     "track has not yet correlated, so findings reach the job track first"),
    ("... its longest wait", "wall", ("policy.correlation_wait_max_s",),
     "telemetry stalled or absent: judged on the evidence at hand (an anomaly never correlated stops holding "
     "the ticks back after as long)"),
    ("degradation confirmations", "event", ("policy.degrade_window_s",),
     "degrade_confirmations findings within it isolate the node"),
    ("repeat failures on one node", "event", ("policy.repeat_failure_window_s", "policy.repeat_origin_window_s"),
     "failed jobs' blame and failures that began on the node, counted within them"),
    ("Xid repeats", "event", ("policy.xid_window_s",), "one code on one GPU repeating, or 13/31/43 across jobs"),
    ("checkpoint deadline of a degrading node's job", "event", ("policy.checkpoint_deadline_s",),
     "the job is asked to save now (policy.checkpoint_now: a checkpoint action with this deadline) and moved at "
     "its next checkpoint record, or when the telemetry watermark passes the deadline (the move is stamped with "
     "the deadline); its node is drained once every job on it has moved"),
    ("... its longest wait", "wall", ("policy.checkpoint_deadline_s",),
     "telemetry stalled or absent: the job is moved this long after the request in wall time"),
    ("lemon nodes", "event", ("policy.lemon_window_s",), "returns to service within it"),
    ("switch hold of a lone node's port anomaly", "event", ("network.hold_s", "network.window_s"),
     "ended only by a tick on the fabric's watermark (network partitions); a later notice of another node does "
     "not end it"),
    ("... its propagation allowance", "wall", ("network.tick_lag_s",), "as correlation_lag_s"),
    ("fabric model refit", "event", ("network.refit_s",),
     "fits at 60 s grid points of the network watermark (the first with network.min_train_rows healthy windows "
     "before it, then every refit_s) on an order-free sample (bottom-k by a stable hash) of the last refit_s; "
     "the model scores windows from 60 s of event time later, and the stream waits for a fit that is late: every "
     "replay speed fits and scores alike"),
    ("circuit breaker window", "event", ("safety.window_s",), "isolations counted by their verdicts' event time"),
    ("actuator retries", "wall", ("actuators.base_delay_s", "actuators.max_delay_s"),
     "exponential backoff between the attempts (actuators.max_attempts) of a backend that failed temporarily; "
     "each next try is a due time kept in the worker's action_pending table, never a sleep in the stream"),
    ("a drain refused for now (a PodDisruptionBudget), or an action waiting on a controller", "wall",
     ("actuators.drain_wait_s",),
     "tried again at the backoff's pace (or the server's Retry-After) past max_attempts, until this long after "
     "its first try; other targets go on meanwhile (actuators.max_in_flight at once, each in its own order). "
     "A requeue waits so on the training operator (a suspended PyTorchJob's pods to stop) and on Kueue (a "
     "deactivated Workload's job to be suspended), looking again every second"),
    ("containment first", "wall", ("actuators.contain_quiet_s",),
     "while an isolation runs or is due, and for this long after, only isolations and the requeues that move "
     "jobs off failing nodes start; drains, diagnostics, checkpoint requests and returns wait (a burst's "
     "isolations arrive over seconds: the work between them would take the backend from containment)"),
    ("a pod's drain mode (Kubernetes)", "wall", ("actuators.drain_timeout_s",),
     "DeleteAfterTimeout pods are evicted once the drain has waited this long since its first try (a pod's "
     "fleetmedic.dev/drain-timeout-s overrides it); AllowCompletion pods are never evicted, the drain waits "
     "for them (up to actuators.drain_wait_s); Immediate pods (actuators.drain_mode's default) at once"),
    ("a Slurm diagnostics job's start", "wall", ("actuators.slurm_diag_start_wait_s",),
     "the diagnostics action looks at its job every 0.5 s for this long, inside the runner's task for that "
     "node (never in the stream): once the job runs, the node is drained again around it; a job still "
     "pending is left to the node's maintenance reservation"),
]

#: what the job track does with each triage kind at the job's first failure, and later
KIND_ACTIONS: dict[str, tuple[str, str]] = {
    "hardware": ("requeue", "without the node the output names; that node is isolated"),
    "contained": ("restart", "in place from the checkpoint; a repeat is judged as unknown"),
    "suspect": ("requeue", "on other nodes, without the node it points at; the same failure on other nodes stops it"),
    "network": ("requeue", "on other nodes; as suspect"),
    "user": ("retry", "policy.user_error_retries times, then stop"),
    "transient": ("retry", "policy.transient_retries times, then requeue"),
    "elsewhere": ("requeue", "on other nodes; the same failure unknown_repeats times stops it for a person"),
    "unknown": ("requeue", "on other nodes; the same failure unknown_repeats times stops it for a person"),
}

#: decisions of the job track besides the triage rules (``evidence.decided_by``)
JOB_RULES: dict[str, str] = {
    "driver_contained_xid": "the driver contained an Xid to the job's application (catalog RESTART_APP): restart",
    "driver_application_xid": "the driver names the application (Xid 13/31/43): the user's, as a user error",
    "same_failure_on_other_nodes": "the same failure on another placement: the job's, stop (user_error)",
    "same_failure_repeats": "the same unexplained failure policy.unknown_repeats times: stop and escalate",
    "same_failure_same_nodes": "the same failure again on the same nodes: requeue elsewhere",
}

#: rules of the node track: (rule, fault class, actions, settings)
NODE_RULES: list[tuple[str, str, str, tuple[str, ...]]] = [
    ("a critical finding (GPU lost, ECC DBE, row remap failure)", "gpu_hardware / gpu_memory",
     "isolate, drain, diagnose; every job on the node is told (node_fault) and moved off it", ()),
    ("an Xid or SXid whose catalog action is isolate", "the catalog's", "isolate, drain, diagnose (remedy)", ()),
    ("an Xid the driver contained (restart_app)", "-", "the job is told; it restarts in place", ()),
    ("Xid 13/31/43 on one GPU in several jobs", "gpu_hardware", "isolate, drain, diagnose (field_diagnostics)",
     ("policy.xid_app_repeat_jobs", "policy.xid_window_s")),
    ("one Xid code repeating on one GPU", "the Xid's", "escalate", ("policy.xid_repeat_escalate", "policy.xid_window_s")),
    ("degradation findings (rates, throttling, NVLink)", "node_degrading / nvlink",
     "isolate; under a job: the job is moved at its next checkpoint, diagnose when free",
     ("policy.degrade_confirmations", "policy.degrade_window_s")),
    ("failed jobs' blame on one node", "node_degrading (suspect)", "isolate, drain, diagnose",
     ("policy.repeat_failure_jobs", "policy.repeat_failure_share", "policy.repeat_failure_window_s")),
    ("failures of distinct jobs beginning on one node", "node_degrading (suspect)", "isolate, drain, diagnose",
     ("policy.repeat_origin_failures", "policy.repeat_origin_window_s")),
    ("a lone node's port anomaly under its switch", "node_network", "escalate (advisory) or isolate with "
     "network.enforce", ("network.hold_s", "network.switch_min_nodes")),
    ("port anomalies on several nodes under one switch", "fabric_switch", "escalate the switch (alert_only); "
     "its nodes are not blamed", ("network.switch_min_nodes", "network.window_s")),
    ("diagnostics pass / fail", "-", "return / escalate", ()),
    ("a node back too often", "-", "escalate (lemon); it stays out", ("policy.lemon_returns", "policy.lemon_window_s")),
]

ENDPOINTS: list[tuple[str, str, str]] = [
    ("GET /healthz", "public", "200 {ok, uptime_s} while the worker's event loop answers: a liveness probe"),
    ("GET /readyz", "public",
     "200 when ready, else 503; {ready, assigned, rebalancing, control_loaded, caught_up, lag_records, max_lag, "
     "partitions, partitions_unknown}. Ready = the operator's decisions are read from the control topic, the "
     "consumers have partitions, no rebalance is under way, and at most worker.ready_max_lag records are left "
     "to read on them (caught up): a readiness probe"),
    ("GET /fleetmedic/ready", "public", "as /readyz without the caught-up condition (tools that start workers)"),
    ("GET /metrics", "viewer", "Prometheus text format: the metrics below"),
    ("GET /fleetmedic/stats", "viewer", "the worker's counters as JSON"),
]


# ------------------------------------------------------------------------- extracted from code


def triage_rules() -> list[dict[str, str]]:
    """The rules of :func:`pipeline.correlate.triage.classify`, in order, read from its source:
    kind, fault class, rule name and the reason it gives."""
    from pipeline.correlate import triage

    tree = ast.parse(inspect.getsource(triage.classify))
    rules: list[dict[str, str]] = []

    def text(node: ast.AST) -> str:
        if isinstance(node, ast.Constant):
            return str(node.value)
        if isinstance(node, ast.JoinedStr):
            return "".join(str(v.value) if isinstance(v, ast.Constant) else "…" for v in node.values)
        if isinstance(node, ast.Attribute):
            return node.attr
        return "varies"  # computed from what the text says (see pipeline/correlate/triage.py)

    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "t" \
                and len(node.args) >= 4:
            kind, fc, rule, why = (text(a) for a in node.args[:4])
            if fc == "varies" and "xid" in rule:
                fc = "the Xid's (NVIDIA's catalog)"
            rules.append({"kind": kind, "fault_class": fc, "rule": rule, "why": why, "line": str(node.lineno)})
    rules.sort(key=lambda r: int(r["line"]))
    return rules


def metrics() -> list[tuple[str, str, str, tuple[str, ...]]]:
    """(name, type, help, labels) of every metric the worker exports."""
    from pipeline.worker.metrics import Metrics

    out = []
    for collector in Metrics().registry._collector_to_names:  # the registry's own list
        for fam in collector.describe():
            labels = tuple(getattr(collector, "_labelnames", ()))
            name = fam.name + ("_total" if fam.type == "counter" else "")
            out.append((name, fam.type, fam.documentation, labels))
    return sorted(set(out))


def _setting(path: str) -> Any:
    from pipeline.config import Settings

    section, field = path.split(".")
    return getattr(getattr(Settings(), section), field)


def breaker_table(sizes: tuple[int, ...] = (8, 32, 100, 512, 2048, 10000)) -> list[tuple[int, int]]:
    from actuators import CircuitBreaker

    from pipeline.config import Settings

    s = Settings().safety
    b = CircuitBreaker(max_fraction=s.max_fraction, max_absolute=s.max_absolute, window_s=s.window_s)
    return [(n, b.budget(n)) for n in sizes]


# ------------------------------------------------------------------------- the document


def render() -> str:
    from pipeline.config import Settings

    s = Settings()
    out: list[str] = []
    w = out.append
    w("# The fleetmedic contract")
    w("")
    w("<!-- generated by `fleetmedic contract` from pipeline/cli/contract.py and the code it reads; "
      "tests/unit/test_contract.py fails when this file is stale or the code emits something it does not name -->")
    w("")
    w("The records themselves are specified by the JSON Schemas in `schemas/json/` (every record carries "
      "`schema`, e.g. `gpu/1`, and `ts`, its event time in Unix seconds). This document is the rest: the "
      "clocks, the meaning of `params` and `evidence`, the rules, the metrics, the endpoints and the limits.")
    w("")
    w("## Clocks: event time and wall time")
    w("")
    w("Every decision runs on event time (`ts` of the records), so replaying a recording "
      "(`fleetmedic record`, `fleetmedic replay --speed 100`) gives the verdicts of real time. The wall clock "
      "only bounds waits for records that may never come, and paces retries of a backend.")
    w("")
    w("| rule | clock | settings (default) | what happens |")
    w("|---|---|---|---|")
    for rule, clock, keys, what in CLOCKS:
        settings = ", ".join(f"`{k}` ({_setting(k):g})" for k in keys) or "-"
        w(f"| {rule} | {clock} | {settings} | {what} |")
    w("")
    w("A *telemetry watermark* is the event time that every partition of the telemetry topics has reached "
      "(a partition more than 300 s of event time behind the newest is left out). Records older than their "
      "node's last used sample are refused (see `fleetmedic_records_total`).")
    w("")
    w("## Actions and their params")
    w("")
    w("Job actions target a job, node actions a node (or a switch, or `fleet`, with `alert_only`). Every "
      "action of a verdict becomes one `action/1` record per attempt outcome; `params` are carried over.")
    w("")
    for action, params in ACTION_PARAMS.items():
        w(f"- **{action}**: " + "; ".join(f"`{k}`: {v}" for k, v in params.items()))
    w("")
    w("## Findings and their evidence")
    w("")
    w("`anomaly/1` records: `kind` names the finding, `evidence` holds these keys (a key may be absent or null "
      "where its value is unknown).")
    w("")
    w("| kind | evidence keys |")
    w("|---|---|")
    for kind, keys in EVIDENCE.items():
        w(f"| `{kind}` | " + "; ".join(f"`{k}`: {v}" for k, v in keys.items()) + " |")
    w("")
    w("## Classification rules")
    w("")
    w("### A job's failure, from its own output (`pipeline/correlate/triage.py`, the first rule that matches)")
    w("")
    w("A failure waits for node evidence first (see Clocks), until its grace has passed even when evidence "
      "is already there (another node's may still be on its way): a fault found on one of its nodes within "
      "`policy.degrade_window_s` before it and up to the grace after it makes it that node's (requeue "
      "without every node at fault). Otherwise its output decides; `evidence.decided_by` names the rule.")
    w("")
    w("A job still running on a node that takes a hard fault (`node_fault`) is not left to crash: it waits "
      "the same grace for faults on its other nodes, then is requeued without them all, from its last "
      "checkpoint (`evidence.reason`, `evidence.checkpoint`). If it fails meanwhile, the failure is judged "
      "instead, no later than the move was due. Every job running on the node is told, and so is a job "
      "placed on it afterwards.")
    w("")
    w("| # | rule (`decided_by`) | kind | fault class | reason given |")
    w("|---|---|---|---|---|")
    for k, r in enumerate(triage_rules(), 1):
        why = r["why"].replace("|", "\\|")
        w(f"| {k} | `{r['rule']}` | {r['kind']} | {r['fault_class']} | {why} |")
    w("")
    w("What each kind does:")
    w("")
    w("| kind | first failure | later |")
    w("|---|---|---|")
    for kind, (first, later) in KIND_ACTIONS.items():
        w(f"| {kind} | {first} | {later} |")
    w("")
    w("Rules of the job's history (they override the kind):")
    w("")
    for rule, what in JOB_RULES.items():
        w(f"- `{rule}`: {what}")
    w("")
    w("### A node's findings and history")
    w("")
    w("| rule | fault class | actions | settings |")
    w("|---|---|---|---|")
    for rule, fc, actions, keys in NODE_RULES:
        w(f"| {rule} | {fc} | {actions} | " + (", ".join(f"`{k}`" for k in keys) or "-") + " |")
    w("")
    w("## Metrics (`/metrics`)")
    w("")
    w("| name | type | labels | meaning |")
    w("|---|---|---|---|")
    for name, typ, doc, labels in metrics():
        w(f"| `{name}` | {typ} | {', '.join(f'`{x}`' for x in labels) or '-'} | {doc} |")
    w("")
    w("`fleetmedic_records_total{result}`: `ok` (used), `deadletter` (undecodable or invalid; on the "
      "dead-letter topic with the reason), `duplicate` (a redelivered telemetry sample: a sample of that node "
      "with that event time was used; dropped), `late` (a telemetry sample older than its node's last used "
      "one; on the dead-letter topic with a reason that starts `late:`).")
    w("")
    w("## Endpoints")
    w("")
    w("| endpoint | who | answer |")
    w("|---|---|---|")
    for ep, who, what in ENDPOINTS:
        w(f"| `{ep}` | {who} | {what} |")
    w("")
    w("## The circuit breaker")
    w("")
    sf = s.safety
    w(f"Automated isolations are capped per sliding window of `safety.window_s` ({sf.window_s:g} s, event "
      "time of the verdicts): the budget is `min(max_absolute, max(1, floor(max_fraction x fleet)))` with "
      f"`safety.max_fraction` = {sf.max_fraction:g} and `safety.max_absolute` = {sf.max_absolute}; the fleet "
      "is `safety.fleet_size`, or the nodes seen when it is 0. The fraction is rounded **down**, but never "
      "below one isolation. An isolation beyond the budget is *held* (`held_by_budget`, with the node's other "
      "actions) and escalated for a person; an isolation that failed gives its place back; an operator's "
      "isolation is not counted. Dry-run isolations (`safety.dry_run`, or the operator's switch) **are** "
      "counted: dry-run shows what the breaker would hold.")
    w("")
    w("| fleet | budget per window |")
    w("|---|---|")
    for n, b in breaker_table():
        w(f"| {n} | {b} |")
    w("")
    example = dict(breaker_table((40,)))[40]
    w(f"Worked example: a fleet of 40 nodes, defaults: floor({sf.max_fraction:g} x 40) = {example}. A "
      f"storm flags 20 nodes within an hour: the first {example} are isolated, the other {20 - example} are "
      f"held and escalated; {sf.window_s:g} s after the first isolation its place frees again.")
    w("")
    return "\n".join(out)


def write(path: Path = DOC) -> Path:
    path.write_text(render())
    return path
