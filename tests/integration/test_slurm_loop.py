"""The recovery loop on a real Slurm controller (deploy/slurm.sh): watcher, worker, backend.

Jobs are real ``sbatch`` jobs on the local slurmctld/slurmd nodes.  The job script plays
the training process: on its first attempt it crashes when the test says so (printing
the error a real crash would print), on later attempts it keeps running.  GPU telemetry
is written to Kafka by the test, since these nodes have no GPUs.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipeline.eval.failures import excerpt

from .harness import ROOT, Worker, collect, gpu_sample, produce

from .slurm_helpers import job as slurm_job
from .slurm_helpers import reset_cluster, running_nodes, sh, wait_for

pytestmark = pytest.mark.integration

JOB_SCRIPT = """#!/bin/bash
# attempt 1 waits for the crash marker, then dies as the test asks; later attempts run on
if [ "${SLURM_RESTART_COUNT:-0}" -gt 0 ]; then exec sleep 600; fi
while [ ! -e "$1" ]; do sleep 0.2; done
cat "$1" >&2
exit 1
"""


@pytest.fixture(autouse=True)
def clean_cluster(slurm_conf):
    reset_cluster(slurm_conf)
    yield


@pytest.fixture(scope="module")
def slurm_loop(kafka_bootstrap, slurm_conf, tmp_path_factory):
    work = tmp_path_factory.mktemp("slurm")
    diag_gate = work / "diag-go"
    env = {
        "FLEETMEDIC_ACTUATORS__BACKEND": "slurm",
        "FLEETMEDIC_ACTUATORS__SLURM_CONF": slurm_conf,
        "FLEETMEDIC_ACTUATORS__SLURM_DIAG_COMMAND": f"while [ ! -e {diag_gate} ]; do sleep 0.2; done",
        "FLEETMEDIC_SAFETY__FLEET_SIZE": "4",
        "FLEETMEDIC_SAFETY__MAX_FRACTION": "0.5",
        "SLURM_CONF": slurm_conf,
    }
    worker = Worker(kafka_bootstrap, sim_url="http://127.0.0.1:9", env=env).start()
    log = open(work / "watcher.log", "w")
    watcher = subprocess.Popen([sys.executable, "-m", "pipeline", "watch-slurm", "--interval", "0.5"], cwd=ROOT,
                               env=worker.env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    script = work / "train.sh"
    script.write_text(JOB_SCRIPT)
    script.chmod(0o755)
    yield kafka_bootstrap, worker, slurm_conf, work, diag_gate
    watcher.terminate()
    watcher.wait(10)
    log.close()
    worker.stop()
    reset_cluster(slurm_conf)


def submit(slurm_conf: str, work: Path, name: str) -> tuple[str, Path]:
    marker = work / f"{name}.crash"
    out = sh(slurm_conf, "sbatch", "--parsable", "--requeue", "-N", "2", f"--job-name={name}",
             f"--output={work}/{name}-%j.out", f"--error={work}/{name}-%j.err",
             str(work / "train.sh"), str(marker))
    return out.strip().split(";")[0], marker


def test_xid79_requeues_job_without_node_drains_it_and_resumes_it_after_diagnostics(slurm_loop):
    bootstrap, worker, conf, work, diag_gate = slurm_loop
    jid, crash = submit(conf, work, "xid")
    nodes = wait_for("the job to run", lambda: running_nodes(conf, jid), 30)
    bad = sorted(nodes)[1]
    job = f"slurm-{jid}"
    # the watcher has seen the job start before the GPU falls off the bus
    collect(bootstrap, worker.topic("telemetry.job"),
            lambda rs: any(r["job"] == job and r["event"] == "started" for r in rs), timeout=30)
    lost = [False] * 8
    lost[5] = True
    produce(bootstrap, [(worker.topic("telemetry.gpu"), bad, gpu_sample(bad, time.time(), lost=lost, xids=[(5, 79)]))])
    crash.write_text("RuntimeError: CUDA error: unspecified launch failure\n")

    verdicts = collect(bootstrap, worker.topic("verdicts"),
                       lambda rs: {job, bad} <= {v["subject"] for v in rs}, timeout=60)
    jv = next(v for v in verdicts if v["subject"] == job)
    nv = next(v for v in verdicts if v["subject"] == bad)
    assert jv["incident"] == nv["incident"]
    assert jv["actions"][0]["action"] == "requeue" and jv["actions"][0]["params"]["exclude"] == [bad]
    assert [a["action"] for a in nv["actions"]] == ["isolate", "drain", "diagnose"]

    # the job runs again, elsewhere, with the bad node excluded
    new_nodes = wait_for("the requeued job to run again",
                         lambda: slurm_job(conf, jid).get("Restarts") == "1" and running_nodes(conf, jid), 60)
    assert bad not in new_nodes
    assert bad in slurm_job(conf, jid)["ExcNodeList"]

    # the node is drained with a reason that names the verdict while diagnostics run
    def drained_reason():
        for line in sh(conf, "sinfo", "-h", "-R", "-o", "%N|%E").splitlines():
            n, _, reason = line.partition("|")
            if n.strip() == bad:
                return reason
        return None

    reason = wait_for(f"{bad} to show as drained", drained_reason, 30)
    assert reason.startswith("fleetmedic ") and nv["id"] in reason
    state = sh(conf, "sinfo", "-h", "-n", bad, "-o", "%T").strip()
    assert state.startswith("drain"), state

    # diagnostics pass: the node returns to service
    diag_gate.touch()
    verdicts = collect(bootstrap, worker.topic("verdicts"),
                       lambda rs: any(v["subject"] == bad and v["actions"][0]["action"] == "return" for v in rs),
                       timeout=60)
    wait_for(f"{bad} to be back in service",
             lambda: sh(conf, "sinfo", "-h", "-n", bad, "-o", "%T").strip() in ("idle", "mixed", "allocated"), 30)
    actions = collect(bootstrap, worker.topic("actions"),
                      lambda rs: any(a["target"] == bad and a["action"] == "return" for a in rs), timeout=30)
    ret = [a for a in actions if a["target"] == bad and a["action"] == "return"]
    assert ret[0]["outcome"] == "applied" and ret[0]["backend"] == "slurm"
    sh(conf, "scancel", jid)


def test_transient_failure_is_requeued_and_no_node_is_drained(slurm_loop):
    bootstrap, worker, conf, work, _ = slurm_loop
    since = time.time()
    jid, crash = submit(conf, work, "nccl")
    nodes = wait_for("the job to run", lambda: running_nodes(conf, jid), 30)
    job = f"slurm-{jid}"
    collect(bootstrap, worker.topic("telemetry.job"),
            lambda rs: any(r["job"] == job and r["event"] == "started" for r in rs), timeout=30)
    # the Hugging Face Hub answering 500 to a fine-tuning job, as it printed it (tests/data/failures/tune)
    crash.write_text(excerpt("t-parler-tts-90-hf-hub-500-finetune").log + "\n")
    verdicts = collect(bootstrap, worker.topic("verdicts"), lambda rs: any(v["subject"] == job for v in rs), timeout=60)
    jv = next(v for v in verdicts if v["subject"] == job)
    assert jv["fault_class"] == "transient_software"
    assert jv["actions"][0]["action"] == "retry"
    assert jv["evidence"]["triage"]["rule"] == "transient_exception"
    wait_for("the job to run again",
             lambda: slurm_job(conf, jid).get("Restarts") == "1" and running_nodes(conf, jid), 60)
    drained = [ln for ln in sh(conf, "sinfo", "-h", "-R", "-o", "%N|%E").splitlines()
               if ln.split("|")[0].strip() in nodes]
    assert drained == []
    assert not [v for v in verdicts if v["scope"] == "node" and v["subject"] in nodes and v["ts"] >= since]
    sh(conf, "scancel", jid)


def _scenario(job: str, other: str, scheduler: str, t0: float):
    """Xid 79 on the second node of one job, a failing service in another (both jobs print
    real output, tests/data/failures/tune); all event-timed."""
    from schemas import GpuSample, JobEvent

    recs = []
    a, b = ["n1", "n2"], ["n3", "n4"]
    recs.append(JobEvent(ts=t0, job=job, event="started", scheduler=scheduler, nodes=a))
    recs.append(JobEvent(ts=t0, job=other, event="started", scheduler=scheduler, nodes=b))
    for t in range(30):
        for n in a + b:
            lost, xids = [False] * 8, []
            if n == "n2" and t == 25:
                lost[5], xids = True, [(5, 79)]
            recs.append(GpuSample.model_validate(gpu_sample(n, t0 + t, lost=lost, xids=xids)))
        if t == 25:
            recs.append(JobEvent(ts=t0 + t + 0.5, job=job, event="failed", scheduler=scheduler, nodes=a,
                                 **excerpt("g-mineru-426-unspecified-launch-failure-bad-card").failed_fields()))
        if t == 28:
            recs.append(JobEvent(ts=t0 + t, job=other, event="failed", scheduler=scheduler, nodes=b,
                                 **excerpt("t-parler-tts-90-hf-hub-500-finetune").failed_fields()))
    return recs


def test_same_scenario_gives_the_same_verdicts_with_the_kubernetes_and_the_slurm_backend(slurm_conf, tmp_path):
    import asyncio

    from actuators import CircuitBreaker, RetryPolicy
    from actuators.kubernetes import KubernetesBackend
    from actuators.slurm import SlurmBackend
    from pipeline.actuate.core import Actuation
    from pipeline.config import load_settings
    from pipeline.eval.replay import LocalPipeline
    from tests.unit.actuators.test_kubernetes import FakeBatchV1Api, FakeCoreV1Api, FakeCustomObjectsApi

    # two real Slurm jobs so that the Slurm backend acts on real objects
    script = tmp_path / "run.sh"
    script.write_text("#!/bin/bash\nexec sleep 600\n")
    script.chmod(0o755)
    jids = [sh(slurm_conf, "sbatch", "--parsable", "--requeue", "-N", "2", "--output=/dev/null", str(script))
            .strip().split(";")[0] for _ in range(2)]
    job, other = (f"slurm-{j}" for j in jids)
    wait_for("both jobs to run", lambda: all(running_nodes(slurm_conf, j) for j in jids), 30)

    settings = load_settings(environ={})
    runs = {}
    for scheduler in ("kubernetes", "slurm"):
        lp = LocalPipeline(settings)
        lp.feed(_scenario(job, other, scheduler, 1_800_000_000.0))
        lp.finish()
        runs[scheduler] = lp.verdicts

    def normal(vs):
        out = []
        for v in vs:
            d = v.model_dump(mode="json")
            for a in d["actions"]:
                a["params"].pop("scheduler", None)
            out.append(d)
        return out

    assert normal(runs["kubernetes"]) == normal(runs["slurm"])
    kinds = {(v.scope, v.subject, v.fault_class.value, tuple(a.action.value for a in v.actions)) for v in runs["slurm"]}
    assert ("node", "n2", "gpu_hardware", ("isolate", "drain", "diagnose")) in kinds
    assert ("job", job, "gpu_hardware", ("requeue",)) in kinds
    assert ("job", other, "transient_software", ("retry",)) in kinds
    assert all(a.params.get("scheduler") == "slurm" for v in runs["slurm"] for a in v.actions if v.scope == "job")

    # and each backend carries the same verdicts out
    core, batch = FakeCoreV1Api(), FakeBatchV1Api()
    for n in ("n1", "n2", "n3", "n4"):
        core.add_node(n)
    backends = {
        "kubernetes": KubernetesBackend(core, batch, custom=FakeCustomObjectsApi(batch)),  # type: ignore[arg-type]
        "slurm": SlurmBackend(slurm_conf=slurm_conf, diag_command="true"),
    }
    outcomes = {}
    for name, backend in backends.items():
        act = Actuation(backend=backend, breaker=CircuitBreaker(max_fraction=0.5), fleet_size=lambda: 4,
                        retry=RetryPolicy(max_attempts=3, base_delay=0.2))
        recs = []
        for v in runs[name]:
            recs.extend(asyncio.run(act.carry_out(v)))
        outcomes[name] = [(r.action.value, r.target, r.outcome.value) for r in recs]
    for name, outs in outcomes.items():
        assert all(o in ("applied", "already_so") for _, _, o in outs), (name, outs)
    assert [(a, t) for a, t, _ in outcomes["kubernetes"]] == [(a, t) for a, t, _ in outcomes["slurm"]]
    assert core.nodes["n2"]["spec"].get("unschedulable") is True
    assert ("isolate", "n2", "applied") in outcomes["slurm"]
    assert ("requeue", job, "applied") in outcomes["slurm"] and ("retry", other, "applied") in outcomes["slurm"]
