"""The ``fleetmedic`` command.

    fleetmedic worker      run the pipeline (Faust worker) against a Kafka broker
    fleetmedic simulate    run a simulated GPU cluster that streams telemetry and obeys actions
    fleetmedic demo        start Kafka, a worker and the simulator; print a live log and a JSON summary
    fleetmedic watch-slurm publish a Slurm controller's job state changes on telemetry.job
    fleetmedic watch-k8s   publish a Kubernetes cluster's pod and Job failures on telemetry.job
    fleetmedic collect     node agent: NVML, dcgm-exporter and InfiniBand counters -> telemetry
    fleetmedic eval        detection quality through the pipeline, and a 54-day closed loop against baselines
    fleetmedic eval-nab    the univariate detector on the Numenta Anomaly Benchmark, with a verified scorer
    fleetmedic eval-network the network track on a seeded fabric scenario suite
    fleetmedic eval-failures real failure output replayed through the job and node tracks, scored
    fleetmedic chaos       worker and broker kills, a backend outage and fuzzing during a scenario
    fleetmedic bench       throughput, latency, scale-out and memory against a baseline consumer
    fleetmedic record      write the input topics (telemetry and job events) to a recording (JSON Lines)
    fleetmedic replay      send a recording to the input topics, paced by event time at any speed
    fleetmedic contract    write docs/contract.md from the code
    fleetmedic topics      create fleetmedic's topics on a broker
    fleetmedic schemas     write the JSON Schema files of every record
    fleetmedic chart-schema write the Helm chart's values.schema.json from the settings
    fleetmedic config      print the effective configuration
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import logging
import os
import signal
import subprocess
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from pipeline import paths
from pipeline.config import ConfigError, Settings, load_settings, state_dir
from pipeline.worker.procs import WorkerProcess, free_port, wait_ready

KAFKA_SH = paths.deploy_script("kafka.sh")


def _settings(args: argparse.Namespace, **overrides: dict) -> Settings:
    over: dict = {}
    if getattr(args, "bootstrap", None):
        over.setdefault("kafka", {})["bootstrap"] = args.bootstrap
    for k, v in overrides.items():
        over.setdefault(k, {}).update(v)
    return load_settings(getattr(args, "config", None), overrides=over)


def _logging(level: str) -> None:
    logging.basicConfig(level=getattr(logging, level.upper()), stream=sys.stderr,
                        format="%(asctime)s %(levelname)-7s %(name)s: %(message)s")


# ------------------------------------------------------------------------------ commands


def cmd_worker(args: argparse.Namespace) -> int:
    s = _settings(args)
    _logging(s.worker.log_level)
    from pipeline.worker.app import create_app, faust_worker
    from pipeline.worker.topics import ensure_topics

    created = asyncio.run(ensure_topics(s))
    if created:
        logging.getLogger("fleetmedic").info("created topics: %s", ", ".join(created))
    app = create_app(s)
    if s.safety.fleet_size == 0:
        logging.getLogger("fleetmedic").warning(
            "safety.fleet_size is 0: the circuit breaker's share is taken of the nodes seen so far")
    faust_worker(app, s.worker.log_level).execute_from_commandline()
    return 0


def _sim_config(args: argparse.Namespace):
    from pipeline.sim.cluster import SimConfig

    return SimConfig(nodes=args.nodes, speed=args.speed, duration=args.duration, seed=args.seed, faults=args.faults)


def cmd_simulate(args: argparse.Namespace) -> int:
    s = _settings(args)
    _logging("warning" if args.quiet else "info")
    from pipeline.sim.run import SimRunner
    from pipeline.worker.topics import ensure_topics

    asyncio.run(ensure_topics(s))
    runner = SimRunner(s, _sim_config(args), api_port=args.api_port, show_anomalies=not args.no_anomalies)
    result = asyncio.run(runner.run())
    print(json.dumps(result))
    return 0


def _kafka(cmd: str, env: dict[str, str]) -> str:
    proc = subprocess.run(["bash", str(KAFKA_SH), cmd], env=env, stdout=subprocess.PIPE, stderr=sys.stderr,
                          text=True, stdin=subprocess.DEVNULL)
    if proc.returncode != 0:
        raise SystemExit(f"deploy/kafka.sh {cmd} failed with status {proc.returncode}")
    lines = [ln for ln in proc.stdout.strip().splitlines() if ln.strip()]
    return lines[-1] if lines else ""


#: the demo's detector windows, for its time-compressed degradations (1 s samples)
DEMO_WINDOWS = {"FLEETMEDIC_DETECTORS__WINDOW_S": "600", "FLEETMEDIC_DETECTORS__RECENT_S": "60",
                "FLEETMEDIC_DETECTORS__BUCKET_S": "5", "FLEETMEDIC_DETECTORS__THROTTLE_WINDOW_S": "60"}


def cmd_demo(args: argparse.Namespace) -> int:
    """Kafka + worker + simulator, a live log, and a JSON summary as the last line."""
    _logging("warning")
    state = state_dir("demo")
    env = {**os.environ, "FLEETMEDIC_STATE": str(state)}
    if args.kafka_port:
        env["KAFKA_PORT"] = str(args.kafka_port)
    print("fleetmedic demo: starting the embedded Kafka broker", file=sys.stderr)
    if args.bootstrap:
        bootstrap = args.bootstrap
    else:
        if not args.keep_data:
            _kafka("reset", env)
        bootstrap = _kafka("start", env)
    api_port = args.api_port or free_port()
    overrides = {
        "FLEETMEDIC_KAFKA__BOOTSTRAP": bootstrap,
        # a port of the user's choosing (an identity provider's redirect URI names it), else any
        "FLEETMEDIC_WORKER__WEB_PORT": os.environ.get("FLEETMEDIC_WORKER__WEB_PORT") or str(free_port()),
        "FLEETMEDIC_WORKER__LOG_LEVEL": "info",
        "FLEETMEDIC_ACTUATORS__BACKEND": "sim",
        "FLEETMEDIC_ACTUATORS__SIM_URL": f"http://127.0.0.1:{api_port}",
        "FLEETMEDIC_SAFETY__FLEET_SIZE": str(args.nodes),
        # The demo packs a fault of every kind into minutes (far above field rates), so
        # its breaker allows a quarter of the small fleet per hour instead of a tenth.
        "FLEETMEDIC_SAFETY__MAX_FRACTION": os.environ.get("FLEETMEDIC_SAFETY__MAX_FRACTION", "0.25"),
    }
    # The simulator compresses degradations that take hours in the field into minutes of
    # simulated time (sampled every second); the demo's rate and throttle windows are
    # compressed alike (the field defaults are window_s 3600, recent_s 300 at 30 s buckets).
    for key, value in DEMO_WINDOWS.items():
        overrides[key] = os.environ.get(key, value)
    if args.bootstrap and "FLEETMEDIC_KAFKA__APP_ID" not in env:
        # a broker of one's own: its tables and consumer groups must not be another
        # worker's (a demo earlier on the same broker would hand over its node states)
        import uuid

        overrides["FLEETMEDIC_KAFKA__APP_ID"] = f"fleetmedic-demo-{uuid.uuid4().hex[:8]}"
    wenv = {**env, **overrides}
    s = load_settings(args.config, environ=wenv)
    state.mkdir(parents=True, exist_ok=True)
    worker_log = state / "worker.log"
    from pipeline.worker.topics import ensure_topics

    asyncio.run(ensure_topics(s))
    print(f"fleetmedic demo: Kafka at {bootstrap}; worker log in {worker_log}", file=sys.stderr)
    print(f"fleetmedic demo: detector windows compressed like the simulated degradations: window_s "
          f"{s.detectors.window_s:g}, recent_s {s.detectors.recent_s:g}, bucket_s {s.detectors.bucket_s:g}, "
          f"throttle_window_s {s.detectors.throttle_window_s:g} (field defaults 3600/300/30/300)", file=sys.stderr)
    print(f"fleetmedic demo: read verdicts with: kcat -b {bootstrap} -t {s.topic('verdicts')} -C -e", file=sys.stderr)
    web = f"http://127.0.0.1:{overrides['FLEETMEDIC_WORKER__WEB_PORT']}"
    print(f"fleetmedic demo: dashboard at {web}/dashboard (operator API {web}/api/v1, metrics {web}/metrics)",
          file=sys.stderr)
    worker = WorkerProcess(wenv, worker_log, argv=["--config", args.config] if args.config else [])
    try:
        from pipeline.sim.run import SimRunner

        runner = SimRunner(s, _sim_config(args), api_port=api_port, out=sys.stdout, show_anomalies=not args.no_anomalies)

        async def ready() -> None:
            try:
                await asyncio.to_thread(wait_ready, [worker], 120.0)
            except RuntimeError as exc:
                raise SystemExit(f"fleetmedic demo: {exc}") from None
            print("fleetmedic demo: worker ready; the simulated cluster starts now", file=sys.stderr)

        result = asyncio.run(runner.run(ready=ready))
    finally:
        worker.stop()
        if not args.bootstrap and not args.keep_running:
            _kafka("stop", env)
    sys.stdout.flush()
    print(json.dumps(result), flush=True)
    ok = result["false_isolations"] == 0 and result["hardware_faults_detected"] == result["hardware_faults"]
    return 0 if ok or not args.check else 1


def _stop_on_signals() -> asyncio.Event:
    """An event set by SIGTERM or SIGINT (call it inside the running loop)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    return stop


async def _publish_job_events(s: Settings, name: str, run: Callable[..., Awaitable[None]]) -> None:
    """Run a job watcher (``run(emit, stop=...)``) and publish its events on telemetry.job
    until SIGTERM or SIGINT."""
    from aiokafka import AIOKafkaProducer

    from pipeline.worker.topics import ensure_topics

    await ensure_topics(s)
    producer = AIOKafkaProducer(bootstrap_servers=s.kafka.bootstrap, acks="all")
    await producer.start()
    stop = _stop_on_signals()
    topic = s.topic("telemetry.job")
    logger = logging.getLogger(f"fleetmedic.{name}")

    async def emit(ev) -> None:
        logger.info("%s %s attempt %d on %s%s", ev.job, ev.event.value, ev.attempt, ",".join(ev.nodes),
                    f" (diagnostics of {ev.diagnostics_for})" if ev.diagnostics_for else "")
        await producer.send_and_wait(topic, key=ev.job.encode(), value=ev.to_json())

    try:
        await run(emit, stop=stop)
    finally:
        await producer.stop()


def cmd_watch_slurm(args: argparse.Namespace) -> int:
    """Poll a Slurm controller and publish its job state changes on telemetry.job."""
    s = _settings(args)
    _logging(s.worker.log_level)
    from pipeline.watch.slurm import Scontrol, SlurmJobWatcher

    watcher = SlurmJobWatcher(Scontrol(slurm_conf=args.slurm_conf or s.actuators.slurm_conf))
    asyncio.run(_publish_job_events(s, "slurm", functools.partial(watcher.run, interval=args.interval)))
    return 0


def cmd_watch_k8s(args: argparse.Namespace) -> int:
    """Watch a Kubernetes cluster's pods and Jobs and publish job events on telemetry.job."""
    s = _settings(args)
    _logging(s.worker.log_level)
    from pipeline.watch.k8s import KubernetesJobWatcher, api_clients

    a = s.actuators
    core, batch = api_clients(args.kubeconfig or a.kubeconfig, context=a.kube_context, impersonate=a.kube_as)
    watcher = KubernetesJobWatcher(core, batch, namespace=args.namespace, timeout_s=args.watch_timeout)
    asyncio.run(_publish_job_events(s, "kubernetes", watcher.run))
    return 0


def cmd_collect(args: argparse.Namespace) -> int:
    """The node agent: NVML, dcgm-exporter and InfiniBand counters -> telemetry topics."""
    over: dict[str, Any] = {}
    for key in ("node", "interval_s", "nvml", "infiniband_root", "node_exporter_url", "kernel_log"):
        value = getattr(args, key, None)
        if value is not None:
            over[key] = value
    if args.dcgm:
        over["dcgm_urls"] = args.dcgm
    s = _settings(args, collect=over)
    _logging(s.worker.log_level if not args.once else "warning")
    from pipeline.collect.agent import Agent

    nvml = None
    if args.fake_nvml:
        from pipeline.collect.fake_nvml import FakeNVML

        nvml = FakeNVML(args.fake_nvml)
        print(f"fleetmedic collect: using a FAKE NVML with {args.fake_nvml} simulated GPUs (no GPU is read)",
              file=sys.stderr)
    try:
        agent = Agent(s.collect, nvml=nvml)
    except RuntimeError as exc:
        print(f"fleetmedic collect: {exc}", file=sys.stderr)
        return 2
    try:
        if args.once:
            records = asyncio.run(agent.collect_once())
            for _topic, rec in records:
                print(json.dumps(rec), flush=True)
            if not records:
                print("fleetmedic collect: no source produced a record (no NVML, no InfiniBand device, "
                      "no dcgm-exporter URL)", file=sys.stderr)
                return 1
            return 0
        from pipeline.collect.agent import publish

        async def main() -> None:
            logging.getLogger("fleetmedic.collect").info("collecting on %s every %.1fs -> %s", agent.node,
                                                         s.collect.interval_s, s.kafka.bootstrap)
            await publish(agent, s, _stop_on_signals())

        asyncio.run(main())
    finally:
        agent.close()
    return 0


def cmd_eval_network(args: argparse.Namespace) -> int:
    """The network track on a seeded fabric scenario suite (see pipeline/eval/network.py)."""
    _logging("warning")
    from pipeline.eval.network import run

    r = run(nodes=args.nodes, leaves=args.leaves, epochs=args.epochs, seed=args.seed, model=args.model,
            out=Path(args.out), compare_models=not args.no_compare,
            say=lambda *a: print(*a, file=sys.stderr, flush=True))
    print(f"results: {args.out}", file=sys.stderr)
    node_ok = all((r["kinds"][k]["precision"] or 0) >= 0.95 and (r["kinds"][k]["recall"] or 0) >= 0.95
                  for k in ("port_degrade", "flap", "nic"))
    ok = node_ok and r["switch_attribution_accuracy"] >= 0.95 and r["switch_fault_node_isolations"] == 0 \
        and r["healthy_isolations"] == 0
    return 0 if ok or not args.check else 1


def cmd_eval(args: argparse.Namespace) -> int:
    """Detection quality (Kafka + Faust) and the closed loop against the baselines (pipeline/eval/)."""
    _logging("warning")
    from pipeline.eval import report

    def say(*a: Any) -> None:
        print(*a, file=sys.stderr, flush=True)

    out = Path(args.out)
    quality = closed = None
    if args.rescore:
        from pipeline.eval.quality import rescore

        say(f"== eval 1/2: detection quality, the run recorded in {args.rescore} scored again")
        try:
            quality = rescore(Path(args.rescore), say=say)
        except ValueError as exc:
            say(f"error: {exc}")
            return 2
    elif not args.skip_quality:
        from pipeline.eval.quality import run as run_quality

        say("== eval 1/2: detection quality through the real pipeline")
        records = state_dir("eval") / ("quality_records_quick.json" if args.quick else "quality_records.json")
        quality = run_quality(nodes=args.nodes, hours=args.hours, speed=args.speed, seed=args.seed, quick=args.quick,
                              inprocess=args.inprocess, bootstrap=args.bootstrap, records=records, say=say)
    if not args.skip_closed_loop:
        from pipeline.eval.closedloop import run as run_closed

        say("== eval 2/2: closed loop, six policies on the same fault sequence")
        closed = run_closed(quick=args.quick, seed=args.seed, say=say)
    ev = report.combine(quality, closed)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(ev, indent=2) + "\n")
    for p in report.plots(ev, out.parent):
        say(f"plot: {p}")
    default_out = paths.result("eval.json")
    full = (quality is not None and closed is not None and paths.in_checkout()
            and out.resolve() == default_out.resolve())
    if full and not args.quick:
        report.write_readme(ev, report.load("nab.json", out.parent))
        say(f"summary: {report.README}")
    elif not args.quick:
        say(f"summary: {report.README} left as it was (it is written from a full run of both parts to {default_out})")
    say(f"results: {out}")
    missed = report.check(ev)  # the parts that ran
    for m in missed:
        say(f"target missed: {m}")
    return 1 if (missed and args.check) else 0


def cmd_eval_nab(args: argparse.Namespace) -> int:
    """NAB: prove the scorer on the published Numenta outputs, then score the univariate detector."""
    _logging("warning")
    from pipeline.eval import nab, report

    argv = ["--out", args.out] + (["--quick"] if args.quick else []) + (["--data", args.data] if args.data else [])
    rc = nab.main(argv)
    if rc == 0 and not args.quick and paths.in_checkout():
        report.write_readme(report.load("eval.json", Path(args.out).parent), report.load("nab.json", Path(args.out).parent))
        print(f"summary: {report.README}", file=sys.stderr)
    return rc


def cmd_eval_failures(args: argparse.Namespace) -> int:
    """The failure corpus's real excerpts through the job and node tracks, scored."""
    _logging("warning")
    from pipeline.eval import failures

    argv = ["--split", args.split] + (["--out", args.out] if args.out else []) + (["--check"] if args.check else [])
    return failures.main(argv + (["--show"] if args.show else []))


def cmd_chaos(args: argparse.Namespace) -> int:
    """Kills, a broker restart, a backend outage and hostile input during a seeded scenario."""
    _logging("warning")
    from pipeline.eval.chaos import failures, run

    r = run(nodes=args.nodes, duration=args.duration, speed=args.speed, kills=args.kills, outage_s=args.outage,
            hostile=args.hostile, seed=args.seed, broker_restart=not args.no_broker_restart, brokers=args.brokers,
            faults=args.faults, out=Path(args.out), say=lambda *a: print(*a, file=sys.stderr, flush=True))
    print(f"results: {args.out}", file=sys.stderr)
    failed = failures(r)
    for why in failed:
        print(f"chaos: FAILED: {why}", file=sys.stderr)
    return 1 if failed else 0


def cmd_bench(args: argparse.Namespace) -> int:
    """Throughput, latency, scale-out and memory against a baseline consumer."""
    _logging("warning")
    from pipeline.eval.bench import run

    env = dict(os.environ)
    state = state_dir("bench")
    env["FLEETMEDIC_STATE"] = str(state)
    started = False
    bootstrap = args.bootstrap
    if not bootstrap:
        print("fleetmedic bench: starting the embedded Kafka broker", file=sys.stderr)
        bootstrap = _kafka("start", env)
        started = True
    if args.quick:
        nodes, rounds, lat_s, faults = 300, 8, 6.0, 4
    else:
        nodes, rounds, lat_s, faults = args.nodes, args.rounds, args.latency_seconds, args.faults
    logdir = state / "logs"
    logdir.mkdir(parents=True, exist_ok=True)
    rc = 0
    try:
        run(bootstrap=bootstrap, nodes=nodes, rounds=rounds, net_every=args.network_every, latency_seconds=lat_s,
            faults=faults, two_workers=not args.one_worker, out=Path(args.out), logdir=logdir,
            repeat=1 if args.quick else args.repeat)
        if not args.no_dashboard:
            from pipeline.eval import dashboard

            out = Path(args.out).with_name("dashboard.json")
            print(f"dashboard: {nodes:,} nodes in Chromium, frame times idle and under live updates "
                  f"(skip with --no-dashboard)", file=sys.stderr)
            try:
                dashboard.run(bootstrap=bootstrap, nodes=nodes, logdir=logdir, out=out,
                              runs=1 if args.quick else args.repeat, seconds=2.0 if args.quick else 5.0,
                              say=lambda *a: print(*a, file=sys.stderr, flush=True))
                print(f"results: {out}", file=sys.stderr)
            except dashboard.BrowserMissing as exc:
                print(f"fleetmedic bench: the dashboard needs headless Chromium: {exc}\n"
                      "run again with --no-dashboard to leave it out", file=sys.stderr)
                rc = 1
    finally:
        if started and not args.keep_running:
            _kafka("stop", env)
    return rc


def cmd_bench_burst(args: argparse.Namespace) -> int:
    """Simultaneous hardware faults isolated on a real API server, against the raw PATCH limit."""
    _logging("warning")
    from pipeline.eval.burst import SIZES, run

    if args.quick:
        nodes, sizes, runs = 600, (20, 50), 3
    else:
        nodes, sizes, runs = args.nodes, tuple(args.sizes or SIZES), args.runs
    try:
        run(nodes=nodes, sizes=sizes, runs=runs, threads=args.threads, out=Path(args.out),
            keep_running=args.keep_running, say=lambda *a: print(*a, file=sys.stderr, flush=True),
            backends=tuple(args.backend))
    except ValueError as exc:
        print(f"fleetmedic bench-burst: {exc}", file=sys.stderr)
        return 2
    print(f"results: {args.out}", file=sys.stderr)
    return 0


def cmd_record(args: argparse.Namespace) -> int:
    s = _settings(args)
    from pipeline.sim.recording import record_from_kafka, write

    print(f"recording {', '.join(s.topic(t) for t in ('telemetry.gpu', 'telemetry.network', 'telemetry.job'))} "
          f"from {s.kafka.bootstrap} for at most {args.seconds:g} s", file=sys.stderr)
    recs = asyncio.run(record_from_kafka(s.kafka.bootstrap, s.kafka.topic_prefix, args.seconds,
                                         idle_s=args.idle, from_beginning=not args.from_now))
    n = write(args.out, recs)
    span = recs[-1].ts - recs[0].ts if recs else 0.0
    print(json.dumps({"out": str(args.out), "records": n, "event_span_s": span}))
    return 0


def cmd_replay(args: argparse.Namespace) -> int:
    s = _settings(args)
    from pipeline.sim.recording import RecordingError, read, replay_to_kafka
    from pipeline.worker.topics import ensure_topics

    try:
        recs = read(args.file)
    except RecordingError as exc:
        print(f"fleetmedic: {exc}", file=sys.stderr)
        return 2
    if args.speed < 0:
        print(f"fleetmedic: --speed must be >= 0 (0: as fast as possible), got {args.speed:g}", file=sys.stderr)
        return 2
    speed = float("inf") if args.speed == 0 else args.speed
    span = recs[-1].ts - recs[0].ts if recs else 0.0
    print(f"replaying {len(recs)} records ({span:.0f} s of event time) into {s.kafka.bootstrap} "
          f"(prefix {s.kafka.topic_prefix!r}) at {'full speed' if speed == float('inf') else f'{speed:g}x'}: "
          f"about {0 if speed == float('inf') else span / speed:.0f} s", file=sys.stderr)
    asyncio.run(ensure_topics(s))

    def progress(k: int, n: int) -> None:
        print(f"  {k}/{n} records sent", file=sys.stderr)

    out = asyncio.run(replay_to_kafka(s.kafka.bootstrap, s.kafka.topic_prefix, recs, speed,
                                      progress=progress if args.progress else None))
    print(json.dumps(out))
    return 0


def cmd_contract(args: argparse.Namespace) -> int:
    from pipeline.cli.contract import render

    text = render()
    doc = paths.contract_doc()
    if args.check:
        current = doc.read_text() if doc.exists() else ""
        if current != text:
            print(f"fleetmedic: {doc} is stale: run `fleetmedic contract`", file=sys.stderr)
            return 1
        print(f"{doc} is up to date")
        return 0
    if not args.out and not paths.in_checkout():
        sys.stdout.write(text)  # an installed package's copy is not rewritten
        return 0
    out = Path(args.out) if args.out else doc
    out.write_text(text)
    print(out)
    return 0


def cmd_topics(args: argparse.Namespace) -> int:
    s = _settings(args)
    from pipeline.worker.topics import ensure_topics, topic_specs

    created = asyncio.run(ensure_topics(s))
    for spec in topic_specs(s).values():
        print(f"{spec.name}\t{spec.partitions} partitions\t{'created' if spec.name in created else 'exists'}")
    return 0


def cmd_schemas(args: argparse.Namespace) -> int:
    from schemas.jsonschema import JSON_DIR, write

    # in a checkout, the repository's schemas/json; an installed package's copy is not rewritten
    default = JSON_DIR if paths.in_checkout() else Path.cwd() / "schemas"
    for path in write(Path(args.out) if args.out else default):
        print(path)
    return 0


def cmd_chart_schema(args: argparse.Namespace) -> int:
    from pipeline.cli.chart import render, schema_path

    out = Path(args.out) if args.out else schema_path()
    if not args.out and not paths.in_checkout():
        raise SystemExit("chart-schema: an installed package's chart is not rewritten; give --out FILE")
    text = render()
    if args.check:
        if not out.exists() or out.read_text() != text:
            print(f"{out} is not current: run fleetmedic chart-schema", file=sys.stderr)
            return 1
        print(f"{out} is current")
        return 0
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(out)
    return 0


def cmd_config(args: argparse.Namespace) -> int:
    s = _settings(args)
    print(json.dumps(s.model_dump(), indent=2))
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="fleetmedic",
        description="Autonomous fault recovery for GPU clusters: telemetry in Kafka, windowed detectors, "
                    "a correlator that issues fault verdicts, actuators on Kubernetes or a simulated cluster.",
        epilog="Configuration: --config FILE (TOML) or FLEETMEDIC_<SECTION>__<KEY> variables; "
               "see `fleetmedic config` and README.md.",
    )
    p.add_argument("--config", help="TOML configuration file (also FLEETMEDIC_CONFIG)")
    p.add_argument("--bootstrap", help="Kafka bootstrap servers, host:port (overrides kafka.bootstrap)")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    sp = sub.add_parser("worker", help="run the pipeline worker (Faust)")
    sp.set_defaults(func=cmd_worker)

    def sim_args(sp: argparse.ArgumentParser, duration: float) -> None:
        sp.add_argument("--nodes", type=int, default=32, help="nodes in the simulated cluster (8 GPUs each; default 32)")
        sp.add_argument("--duration", type=float, default=duration, help=f"wall seconds to simulate (default {duration:g})")
        sp.add_argument("--speed", type=float, default=10.0, help="simulated seconds per wall second (default 10)")
        sp.add_argument("--seed", type=int, default=1, help="random seed (default 1)")
        sp.add_argument("--faults", default="demo",
                        help="'demo' (every kind in the catalogue), 'none', or a comma list of: transient_crash, "
                             "nccl_timeout, user_bug, xid79, ecc_dbe, sbe_rise, nvlink, thermal")
        sp.add_argument("--api-port", type=int, default=0, help="port of the simulated cluster API (default: free)")
        sp.add_argument("--no-anomalies", action="store_true", help="leave anomalies out of the live log")

    sp = sub.add_parser("simulate", help="run the simulated cluster against a running worker")
    sim_args(sp, 120.0)
    sp.add_argument("--quiet", action="store_true")
    sp.set_defaults(func=cmd_simulate)

    sp = sub.add_parser("demo", help="start Kafka, a worker and the simulator; print a JSON summary last")
    sim_args(sp, 120.0)
    sp.add_argument("--kafka-port", type=int, default=0, help="port for the embedded broker (default: free)")
    sp.add_argument("--keep-data", action="store_true", help="do not wipe the demo broker's data first")
    sp.add_argument("--keep-running", action="store_true", help="leave the broker running afterwards")
    sp.add_argument("--check", action="store_true", help="exit 1 when a hardware fault was missed or a healthy node isolated")
    sp.set_defaults(func=cmd_demo)

    sp = sub.add_parser("watch-slurm", help="publish a Slurm controller's job state changes on telemetry.job")
    sp.add_argument("--slurm-conf", help="path of slurm.conf (default: actuators.slurm_conf or $SLURM_CONF)")
    sp.add_argument("--interval", type=float, default=2.0, help="seconds between polls (default 2)")
    sp.set_defaults(func=cmd_watch_slurm)

    sp = sub.add_parser("watch-k8s", help="publish a Kubernetes cluster's pod and Job failures on telemetry.job")
    sp.add_argument("--kubeconfig", help="kubeconfig file (default: actuators.kubeconfig, in-cluster, ~/.kube/config)")
    sp.add_argument("--namespace", help="watch one namespace only (default: all)")
    sp.add_argument("--watch-timeout", type=int, default=300,
                    help="seconds before the server ends a watch; it resumes from the last resource version (default 300)")
    sp.set_defaults(func=cmd_watch_k8s)

    sp = sub.add_parser("collect", help="node agent: NVML, dcgm-exporter and InfiniBand counters -> telemetry topics",
                        description="Run the collectors every --interval seconds and produce telemetry.gpu and "
                                    "telemetry.network records (an Xid is sent at once). Sources: NVML on this node "
                                    "(collect.nvml), dcgm-exporter endpoints (--dcgm), InfiniBand/RoCE counters "
                                    "from sysfs (collect.infiniband_root) or from node_exporter (--node-exporter), "
                                    "and the driver's Xid and NVSwitch SXid "
                                    "lines in the kernel log (--kernel-log), merged with NVML's Xid events.")
    sp.add_argument("--once", action="store_true", help="collect one round and print each record as a JSON line")
    sp.add_argument("--interval", dest="interval_s", type=float, help="seconds between samples (default 10)")
    sp.add_argument("--node", help="node name on the records (default: $NODE_NAME, else the host name)")
    sp.add_argument("--nvml", choices=["auto", "on", "off"], help="NVML source (default auto)")
    sp.add_argument("--dcgm", action="append", metavar="URL", help="a dcgm-exporter endpoint to scrape (repeatable)")
    sp.add_argument("--infiniband-root", help="sysfs directory of RDMA devices (default /sys/class/infiniband)")
    sp.add_argument("--node-exporter", dest="node_exporter_url", metavar="URL",
                    help="read the fabric ports from node_exporter's node_infiniband_* metrics at this URL "
                         "(http://127.0.0.1:9100/metrics) instead of sysfs")
    sp.add_argument("--kernel-log", metavar="SOURCE",
                    help="kernel log to follow for Xid/SXid lines: auto (journald, else /dev/kmsg; the default), off, "
                         "journald, journald:FILE, kmsg, kmsg:FILE, file:PATH (a syslog file)")
    sp.add_argument("--fake-nvml", type=int, metavar="GPUS", default=0,
                    help="use a fake NVML with this many simulated H100s (for trying the agent without GPUs)")
    sp.set_defaults(func=cmd_collect)

    sp = sub.add_parser(
        "eval", help="detection quality through Kafka + Faust, and a 54-day closed loop against the baselines",
        epilog="The quality run starts the embedded Kafka broker unless the global --bootstrap names one.",
        description="Part 1 runs a seeded scenario (512 nodes x 8 GPUs, 300 faults of every class, 7 simulated hours "
                    "at 25x) through the embedded Kafka and a Faust worker and scores every verdict against the "
                    "ground truth. Part 2 replays a 2,048-node cluster over 54 simulated days at field failure rates "
                    "(pipeline/eval/field.toml) with fleetmedic, fleetmedic acting on precursors with checkpoint-now, "
                    "a reactive oracle (right the instant each failure happens), manual handling, naive auto-cordon and "
                    "retry-only. "
                    "Writes bench/results/eval.json, PNG plots and the summary in bench/README.md.")
    sp.add_argument("--quick", action="store_true", help="a small run of both parts (about two minutes)")
    sp.add_argument("--nodes", type=int, default=512, help="nodes of the quality run (default 512)")
    sp.add_argument("--hours", type=float, default=7.0, help="simulated hours of the quality run (default 7)")
    sp.add_argument("--speed", type=float, default=25.0, help="simulated seconds per wall second (default 25)")
    sp.add_argument("--seed", type=int, default=1)
    sp.add_argument("--inprocess", action="store_true", help="quality run without Kafka (the same code, one process)")
    sp.add_argument("--skip-quality", action="store_true", help="only the closed loop")
    sp.add_argument("--rescore", metavar="RECORDS",
                    help="instead of running the quality part, score the run recorded in RECORDS again (every run "
                         "records its faults, verdicts and actions in the state dir, eval/quality_records.json)")
    sp.add_argument("--skip-closed-loop", action="store_true", help="only the quality run")
    sp.add_argument("--check", action="store_true",
                    help="exit 1 when an acceptance target of the parts that ran is missed (pipeline/eval/report.py)")
    sp.add_argument("--out", default=None, metavar="PATH",
                    help="JSON output path (default bench/results/eval.json in a checkout, else "
                         "./fleetmedic-results/eval.json; "
                         "bench/README.md's summary is written only for the default path of a checkout)")
    sp.set_defaults(func=cmd_eval, result="eval.json")

    sp = sub.add_parser("eval-nab", help="the univariate detector on NAB, scored by a scorer checked against NAB's own",
                        description="Reproduces the published Numenta detector's NAB scores from its per-row "
                                    "outputs (the scorer check), then runs fleetmedic's univariate streaming "
                                    "detector over ../shared/data/nab and compares it with every published "
                                    "detector on the same files. Writes bench/results/nab.json.")
    sp.add_argument("--quick", action="store_true", help="a handful of files")
    sp.add_argument("--data", help="NAB directory (default nab under $FLEETMEDIC_DATA, else ../shared/data/nab)")
    sp.add_argument("--out", default=None, metavar="PATH",
                    help="JSON output path (default bench/results/nab.json in a checkout, "
                         "else ./fleetmedic-results/nab.json)")
    sp.set_defaults(func=cmd_eval_nab, result="nab.json")

    sp = sub.add_parser("eval-failures", help="real failure output replayed through the job and node tracks (JSON)",
                        description="Replays the failure corpus (tests/data/failures: real output from public "
                                    "threads, docs and fixtures, with the root cause each settled) through the "
                                    "worker's own policy code, in two variants (no origin, origin = rank 0), and "
                                    "scores stopping user errors, retrying transient faults, moving jobs off "
                                    "hardware faults and false isolations. Writes bench/results/failures.json "
                                    "for the eval split.")
    sp.add_argument("--split", choices=("eval", "tune", "all"), default="eval",
                    help="corpus split (default eval; rules are tuned on tune only)")
    sp.add_argument("--out", default=None, help="JSON output path (default bench/results/failures.json for eval)")
    sp.add_argument("--check", action="store_true", help="exit 1 when a target is missed")
    sp.add_argument("--show", action="store_true", help="print each excerpt's decisions")
    sp.set_defaults(func=cmd_eval_failures)

    sp = sub.add_parser("eval-network", help="score the network track on a seeded fabric scenario suite (JSON)")
    sp.add_argument("--nodes", type=int, default=256, help="nodes, 4 ports each (default 256)")
    sp.add_argument("--leaves", type=int, default=8, help="leaf switches (default 8)")
    sp.add_argument("--epochs", type=int, default=100,
                    help="epochs; each injects one fault of every kind (default 100: 100 faults per kind)")
    sp.add_argument("--seed", type=int, default=1)
    sp.add_argument("--model", choices=["hbos", "ecod", "copod", "iforest"], default="ecod",
                    help="PyOD model of the run (all four are compared afterwards)")
    sp.add_argument("--no-compare", action="store_true", help="skip the model comparison")
    sp.add_argument("--check", action="store_true", help="exit 1 when a target is missed")
    sp.add_argument("--out", default=None, metavar="PATH",
                    help="JSON output path (default bench/results/network.json in a checkout, "
                         "else ./fleetmedic-results/network.json)")
    sp.set_defaults(func=cmd_eval_network, result="network.json")

    sp = sub.add_parser("chaos", help="kill workers and brokers, take the backend down, fuzz; judge from the backend's log (JSON)",
                        description="A seeded fleet scenario on a real Kafka under fire: worker SIGKILLs in every phase "
                                    "(running, starting, rebalance, backend outage, a drain blocked by a "
                                    "PodDisruptionBudget, just after dry-run is switched on), SIGKILL of a follower and "
                                    "of the leader of the verdicts topic on a 3-broker cluster, a backend outage and "
                                    "hostile input on every telemetry topic. Judged from the backend's own request "
                                    "log, the dead-letter topic and the worker logs; exit 1 when a check fails.")
    sp.add_argument("--nodes", type=int, default=96, help="simulated fleet size (default 96)")
    sp.add_argument("--faults", type=int, default=60,
                    help="faults injected, every node and job kind in turn (default 60)")
    sp.add_argument("--brokers", type=int, default=3,
                    help="Kafka nodes: 3 (default) kills a follower and a leader; 1 restarts the single broker")
    sp.add_argument("--duration", type=float, default=400.0, help="wall seconds of the scenario (default 400)")
    sp.add_argument("--speed", type=float, default=3.0, help="simulated seconds per wall second (default 3)")
    sp.add_argument("--kills", type=int, default=22, help="SIGKILLs of the worker over every phase (default 22)")
    sp.add_argument("--outage", type=float, default=60.0, help="seconds the backend answers 503 (default 60)")
    sp.add_argument("--hostile", type=int, default=100_000, help="fuzzed malformed messages (default 100000)")
    sp.add_argument("--seed", type=int, default=1)
    sp.add_argument("--no-broker-restart", action="store_true", help="leave the brokers alone")
    sp.add_argument("--out", default=None, metavar="PATH",
                    help="JSON output path (default bench/results/chaos.json in a checkout, "
                         "else ./fleetmedic-results/chaos.json)")
    sp.set_defaults(func=cmd_chaos, result="chaos.json")

    sp = sub.add_parser("bench", help="measure throughput, latency, scale-out and memory (writes JSON)")
    sp.add_argument("--nodes", type=int, default=10000, help="fleet size (default 10000 nodes x 8 GPUs)")
    sp.add_argument("--rounds", type=int, default=20, help="samples per node in the backlog (default 20)")
    sp.add_argument("--network-every", type=int, default=5, help="a network sample every N rounds (default 5)")
    sp.add_argument("--latency-seconds", type=float, default=30.0, help="length of the latency run (default 30)")
    sp.add_argument("--faults", type=int, default=60,
                    help="faults injected in each latency run, after a 5 s warm-up (default 60)")
    sp.add_argument("--one-worker", action="store_true", help="skip the two-worker run")
    sp.add_argument("--repeat", type=int, default=3,
                    help="baseline/worker pairs measured back to back; medians are reported (default 3)")
    sp.add_argument("--quick", action="store_true", help="a small, fast run (300 nodes) that checks the harness works")
    sp.add_argument("--out", default=None, metavar="PATH",
                    help="JSON output path (default bench/results/throughput.json in a checkout, "
                         "else ./fleetmedic-results/throughput.json)")
    sp.add_argument("--keep-running", action="store_true", help="leave the broker running afterwards")
    sp.add_argument("--no-dashboard", action="store_true",
                    help="leave out the dashboard's frame times (a worker with the whole fleet, measured in headless "
                         "Chromium; written to dashboard.json beside --out)")
    sp.set_defaults(func=cmd_bench, result="throughput.json")

    sp = sub.add_parser(
        "bench-burst", help="isolate 100, 500 and 1,000 nodes at once on a real API server (writes JSON)",
        description="Starts its own Kubernetes control plane (deploy/k8s.sh, reset first) and Kafka broker, "
                    "registers --nodes Node objects and, for each burst size, --runs times: writes an Xid 79 sample "
                    "for every node of the burst at once, and times one worker (backend kubernetes) until a watch "
                    "sees every node cordoned, tainted and conditioned; then the same writes to as many other "
                    "nodes as parallel PATCH requests from the same client library (the raw limit). Reports "
                    "nodes/s, the ratio to the raw limit and verdict-to-cordon p50/p99 (medians with min and max). "
                    "Then the same bursts on a Slurm controller of its own (deploy/slurm.sh, bench nodes without "
                    "slurmd): fleetmedic's drains against scontrol reading a line per node, one host-list update, "
                    "and a process per node.")
    sp.add_argument("--nodes", type=int, default=10_000, help="Node objects registered (default 10000)")
    sp.add_argument("--sizes", type=int, nargs="+", help="burst sizes (default 100 500 1000)")
    sp.add_argument("--runs", type=int, default=3, help="runs per burst size; medians are reported (default 3)")
    sp.add_argument("--threads", type=int, default=32,
                    help="API calls in flight, for the worker and for the raw limit alike (default 32)")
    sp.add_argument("--backend", nargs="+", choices=["kubernetes", "slurm"], default=["kubernetes", "slurm"],
                    help="where to isolate: the Kubernetes API server (Node objects), a Slurm controller (bench "
                         "nodes without slurmd, drained through scontrol), or both (default)")
    sp.add_argument("--quick", action="store_true", help="600 nodes, bursts of 20 and 50: checks the harness works")
    sp.add_argument("--out", default=None, metavar="PATH",
                    help="JSON output path (default bench/results/burst.json in a checkout, "
                         "else ./fleetmedic-results/burst.json)")
    sp.add_argument("--keep-running", action="store_true", help="leave the control plane and the broker running")
    sp.set_defaults(func=cmd_bench_burst, result="burst.json")

    sp = sub.add_parser(
        "record", help="write the input topics (telemetry.gpu, telemetry.network, telemetry.job) to a recording",
        description="Read fleetmedic's input topics (with the configured prefix) and write every record, in "
                    "event-time order, as JSON Lines: {topic, key, ts, value}. Replay it with `fleetmedic replay`.")
    sp.add_argument("--out", required=True, help="the recording file to write (JSON Lines)")
    sp.add_argument("--seconds", type=float, default=60.0, help="read for at most this many wall seconds (default 60)")
    sp.add_argument("--idle", type=float, default=5.0,
                    help="stop once no record came for this many seconds (0: read all --seconds; default 5)")
    sp.add_argument("--from-now", action="store_true", help="record new records only (default: from the beginning)")
    sp.set_defaults(func=cmd_record)

    sp = sub.add_parser(
        "replay", help="send a recording to the input topics, paced by event time (--speed 100: 100x)",
        description="Send the records of a recording (see `fleetmedic record`) to the input topics with the "
                    "configured prefix, each at (its event time - the first's) / speed seconds after the start. "
                    "The worker decides on event time, so every speed gives the same verdicts; event times are "
                    "kept as recorded.")
    sp.add_argument("file", help="the recording (JSON Lines: topic, key, ts, value)")
    sp.add_argument("--speed", type=float, default=1.0,
                    help="event seconds per wall second: 1 real time, 100 a hundred times faster, 0 as fast as "
                         "possible (default 1)")
    sp.add_argument("--progress", action="store_true", help="print a line every 1,000 records")
    sp.set_defaults(func=cmd_replay)

    sp = sub.add_parser("contract", help="write docs/contract.md (clocks, params, evidence, rules, metrics, "
                                         "endpoints, breaker) from the code",
                        description="Generate the integration contract from the code's registries and tables.")
    sp.add_argument("--out", help="write here instead of docs/contract.md (outside a checkout: standard output)")
    sp.add_argument("--check", action="store_true", help="exit 1 when docs/contract.md is not what would be written")
    sp.set_defaults(func=cmd_contract)

    sp = sub.add_parser("topics", help="create fleetmedic's topics (idempotent)")
    sp.set_defaults(func=cmd_topics)

    sp = sub.add_parser("schemas", help="write the JSON Schema files (schemas/json/)")
    sp.add_argument("--out", help="directory to write to (default schemas/json in a checkout, else ./schemas)")
    sp.set_defaults(func=cmd_schemas)

    sp = sub.add_parser("chart-schema", help="write the Helm chart's values.schema.json from the settings schema")
    sp.add_argument("--out", help="file to write (default deploy/helm/fleetmedic/values.schema.json in a checkout)")
    sp.add_argument("--check", action="store_true", help="only say whether the file is current (exit 1 if not)")
    sp.set_defaults(func=cmd_chart_schema)

    sp = sub.add_parser("config", help="print the effective configuration as JSON")
    sp.set_defaults(func=cmd_config)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "simulate" and args.api_port == 0:
        args.api_port = 7070
    if getattr(args, "result", None) and args.out is None:
        args.out = str(paths.result(args.result))
    try:
        return int(args.func(args) or 0)
    except (ConfigError, FileNotFoundError) as exc:
        # a bad setting, or a data set or file of ours that is not where it should be
        print(f"fleetmedic: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
