"""``make eval-network``: the network track on a seeded fabric scenario suite.

A leaf/spine fabric (``nodes`` nodes, 4 ports each, ``leaves`` leaf switches, every port
of a node cabled to its leaf) streams ``telemetry.network`` samples every ``interval``
seconds with baselines of a training cluster: 10-25 GB/s per busy port, a little
transmit wait per MB, and rare isolated symbol, receive and discard errors. The run is
a sequence of epochs; each epoch injects, on distinct nodes of distinct leaves:

* ``port_degrade``: one port's symbol errors rise (0.05 -> 20 per second) and the link
  flaps once it is bad enough;
* ``flap``: one port's link goes down for a sample every 30-60 s;
* ``nic``: a failing NIC: receive errors and discards on every port of one node;
* ``congestion``: one port waits for credits (transmit wait per MB x 20-60) while it
  sends less: the fabric's problem, not the node's (no isolation expected);
* ``leaf``: a degrading leaf switch: symbol and receive errors on the ports of every
  node under it, starting within 30 s of each other (a switch verdict, no node
  isolation expected).

The first epochs are healthy (the model fits on them) and so is the last part of every
epoch. Records go through :class:`pipeline.eval.replay.LocalPipeline`, the very detection and
correlator code the Faust agents call; nodes are returned to service between epochs.

Then the PyOD models (HBOS, ECOD, COPOD, IForest) are compared on labelled feature rows
from the same generator: ROC AUC, recall at the calibrated threshold, false-positive
rate on healthy rows, and scoring cost per port-sample.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from detectors.fabric import MODELS, PortModel, port_features
from schemas import NetworkSample, NodeNotice, PortSample

from pipeline.config import Settings, load_settings

KINDS = ("port_degrade", "flap", "nic", "congestion", "leaf")
NODE_KINDS = ("port_degrade", "flap", "nic")
PORTS = 4
C_SYM, C_LER, C_DOWN, C_RCV, C_DISC, C_WAIT, C_TX, C_RX = range(8)


@dataclass
class FabricFault:
    kind: str
    start: float
    end: float
    node: int | None = None
    port: int | None = None
    leaf: int | None = None


class Fabric:
    """Counters of every port, advanced one interval at a time (vectorised)."""

    def __init__(self, nodes: int, leaves: int, interval: float, seed: int) -> None:
        self.n, self.leaves, self.dt = nodes, leaves, interval
        self.per_leaf = nodes // leaves
        self.rng = np.random.default_rng(seed)
        self.c = np.zeros((nodes, 8, PORTS))
        self.busy = self.rng.random(nodes) < 0.85
        self.names = [f"gpu-{i:04d}" for i in range(nodes)]
        self.leaf_of = np.arange(nodes) // self.per_leaf
        self.down = np.zeros((nodes, PORTS), dtype=bool)

    def step(self, t: float, active: list[FabricFault]) -> None:
        r, n, dt = self.rng, self.n, self.dt
        if r.random() < 0.05:  # jobs come and go
            flip = r.random(n) < 0.1
            self.busy = np.where(flip, ~self.busy, self.busy)
        gbps = np.where(self.busy, r.normal(20e9, 2.5e9, n), r.normal(0.3e9, 0.1e9, n)).clip(1e7)
        tx = (gbps[:, None] * dt * r.uniform(0.85, 1.15, (n, PORTS))).clip(0)
        rx = (gbps[:, None] * dt * r.uniform(0.85, 1.15, (n, PORTS))).clip(0)
        inc = np.zeros((n, 8, PORTS))
        inc[:, C_TX], inc[:, C_RX] = tx, rx
        inc[:, C_WAIT] = tx / 1e6 * r.gamma(4.0, 0.12, (n, PORTS))
        inc[:, C_SYM] = r.poisson(2e-4 * dt, (n, PORTS))
        inc[:, C_RCV] = r.poisson(1e-4 * dt, (n, PORTS))
        inc[:, C_DISC] = r.poisson(2e-4 * dt, (n, PORTS))
        inc[:, C_LER] = r.poisson(2e-5 * dt, (n, PORTS))
        self.down[:] = False
        for f in active:
            age = t - f.start
            if f.kind == "port_degrade":
                rate = min(20.0, 0.05 * np.exp(age / 40.0))
                inc[f.node, C_SYM, f.port] += r.poisson(rate * dt)
                inc[f.node, C_LER, f.port] += r.poisson(rate * dt / 200)
                if rate >= 20.0 and r.random() < 0.15:
                    inc[f.node, C_DOWN, f.port] += 1
                    self.down[f.node, f.port] = True
            elif f.kind == "flap":
                if r.random() < dt / 45.0:
                    inc[f.node, C_DOWN, f.port] += 1
                    inc[f.node, C_LER, f.port] += r.integers(1, 4)
                    inc[f.node, C_SYM, f.port] += r.poisson(30)
                    self.down[f.node, f.port] = True
            elif f.kind == "nic":
                inc[f.node, C_RCV] += r.poisson(15 * dt, PORTS)
                inc[f.node, C_DISC] += r.poisson(8 * dt, PORTS)
            elif f.kind == "congestion":
                inc[f.node, C_TX, f.port] *= 0.4
                inc[f.node, C_RX, f.port] *= 0.6
                inc[f.node, C_WAIT, f.port] = inc[f.node, C_TX, f.port] / 1e6 * r.uniform(20, 60)
            elif f.kind == "leaf":
                under = np.flatnonzero(self.leaf_of == f.leaf)
                stagger = (hash((f.leaf, int(f.start))) % 7919) / 7919.0
                on = under[(age >= 30.0 * ((np.arange(len(under)) * 0.37 + stagger) % 1.0))]
                inc[on, C_SYM] += r.poisson(3 * dt, (len(on), PORTS))
                inc[on, C_RCV] += r.poisson(1 * dt, (len(on), PORTS))
        self.last_inc = inc
        self.c += inc

    def samples(self, t: float) -> list[NetworkSample]:
        out = []
        c = self.c.astype(np.int64)
        for i, name in enumerate(self.names):
            leaf = f"leaf-{self.leaf_of[i]:02d}"
            ports = [PortSample.model_construct(
                port=f"mlx5_{p}/1", switch=leaf, state="down" if self.down[i, p] else "up",
                symbol_errors=int(c[i, C_SYM, p]), link_error_recovery=int(c[i, C_LER, p]),
                link_downed=int(c[i, C_DOWN, p]), rcv_errors=int(c[i, C_RCV, p]),
                xmit_discards=int(c[i, C_DISC, p]), xmit_wait=int(c[i, C_WAIT, p]), xmit_bytes=int(c[i, C_TX, p]),
                rcv_bytes=int(c[i, C_RX, p]), hw=None) for p in range(PORTS)]
            out.append(NetworkSample.model_construct(schema_="network/1", ts=t, node=name, ports=ports))
        return out


def schedule(nodes: int, leaves: int, epochs: int, healthy_epochs: int, epoch_s: float, rng: np.random.Generator,
             t0: float) -> list[FabricFault]:
    """Per epoch: one fault of every kind, each on a node of a different leaf."""
    per_leaf = nodes // leaves
    faults = []
    for e in range(healthy_epochs, healthy_epochs + epochs):
        start = t0 + e * epoch_s + 0.1 * epoch_s
        end = start + 240.0  # then the rest of the epoch is healthy again
        order = rng.permutation(leaves)
        for kind, leaf in zip(KINDS, order, strict=False):
            if kind == "leaf":
                faults.append(FabricFault(kind, start, end, leaf=int(leaf)))
            else:
                node = int(leaf) * per_leaf + int(rng.integers(per_leaf))
                faults.append(FabricFault(kind, start, end, node=node, port=int(rng.integers(PORTS))))
    return faults


def run(*, nodes: int = 256, leaves: int = 8, epochs: int = 100, healthy_epochs: int = 6, interval: float = 10.0,
        epoch_s: float = 720.0, seed: int = 1, model: str = "ecod", out: Path | None = None,
        compare_models: bool = True, say=print) -> dict[str, Any]:
    from pipeline.eval.replay import LocalPipeline

    s: Settings = load_settings(environ={}, overrides={"network": {"enforce": True, "model": model}})
    pipe = LocalPipeline(s)
    rng = np.random.default_rng(seed)
    fab = Fabric(nodes, leaves, interval, seed)
    t0 = 1_800_000_000.0
    faults = schedule(nodes, leaves, epochs, healthy_epochs, epoch_s, rng, t0)
    steps = int((healthy_epochs + epochs) * epoch_s / interval)
    say(f"fabric: {nodes} nodes x {PORTS} ports, {leaves} leaf switches; {len(faults)} faults "
        f"({epochs} of each kind) over {steps * interval / 3600:.1f} h of samples every {interval:.0f} s")
    started = time.perf_counter()
    fi = 0
    active: list[FabricFault] = []
    epoch_of = -1
    for k in range(steps):
        t = t0 + k * interval
        e = int((t - t0) // epoch_s)
        if e != epoch_of:
            epoch_of = e
            # between epochs every node is back in service (diagnostics passed, cable replaced)
            for node in list(pipe.core.nodes):
                pipe.core.handle(NodeNotice(ts=t, node=node, kind="operator_return", job="-", reason="next epoch"), t)
            pipe.core.switches.clear()
            pipe.core.schedule.switches.clear()
        while fi < len(faults) and faults[fi].start <= t:
            active.append(faults[fi])
            fi += 1
        active = [f for f in active if f.end > t]
        fab.step(t, active)
        pipe.feed(fab.samples(t))
        if k % 600 == 0 and k:
            say(f"  {k}/{steps} steps, {len(pipe.verdicts)} verdicts, model fitted: {pipe.net.model.ready} "
                f"({time.perf_counter() - started:.0f} s)")
    pipe.finish(t0 + steps * interval + s.network.hold_s + 1)
    result = score(pipe, fab, faults, t0, healthy_epochs * epoch_s, interval, s)
    result.update({"nodes": nodes, "leaves": leaves, "ports_per_node": PORTS, "interval_s": interval,
                   "epochs": epochs, "faults": len(faults), "model_used": model,
                   "samples": steps * nodes, "seconds": time.perf_counter() - started,
                   "scoring_us_per_port_sample": (pipe.net.score_s / max(pipe.net.scored_rows, 1)) * 1e6})
    if compare_models:
        say("comparing PyOD models on labelled port windows")
        result["models"] = compare(nodes, leaves, interval, seed + 1)
        best = max(result["models"].items(), key=lambda kv: kv[1]["auc"])
        others = ", ".join(f"{m} {v['us_per_row']:.1f} us" for m, v in result["models"].items() if m != model)
        result["model_choice"] = (
            f"{model}: AUC {result['models'][model]['auc']:.3f} against the best {best[0]} "
            f"{best[1]['auc']:.3f}, at {result['models'][model]['us_per_row']:.1f} us per port-sample ({others})")
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2) + "\n")
    say(table(result))
    return result


def _matches(v: Any, f: FabricFault, fab: Fabric, slack: float) -> bool:
    if not (f.start <= v.ts <= f.end + slack):
        return False
    if f.kind == "leaf":
        return v.scope == "switch" and v.subject == f"leaf-{f.leaf:02d}"
    return v.scope == "node" and v.subject == fab.names[f.node]


def score(pipe: Any, fab: Fabric, faults: list[FabricFault], t0: float, healthy_s: float, interval: float,
          s: Settings) -> dict[str, Any]:
    slack = s.network.hold_s + 3 * interval * s.network.feature_samples
    net_verdicts = [v for v in pipe.verdicts if v.fault_class.value in ("node_network", "fabric_switch")]
    node_verdicts = [v for v in net_verdicts if v.scope == "node"]
    switch_verdicts = [v for v in net_verdicts if v.scope == "switch"]
    kinds: dict[str, Any] = {}
    used: set[int] = set()
    for kind in KINDS:
        fs = [f for f in faults if f.kind == kind]
        delays, hit = [], 0
        for f in fs:
            if kind == "congestion":
                an = [a for a in pipe.anomalies if a.kind == "congestion" and a.node == fab.names[f.node]
                      and f.start <= a.ts <= f.end + slack]
                if an:
                    hit += 1
                    delays.append(min(a.ts for a in an) - f.start)
                continue
            m = [v for v in net_verdicts if _matches(v, f, fab, slack)]
            if m:
                hit += 1
                delays.append(min(v.ts for v in m) - f.start)
                used.update(id(v) for v in m)
        kinds[kind] = {"faults": len(fs), "detected": hit, "recall": hit / len(fs) if fs else None,
                       "median_delay_s": float(np.median(delays)) if delays else None}
    # precision: every verdict of a kind's scope that matches no fault of that kind is a false one
    false_node = [v for v in node_verdicts if id(v) not in used]
    for kind in NODE_KINDS:
        tp = kinds[kind]["detected"]
        kinds[kind]["precision"] = tp / (tp + len(false_node)) if tp + len(false_node) else None
    false_switch = [v for v in switch_verdicts if id(v) not in used]
    tp = kinds["leaf"]["detected"]
    kinds["leaf"]["precision"] = tp / (tp + len(false_switch)) if tp + len(false_switch) else None
    cong = [a for a in pipe.anomalies if a.kind == "congestion"]
    cong_ok = [a for a in cong if any(f.kind == "congestion" and fab.names[f.node] == a.node
                                      and f.start <= a.ts <= f.end + slack for f in faults)]
    kinds["congestion"]["precision"] = len(cong_ok) / len(cong) if cong else None
    leaf_faults = [f for f in faults if f.kind == "leaf"]
    under = {f"leaf-{f.leaf:02d}": (f, {fab.names[i] for i in np.flatnonzero(fab.leaf_of == f.leaf)})
             for f in leaf_faults}
    switch_fault_isolations = 0
    for v in node_verdicts:
        for f in leaf_faults:
            names = under[f"leaf-{f.leaf:02d}"][1]
            if v.subject in names and f.start <= v.ts <= f.end + slack:
                switch_fault_isolations += 1
    cong_nodes = [v for v in node_verdicts for f in faults
                  if f.kind == "congestion" and v.subject == fab.names[f.node] and f.start <= v.ts <= f.end + slack]
    return {
        "kinds": kinds,
        "switch_attribution_accuracy": kinds["leaf"]["recall"],
        "switch_fault_node_isolations": switch_fault_isolations,
        "congestion_node_isolations": len(cong_nodes),
        "healthy_isolations": sum(1 for v in node_verdicts if v.ts < t0 + healthy_s) + len(
            [v for v in false_node if v.ts >= t0 + healthy_s]),
        "verdicts": {"node": len(node_verdicts), "switch": len(switch_verdicts)},
        "model_fits": pipe.net.fits,
    }


def compare(nodes: int, leaves: int, interval: float, seed: int, fw: int = 6) -> dict[str, Any]:
    """Each PyOD model on the same labelled port windows: AUC, recall/FPR at threshold, cost."""
    from sklearn.metrics import roc_auc_score

    rng = np.random.default_rng(seed)
    fab = Fabric(nodes, leaves, interval, seed)
    t0 = 0.0
    hist = []
    faults = schedule(nodes, leaves, 8, 2, 600.0, rng, t0)
    steps = int(10 * 600 / interval)
    labels = []
    for k in range(steps):
        t = t0 + k * interval
        active = [f for f in faults if f.start <= t < f.end]
        fab.step(t, active)
        hist.append(fab.c.copy())
        if k >= fw:
            inc = np.maximum(hist[-1] - hist[-1 - fw], 0.0)
            feats = port_features(inc, np.full(nodes, fw * interval)).reshape(-1, 7)
            lab = np.zeros((nodes, PORTS), dtype=np.int8)
            for f in active:
                if t - f.start < fw * interval:
                    continue
                if f.kind == "leaf":
                    lab[fab.leaf_of == f.leaf] = 1
                elif f.kind == "nic":
                    lab[f.node] = 1
                else:
                    lab[f.node, f.port] = 1
            labels.append((t, feats, lab.reshape(-1)))
    healthy_rows = np.concatenate([x for t, x, _ in labels if t < 2 * 600])
    test = [(x, y) for t, x, y in labels if t >= 2 * 600]
    xt = np.concatenate([x for x, _ in test])
    yt = np.concatenate([y for _, y in test])
    out = {}
    for name in MODELS:
        m = PortModel(name, seed=seed)
        t1 = time.perf_counter()
        m.fit(healthy_rows[rng.permutation(len(healthy_rows))[:20000]])
        fit_s = time.perf_counter() - t1
        t1 = time.perf_counter()
        sc = m.scores(xt)
        per_row = (time.perf_counter() - t1) / len(xt) * 1e6
        t1 = time.perf_counter()
        m.scores(xt[:1])
        single = (time.perf_counter() - t1) * 1e3
        flagged = sc > m.threshold
        _, flags = m.flag(xt)  # the decision rule the detector applies: score and feature gates
        rule = np.zeros(len(xt), dtype=bool)
        rule[[f.index for f in flags]] = True
        out[name] = {"auc": float(roc_auc_score(yt, sc)), "recall_at_threshold": float(flagged[yt == 1].mean()),
                     "false_positive_rate": float(flagged[yt == 0].mean()),
                     "recall_flagged": float(rule[yt == 1].mean()), "false_positive_rate_flagged": float(rule[yt == 0].mean()),
                     "us_per_row": per_row,
                     "single_row_ms": single, "fit_s": fit_s, "rows_scored": int(len(xt))}
    return out


def table(r: dict[str, Any]) -> str:
    lines = [f"{'kind':<14}{'faults':>7}{'recall':>8}{'precision':>10}{'median delay':>14}"]
    for k, v in r["kinds"].items():
        p = "-" if v.get("precision") is None else f"{v['precision']:.3f}"
        rc = "-" if v["recall"] is None else f"{v['recall']:.3f}"
        d = "-" if v["median_delay_s"] is None else f"{v['median_delay_s']:.0f} s"
        lines.append(f"{k:<14}{v['faults']:>7}{rc:>8}{p:>10}{d:>14}")
    lines.append(f"switch attribution accuracy {r['switch_attribution_accuracy']:.3f}; "
                 f"node isolations during switch faults {r['switch_fault_node_isolations']}; "
                 f"healthy isolations {r['healthy_isolations']}; congestion isolations {r['congestion_node_isolations']}")
    if "models" in r:
        lines.append(f"{'model':<10}{'AUC':>7}{'recall@thr':>12}{'FPR':>9}{'recall(rule)':>14}{'FPR(rule)':>11}"
                     f"{'us/row':>9}{'1 row ms':>10}")
        for m, v in r["models"].items():
            lines.append(f"{m:<10}{v['auc']:>7.3f}{v['recall_at_threshold']:>12.3f}{v['false_positive_rate']:>9.4f}"
                         f"{v['recall_flagged']:>14.3f}{v['false_positive_rate_flagged']:>11.4f}"
                         f"{v['us_per_row']:>9.2f}{v['single_row_ms']:>10.2f}")
        lines.append(f"model used: {r.get('model_choice', r['model_used'])}")
    return "\n".join(lines)
