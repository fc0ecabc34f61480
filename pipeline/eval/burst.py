"""``make bench-burst``: many nodes fail at once; how fast the real API server sees them isolated.

1. **Fleet.** A local control plane of its own (``deploy/k8s.sh``, reset first) holds
   ``nodes`` Node objects (10,000 by default) registered as a kubelet registers them: GPU
   capacity, ``Ready``, schedulable.
2. **fleetmedic.** For each burst size (100, 500 and 1,000 by default), ``runs`` times, on
   nodes not touched before: the GPU collector of each struck node reports Xid 79 (the
   GPU fell off the bus) in one sample, all written to ``telemetry.gpu`` at once. One
   worker (backend ``kubernetes``, the breaker configured to allow the burst) detects,
   decides and carries out each verdict: cordon and taint, the quarantine condition, an
   Event, then the drain and a diagnostics Job, as it would in production. A watch on
   the Nodes records when each node is cordoned, tainted and conditioned. ``seconds``
   runs from the first sample sent to the last node done; ``verdict_to_cordon`` from the
   moment each verdict is on the ``verdicts`` topic to its node done. Before anything else
   is timed the worker finishes the burst's drains and diagnostics, and the diagnostics
   Jobs are deleted (with no kubelet their pods stay pending, and the scheduler's passes
   over 10,000 nodes for them took the cores from whichever side ran next; a raw side run
   during the drains measured half the rate it measures on a quiet machine).
3. **The raw limits.** On as many other nodes, split in two halves (which half goes first
   alternates), from the same client library, in ``threads`` parallel threads, with
   nothing else in the way:

   - ``raw_limit``: the two writes that make a node done (the spec patch with the cordon
     and the taint, the status patch with the condition). ``ratio`` is fleetmedic's nodes
     per second over this one's.
   - ``raw_same_calls``: the four calls that fleetmedic's backend makes per isolation
     (read the node, the conditional spec patch that keeps the node's other taints, the
     status patch, an Event). ``ratio_same_calls`` is fleetmedic over this one: what the
     pipeline adds, apart from what an isolation costs the API server.

Every figure is the median of the runs, with its minimum and maximum. NVIDIA NVSentinel
publishes 61 to 73 nodes/s for a burst of 1,000 (16.3 s); it is quoted beside ours, not
measured here.

Results go to ``bench/results/burst.json`` and a printed table.
"""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from actuators.k8s_nodes import NodeCache
from pipeline.config import load_settings
from pipeline.eval.bench import fault_sample, machine, spread
from pipeline.worker.procs import (
    K8S_SH,
    WorkerProcess,
    deploy_script,
    kafka_script,
    machine_cpu_seconds,
    process_cpu_seconds,
    wait_ready,
)
from pipeline.worker.topics import ensure_topics

SIZES = (100, 500, 1000)
#: NVIDIA NVSentinel's published burst figures (1,000 simultaneous failures, every node
#: cordoned in 16.3 s), for comparison only
NVSENTINEL = {"burst": 1000, "seconds": 16.3, "nodes_per_s": [61, 73]}
TAINT_KEY = "fleetmedic.dev/quarantine"
CONDITION = "FleetmedicQuarantine"
LABEL = "fleetmedic.bench/burst"

Say = Callable[[str], None]


def _now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _clients(kubeconfig: str, threads: int) -> Any:
    import kubernetes.client
    import kubernetes.config

    cfg = kubernetes.client.Configuration()
    kubernetes.config.load_kube_config(config_file=kubeconfig, client_configuration=cfg, persist_config=False)
    cfg.connection_pool_maxsize = threads
    return kubernetes.client.CoreV1Api(kubernetes.client.ApiClient(cfg))


def register(core: Any, names: list[str], threads: int, say: Say) -> float:
    """Create the Node objects as a kubelet would; seconds taken."""
    from kubernetes.client.exceptions import ApiException

    cap = {"cpu": "64", "memory": "512Gi", "pods": "110", "nvidia.com/gpu": "8"}

    def one(name: str) -> None:
        body = {"apiVersion": "v1", "kind": "Node",
                "metadata": {"name": name, "labels": {"kubernetes.io/hostname": name, LABEL: "1",
                                                     "nvidia.com/gpu.present": "true"}}}
        try:
            core.create_node(body)
        except ApiException as exc:
            if exc.status != 409:
                raise
        core.patch_node_status(name, {"status": {"capacity": cap, "allocatable": cap, "conditions": [
            {"type": "Ready", "status": "True", "reason": "KubeletReady", "message": "registered by the bench",
             "lastHeartbeatTime": _now(), "lastTransitionTime": _now()}]}})

    t0 = time.perf_counter()
    done = 0
    with ThreadPoolExecutor(threads) as pool:
        for _ in pool.map(one, names):
            done += 1
            if done % 2000 == 0:
                say(f"  {done}/{len(names)} nodes registered")
    return time.perf_counter() - t0


class NodeWatch:
    """A watch on the bench's Nodes: the first wall time each is cordoned, tainted with the
    quarantine taint and has the quarantine condition ``True``.

    It is the worker's own node cache (:class:`actuators.k8s_nodes.NodeCache`) on the
    bench's label: raw JSON rather than the client's models (building 10,000 ``V1Node``
    objects for a list takes seconds of a core, which the observer would take from the
    worker it measures), bookmarks followed, a list again after a 410 or a broken stream,
    so no change is missed.  A node done when first listed is recorded at the list's
    start."""

    def __init__(self, kubeconfig: str | None = None, *, core: Any = None) -> None:
        self.core = core if core is not None else _clients(str(kubeconfig), 2)
        self.done: dict[str, float] = {}
        self._listing_since = time.time()
        self.cache = NodeCache(self._list_node, conditions=(CONDITION,), annotation_prefix="fleetmedic.",
                               timeout_s=5, on_change=self._saw)

    def _list_node(self, **kw: Any) -> Any:
        if not kw.get("watch"):
            self._listing_since = time.time()
        return self.core.list_node(label_selector=LABEL, **kw)

    @property
    def errors(self) -> list[str]:
        """Why the watch listed again (the last few times)."""
        return list(self.cache.relisted)

    @property
    def lists(self) -> int:
        return self.cache.lists

    @staticmethod
    def is_done(node: dict[str, Any]) -> bool:
        """Whether a node (as the cache keeps it) is cordoned, tainted and conditioned."""
        tainted = any(t.get("key") == TAINT_KEY for t in node.get("taints") or [])
        conditioned = any(c.get("type") == CONDITION and c.get("status") == "True"
                          for c in node.get("conditions") or [])
        return bool(node.get("unschedulable")) and tainted and conditioned

    def _saw(self, node: dict[str, Any], listed: bool) -> None:
        name = node["name"]
        if name not in self.done and self.is_done(node):
            self.done[name] = self._listing_since if listed else time.time()

    def __enter__(self) -> NodeWatch:
        self.cache.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.cache.stop(join_s=10)

    def wait(self, names: list[str], timeout: float) -> bool:
        end = time.time() + timeout
        while time.time() < end:
            if all(n in self.done for n in names):
                return True
            time.sleep(0.05)
        return False


def _state(node: Any) -> str:
    spec, status = node.spec, node.status
    taints = [t.key for t in (spec.taints or [])] if spec else []
    conds = {c.type: c.status for c in (status.conditions or [])} if status else {}
    return (f"{node.metadata.name}: unschedulable={bool(spec and spec.unschedulable)} taints={taints} "
            f"{CONDITION}={conds.get(CONDITION)}")


def raw_limit(core: Any, names: list[str], threads: int) -> float:
    """Seconds for ``threads`` threads to cordon, taint and condition ``names`` with two
    PATCH requests each, from the same client library, with nothing else in the way."""

    def one(name: str) -> None:
        core.patch_node(name, {"spec": {"unschedulable": True, "taints": [
            {"key": TAINT_KEY, "value": "gpu_hardware", "effect": "NoSchedule"}]}})
        core.patch_node_status(name, {"status": {"conditions": [
            {"type": CONDITION, "status": "True", "reason": "BenchRaw", "message": "raw limit",
             "lastHeartbeatTime": _now(), "lastTransitionTime": _now()}]}})

    t0 = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(one, names))
    return time.perf_counter() - t0


def raw_same_calls(core: Any, names: list[str], threads: int) -> float:
    """Seconds for ``threads`` threads to isolate ``names`` with the calls that the
    Kubernetes backend makes per isolation: read the node; one spec patch, conditional on
    the resourceVersion read, with the cordon, the annotations and the taint list re-sent
    whole; the status patch with the condition; an Event on the node. Written here with the
    client library alone, not with the backend's code."""
    import kubernetes.client

    def one(name: str) -> None:
        node = core.read_node(name)
        taints = [{"key": t.key, "value": t.value, "effect": t.effect} for t in (node.spec.taints or [])]
        core.patch_node(name, {
            "metadata": {"resourceVersion": node.metadata.resource_version,
                         "annotations": {"fleetmedic.bench/verdict": "raw", "fleetmedic.bench/cordoned": "true"}},
            "spec": {"unschedulable": True,
                     "taints": [*taints, {"key": TAINT_KEY, "value": "gpu_hardware", "effect": "NoSchedule"}]}},
            _preload_content=False)
        core.patch_node_status(name, {"status": {"conditions": [
            {"type": CONDITION, "status": "True", "reason": "BenchRaw", "message": "raw limit, same calls",
             "lastHeartbeatTime": _now(), "lastTransitionTime": _now()}]}}, _preload_content=False)
        now = datetime.now(timezone.utc).replace(microsecond=0)
        core.create_namespaced_event("default", kubernetes.client.CoreV1Event(
            metadata=kubernetes.client.V1ObjectMeta(name=f"{name}.raw-{uuid.uuid4().hex[:12]}"),
            involved_object=kubernetes.client.V1ObjectReference(api_version="v1", kind="Node", name=name,
                                                                uid=node.metadata.uid),
            reason="BenchRawIsolate", message="raw limit, same calls", type="Warning",
            source=kubernetes.client.V1EventSource(component="fleetmedic-bench"),
            first_timestamp=now, last_timestamp=now, count=1), _preload_content=False)

    t0 = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(one, names))
    return time.perf_counter() - t0


#: the parties whose CPU seconds a burst reports: the process's name in ``/proc/<pid>/comm``,
#: or a word of its command line
PARTIES = {"apiserver": ("kube-apiserver", None), "etcd": ("etcd", None), "broker": ("java", "kafka.Kafka")}


def party_pids() -> dict[str, list[int]]:
    """The processes of each of :data:`PARTIES` running now (``/proc``)."""
    found: dict[str, list[int]] = {p: [] for p in PARTIES}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            comm = (entry / "comm").read_text().strip()
            cmdline = (entry / "cmdline").read_bytes() if any(c == comm and w for c, w in PARTIES.values()) else b""
        except OSError:
            continue
        for party, (name, word) in PARTIES.items():
            if comm == name and (word is None or word.encode() in cmdline):
                found[party].append(int(entry.name))
    return found


class CpuMeter:
    """CPU seconds used while a side of the burst runs: the whole machine's (every core,
    busy time), and each party's (:data:`PARTIES`, this process, the worker). On a machine
    whose cores the API server, the broker and the worker share, the nodes per second of
    either side are bounded by the cores over its CPU seconds per node."""

    def __init__(self, pids: dict[str, list[int]]) -> None:
        self.pids = {**pids, "bench": [os.getpid()]}

    def _read(self) -> dict[str, float]:
        out = {party: sum(process_cpu_seconds(p) for p in pids) for party, pids in self.pids.items()}
        out["machine"] = machine_cpu_seconds()[0]
        return out

    def measure(self, prefix: str, fn: Callable[[], Any]) -> tuple[Any, dict[str, float]]:
        """``fn()``, and the CPU seconds each party used meanwhile as ``<prefix>cpu_<party>_s``."""
        before = self._read()
        got = fn()
        after = self._read()
        return got, {f"{prefix}cpu_{k}_s": round(after[k] - before[k], 3) for k in after}


def raw_limits(core: Any, names: list[str], threads: int, *, swap: bool = False,
               meter: CpuMeter | None = None) -> dict[str, float]:
    """Both raw figures, each on half of ``names`` (``swap``: the same calls first); with a
    ``meter``, the CPU seconds of the ``raw_limit`` half as ``raw_cpu_<party>_s``."""
    half = len(names) // 2
    sides = [("raw_seconds", "raw_limit_nodes_per_s", raw_limit, names[:half]),
             ("raw_same_calls_seconds", "raw_same_calls_nodes_per_s", raw_same_calls, names[half:])]
    r: dict[str, float] = {}
    for seconds_key, rate_key, measure, part in reversed(sides) if swap else sides:
        if meter is not None and measure is raw_limit:
            r[seconds_key], cpu = meter.measure("raw_", lambda: measure(core, part, threads))
            r.update(cpu)
        else:
            r[seconds_key] = measure(core, part, threads)
        r[rate_key] = len(part) / r[seconds_key]
    return r


async def fleetmedic_burst(bootstrap: str, s: Any, names: list[str], watch: Any, timeout: float, *,
                           done: str = "cordon", explain: Callable[[list[str]], str] | None = None) -> dict[str, Any]:
    """Write one Xid 79 sample per node at once; wait until ``watch`` (``done``: node name
    to wall time; ``wait(names, timeout)``) sees every node done. ``done`` names the
    latency figures (``verdict_to_<done>_p50_s``); ``explain(missing)`` adds to the error
    when some node is not done in time."""
    from aiokafka import AIOKafkaConsumer, AIOKafkaProducer

    seen: dict[str, float] = {}
    want = set(names)
    consumer = AIOKafkaConsumer(s.topic("verdicts"), bootstrap_servers=bootstrap, group_id=None,
                                auto_offset_reset="latest", enable_auto_commit=False, fetch_max_wait_ms=20)
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, linger_ms=5, acks=1)
    await consumer.start()
    await consumer.seek_to_end()
    await producer.start()
    stop = asyncio.Event()

    async def follow() -> None:
        while not stop.is_set():
            batch = await consumer.getmany(timeout_ms=100)
            now = time.time()
            for msgs in batch.values():
                for m in msgs:
                    v = orjson.loads(m.value)
                    if v.get("subject") in want:
                        seen.setdefault(v["subject"], now)

    fol = asyncio.create_task(follow())
    try:
        t0 = time.time()
        for n in names:
            await producer.send(s.topic("telemetry.gpu"), key=n.encode(), value=fault_sample(n, t0))
        await producer.flush()
        ok = await asyncio.to_thread(watch.wait, names, timeout)
        await asyncio.sleep(0.5)
    finally:
        stop.set()
        await fol
        await consumer.stop()
        await producer.stop()
    if not ok:
        missing = [n for n in names if n not in watch.done]
        raise RuntimeError(f"burst of {len(names)}: {len(missing)} nodes not done ({done}) within {timeout:.0f} s "
                           f"(e.g. {explain(missing) if explain else missing[:5]}; watch errors: {watch.errors[-3:]})")
    last = max(watch.done[n] for n in names)
    lat = [watch.done[n] - seen[n] for n in names if n in seen]
    return {"seconds": last - t0, "nodes_per_s": len(names) / (last - t0),
            "fault_to_done_p50_s": float(np.percentile([watch.done[n] - t0 for n in names], 50)),
            f"verdict_to_{done}_p50_s": float(np.percentile(lat, 50)) if lat else None,
            f"verdict_to_{done}_p99_s": float(np.percentile(lat, 99)) if lat else None,
            "verdicts_seen": len(lat),
            # when, after the faults were written, a tenth, half, nine tenths and all of the
            # verdicts were out, and of the nodes done: where a burst's seconds go
            "timeline_s": {"verdicts": _quantiles([seen[n] - t0 for n in names if n in seen]),
                           done: _quantiles([watch.done[n] - t0 for n in names])}}


def _quantiles(xs: list[float]) -> list[float] | None:
    """The 10th, 50th, 90th and 100th percentiles of ``xs``, rounded to milliseconds."""
    return [round(float(q), 3) for q in np.percentile(xs, [10, 50, 90, 100])] if xs else None


def settle(worker: WorkerProcess, timeout: float) -> bool:
    """Wait until the worker has no action left to try (the drains and diagnostics that
    follow each isolation), so that the next run starts on a quiet API server."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        st = worker.stats()
        if not st.get("actions_waiting"):
            time.sleep(1.0)
            return True
        time.sleep(0.5)
    return False


BACKENDS = ("kubernetes", "slurm")


def clear_diagnostics(core: Any, say: Say, namespace: str = "fleetmedic-diag", timeout: float = 180.0) -> None:
    """Delete the diagnostics Jobs of the bursts so far, and wait until their pods are gone."""
    import kubernetes.client

    batch = kubernetes.client.BatchV1Api(core.api_client)
    jobs = batch.list_namespaced_job(namespace).items
    for name in [j.metadata.name for j in jobs if j.metadata and j.metadata.name]:
        batch.delete_namespaced_job(name, namespace, propagation_policy="Background")
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        left = len(core.list_namespaced_pod(namespace).items)
        if not left:
            return
        if not jobs:  # pods without Jobs: delete them directly
            core.delete_collection_namespaced_pod(namespace)
        time.sleep(1.0)
    say(f"  note: diagnostics pods still in {namespace} after {timeout:.0f} s")


def run(*, nodes: int = 10_000, sizes: tuple[int, ...] = SIZES, runs: int = 3, threads: int = 32,
        out: Path, say: Say = print, keep_running: bool = False,
        backends: tuple[str, ...] = BACKENDS) -> dict[str, Any]:
    """The burst bench on each of ``backends`` (the Kubernetes figures at the top level of
    the results, Slurm's under ``slurm``: :mod:`pipeline.eval.burst_slurm`)."""
    need = 2 * runs * sum(sizes)
    if "kubernetes" in backends and nodes < need:
        raise ValueError(f"{nodes} nodes are too few: {runs} runs of bursts {list(sizes)} for fleetmedic and for "
                         f"the raw limit need {need} untouched nodes")
    if unknown := set(backends) - set(BACKENDS):
        raise ValueError(f"unknown backend {sorted(unknown)}: choose from {list(BACKENDS)}")
    from pipeline.config import state_dir
    from pipeline.eval import burst_slurm

    state = state_dir("bench-burst")
    env = {**os.environ, "FLEETMEDIC_STATE": str(state)}
    say("bench-burst: the embedded Kafka broker")
    bootstrap = kafka_script("start", env)
    result: dict[str, Any] = {"machine": machine(), "runs": runs, "threads": threads,
                              "nvsentinel_published": NVSENTINEL}
    try:
        if "kubernetes" in backends:
            result.update(_kubernetes(env, state, bootstrap, nodes=nodes, sizes=sizes, runs=runs, threads=threads,
                                      say=say, keep_running=keep_running))
        if "slurm" in backends:
            result["slurm"] = burst_slurm.run(sizes=sizes, runs=runs, threads=threads, env=dict(os.environ),
                                              bootstrap=bootstrap, say=say)
    finally:
        if not keep_running:
            kafka_script("stop", env)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(orjson.dumps(result, option=orjson.OPT_INDENT_2).decode())
    if "bursts" in result:
        say(table(result))
    if "slurm" in result:
        say(burst_slurm.table(result["slurm"]))
    return result


def _kubernetes(env: dict[str, str], state: Path, bootstrap: str, *, nodes: int, sizes: tuple[int, ...], runs: int,
                threads: int, say: Say, keep_running: bool) -> dict[str, Any]:
    """The Kubernetes half: its own control plane, ``nodes`` Node objects, the bursts."""
    say(f"bench-burst: a fresh control plane in {state} (deploy/k8s.sh reset, start)")
    deploy_script(K8S_SH, "reset", env, progress=True)
    kubeconfig = deploy_script(K8S_SH, "start", env, timeout=3600, progress=True).removeprefix("KUBECONFIG=")
    worker: WorkerProcess | None = None
    try:
        core = _clients(kubeconfig, threads)
        core.create_namespace({"metadata": {"name": "fleetmedic-diag"}})
        names = [f"gpu-{i:05d}" for i in range(nodes)]
        say(f"registering {nodes} nodes with {threads} threads")
        reg_s = register(core, names, threads, say)
        say(f"  {nodes / reg_s:,.0f} nodes/s")
        app = f"fleetmedic-burst-{uuid.uuid4().hex[:6]}"
        wenv = {**env, "FLEETMEDIC_KAFKA__BOOTSTRAP": bootstrap, "FLEETMEDIC_KAFKA__TOPIC_PREFIX": f"{app}.",
                "FLEETMEDIC_KAFKA__APP_ID": app, "FLEETMEDIC_WORKER__LOG_LEVEL": "warning",
                "FLEETMEDIC_ACTUATORS__BACKEND": "kubernetes", "FLEETMEDIC_ACTUATORS__KUBECONFIG": kubeconfig,
                "FLEETMEDIC_ACTUATORS__KUBE_MAX_REQUESTS": str(threads),
                "FLEETMEDIC_SAFETY__FLEET_SIZE": str(nodes), "FLEETMEDIC_SAFETY__MAX_FRACTION": "1.0",
                "FLEETMEDIC_SAFETY__MAX_ABSOLUTE": str(nodes)}
        s = load_settings(environ=wenv)
        asyncio.run(ensure_topics(s))
        logdir = state / "logs"
        logdir.mkdir(parents=True, exist_ok=True)
        worker = WorkerProcess(wenv, logdir / f"{app}.log")
        wait_ready([worker])
        assert worker is not None
        free = iter(names)
        meter = CpuMeter({**party_pids(), "worker": [worker.proc.pid]})
        by_size: dict[str, Any] = {}
        with NodeWatch(kubeconfig) as watch:
            for size in sizes:
                per_run = []
                for rep in range(runs):
                    # the two sides alternate who goes first, so a drift favours neither
                    fm_names = [next(free) for _ in range(size)]
                    raw_names = [next(free) for _ in range(size)]
                    order = ("fleetmedic", "raw") if rep % 2 == 0 else ("raw", "fleetmedic")
                    r: dict[str, Any] = {}
                    for side in order:
                        if side == "raw":
                            r.update(raw_limits(core, raw_names, threads, swap=rep % 2 == 1, meter=meter))
                        else:
                            # CPU seconds from the first fault sent to half a second after the
                            # last node was done: the worker's, and every party's
                            got, cpu = meter.measure("fm_", lambda: asyncio.run(fleetmedic_burst(
                                bootstrap, s, fm_names, watch, timeout=max(120.0, size / 5),
                                explain=lambda missing: str([_state(watch.core.read_node(n))
                                                             for n in missing[:3]]))))
                            r.update(got)
                            r.update(cpu)
                            r["worker_cpu_s"] = cpu["fm_cpu_worker_s"]
                            # the burst's drains and diagnostics settle, and their Jobs go,
                            # before anything else is timed: the raw side run while the worker
                            # drained a thousand nodes measured half its quiet rate (pending
                            # pods on 10,000 nodes keep the scheduler busy on the same cores)
                            settle(worker, 300.0)
                            clear_diagnostics(core, say)
                    r["ratio"] = r["nodes_per_s"] / r["raw_limit_nodes_per_s"]
                    # CPU per node done, all cores; the ratio can be no more than raw's over fleetmedic's
                    # where both sides keep the cores busy
                    r["fm_cpu_ms_per_node"] = 1000 * r["fm_cpu_machine_s"] / size
                    r["raw_cpu_ms_per_node"] = 1000 * r["raw_cpu_machine_s"] / (size // 2)
                    r["fm_cores_busy"] = r["fm_cpu_machine_s"] / r["seconds"]
                    r["raw_cores_busy"] = r["raw_cpu_machine_s"] / r["raw_seconds"]
                    r["ratio_same_calls"] = r["nodes_per_s"] / r["raw_same_calls_nodes_per_s"]
                    per_run.append(r)
                    say(f"  burst {size} run {rep + 1}/{runs}: fleetmedic {r['seconds']:.1f} s "
                        f"({r['nodes_per_s']:.0f} nodes/s), raw limit {r['raw_limit_nodes_per_s']:.0f} nodes/s "
                        f"(ratio {r['ratio']:.2f}), raw with the same calls {r['raw_same_calls_nodes_per_s']:.0f} "
                        f"nodes/s (ratio {r['ratio_same_calls']:.2f}), verdict to cordon p50 "
                        f"{r['verdict_to_cordon_p50_s']:.2f} s "
                        f"p99 {r['verdict_to_cordon_p99_s']:.2f} s, worker CPU {r['worker_cpu_s']:.1f} s")
                summary: dict[str, Any] = {}
                for key in ("seconds", "nodes_per_s", "raw_limit_nodes_per_s", "ratio", "raw_same_calls_nodes_per_s",
                            "ratio_same_calls", "verdict_to_cordon_p50_s", "verdict_to_cordon_p99_s",
                            "fault_to_done_p50_s", "worker_cpu_s", "fm_cpu_ms_per_node", "raw_cpu_ms_per_node",
                            "fm_cores_busy", "raw_cores_busy"):
                    summary.update(spread(key, [r[key] for r in per_run if r.get(key) is not None]))
                summary["p50_s"], summary["p99_s"] = summary["verdict_to_cordon_p50_s"], summary["verdict_to_cordon_p99_s"]
                summary["runs"] = per_run
                by_size[str(size)] = summary
        return {
            "nodes_registered": nodes, "register_nodes_per_s": nodes / reg_s,
            "bursts": by_size,
            "method": "Xid 79 samples for every node of a burst written at once to telemetry.gpu; one worker "
                      "(backend kubernetes, admin credentials) detects, decides and carries out isolate, drain and "
                      "diagnose; a watch on the Nodes records when each is cordoned, tainted and conditioned. On "
                      "as many other nodes, half each, from the same client library in the same number of "
                      "threads: raw_limit makes the two writes that make a node done (spec patch, status "
                      "patch); raw_same_calls makes the four calls of the backend's isolation (read, "
                      "conditional spec patch, status patch, Event). ratio and ratio_same_calls are "
                      "fleetmedic's nodes/s over each. Medians of the runs, with min and max.",
            "watch_errors": watch.errors[:5],
            "watch_lists": watch.lists,
        }
    finally:
        if worker is not None:
            worker.stop()
        if not keep_running:
            deploy_script(K8S_SH, "stop", env, progress=True)


def table(r: dict[str, Any]) -> str:
    rows = ["| burst | seconds | nodes/s | raw limit nodes/s | ratio | raw, same calls, nodes/s | ratio "
            "| verdict to cordon p50 | p99 |",
            "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for size, b in r["bursts"].items():
        rows.append(f"| {size} | {b['seconds']:.1f} ({b['seconds_min']:.1f} to {b['seconds_max']:.1f}) "
                    f"| {b['nodes_per_s']:.0f} | {b['raw_limit_nodes_per_s']:.0f} "
                    f"| {b['ratio']:.2f} ({b['ratio_min']:.2f} to {b['ratio_max']:.2f}) "
                    f"| {b['raw_same_calls_nodes_per_s']:.0f} "
                    f"| {b['ratio_same_calls']:.2f} ({b['ratio_same_calls_min']:.2f} to "
                    f"{b['ratio_same_calls_max']:.2f}) "
                    f"| {b['p50_s']:.2f} s | {b['p99_s']:.2f} s |")
    for size, b in r["bursts"].items():
        if b.get("fm_cpu_ms_per_node") is not None:
            rows.append(f"burst {size}: CPU per node done, all parties, {b['fm_cpu_ms_per_node']:.1f} ms for fleetmedic "
                        f"({b['fm_cores_busy']:.2f} cores busy) and {b['raw_cpu_ms_per_node']:.1f} ms raw "
                        f"({b['raw_cores_busy']:.2f} cores busy)")
    ns = r["nvsentinel_published"]
    rows.append(f"\nNVSentinel (published, not measured here): {ns['burst']} nodes in {ns['seconds']} s, "
                f"{ns['nodes_per_s'][0]} to {ns['nodes_per_s'][1]} nodes/s. Medians of {r['runs']} runs "
                f"(min to max); {r['nodes_registered']} Node objects on the API server.")
    return "\n".join(rows)
