"""The evaluation's report: ``eval.json``, PNG plots and the summary in ``bench/README.md``.

Everything here is generated from the JSON results, so the summary never drifts from
the numbers: ``python -m pipeline.eval.report`` rewrites the plots and the summary from
``bench/results/eval.json`` and ``bench/results/nab.json``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "bench" / "results"
README = ROOT / "bench" / "README.md"
START, END = "<!-- eval:start -->", "<!-- eval:end -->"
POLICIES = ("fleetmedic", "manual", "naive_cordon", "retry_only")

#: (key, threshold, comparison) of the issue's acceptance, checked by ``fleetmedic eval --check``
ACCEPTANCE = (
    ("hw_recall", 0.99, ">="),
    ("hw_precision", 0.95, ">="),
    ("false_isolations", 0, "=="),
    ("user_errors_blamed_on_hardware", 0, "=="),
    ("degrading_isolated_before_failure", 0.90, ">="),
    ("median_lead_s", 600.0, ">="),
)


def combine(quality: dict[str, Any] | None, closed: dict[str, Any] | None) -> dict[str, Any]:
    """``eval.json``: the headline keys at the top, each part whole beneath."""
    out: dict[str, Any] = {}
    if quality is not None:
        for k in ("hw_recall", "hw_precision", "false_isolations", "user_errors_blamed_on_hardware",
                  "switch_faults_blamed_on_nodes", "degrading_isolated_before_failure", "median_lead_s"):
            out[k] = quality.get(k)
    if closed is not None:
        out["policies"] = {p: {k: closed["policies"][p].get(k) for k in
                               ("ettr", "gpu_hours_lost", "healthy_nodes_isolated", "needed_human")}
                           for p in POLICIES if p in closed.get("policies", {})}
        fm = out["policies"].get("fleetmedic", {}).get("gpu_hours_lost")
        ratios = {}
        for p in ("manual", "naive_cordon", "retry_only"):
            other = out["policies"].get(p, {}).get("gpu_hours_lost")
            if fm is not None and other:
                ratios[p] = fm / other
        out["gpu_hours_lost_vs"] = ratios
    out["quality"] = quality
    out["closed_loop"] = closed
    return out


def check(ev: dict[str, Any]) -> list[str]:
    """The acceptance criteria that ``ev`` misses (empty: all met)."""
    bad = []
    for key, thr, op in ACCEPTANCE:
        v = ev.get(key)
        if v is None or not {">=": v >= thr, "==": v == thr}[op]:
            bad.append(f"{key} = {v} (wanted {op} {thr})")
    pol = ev.get("policies") or {}
    if pol:
        ettr = pol.get("fleetmedic", {}).get("ettr")
        if ettr is None or ettr < 0.97:
            bad.append(f"fleetmedic ettr = {ettr} (wanted >= 0.97)")
        r = ev.get("gpu_hours_lost_vs", {})
        if r.get("naive_cordon") is None or r["naive_cordon"] > 1 / 3:
            bad.append(f"GPU-hours lost vs naive cordon = {r.get('naive_cordon')} (wanted <= 1/3)")
        if r.get("manual") is None or r["manual"] > 0.1:
            bad.append(f"GPU-hours lost vs manual = {r.get('manual')} (wanted <= 1/10)")
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
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
        a1.bar(names, [pol[p]["ettr"] for p in names], color=["tab:green", "tab:gray", "tab:orange", "tab:red"][:len(names)])
        a1.set_ylim(min(pol[p]["ettr"] for p in names) - 0.02, 1.0)
        a1.axhline(0.97, color="k", ls="--", lw=1)
        a1.set_title("ETTR (productive / allocated GPU time)")
        a2.bar(names, [pol[p]["gpu_hours_lost"] for p in names], color=["tab:green", "tab:gray", "tab:orange", "tab:red"][:len(names)])
        a2.set_yscale("log")
        a2.set_title("GPU-hours lost (log scale)")
        for a in (a1, a2):
            a.tick_params(axis="x", rotation=15)
        fig.suptitle("The same 54-day fault sequence on 2,048 nodes, four policies")
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
            "| policy | ETTR | GPU-hours lost | healthy nodes isolated | failures that needed a human |",
            "| --- | ---: | ---: | ---: | ---: |",
        ]
        for p, v in ev["policies"].items():
            lines.append(f"| {p} | {_f(v['ettr'], '.4f')} | {_f(v['gpu_hours_lost'], ',.0f')} | "
                         f"{v['healthy_nodes_isolated']} | {v['needed_human']} |")
        r = ev.get("gpu_hours_lost_vs", {})
        lines += ["", "fleetmedic's GPU-hours lost: " + ", ".join(f"{_f(v, '.3f')} of {k}'s" for k, v in r.items()) + ".", ""]
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
    ev, nab = load("eval.json"), load("nab.json")
    if ev:
        plots(ev)
    write_readme(ev, nab)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
