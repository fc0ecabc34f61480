"""The local Slurm cluster of deploy/slurm.sh does what fleetmedic's Slurm backend needs.

Against a real slurmctld and one slurmd per node (n1..n4 on 127.0.0.1): the controller
answers, every node is idle, a 2-node batch job runs to COMPLETED, a drain with a reason
shows in ``sinfo -R`` and resume brings the node back, and a running job that is
requeued runs again, also after ``requeuehold`` + ``ExcNodeList`` + ``release``.
Also pins what the build offers for machine-readable output (``squeue/sinfo --json``),
checkpoint-now (``SIGUSR1`` to a batch shell that traps it), and where a failed job's
``origin_node`` comes from: ``sacct`` on a second cluster with accounting (slurmdbd), and
none on this one, which has no accounting.
"""

from __future__ import annotations

import json
import time
import uuid
from pathlib import Path

import pytest

from actuators.slurm import parse_oneliner

from .slurm_helpers import accounting_cluster, job, sh, wait_for

pytestmark = pytest.mark.integration

USABLE = {"idle", "mix", "alloc"}


def hostnames(conf: str, hostlist: str) -> list[str]:
    if not hostlist or hostlist == "(null)":
        return []
    return sh(conf, "scontrol", "show", "hostnames", hostlist).split()


def node_states(conf: str) -> dict[str, str]:
    out = sh(conf, "sinfo", "-h", "-N", "-o", "%N %t")
    return dict(line.split() for line in out.strip().splitlines())


def nodes(conf: str) -> list[str]:
    return sorted(node_states(conf), key=lambda n: (len(n), n))


def all_idle(conf: str) -> dict[str, str] | None:
    states = node_states(conf)
    return states if states and set(states.values()) == {"idle"} else None


def sbatch(conf: str, cwd: Path, *args: str) -> str:
    return sh(conf, "sbatch", "--parsable", *args, cwd=cwd).strip().split(";")[0]


def state_is(conf: str, jid: str, *states: str) -> dict[str, str] | None:
    info = job(conf, jid)
    return info if info.get("JobState") in states else None


def test_controller_answers_ping(slurm_conf: str) -> None:
    out = sh(slurm_conf, "scontrol", "ping")
    assert "is UP" in out, out
    assert Path(slurm_conf).is_file()
    assert "ClusterName=fleetmedic" in Path(slurm_conf).read_text()


def test_all_nodes_are_idle_and_have_gpus(slurm_conf: str) -> None:
    states = wait_for("every node idle", lambda: all_idle(slurm_conf), timeout=30)
    assert len(states) >= 3, f"need several nodes, got {states}"
    assert set(nodes(slurm_conf)) >= {"n1", "n2", "n3"}
    gres = sh(slurm_conf, "sinfo", "-h", "-N", "-o", "%N %G").split("\n")
    assert all("gpu:" in line for line in gres if line), gres


def test_two_node_batch_job_runs_to_completed(slurm_conf: str, tmp_path: Path) -> None:
    out = tmp_path / "job.out"
    jid = sbatch(
        slurm_conf, tmp_path, "-N", "2", "--gres=gpu:2", f"--output={out}",
        "--wrap", 'echo "nodes=$SLURM_JOB_NODELIST gpus=$CUDA_VISIBLE_DEVICES"; srun -l printenv SLURMD_NODENAME',
    )
    info = wait_for("job to complete", lambda: state_is(slurm_conf, jid, "COMPLETED", "FAILED", "CANCELLED"))
    assert info["JobState"] == "COMPLETED", info
    assert info["ExitCode"] == "0:0", info
    ran_on = hostnames(slurm_conf, info["NodeList"])
    assert len(ran_on) == 2, info
    text = out.read_text()
    assert "gpus=0,1" in text, text
    # one task per node, each reporting the node it ran on
    assert sorted(line.split(": ", 1)[1] for line in text.splitlines() if ": " in line) == sorted(ran_on), text

    # squeue --json (openapi/v0.0.38 in 22.05) lists finished jobs until MinJobAge;
    # its filters (-j, -t) are ignored, so callers filter themselves.
    data = json.loads(sh(slurm_conf, "squeue", "--json"))
    mine = [j for j in data["jobs"] if str(j["job_id"]) == jid]
    assert mine and mine[0]["job_state"] == "COMPLETED", mine
    assert hostnames(slurm_conf, mine[0]["nodes"]) == ran_on
    info_nodes = json.loads(sh(slurm_conf, "sinfo", "--json"))["nodes"]
    assert {n["name"] for n in info_nodes} >= set(ran_on)


def test_drain_with_reason_shows_in_sinfo_and_resume_brings_node_back(slurm_conf: str) -> None:
    node = nodes(slurm_conf)[1]
    reason = f"fleetmedic test xid 79 {uuid.uuid4().hex[:8]}"
    wait_for(f"{node} idle", lambda: node_states(slurm_conf)[node] == "idle", timeout=30)
    try:
        sh(slurm_conf, "scontrol", "update", f"NodeName={node}", "State=DRAIN", f"Reason={reason}")
        reasons = sh(slurm_conf, "sinfo", "-R", "-h", "-o", "%N|%E")
        assert f"{node}|{reason}" in reasons.splitlines(), reasons
        assert node_states(slurm_conf)[node] in ("drain", "drng"), node_states(slurm_conf)
        shown = json.loads(sh(slurm_conf, "sinfo", "--json"))["nodes"]
        entry = next(n for n in shown if n["name"] == node)
        assert entry["reason"] == reason and "DRAIN" in entry["state_flags"], entry
    finally:
        sh(slurm_conf, "scontrol", "update", f"NodeName={node}", "State=RESUME", check=False)
    # resume first marks the node not-responding (idle*) until the next ping answers
    wait_for(f"{node} idle again", lambda: node_states(slurm_conf)[node] == "idle", timeout=30)
    assert node not in sh(slurm_conf, "sinfo", "-R", "-h", "-o", "%N")


def test_requeued_job_runs_again_and_can_exclude_a_node_while_held(slurm_conf: str, tmp_path: Path) -> None:
    jid = sbatch(slurm_conf, tmp_path, "-N", "2", "--requeue", "--output=/dev/null", "--wrap", "sleep 300")
    try:
        first = wait_for("job to run", lambda: state_is(slurm_conf, jid, "RUNNING"))
        first_nodes = hostnames(slurm_conf, first["NodeList"])
        assert len(first_nodes) == 2

        # plain requeue: back to PENDING (held off for cred_expire+1 s), then RUNNING again
        sh(slurm_conf, "scontrol", "requeue", jid)
        pending = wait_for("requeued job to pend", lambda: state_is(slurm_conf, jid, "PENDING"), timeout=30)
        assert pending["Restarts"] == "1", pending
        second = wait_for("requeued job to run again", lambda: state_is(slurm_conf, jid, "RUNNING"), timeout=90)
        bad = hostnames(slurm_conf, second["NodeList"])[0]

        # requeue in held state, exclude a node while pending, release
        sh(slurm_conf, "scontrol", "requeuehold", jid)
        held = wait_for("job to be held", lambda: state_is(slurm_conf, jid, "PENDING"), timeout=30)
        assert held["Restarts"] == "2", held
        assert "held" in held["Reason"].lower() or held["Reason"] == "JobHeldAdmin", held
        time.sleep(2)
        assert job(slurm_conf, jid)["JobState"] == "PENDING", "held job must not start"
        sh(slurm_conf, "scontrol", "update", f"JobId={jid}", f"ExcNodeList={bad}")
        assert job(slurm_conf, jid)["ExcNodeList"] == bad
        sh(slurm_conf, "scontrol", "release", jid)
        third = wait_for("released job to run", lambda: state_is(slurm_conf, jid, "RUNNING"), timeout=90)
        third_nodes = hostnames(slurm_conf, third["NodeList"])
        assert len(third_nodes) == 2 and bad not in third_nodes, third
        assert third["ExcNodeList"] == bad, third
    finally:
        sh(slurm_conf, "scancel", jid, check=False)
    wait_for("job to leave the nodes", lambda: state_is(slurm_conf, jid, "CANCELLED"), timeout=30)


def test_drains_that_arrive_together_are_made_in_one_batch_each_with_its_own_reason(slurm_conf: str) -> None:
    """The Slurm backend against the real controller: four isolations at once (two
    nodes in service, one a person drained, one unknown) are observed, made and checked
    in one batch; each drained node carries its own verdict in its reason, the person's
    drain is left as it is, and the unknown node fails alone."""
    import asyncio

    from actuators.base import ActionRequest, PermanentError
    from actuators.slurm import SlurmBackend
    from schemas import ActionName, Outcome

    ours, person = nodes(slurm_conf)[1:3], nodes(slurm_conf)[3]
    for n in (*ours, person):
        wait_for(f"{n} idle", lambda n=n: node_states(slurm_conf)[n] == "idle", timeout=30)
    tag = uuid.uuid4().hex[:6]
    sh(slurm_conf, "scontrol", "update", f"NodeName={person}", "State=DRAIN", "Reason=rma ticket 4711")
    backend = SlurmBackend(slurm_conf=slurm_conf)

    def isolate(node: str) -> ActionRequest:
        return ActionRequest(verdict_id=f"v-{tag}-{node}", action=ActionName.isolate, target=node,
                             reason=f'gpu_hardware (node {node}, "xid 79")')

    async def burst() -> list[object]:
        return await asyncio.gather(*(backend.apply(isolate(n)) for n in (*ours, person, "n999")),
                                    return_exceptions=True)

    try:
        got = asyncio.run(burst())
        assert backend._drains.batches == [4]
        assert [g.outcome for g in got[:3]] == [Outcome.applied, Outcome.applied, Outcome.already_so], got
        assert isinstance(got[3], PermanentError) and "n999" in str(got[3])
        reasons = dict(line.split("|", 1) for line in sh(slurm_conf, "sinfo", "-R", "-h", "-o", "%N|%E").splitlines())
        for n in ours:
            assert reasons[n] == f"fleetmedic v-{tag}-{n}: gpu_hardware (node {n}, 'xid 79')", reasons
        assert reasons[person] == "rma ticket 4711"
        # again: everything is already so, and nothing is written
        again = asyncio.run(burst())
        assert [g.outcome for g in again[:3]] == [Outcome.already_so] * 3, again
    finally:
        sh(slurm_conf, "scontrol", "update", f"NodeName={','.join((*ours, person))}", "State=RESUME", check=False)
    for n in (*ours, person):
        wait_for(f"{n} idle again", lambda n=n: node_states(slurm_conf)[n] == "idle", timeout=30)


def _diagnose(conf: str, node: str, tag: str, diag_time_limit: str = "30:00") -> object:
    """The Slurm backend's diagnostics action on ``node``, against the real controller;
    its result or the error it raised."""
    import asyncio

    from actuators.base import ActionRequest
    from actuators.slurm import SlurmBackend
    from schemas import ActionName

    backend = SlurmBackend(slurm_conf=conf, diag_command="true", diag_start_wait_s=10.0,
                           diag_time_limit=diag_time_limit)
    req = ActionRequest(verdict_id=f"v-{tag}", action=ActionName.diagnose, target=node, reason="gpu_hardware")

    async def go() -> object:
        try:
            return await backend.apply(req)
        except Exception as exc:  # the test looks at it
            return exc

    return asyncio.run(go())


def _release(conf: str, node: str) -> None:
    for line in sh(conf, "squeue", "-h", "-w", node, "-o", "%i").split():
        sh(conf, "scancel", line, check=False)
    sh(conf, "scontrol", "delete", f"ReservationName=fleetmedic-diag-{node}", check=False)
    sh(conf, "scontrol", "update", f"NodeName={node}", "State=RESUME", check=False)
    wait_for(f"{node} idle again", lambda: node_states(conf)[node] == "idle", timeout=60)


def test_a_diagnostics_job_that_cannot_be_submitted_leaves_the_node_drained(slurm_conf: str) -> None:
    """The backend resumes a drained node into a maintenance reservation to submit its
    diagnostics job there. When the controller refuses the job (here a time limit it
    cannot parse: sbatch's own error), the node is drained again, not left open."""
    from actuators.base import ActuatorError

    node, tag = nodes(slurm_conf)[3], uuid.uuid4().hex[:6]
    wait_for(f"{node} idle", lambda: node_states(slurm_conf)[node] == "idle", timeout=30)
    sh(slurm_conf, "scontrol", "update", f"NodeName={node}", "State=DRAIN", f"Reason=fleetmedic v-{tag}: xid 79")
    try:
        got = _diagnose(slurm_conf, node, tag, diag_time_limit="not-a-time")
        assert isinstance(got, ActuatorError) and "sbatch" in str(got), got
        assert node_states(slurm_conf)[node].rstrip("*") in ("drain", "drng"), node_states(slurm_conf)
        reason = sh(slurm_conf, "sinfo", "-R", "-h", "-n", node, "-o", "%E").strip()
        assert reason == f"fleetmedic v-{tag}: diagnostics could not be submitted", reason
    finally:
        _release(slurm_conf, node)


def test_diagnostics_run_on_a_node_outside_the_default_partition(slurm_conf: str) -> None:
    """A node that is only in a partition other than the default one: the diagnostics job
    is submitted to the node's own partition (sbatch without one uses the default, and the
    controller answers "Requested node configuration is not available")."""
    from schemas import Outcome

    all_nodes = nodes(slurm_conf)
    node, tag = all_nodes[3], uuid.uuid4().hex[:6]
    part = f"diag{tag}"
    first = parse_oneliner(sh(slurm_conf, "scontrol", "show", "partition", "-o").splitlines()[0])
    gpu, gpu_nodes = first["PartitionName"], first["Nodes"]
    wait_for(f"{node} idle", lambda: node_states(slurm_conf)[node] == "idle", timeout=30)
    sh(slurm_conf, "scontrol", "update", f"PartitionName={gpu}", f"Nodes={','.join(all_nodes[:3])}")
    sh(slurm_conf, "scontrol", "create", f"PartitionName={part}", f"Nodes={node}", "Default=NO", "State=UP")
    try:
        sh(slurm_conf, "scontrol", "update", f"NodeName={node}", "State=DRAIN", f"Reason=fleetmedic v-{tag}: xid 79")
        got = _diagnose(slurm_conf, node, tag)
        assert getattr(got, "outcome", None) is Outcome.applied, got
        jid = sh(slurm_conf, "squeue", "-h", "-t", "all", "-n", f"fleetmedic-diag-{node}-v-{tag}", "-o", "%i").split()
        assert jid, "no diagnostics job"
        info = job(slurm_conf, jid[0])
        assert info["Partition"] == part and info["Comment"] == f"diagnostics_for={node}", info
    finally:
        _release(slurm_conf, node)
        sh(slurm_conf, "scontrol", "delete", f"PartitionName={part}", check=False)
        sh(slurm_conf, "scontrol", "update", f"PartitionName={gpu}", f"Nodes={gpu_nodes}", check=False)


# ----------------------------------------------------------------- checkpoint-now

#: the usual pattern of a batch script that checkpoints on USR1: trap it, work in the
#: background, wait for the work (bash runs a trap only between commands, and ``wait``
#: returns when one fires, so it waits again)
CHECKPOINT_SCRIPT = """#!/bin/bash
trap 'echo ack >> {ack}' USR1
sleep 300 & work=$!
echo ready > {ready}
while kill -0 "$work" 2>/dev/null; do wait "$work"; done
"""


def test_checkpoint_now_signals_the_batch_shell_once_per_verdict_and_the_job_acks(
        slurm_conf: str, tmp_path: Path) -> None:
    """The Slurm backend's checkpoint action against the real controller: the batch
    script's USR1 trap runs (its ack file appears), the job keeps running, the request is
    recorded in the job's AdminComment, the same verdict again signals nothing, and once
    the job has ended there is nothing to save."""
    import asyncio

    from actuators.base import ActionRequest
    from actuators.slurm import SlurmBackend
    from schemas import ActionName, Outcome

    ack, ready, script = tmp_path / "ack", tmp_path / "ready", tmp_path / "train.sh"
    script.write_text(CHECKPOINT_SCRIPT.format(ack=ack, ready=ready))
    jid = sbatch(slurm_conf, tmp_path, "-N", "2", "--output=/dev/null", str(script))
    backend, tag = SlurmBackend(slurm_conf=slurm_conf), uuid.uuid4().hex[:6]
    try:
        info = wait_for("job to run", lambda: state_is(slurm_conf, jid, "RUNNING"))
        wait_for("the script's trap to be set", ready.exists, timeout=30)
        degrading = hostnames(slurm_conf, info["NodeList"])[1]
        req = ActionRequest(verdict_id=f"v-{tag}", action=ActionName.checkpoint, target=f"slurm-{jid}",
                            params={"deadline": time.time() + 600, "node": degrading}, reason="node_degrading")
        got = asyncio.run(backend.apply(req))
        assert got.outcome is Outcome.applied and "USR1" in got.detail, got
        wait_for("the job's ack", lambda: ack.exists() and ack.read_text(), timeout=30)
        after = job(slurm_conf, jid)
        assert after["JobState"] == "RUNNING", after  # asked to save, not stopped
        assert after["AdminComment"].startswith(f"fleetmedic-checkpoint:v-{tag}@"), after

        again = asyncio.run(backend.apply(req))
        assert again.outcome is Outcome.already_so and "already asked" in again.detail, again
        time.sleep(1)
        assert ack.read_text() == "ack\n", "one request, one ack"
    finally:
        sh(slurm_conf, "scancel", jid, check=False)
    wait_for("job to end", lambda: state_is(slurm_conf, jid, "CANCELLED"), timeout=30)
    late = asyncio.run(backend.apply(ActionRequest(
        verdict_id=f"v-{tag}-late", action=ActionName.checkpoint, target=f"slurm-{jid}",
        params={"deadline": time.time() + 600}, reason="node_degrading")))
    assert late.outcome is Outcome.already_so and "nothing to save" in late.detail, late


# -------------------------------------------------------------------- origin_node

#: a 2-node job, one one-node srun per node: on the second node it fails after a
#: second, on the first it works on; the script ends when the first srun ends
ONE_NODE_FAILS_FIRST = """#!/bin/bash
nodes=($(scontrol show hostnames "$SLURM_JOB_NODELIST"))
srun -N1 -n1 -w "${nodes[1]}" bash -c 'sleep 1; echo "CUDA error: uncorrectable ECC error" >&2; exit 3' &
srun -N1 -n1 -w "${nodes[0]}" sleep 300 &
wait -n
exit 1
"""
#: one srun over both nodes; its task on the second node fails, -K ends the step
ONE_TASK_OF_A_TWO_NODE_STEP_FAILS = """#!/bin/bash
srun -K -N2 -n2 bash -c 'if [ "$SLURM_NODEID" = 1 ]; then sleep 1; exit 4; fi; sleep 300'
"""


def _failed_event(conf: str, watcher: object, jid: str) -> object:
    """Poll ``watcher`` (its own poll loop's steps) until job ``jid``'s failure comes out."""
    import asyncio

    got: list[object] = []

    def probe() -> object:
        got.extend(e for e in asyncio.run(watcher.poll()) if e.job == f"slurm-{jid}")  # type: ignore[attr-defined]
        return next((e for e in got if e.event.value == "failed"), None)

    return wait_for(f"job {jid}'s failure from the watcher", probe, timeout=60)


def _run_to_failure(conf: str, cwd: Path, script: str) -> tuple[str, list[str]]:
    path = cwd / f"job-{uuid.uuid4().hex[:6]}.sh"
    path.write_text(script)
    jid = sbatch(conf, cwd, "-N", "2", f"--output={cwd}/%j.out", str(path))
    info = wait_for(f"job {jid} to fail", lambda: state_is(conf, jid, "FAILED", "COMPLETED", "CANCELLED"), timeout=60)
    assert info["JobState"] == "FAILED", info
    return jid, hostnames(conf, info["NodeList"])


@pytest.fixture(scope="module")
def accounting_conf(tmp_path_factory: pytest.TempPathFactory) -> object:
    """A 2-node cluster of its own with slurmdbd, for ``sacct``."""
    with accounting_cluster(tmp_path_factory.mktemp("acct")) as conf:
        yield conf


def test_with_accounting_the_watcher_names_the_node_whose_step_failed_first(
        accounting_conf: str, tmp_path: Path) -> None:
    from pipeline.watch.slurm import Scontrol, SlurmJobWatcher

    conf = accounting_conf
    jid, nodes = _run_to_failure(conf, tmp_path, ONE_NODE_FAILS_FIRST)
    watcher = SlurmJobWatcher(Scontrol(slurm_conf=conf))
    failed = _failed_event(conf, watcher, jid)
    assert failed.origin_node == nodes[1], (failed, sh(conf, "sacct", "-j", jid, "-P"))  # type: ignore[attr-defined]
    # what sacct recorded: the failed one-node step on that node, the other step cancelled
    steps = sh(conf, "sacct", "-j", jid, "--parsable2", "--noheader", "--format=JobID,State,ExitCode,NodeList")
    assert f"|FAILED|3:0|{nodes[1]}" in steps, steps
    assert watcher.accounting


def test_with_accounting_a_task_failure_inside_a_two_node_step_names_no_node(
        accounting_conf: str, tmp_path: Path) -> None:
    """srun says which task failed (in the job's output); sacct keeps the step on both
    nodes, so the watcher names none rather than guess."""
    from pipeline.watch.slurm import Scontrol, SlurmJobWatcher

    conf = accounting_conf
    jid, nodes = _run_to_failure(conf, tmp_path, ONE_TASK_OF_A_TWO_NODE_STEP_FAILS)
    failed = _failed_event(conf, SlurmJobWatcher(Scontrol(slurm_conf=conf)), jid)
    assert failed.origin_node is None, failed  # type: ignore[attr-defined]
    assert f"srun: error: {nodes[1]}: task 1: Exited with exit code 4" in (tmp_path / f"{jid}.out").read_text()
    steps = sh(conf, "sacct", "-j", jid, "--parsable2", "--noheader", "--format=JobID,State,NodeList")
    assert f"{jid}.0|FAILED|" in steps and "n[1-2]" in steps, steps


def test_without_accounting_a_failure_goes_out_at_once_without_origin_node(slurm_conf: str, tmp_path: Path) -> None:
    """The session's cluster keeps no accounting: sacct says so, the watcher says so once,
    stops asking, and sends failures without ``origin_node`` (no waiting for a record that
    will never come)."""
    import os
    import subprocess

    from pipeline.watch.slurm import Scontrol, SlurmJobWatcher

    res = subprocess.run(["sacct", "-j", "1"], env={**os.environ, "SLURM_CONF": slurm_conf}, capture_output=True,
                         text=True, check=False, stdin=subprocess.DEVNULL)
    assert res.returncode != 0 and "Slurm accounting storage is disabled" in res.stderr, res
    jid, _ = _run_to_failure(slurm_conf, tmp_path, ONE_NODE_FAILS_FIRST)
    watcher = SlurmJobWatcher(Scontrol(slurm_conf=slurm_conf), origin_wait_s=3600)
    started = time.monotonic()
    failed = _failed_event(slurm_conf, watcher, jid)
    assert failed.origin_node is None and watcher.accounting is False, failed  # type: ignore[attr-defined]
    assert time.monotonic() - started < 30  # not held for the hour it was allowed
