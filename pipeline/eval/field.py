"""Published field failure data and the closed-loop scenario built on it (``field.toml``).

:func:`load` reads the scenario with :mod:`tomllib` into a :class:`Field`; every value is
checked, and a bad one raises :class:`ValueError` naming its field (``causes.hbm3.kinds``,
``people.human_sigma``).  The file documents its sources and which values are assumptions;
every figure of ``[precursors]`` and ``[checkpoint_now]`` carries its source string, which
:meth:`Field.precursor_figures` lists for the evaluation's report and its check.
"""

from __future__ import annotations

import math
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipeline.sim.cluster import FAULT_KINDS

PATH = Path(__file__).with_name("field.toml")
#: kinds a cause may map to: the simulator's, and "hidden" (no telemetry signal)
KINDS = frozenset(FAULT_KINDS) | {"hidden"}
#: the simulator's kinds that show a sign before they fail (a ramp of [ramps]): the only
#: carriers of a cause's precursor share
PRECURSOR_KINDS = ("sbe_rise", "nvlink", "thermal")


@dataclass(frozen=True)
class Cause:
    name: str
    count: int
    percent: float
    kinds: dict[str, float]
    erratum: str = ""


@dataclass(frozen=True)
class Precursor:
    """The share of one cause's failures that show a sign fleetmedic can act on, and why."""

    cause: str
    share: float
    kinds: tuple[str, ...]  # the degrading simulator kinds that carry it
    source: str
    assumption: str = ""


@dataclass(frozen=True)
class Field:
    nodes: int
    gpus_per_node: int
    days: float
    quick_nodes: int
    quick_days: float
    interruptions: int
    interruption_days: float
    interruption_gpus: int
    rsc1_per_1000_node_days: float
    rsc2_per_1000_node_days: float
    utilization: float
    job_sizes: tuple[int, ...]
    job_size_shares: tuple[float, ...]
    checkpoint_minutes: float
    restart_minutes: float
    human_median_hours: float
    human_sigma: float
    repair_median_hours: float
    repair_sigma: float
    naive_diag_hours: float
    controller_retries: int
    lemon_share: float
    lemon_recurrence_hours: float
    hidden_recurrence_hours: float
    #: causes of hidden faults whose failures the scheduler traces to the node (origin_node)
    hidden_origin_known: tuple[str, ...]
    ramps: dict[str, float]
    warmup_s: int
    gpu_every_s: int
    causes: tuple[Cause, ...]
    #: per cause: the share of failures with a sign before them ([precursors])
    precursors: dict[str, Precursor] = field(default_factory=dict)
    #: benign rises isolated per real precursor ([precursors] false_alarms_per_true)
    false_alarms_per_true: float = 0.0
    #: the [DRAM] bound on benign rises, per node-year (the report's sensitivity)
    false_alarms_per_node_year_bound: float = 0.0
    #: seconds a job's GPUs spend saving on a checkpoint-now request ([checkpoint_now])
    checkpoint_save_s: float = 0.0
    #: share of jobs that never answer a checkpoint-now request
    non_honouring_share: float = 0.0
    raw: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @property
    def per_node_day(self) -> float:
        """Unexpected interruptions per node-day at the Llama 3 rate."""
        return self.interruptions / (self.interruption_days * self.interruption_gpus / self.gpus_per_node)

    def shares(self) -> dict[str, float]:
        """Each cause's share of interruptions, by count (sums to 1)."""
        total = sum(c.count for c in self.causes)
        return {c.name: c.count / total for c in self.causes}

    def precursor_share(self) -> float:
        """The share of all interruptions (by count) with a sign before the failure."""
        return sum(w * self.precursors[name].share for name, w in self.shares().items())

    def precursor_figures(self) -> list[dict[str, Any]]:
        """Every figure of ``[precursors]`` and ``[checkpoint_now]`` with its source string
        (empty when the file gives none: the evaluation's check flags it)."""
        raw = self.raw
        out = [{"name": f"precursors.{p.cause}.share", "value": p.share, "source": p.source,
                "assumption": p.assumption} for p in self.precursors.values()]
        for section, keys in (("precursors", ("false_alarms_per_true", "false_alarms_per_node_year_bound")),
                              ("checkpoint_now", ("save_seconds", "non_honouring_share"))):
            sect = raw.get(section) or {}
            for k in keys:
                out.append({"name": f"{section}.{k}", "value": sect.get(k),
                            "source": str(sect.get(f"{k}_source") or "")})
        return out


def _get(d: dict[str, Any], section: str, key: str) -> Any:
    if section not in d or not isinstance(d[section], dict):
        raise ValueError(f"{section}: missing section")
    if key not in d[section]:
        raise ValueError(f"{section}.{key}: missing")
    return d[section][key]


def _num(d: dict[str, Any], section: str, key: str, *, lo: float = 0.0, hi: float = math.inf,
         lo_open: bool = True, integer: bool = False) -> Any:
    v = _get(d, section, key)
    name = f"{section}.{key}"
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (integer and not isinstance(v, int)):
        raise ValueError(f"{name}: expected {'an integer' if integer else 'a number'}, got {v!r}")
    if not math.isfinite(v) or v > hi or v < lo or (lo_open and v == lo):
        raise ValueError(f"{name}: {v!r} is out of range ({'(' if lo_open else '['}{lo}, {hi}])")
    return v


def parse(d: dict[str, Any]) -> Field:
    """Validate a parsed scenario; a bad value raises ValueError naming its field."""
    sizes = _get(d, "workload", "job_sizes")
    shares = _get(d, "workload", "job_size_shares")
    if not isinstance(sizes, list) or not sizes or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 1
                                                          for x in sizes):
        raise ValueError(f"workload.job_sizes: expected a list of node counts >= 1, got {sizes!r}")
    if not isinstance(shares, list) or len(shares) != len(sizes) or not all(
            isinstance(x, (int, float)) and not isinstance(x, bool) and x > 0 for x in shares):
        raise ValueError(f"workload.job_size_shares: expected {len(sizes)} positive shares, got {shares!r}")
    if abs(sum(shares) - 1.0) > 1e-6:
        raise ValueError(f"workload.job_size_shares: shares sum to {sum(shares)}, not 1")
    ramps_raw = d.get("ramps")
    if not isinstance(ramps_raw, dict):
        raise ValueError("ramps: missing section")
    ramps = {}
    for k in ("sbe_rise", "nvlink", "thermal"):
        ramps[k] = float(_num(d, "ramps", k, hi=24 * 60.0))
    causes_raw = d.get("causes")
    if not isinstance(causes_raw, dict) or not causes_raw:
        raise ValueError("causes: missing section")
    causes = []
    for name, c in causes_raw.items():
        if not isinstance(c, dict):
            raise ValueError(f"causes.{name}: expected a table")
        sect = {f"causes.{name}": c}
        count = _num(sect, f"causes.{name}", "count", lo=0, lo_open=False, integer=True)
        percent = _num(sect, f"causes.{name}", "percent", lo=0, hi=100, lo_open=False)
        kinds = _get(sect, f"causes.{name}", "kinds")
        if not isinstance(kinds, dict) or not kinds:
            raise ValueError(f"causes.{name}.kinds: expected a table of kind = share")
        for k, share in kinds.items():
            if k not in KINDS:
                raise ValueError(f"causes.{name}.kinds: unknown kind {k!r}; known: {', '.join(sorted(KINDS))}")
            if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 < share <= 1:
                raise ValueError(f"causes.{name}.kinds.{k}: share {share!r} is not in (0, 1]")
        if abs(sum(kinds.values()) - 1.0) > 1e-6:
            raise ValueError(f"causes.{name}.kinds: shares sum to {sum(kinds.values())}, not 1")
        erratum = str(c.get("percent_erratum", ""))
        causes.append(Cause(name=name, count=count, percent=float(percent),
                            kinds={k: float(v) for k, v in kinds.items()}, erratum=erratum))
    interruptions = _num(d, "rates", "interruptions", integer=True)
    total = sum(c.count for c in causes)
    if total != interruptions:
        raise ValueError(f"causes: counts sum to {total}, not rates.interruptions = {interruptions}")
    for c in causes:
        if not c.erratum and abs(100.0 * c.count / total - c.percent) > 0.15:
            raise ValueError(f"causes.{c.name}.percent: {c.percent} does not match count {c.count} of {total} "
                             f"({100.0 * c.count / total:.1f}%); give percent_erratum if the source prints it so")
    f = Field(
        nodes=_num(d, "scenario", "nodes", integer=True),
        gpus_per_node=_num(d, "scenario", "gpus_per_node", integer=True),
        days=float(_num(d, "scenario", "days")),
        quick_nodes=_num(d, "scenario", "quick_nodes", integer=True),
        quick_days=float(_num(d, "scenario", "quick_days")),
        interruptions=interruptions,
        interruption_days=float(_num(d, "rates", "interruption_days")),
        interruption_gpus=_num(d, "rates", "interruption_gpus", integer=True),
        rsc1_per_1000_node_days=float(_num(d, "rates", "rsc1_per_1000_node_days")),
        rsc2_per_1000_node_days=float(_num(d, "rates", "rsc2_per_1000_node_days")),
        utilization=float(_num(d, "workload", "utilization", hi=1.0)),
        job_sizes=tuple(sizes),
        job_size_shares=tuple(float(x) for x in shares),
        checkpoint_minutes=float(_num(d, "workload", "checkpoint_minutes")),
        restart_minutes=float(_num(d, "workload", "restart_minutes", lo_open=False)),
        human_median_hours=float(_num(d, "people", "human_median_hours")),
        human_sigma=float(_num(d, "people", "human_sigma", lo_open=False, hi=5.0)),
        repair_median_hours=float(_num(d, "people", "repair_median_hours")),
        repair_sigma=float(_num(d, "people", "repair_sigma", lo_open=False, hi=5.0)),
        naive_diag_hours=float(_num(d, "people", "naive_diag_hours", lo_open=False)),
        controller_retries=_num(d, "people", "controller_retries", lo_open=False, integer=True),
        lemon_share=float(_num(d, "lemons", "share_of_nodes", lo_open=False, hi=1.0)),
        lemon_recurrence_hours=float(_num(d, "lemons", "recurrence_mean_hours")),
        hidden_recurrence_hours=float(_num(d, "hidden", "recurrence_mean_hours")),
        hidden_origin_known=_origin_known(d, causes),
        ramps=ramps,
        warmup_s=_num(d, "ramps", "warmup_s", integer=True, lo=0, lo_open=False),
        gpu_every_s=_num(d, "ramps", "gpu_every_s", integer=True, hi=60),
        causes=tuple(causes),
        precursors=_precursors(d, causes),
        false_alarms_per_true=float(_num(d, "precursors", "false_alarms_per_true", lo=0.0, lo_open=False, hi=100.0)),
        false_alarms_per_node_year_bound=float(_num(d, "precursors", "false_alarms_per_node_year_bound",
                                                    lo=0.0, lo_open=False, hi=365.0)),
        checkpoint_save_s=float(_num(d, "checkpoint_now", "save_seconds", hi=24 * 3600.0)),
        non_honouring_share=float(_num(d, "checkpoint_now", "non_honouring_share", lo=0.0, lo_open=False, hi=1.0)),
        raw=d,
    )
    return f


def _precursors(d: dict[str, Any], causes: list[Cause]) -> dict[str, Precursor]:
    """``[precursors.<cause>]`` for every cause: a share carried by the cause's degrading
    kinds (their shares in ``[causes]`` sum to it), with a source."""
    sect = d.get("precursors")
    if not isinstance(sect, dict):
        raise ValueError("precursors: missing section")
    out = {}
    for c in causes:
        name = f"precursors.{c.name}"
        p = sect.get(c.name)
        if not isinstance(p, dict):
            raise ValueError(f"{name}: missing (every cause states its precursor share, 0 included, with a source)")
        share = float(_num({name: p}, name, "share", lo=0.0, lo_open=False, hi=1.0))
        kinds = p.get("kinds")
        if not isinstance(kinds, list) or not all(isinstance(k, str) for k in kinds):
            raise ValueError(f"{name}.kinds: expected a list of kinds, got {kinds!r}")
        for k in kinds:
            if k not in PRECURSOR_KINDS:
                raise ValueError(f"{name}.kinds: {k!r} shows no sign before it fails; those that do: "
                                 f"{', '.join(PRECURSOR_KINDS)}")
            if k not in c.kinds:
                raise ValueError(f"{name}.kinds: {k!r} is not among causes.{c.name}.kinds")
        carried = sum(c.kinds[k] for k in kinds)
        missing = [k for k in c.kinds if k in PRECURSOR_KINDS and k not in kinds]
        if missing:
            raise ValueError(f"{name}.kinds: causes.{c.name} maps to {', '.join(missing)}, which show a sign: list them")
        if abs(carried - share) > 1e-6:
            raise ValueError(f"{name}.share: {share} is not the share of its kinds in causes.{c.name}.kinds "
                             f"({carried:g}): the sign is what those kinds simulate")
        source = p.get("source")
        if not isinstance(source, str) or not source.strip():
            raise ValueError(f"{name}.source: missing: every precursor figure names its source or says it is an assumption")
        assumption = p.get("assumption", "")
        if not isinstance(assumption, str):
            raise ValueError(f"{name}.assumption: expected a string, got {assumption!r}")
        out[c.name] = Precursor(cause=c.name, share=share, kinds=tuple(kinds), source=source.strip(),
                                assumption=assumption.strip())
    extra = [k for k, v in sect.items() if isinstance(v, dict) and k not in out]
    if extra:
        raise ValueError(f"precursors: {', '.join(sorted(extra))} is not a cause")
    return out


def _origin_known(d: dict[str, Any], causes: list[Cause]) -> tuple[str, ...]:
    names = _get(d, "hidden", "origin_known")
    hidden = {c.name for c in causes if "hidden" in c.kinds}
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise ValueError("hidden.origin_known: expected a list of cause names")
    for n in names:
        if n not in hidden:
            raise ValueError(f"hidden.origin_known: {n!r} is not a cause of hidden faults; those are: "
                             f"{', '.join(sorted(hidden))}")
    return tuple(names)


def load(path: Path | str | None = None) -> Field:
    """Read and validate ``field.toml`` (or another scenario file)."""
    p = Path(path) if path is not None else PATH
    with open(p, "rb") as fh:
        return parse(tomllib.load(fh))
