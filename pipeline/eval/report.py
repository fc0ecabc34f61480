"""The evaluation's report: ``eval.json``, PNG plots and the summary in ``bench/README.md``.

Everything here is generated from the JSON results, so the summary never drifts from
the numbers: ``python -m pipeline.eval.report`` rewrites the plots and the summary from
``bench/results/eval.json`` and ``bench/results/nab.json``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pipeline import paths

RESULTS = paths.results_dir()
#: the summary's place in a checkout (an installed package has no bench/README.md)
README = paths.CHECKOUT / "bench" / "README.md"
START, END = "<!-- eval:start -->", "<!-- eval:end -->"
POLICIES = ("fleetmedic", "fleetmedic_checkpoint_now", "reactive_oracle", "manual", "naive_cordon", "retry_only")
#: the policies that are fleetmedic (the targets on ETTR and healthy nodes hold for both)
FLEETMEDIC = ("fleetmedic", "fleetmedic_checkpoint_now")
COLOURS = {"fleetmedic": "tab:green", "fleetmedic_checkpoint_now": "tab:olive", "reactive_oracle": "tab:blue",
           "manual": "tab:gray", "naive_cordon": "tab:orange", "retry_only": "tab:red"}

#: (key, threshold, comparison) of the detection-quality acceptance, checked by ``fleetmedic eval --check``
ACCEPTANCE = (
    ("hw_recall", 0.99, ">="),
    ("hw_precision", 0.95, ">="),
    ("false_isolations", 0, "=="),
    ("user_errors_blamed_on_hardware", 0, "=="),
    ("degrading_isolated_before_failure", 0.90, ">="),
    ("median_lead_s", 600.0, ">="),
)
#: the closed loop's targets: (ratio key, threshold, comparison) on GPU-hours lost, and the
#: floors every fleetmedic policy must meet.  Against reactive_oracle, the policy that acts
#: right the instant each failure happens: fleetmedic within 5% of it, and below it by 10%
#: once it acts on precursors with checkpoint-now.  (The former target, 0.10 of manual
#: handling's GPU-hours, is retired: no reactive policy reaches it; the ratio is reported.)
CLOSED_LOOP_RATIOS = (
    ("fleetmedic_over_reactive_oracle", 1.05, "<="),
    ("checkpoint_now_over_reactive_oracle", 0.90, "<="),
    ("fleetmedic_over_naive_cordon", 1 / 3, "<="),
)
MIN_ETTR = 0.99
MAX_HEALTHY_ISOLATED = 0

_OPS = {">=": lambda v, t: v >= t, "<=": lambda v, t: v <= t, "==": lambda v, t: v == t}


def combine(quality: dict[str, Any] | None, closed: dict[str, Any] | None) -> dict[str, Any]:
    """``eval.json``: the headline keys at the top, each part whole beneath."""
    out: dict[str, Any] = {}
    if quality is not None:
        for k in ("hw_recall", "hw_precision", "false_isolations", "user_errors_blamed_on_hardware",
                  "switch_faults_blamed_on_nodes", "degrading_isolated_before_failure", "median_lead_s"):
            out[k] = quality.get(k)
    if closed is not None:
        out["policies"] = {p: {k: closed["policies"][p].get(k) for k in
                               ("ettr", "gpu_hours_lost", "healthy_nodes_isolated", "precursor_false_alarms",
                                "needed_human")}
                           for p in POLICIES if p in closed.get("policies", {})}
        fm = out["policies"].get("fleetmedic", {}).get("gpu_hours_lost")
        ratios = {}
        for p in ("reactive_oracle", "manual", "naive_cordon", "retry_only"):
            other = out["policies"].get(p, {}).get("gpu_hours_lost")
            if fm is not None and other:
                ratios[p] = fm / other
        out["gpu_hours_lost_vs"] = ratios
        out["ratios"] = dict(closed.get("ratios") or {})
    out["quality"] = quality
    out["closed_loop"] = closed
    return out


def check(ev: dict[str, Any]) -> list[str]:
    """The acceptance criteria that ``ev`` misses (empty: all met).  Each part present is
    checked: the detection-quality keys when ``ev`` has a quality run, the closed loop's
    targets when it has policies."""
    bad = []
    if ev.get("quality") is not None or any(k in ev for k, _, _ in ACCEPTANCE):
        for key, thr, op in ACCEPTANCE:
            v = ev.get(key)
            if v is None or not _OPS[op](v, thr):
                bad.append(f"{key} = {v} (wanted {op} {thr})")
    if ev.get("policies"):
        bad += check_closed_loop(ev)
    return bad


def check_closed_loop(ev: dict[str, Any]) -> list[str]:
    """The closed loop's targets: GPU-hours lost against reactive_oracle (fleetmedic, and with
    checkpoint-now), ETTR and healthy nodes isolated of both fleetmedic policies, and a source
    for every precursor figure."""
    bad = []
    pol = ev.get("policies") or {}
    ratios = ev.get("ratios") or {}
    for key, thr, op in CLOSED_LOOP_RATIOS:
        v = ratios.get(key)
        if v is None or not _OPS[op](v, thr):
            bad.append(f"GPU-hours lost {key} = {v} (wanted {op} {thr:.3g})")
    for name in FLEETMEDIC:
        p = pol.get(name) or {}
        ettr, healthy = p.get("ettr"), p.get("healthy_nodes_isolated")
        if ettr is None or ettr < MIN_ETTR:
            bad.append(f"{name} ettr = {ettr} (wanted >= {MIN_ETTR})")
        if healthy is None or healthy > MAX_HEALTHY_ISOLATED:
            bad.append(f"{name} healthy_nodes_isolated = {healthy} (wanted {MAX_HEALTHY_ISOLATED})")
    figures = ((ev.get("closed_loop") or {}).get("precursors") or {}).get("figures")
    if not figures:
        bad.append("precursor figures: none in the result (wanted every [precursors] figure with its source)")
    for f in figures or []:
        if not str(f.get("source") or "").strip():
            bad.append(f"precursor figure {f.get('name')} = {f.get('value')} has no source")
    return bad


def plots(ev: dict[str, Any], outdir: Path = RESULTS) -> list[Path]:
    """Delay distributions per class, degrading lead times, ETTR and GPU-hours lost per policy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    outdir.mkdir(parents=True, exist_ok=True)
    written = []
    q = ev.get("quality") or {}
    delays = {c: d for c, d in (q.get("delays_s") or {}).items() if d}
    if delays:
        fig, ax = plt.subplots(figsize=(9, 4.5))
        names = list(delays)
        ax.boxplot([[max(x, 0.5) for x in delays[c]] for c in names], orientation="horizontal", whis=(5, 95))
        ax.set_yticks(range(1, len(names) + 1), names)
        ax.set_xscale("log")
        ax.set_xlabel("detection delay from fault onset (simulated s, log scale)")
        ax.set_title(f"Right verdicts per fault class ({q.get('nodes')} nodes, {q.get('faults')} faults, {q.get('path')})")
        fig.tight_layout()
        p = outdir / "eval_delays.png"
        fig.savefig(p, dpi=110)
        plt.close(fig)
        written.append(p)
    leads = [x / 60 for x in q.get("lead_s") or []]
    cl_leads = [x / 60 for x in ((ev.get("closed_loop") or {}).get("policies", {}).get("fleetmedic", {})
                                 .get("lead_s") or [])]
    if leads or cl_leads:
        fig, ax = plt.subplots(figsize=(7, 4))
        if leads:
            ax.hist(leads, bins=20, alpha=0.7, label="quality run (Kafka + Faust)")
        if cl_leads:
            ax.hist(cl_leads, bins=20, alpha=0.6, label="closed loop (54 days)")
        ax.axvline(10, color="k", ls="--", lw=1, label="10 min")
        ax.set_xlabel("isolated before the hardware failed (simulated minutes)")
        ax.set_ylabel("degrading nodes")
        ax.legend()
        fig.tight_layout()
        p = outdir / "eval_lead_times.png"
        fig.savefig(p, dpi=110)
        plt.close(fig)
        written.append(p)
    pol = ev.get("policies") or {}
    if pol:
        names = [p for p in POLICIES if p in pol]
        labels = [p.replace("fleetmedic_checkpoint_now", "fleetmedic\n+checkpoint-now") for p in names]
        colours = [COLOURS[p] for p in names]
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4.5))
        a1.bar(labels, [pol[p]["ettr"] for p in names], color=colours)
        a1.set_ylim(min(pol[p]["ettr"] for p in names) - 0.02, 1.0)
        a1.axhline(MIN_ETTR, color="k", ls="--", lw=1)
        a1.set_title("ETTR (productive / allocated GPU time)")
        a2.bar(labels, [pol[p]["gpu_hours_lost"] for p in names], color=colours)
        a2.set_yscale("log")
        a2.set_title("GPU-hours lost (log scale)")
        for a in (a1, a2):
            a.tick_params(axis="x", rotation=30, labelsize=8)
        fig.suptitle(f"The same fault sequence for every policy, {len(names)} policies")
        fig.tight_layout()
        p = outdir / "eval_policies.png"
        fig.savefig(p, dpi=110)
        plt.close(fig)
        written.append(p)
    return written


def _f(x: Any, fmt: str = ".3f") -> str:
    return "-" if x is None else format(x, fmt)


def summary(ev: dict[str, Any] | None, nab: dict[str, Any] | None) -> str:
    """The markdown summary, generated from the JSON results."""
    lines = [START, "", "## Evaluation (generated by `make eval` / `make eval-nab` from `bench/results/*.json`)", ""]
    if ev and ev.get("quality"):
        q = ev["quality"]
        lines += [
            f"**Quality through the real pipeline** ({q['path']}): {q['nodes']} nodes x 8 GPUs, {q['faults']} faults "
            f"over {q['simulated_hours']:g} simulated hours, fault density {q['density_vs_field']}x Llama 3's field "
            f"rate, {q['healthy_nodes_never_faulted']} nodes never faulted, seed {q['seed']}.",
            "",
            "| class | faults | right | false verdicts | precision | recall | F1 | delay p50 | delay p95 |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        ]
        for c, v in q["by_class"].items():
            lines.append(f"| {c} | {v['faults']} | {v['right']} | {v['false_verdicts']} | {_f(v['precision'])} | "
                         f"{_f(v['recall'])} | {_f(v['f1'])} | {_f(v['median_delay_s'], '.0f')} s | "
                         f"{_f(v['p95_delay_s'], '.0f')} s |")
        o = q["overall"]
        lines += [
            f"| **overall** | {q['faults']} | | | {_f(o['precision'])} | {_f(o['recall'])} | {_f(o['f1'])} | "
            f"{_f(o['median_delay_s'], '.0f')} s | {_f(o['p95_delay_s'], '.0f')} s |",
            "",
            f"Hardware recall **{_f(q['hw_recall'])}**, precision **{_f(q['hw_precision'])}**; false isolations "
            f"**{q['false_isolations']}**; user errors blamed on hardware **{q['user_errors_blamed_on_hardware']}** "
            f"({q['user_errors_stopped']} of {q['user_errors']} stopped after the retry budget); switch faults "
            f"blamed on nodes **{q['switch_faults_blamed_on_nodes']}**; degrading nodes isolated before failure "
            f"**{_f(q['degrading_isolated_before_failure'])}**, median lead **{_f((q['median_lead_s'] or 0) / 60, '.1f')}"
            f" min**. Delays are in simulated seconds; job verdicts include the correlation grace.",
            "",
        ]
    if ev and ev.get("policies"):
        sc = ev["closed_loop"].get("scenario") or {}
        lines += [
            f"**Closed loop**: {sc.get('nodes')} nodes over {sc.get('days'):g} simulated days, {sc.get('faults')} "
            f"faults ({sc.get('per_1000_node_days')} per 1,000 node-days, Llama 3's rate and cause mix, "
            f"{sc.get('lemons')} lemon nodes; `pipeline/eval/field.toml`), the same seeded sequence for every "
            f"policy; checkpoints every {sc.get('checkpoint_minutes'):g} min, restart {sc.get('restart_minutes'):g} "
            f"min, a person acts after a lognormal delay (median {sc.get('human_median_hours'):g} h).",
            "",
            "| policy | ETTR | GPU-hours lost | healthy nodes isolated | isolated on a benign sign | "
            "failures that needed a human |",
            "| --- | ---: | ---: | ---: | ---: | ---: |",
        ]
        for p, v in ev["policies"].items():
            lines.append(f"| {p} | {_f(v['ettr'], '.4f')} | {_f(v['gpu_hours_lost'], ',.0f')} | "
                         f"{v['healthy_nodes_isolated']} | {v.get('precursor_false_alarms') or 0} | {v['needed_human']} |")
        r = ev.get("gpu_hours_lost_vs", {})
        ra = ev.get("ratios") or {}
        lines += ["", "fleetmedic's GPU-hours lost: " + ", ".join(f"{_f(v, '.3f')} of {k}'s" for k, v in r.items()) + "."]
        if "checkpoint_now_over_reactive_oracle" in ra:
            lines.append(f"With checkpoint-now on precursors: {_f(ra['checkpoint_now_over_reactive_oracle'], '.3f')} of "
                         f"reactive_oracle's. Targets: <= {CLOSED_LOOP_RATIOS[0][1]} and <= {CLOSED_LOOP_RATIOS[1][1]} "
                         f"of reactive_oracle's, ETTR >= {MIN_ETTR}, no healthy node isolated.")
        pr = ev["closed_loop"].get("precursors") or {}
        if pr:
            lines.append(f"Precursors (`[precursors]` in `field.toml`, every figure with its source): "
                         f"{_f(pr.get('share_of_failures'), '.3f')} of failures show a sign; {pr.get('faults_with_sign')} "
                         f"faults did, {pr.get('found_before_failure')} were found before they failed, "
                         f"{pr.get('false_alarms_drawn')} benign rises ({_f(pr.get('false_alarms_per_true'), 'g')} per real "
                         f"sign), a save on request takes {_f(pr.get('checkpoint_save_s'), 'g')} s, "
                         f"{_f(100 * (pr.get('non_honouring_share') or 0), '.0f')}% of jobs do not answer.")
        lines.append("")
    if nab:
        lines += [
            f"**NAB** (`make eval-nab`): the scorer reproduces the published Numenta scores to within "
            f"{_f(nab.get('scorer_check_abs_diff'), '.1e')} points (aggregate, standard profile). fleetmedic's "
            f"univariate detector: standard **{_f(nab.get('standard'), '.1f')}**, reward low FP "
            f"{_f(nab.get('reward_low_FP_rate'), '.1f')}, reward low FN {_f(nab.get('reward_low_FN_rate'), '.1f')}.",
            "",
        ]
        pub = nab.get("published") or {}
        if pub:
            lines += [f"Same {nab.get('files_scored')} files for every detector (withheld: "
                      f"{', '.join(nab.get('withheld_categories') or []) or 'none'}); the full-benchmark standard "
                      "score from NAB's scoreboard beside it.", "",
                      "| detector | standard | reward low FP | reward low FN | full benchmark (standard) |",
                      "| --- | ---: | ---: | ---: | ---: |"]
            rows = [(name, v.get("same_files") or {}, (v.get("full_benchmark") or {}).get("standard"))
                    for name, v in pub.items() if name != "null"]
            rows.append(("**fleetmedic**", {"standard": nab.get("standard"),
                                           "reward_low_FP_rate": nab.get("reward_low_FP_rate"),
                                           "reward_low_FN_rate": nab.get("reward_low_FN_rate")}, None))
            rows.sort(key=lambda r: -(r[1].get("standard") if r[1].get("standard") is not None else -1e9))
            for name, v, full in rows:
                lines.append(f"| {name} | {_f(v.get('standard'), '.1f')} | {_f(v.get('reward_low_FP_rate'), '.1f')} | "
                             f"{_f(v.get('reward_low_FN_rate'), '.1f')} | {_f(full, '.1f')} |")
            lines.append("")
        if nab.get("note"):
            lines += [str(nab["note"]), ""]
    lines += ["Plots: `bench/results/eval_delays.png`, `eval_lead_times.png`, `eval_policies.png`.", "", END]
    return "\n".join(lines)


def write_readme(ev: dict[str, Any] | None, nab: dict[str, Any] | None, path: Path = README) -> None:
    text = path.read_text() if path.exists() else "# Benchmarks and evaluation\n\n"
    block = summary(ev, nab)
    if START in text and END in text:
        head, rest = text.split(START, 1)
        text = head + block + rest.split(END, 1)[1]
    else:
        text = text.rstrip("\n") + "\n\n" + block + "\n"
    path.write_text(text)


def load(name: str, results: Path = RESULTS) -> dict[str, Any] | None:
    p = results / name
    return json.loads(p.read_text()) if p.exists() else None


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m pipeline.eval.report",
                                description="Regenerate the evaluation plots and bench/README.md's summary from "
                                            "bench/results/eval.json and nab.json.")
    p.parse_args(argv)
    if not paths.in_checkout():
        p.error("bench/README.md is part of a checkout of the repository; this is an installed package")
    ev, nab = load("eval.json"), load("nab.json")
    if ev:
        plots(ev)
    write_readme(ev, nab)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
