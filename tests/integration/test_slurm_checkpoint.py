"""Checkpoint-now on a real Slurm controller: USR1 to a batch job, its acknowledgement
through fleetmedic.client, the move and the node's drain.

In a module of its own: the worker and watcher of ``test_slurm_loop``'s module fixture
would still be running beside this test, acting on the jobs of the tests before it (one
such job, requeued again on the node under test, kept the node from being drained), and
the cluster must hold no job at all when the test's worker and watcher start.
"""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from .harness import ROOT, Worker, collect, produce
from .slurm_helpers import job as slurm_job
from .slurm_helpers import reset_cluster, running_nodes, sh, wait_for

pytestmark = pytest.mark.integration


CHECKPOINT_SCRIPT = """#!/bin/bash
# a training job that answers checkpoint-now: USR1 to the batch shell (scancel --signal=USR1
# --batch, as #SBATCH --signal=B:USR1@N does before the time limit) saves and acknowledges
# through fleetmedic.client; a requeued attempt just runs on
if [ "${SLURM_RESTART_COUNT:-0}" -gt 0 ]; then exec sleep 600; fi
save() {
    date +%s > "$1.usr1"
    "$FM_PYTHON" -m fleetmedic.client --state "$1.ackstate" ack --step 1200 > "$1.ack" 2>&1
}
trap 'save "$1"' USR1
sleep 600 & child=$!
while kill -0 "$child" 2>/dev/null; do wait "$child"; done
"""


@pytest.fixture
def fresh_loop(kafka_bootstrap, slurm_conf, tmp_path):
    """A worker and a watcher of their own: the jobs earlier tests ran (and cancelled)
    are not on this worker's nodes, where they would each be asked to checkpoint first."""
    env = {"FLEETMEDIC_ACTUATORS__BACKEND": "slurm", "FLEETMEDIC_ACTUATORS__SLURM_CONF": slurm_conf,
           "FLEETMEDIC_SAFETY__FLEET_SIZE": "4", "FLEETMEDIC_SAFETY__MAX_FRACTION": "0.5", "SLURM_CONF": slurm_conf}
    reset_cluster(slurm_conf, no_job_left=True)  # no finished job left for the new watcher to report
    worker = Worker(kafka_bootstrap, sim_url="http://127.0.0.1:9", env=env).start()
    log = open(tmp_path / "watcher.log", "w")
    watcher = subprocess.Popen([sys.executable, "-m", "pipeline", "watch-slurm", "--interval", "0.5"], cwd=ROOT,
                               env=worker.env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    yield kafka_bootstrap, worker, slurm_conf, tmp_path
    watcher.terminate()
    watcher.wait(10)
    log.close()
    worker.stop()
    reset_cluster(slurm_conf)  # the node this test drained goes back: the next modules find every node idle


def test_a_batch_job_receives_usr1_and_its_ack_leads_to_the_move_and_the_drain(fresh_loop, monkeypatch):
    bootstrap, worker, conf, work = fresh_loop
    script = work / "ckpt.sh"
    script.write_text(CHECKPOINT_SCRIPT)
    script.chmod(0o755)
    marker = work / "ckpt"
    # the job's environment (sbatch exports the submitter's): where its client sends the ack
    for k, v in {"FLEETMEDIC_BOOTSTRAP": bootstrap, "FM_PYTHON": sys.executable, "PYTHONPATH": str(ROOT),
                 "FLEETMEDIC_TOPIC_PREFIX": worker.topic("telemetry.job").removesuffix("telemetry.job")}.items():
        monkeypatch.setenv(k, v)
    out = sh(conf, "sbatch", "--parsable", "--requeue", "-N", "1", "--job-name=ckpt",
             f"--output={work}/ckpt-%j.out", str(script), str(marker))
    jid = out.strip().split(";")[0]
    [node] = wait_for("the job to run", lambda: running_nodes(conf, jid), 30)
    job = f"slurm-{jid}"
    collect(bootstrap, worker.topic("telemetry.job"),
            lambda rs: any(r["job"] == job and r["event"] == "started" for r in rs), timeout=30)

    # a detector's degradation findings on the job's node (three: the node track's confirmations),
    # once the job's placement has reached the node's owner (a notice after its start record)
    time.sleep(2)
    t = time.time()
    produce(bootstrap, [(worker.topic("anomalies"), node, {
        "schema": "anomaly/1", "ts": t + i, "id": f"sbe-{node}-{jid}-{i}", "detector": "gpu_rates",
        "subject_type": "gpu", "subject": f"{node}/gpu3", "node": node, "gpu": 3, "kind": "ecc_sbe_rate",
        "fault_class": "node_degrading", "score": 6.0, "severity": "warning"}) for i in range(3)])

    usr1 = wait_for("USR1 delivered to the batch script", lambda: marker.with_suffix(".usr1").exists() or None, 60)
    assert usr1
    acts = collect(bootstrap, worker.topic("actions"),
                   lambda rs: any(a["target"] == job and a["action"] == "checkpoint" for a in rs), timeout=30)
    [asked] = [a for a in acts if a["target"] == job and a["action"] == "checkpoint"]
    assert asked["outcome"] == "applied" and asked["backend"] == "slurm"
    # the ack is the job's own checkpoint record, sent by its client
    records = collect(bootstrap, worker.topic("telemetry.job"),
                      lambda rs: any(r["job"] == job and r["event"] == "checkpoint" for r in rs), timeout=60)
    ack = next(r for r in records if r["job"] == job and r["event"] == "checkpoint")
    assert ack["checkpoint_step"] == 1200 and ack["scheduler"] == "slurm"

    verdicts = collect(bootstrap, worker.topic("verdicts"),
                       lambda rs: any(v["subject"] == job and v["actions"][0]["action"] == "requeue" for v in rs)
                       and any(v["subject"] == node and v["actions"][0]["action"] == "drain" for v in rs), 60)
    move = next(v for v in verdicts if v["subject"] == job and v["actions"][0]["action"] == "requeue")
    assert move["evidence"]["reason"] == "checkpoint reached" and move["actions"][0]["params"]["exclude"] == [node]
    drains = [v for v in verdicts if v["subject"] == node and v["actions"][0]["action"] == "drain"]
    seen = [(v["subject"], [a["action"] for a in v["actions"]], v["evidence"].get("rule")) for v in verdicts]
    assert drains, f"no drain of {node} after the move; verdicts: {seen}\n{worker.log_tail(80)}"
    assert drains[0]["ts"] >= move["ts"] >= ack["ts"]
    new_nodes = wait_for("the job to run again elsewhere",
                         lambda: slurm_job(conf, jid).get("Restarts") == "1" and running_nodes(conf, jid), 60)
    assert node not in new_nodes
    state = sh(conf, "sinfo", "-h", "-n", node, "-o", "%T").strip()
    assert state.startswith("drain"), state
    sh(conf, "scancel", jid)
