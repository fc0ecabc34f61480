"""``make bench-burst``, on Slurm: many nodes fail at once; how fast a real slurmctld has them drained.

1. **Cluster.** A Slurm cluster of its own (``deploy/slurm.sh``, reset first) with one
   node that runs a slurmd and ``nodes`` bench nodes (``b00001``...) in a partition of
   their own, registered in ``slurm.conf`` but without a slurmd: a drain needs a node the
   controller knows, not a daemon on it. The controller sees them as not responding; a
   drain is recorded on them (``DOWN+DRAIN``) as on any node.
2. **fleetmedic.** For each burst size, ``runs`` times, on nodes not touched before: an
   Xid 79 sample for every node of the burst written to ``telemetry.gpu`` at once. One
   worker (backend ``slurm``, the breaker configured to allow the burst) detects,
   decides and carries out each verdict as in production: the drain, then diagnostics.
   ``sinfo`` polled every 0.1 s records when each node shows drained (or already in
   the maintenance reservation of its diagnostics, see :class:`DrainWatch`); ``seconds`` runs
   from the first sample sent to the last node drained, ``verdict_to_drain`` from each
   node's verdict on the ``verdicts`` topic to its drain.
3. **The raw limits**, on as many other nodes, with nothing else in the way:
   ``raw_limit``: one ``scontrol`` process reading an ``update`` line per node, each with
   its own reason (what the backend does with a batch); ``raw_hostlist``: one ``scontrol
   update NodeName=<list>`` for the whole burst, with one reason (the floor of a drain);
   ``raw_per_node``: one ``scontrol update`` process per node, ``threads`` at once (how a
   script drains node by node). ``ratio`` is fleetmedic's nodes per second over
   ``raw_limit``'s.

Every figure is the median of the runs, with its minimum and maximum. Results go under
``slurm`` in ``bench/results/burst.json``.
"""

from __future__ import annotations

import asyncio
import subprocess
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from pipeline.config import load_settings
from pipeline.eval.bench import spread
from pipeline.eval.burst import fleetmedic_burst, settle
from pipeline.worker.procs import SLURM_SH, WorkerProcess, deploy_script, kafka_script, wait_ready
from pipeline.worker.topics import ensure_topics

PARTITION = "bench"


def bench_nodes(count: int) -> list[str]:
    return [f"b{i:05d}" for i in range(1, count + 1)]


class DrainWatch:
    """``sinfo`` of the bench partition every ``every`` seconds: the first wall time each
    node shows drained (or draining), or in maintenance. Diagnostics follow a drain at
    once when nothing else is left to isolate: they move the node from DRAIN into the
    maintenance reservation of their job, which can be sooner than the next poll, and the
    controller shows it in maintenance a few seconds later. Such a node counts when it is
    first seen there: later than its drain, never sooner."""

    def __init__(self, env: dict[str, str], every: float = 0.1) -> None:
        self.env, self.every = env, every
        self.done: dict[str, float] = {}
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="drain-watch")

    def poll(self) -> None:
        res = subprocess.run(["sinfo", "-h", "-N", "-p", PARTITION, "-t", "drain,drng,maint", "-o", "%N"], env=self.env,
                             capture_output=True, text=True, timeout=30, stdin=subprocess.DEVNULL)
        now = time.time()
        if res.returncode != 0:
            self.errors.append(res.stderr.strip()[:300])
            return
        for name in res.stdout.split():
            self.done.setdefault(name, now)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.poll()
            except Exception as exc:  # a slow controller: the next poll tries again
                self.errors.append(repr(exc)[:300])
            self._stop.wait(self.every)

    def __enter__(self) -> DrainWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)

    def wait(self, names: list[str], timeout: float) -> bool:
        end = time.time() + timeout
        while time.time() < end:
            if all(n in self.done for n in names):
                return True
            time.sleep(0.05)
        return False


def _scontrol(env: dict[str, str], *argv: str, stdin: str | None = None) -> None:
    res = subprocess.run(["scontrol", *argv], env=env, input=stdin, capture_output=True, text=True, timeout=600,
                         **({} if stdin is not None else {"stdin": subprocess.DEVNULL}))
    if res.returncode != 0:
        raise RuntimeError(f"scontrol {' '.join(argv)[:100]} failed ({res.returncode}): {res.stderr.strip()[:500]}")


def clear_diagnostics(env: dict[str, str], nodes: list[str]) -> None:
    """Cancel the diagnostics jobs queued in the bench partition and delete the
    maintenance reservations of ``nodes`` (as the backend deletes them on a drain)."""
    from actuators.slurm import SlurmBackend

    subprocess.run(["scancel", "-p", PARTITION], env=env, capture_output=True, timeout=120, stdin=subprocess.DEVNULL)
    asyncio.run(SlurmBackend(slurm_conf=env["SLURM_CONF"]).delete_reservations(nodes))


def raw_limits(env: dict[str, str], names: list[str], threads: int) -> dict[str, float]:
    """Seconds to drain each third of ``names`` in the three raw ways (see the module's
    docstring); nodes per second of each."""
    a, b, c = names[0::3], names[1::3], names[2::3]
    t0 = time.perf_counter()
    _scontrol(env, stdin="".join(f'update NodeName={n} State=DRAIN Reason="bench raw {n}: xid 79"\n' for n in a))
    t1 = time.perf_counter()
    _scontrol(env, "update", f"NodeName={','.join(b)}", "State=DRAIN", "Reason=bench raw hostlist")
    t2 = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(lambda n: _scontrol(env, "update", f"NodeName={n}", "State=DRAIN", f"Reason=bench raw {n}"), c))
    t3 = time.perf_counter()
    return {"raw_limit_nodes_per_s": len(a) / (t1 - t0), "raw_hostlist_nodes_per_s": len(b) / (t2 - t1),
            "raw_per_node_nodes_per_s": len(c) / (t3 - t2)}


def run(*, sizes: tuple[int, ...], runs: int, threads: int, env: dict[str, str], bootstrap: str,
        say: Any = print) -> dict[str, Any]:
    """The Slurm half of ``make bench-burst`` on a cluster of its own (stopped afterwards);
    its section of the results."""
    from pipeline.config import state_dir

    need = 2 * runs * sum(sizes)
    state = state_dir("bench-burst-slurm")
    senv = {**env, "FLEETMEDIC_STATE": str(state), "FLEETMEDIC_SLURM_NODES": "1",
            "FLEETMEDIC_SLURM_BENCH_NODES": str(need)}
    say(f"bench-burst (slurm): a fresh cluster in {state} with {need} bench nodes (deploy/slurm.sh reset, start)")
    deploy_script(SLURM_SH, "reset", senv)
    conf = deploy_script(SLURM_SH, "start", senv, timeout=600).removeprefix("SLURM_CONF=")
    cenv = {**senv, "SLURM_CONF": conf}
    worker: WorkerProcess | None = None
    try:
        app = f"fleetmedic-burst-slurm-{uuid.uuid4().hex[:6]}"
        wenv = {**senv, "FLEETMEDIC_KAFKA__BOOTSTRAP": bootstrap, "FLEETMEDIC_KAFKA__TOPIC_PREFIX": f"{app}.",
                "FLEETMEDIC_KAFKA__APP_ID": app, "FLEETMEDIC_WORKER__LOG_LEVEL": "warning",
                "FLEETMEDIC_ACTUATORS__BACKEND": "slurm", "FLEETMEDIC_ACTUATORS__SLURM_CONF": conf,
                "FLEETMEDIC_ACTUATORS__SLURM_DIAG_COMMAND": "true",
                # bench nodes have no slurmd: their diagnostics jobs never start, waiting is moot
                "FLEETMEDIC_ACTUATORS__SLURM_DIAG_START_WAIT_S": "0",
                "FLEETMEDIC_SAFETY__FLEET_SIZE": str(need), "FLEETMEDIC_SAFETY__MAX_FRACTION": "1.0",
                "FLEETMEDIC_SAFETY__MAX_ABSOLUTE": str(need)}
        s = load_settings(environ=wenv)
        asyncio.run(ensure_topics(s))
        logdir = state / "logs"
        logdir.mkdir(parents=True, exist_ok=True)
        worker = WorkerProcess(wenv, logdir / f"{app}.log")
        wait_ready([worker])
        free = iter(bench_nodes(need))
        by_size: dict[str, Any] = {}
        with DrainWatch(cenv) as watch:
            for size in sizes:
                per_run = []
                for rep in range(runs):
                    fm_names = [next(free) for _ in range(size)]
                    raw_names = [next(free) for _ in range(size)]
                    order = ("fleetmedic", "raw") if rep % 2 == 0 else ("raw", "fleetmedic")
                    r: dict[str, Any] = {}
                    for side in order:
                        if side == "raw":
                            r.update(raw_limits(cenv, raw_names, threads))
                        else:
                            r.update(asyncio.run(fleetmedic_burst(bootstrap, s, fm_names, watch,
                                                                  timeout=max(120.0, size / 5), done="drain")))
                    r["ratio"] = r["nodes_per_s"] / r["raw_limit_nodes_per_s"]
                    per_run.append(r)
                    say(f"  slurm burst {size} run {rep + 1}/{runs}: fleetmedic {r['seconds']:.1f} s "
                        f"({r['nodes_per_s']:.0f} nodes/s); raw: a line per node {r['raw_limit_nodes_per_s']:.0f}, "
                        f"one host list {r['raw_hostlist_nodes_per_s']:.0f}, a process per node "
                        f"{r['raw_per_node_nodes_per_s']:.0f} nodes/s; ratio {r['ratio']:.2f}; verdict to drain "
                        f"p50 {r['verdict_to_drain_p50_s']:.2f} s p99 {r['verdict_to_drain_p99_s']:.2f} s")
                    settle(worker, 600.0)
                    # bench nodes run no slurmd: their diagnostics jobs would stay pending, and
                    # the controller's scheduler would pass over them against the next run
                    clear_diagnostics(cenv, fm_names)
                summary: dict[str, Any] = {}
                for key in ("seconds", "nodes_per_s", "raw_limit_nodes_per_s", "raw_hostlist_nodes_per_s",
                            "raw_per_node_nodes_per_s", "ratio", "verdict_to_drain_p50_s", "verdict_to_drain_p99_s",
                            "fault_to_done_p50_s"):
                    summary.update(spread(key, [r[key] for r in per_run if r.get(key) is not None]))
                summary["p50_s"], summary["p99_s"] = summary["verdict_to_drain_p50_s"], summary["verdict_to_drain_p99_s"]
                summary["runs"] = per_run
                by_size[str(size)] = summary
        return {
            "bench_nodes": need, "threads": threads, "runs": runs, "bursts": by_size,
            "method": "Xid 79 samples for every node of a burst written at once to telemetry.gpu; one worker "
                      "(backend slurm) detects, decides and carries out the drain and the diagnostics as in "
                      "production; sinfo, polled every 0.1 s, records when each node shows drained. raw_limit: one "
                      "scontrol process reading an update line per node, each with its own reason (what the "
                      "backend does with a batch); raw_hostlist: one scontrol update of the whole host list; "
                      "raw_per_node: a scontrol process per node, threads at once. ratio = fleetmedic / raw_limit. "
                      "Medians of the runs, with min and max.",
            "sinfo_errors": watch.errors[:5],
        }
    finally:
        if worker is not None:
            worker.stop()
        deploy_script(SLURM_SH, "stop", senv)


def table(r: dict[str, Any]) -> str:
    rows = ["| Slurm burst | seconds | nodes/s | raw: line per node | raw: one host list | raw: process per node "
            "| ratio | verdict to drain p50 | p99 |",
            "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for size, b in r["bursts"].items():
        rows.append(f"| {size} | {b['seconds']:.2f} ({b['seconds_min']:.2f} to {b['seconds_max']:.2f}) "
                    f"| {b['nodes_per_s']:.0f} | {b['raw_limit_nodes_per_s']:.0f} | {b['raw_hostlist_nodes_per_s']:.0f} "
                    f"| {b['raw_per_node_nodes_per_s']:.0f} "
                    f"| {b['ratio']:.2f} ({b['ratio_min']:.2f} to {b['ratio_max']:.2f}) "
                    f"| {b['p50_s']:.2f} s | {b['p99_s']:.2f} s |")
    return "\n".join(rows)

