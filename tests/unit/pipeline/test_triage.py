"""The triage reads failures as real jobs, launchers and drivers print them.

Every text here is real: excerpts of the failure corpus's tune split
(``tests/data/failures/tune``, each with its source), torchrun's summary as a user posted
it (``tests/fixtures/torchrun``), and the driver's own lines (``tests/fixtures/kernel-log``).
"""

from __future__ import annotations

import json
import random
import tomllib
from pathlib import Path

import pytest

from pipeline.eval.failures import excerpt, load
from pipeline.correlate.triage import read_failure, signature_basis, triage

REPO = Path(__file__).resolve().parents[3]
TUNE = load("tune")


def _triage(case_id: str, nodes: list[str] | None = None):
    c = excerpt(case_id)
    f = c.failed_fields()
    return triage(f.get("exit_code"), f.get("reason"), f["log_tail"], nodes or [])


def test_every_tune_excerpt_is_read_and_its_evidence_is_small_json():
    for c in TUNE:
        f = c.failed_fields()
        r, t = triage(f.get("exit_code"), f.get("reason"), f["log_tail"], ["n0", "n1"])
        ev = t.evidence()
        assert ev["rule"] and ev["why"], c.id
        assert len(json.dumps(ev)) < 20_000, c.id


def test_a_cuda_oom_without_a_traceback_header_is_the_users():
    r, t = _triage("u-chatglm3-finetuning-13-cuda-oom-4090")
    assert (t.kind, t.rule) == ("user", "cuda_error") and "cudaErrorMemoryAllocation" in r.cuda_errors
    assert "Traceback (most recent call last)" not in excerpt("u-chatglm3-finetuning-13-cuda-oom-4090").log


def test_the_python_exception_names_the_users_bug():
    r, t = _triage("u-hymba-6-importerror-transformers-version")
    assert t.kind == "user" and t.rule == "python_exception" and r.exception[0].endswith("ImportError")


def test_an_argument_the_program_refuses_is_the_users_whatever_the_launcher_says():
    r, t = _triage("u-tecogan-31-unrecognized-local-rank")
    assert (t.kind, t.rule) == ("user", "argument_error")
    assert r.launcher_exit == [2] and r.exit_code == 2  # torchrun's "failed (exitcode: 2)"


def test_nccl_invalid_usage_is_the_users():
    assert _triage("u-dfine-289-nccl-duplicate-gpu")[1].rule == "nccl_invalid_usage"


def test_a_preemption_notice_is_transient_and_blames_no_node():
    r, t = _triage("t-submitit-1701-slurm-preempted-sighup-requeued")
    assert (t.kind, t.rule, t.blames_nodes) == ("transient", "preempted", False)


def test_a_service_that_failed_a_request_is_transient():
    assert _triage("t-hf-kernels-640-hub-429-multirank-ratelimit")[1].rule == "service_unavailable"


def test_an_uncorrectable_ecc_error_is_hardware_and_names_its_class():
    r, t = _triage("g-darknet-3496-k80-ecc-uncorrectable")
    assert (t.kind, t.fault_class.value, t.strong) == ("hardware", "gpu_memory", True)


def test_a_kernel_xid_line_in_the_output_decides_by_the_catalog():
    r, t = _triage("g-akash-209-xid79-fallen-off-bus-nvidia-smi")
    assert (t.kind, t.rule) == ("hardware", "xid_in_log") and 79 in r.xids
    # a contained error (94) restarts the application; an application Xid (13) runs it elsewhere
    assert _triage("h-nvdocs-xid94-contained-ecc-mig")[1].kind == "contained"
    assert _triage("x-pytorch-51382-dgx-gpu7-xid13-faulty-device")[1].rule == "xid_application_or_gpu"


def test_ambiguous_gpu_errors_are_suspects_to_run_elsewhere():
    for case_id in ("g-mineru-426-unspecified-launch-failure-bad-card", "h-vllm-7896-nccl-unhandled-cuda-bad-node",
                    "x-illinois-scicomp-60-nvml-mismatch-reboot"):
        t = _triage(case_id)[1]
        assert t.kind == "suspect" and not t.strong and t.blames_nodes, case_id


def test_fabric_errors_are_the_network():
    r, t = _triage("n-nccl-tests-24-roce-gid-index")
    assert t.kind == "network" and t.fault_class.value == "node_network"


def test_a_watchdog_timeout_names_no_cause():
    r, t = _triage("w-accelerate-314-slow-file-scan")
    assert (t.kind, t.rule, t.fault_class.value) == ("elsewhere", "nccl_watchdog_timeout", "unknown")
    assert r.nccl_watchdog


def test_torchruns_summary_gives_the_root_cause_rank_host_and_exit_code():
    text = (REPO / "tests/fixtures/torchrun/minigpt4-237.txt").read_text()
    r, t = triage(None, None, text, ["n136-117-135.byted.org", "n136-117-136.byted.org"])
    assert r.torchrun == {"host": "n136-117-136.byted.org", "rank": 0, "exitcode": 1}
    assert r.exit_code == 1 and r.exception is None  # ChildFailedError is the launcher's wrapper
    assert t.node == "n136-117-136.byted.org"
    # a host outside the job is not a node of the job
    assert triage(None, None, text, ["gpu-1", "gpu-2"])[1].node is None


def test_scheduler_reasons_and_exit_signals():
    assert triage(137, "OOMKilled", "")[1].rule == "host_out_of_memory"
    assert triage(None, "NODE_FAIL: None", None)[1].kind == "suspect"
    assert triage(None, "TIMEOUT: None", None)[1].rule == "time_limit"
    assert triage(143, "Error", "")[1].rule == "stop_signal"
    assert triage(137, "Error", "")[1].rule == "sigkill"
    assert triage(-11, None, "")[1].rule == "crash_signal"
    assert triage(None, None, None)[1].rule == "no_evidence"


def test_the_signature_ignores_what_changes_between_placements():
    log = excerpt("u-llamafactory-6191-rank-dataset-file-not-found").log
    a = signature_basis(*triage(1, None, log, ["node-a1", "node-a2"]), ["node-a1", "node-a2"])
    moved = log.replace("[rank5]", "[rank2]")
    b = signature_basis(*triage(1, None, moved, ["node-b7", "node-b8"]), ["node-b7", "node-b8"])
    assert a == b
    other = excerpt("u-hymba-6-importerror-transformers-version").log
    assert signature_basis(*triage(1, None, other, []), []) != a


def test_garbled_truncated_non_utf8_and_huge_output_is_read_without_a_crash():
    rng = random.Random(7)
    real = [c.log for c in TUNE]
    lines = tomllib.loads((REPO / "tests/fixtures/kernel-log/lines.toml").read_text())["line"]
    for k in range(300):
        base = rng.choice(real + [ln["text"] for ln in lines])
        cut = base[: rng.randrange(len(base) + 1)]  # truncated mid-line
        noise = bytes(rng.randrange(256) for _ in range(rng.randrange(200))).decode("utf-8", errors="replace")
        text = rng.choice([cut, cut + noise, noise + cut, cut.replace("\n", "\r"), "\x00".join(cut)])
        r, t = triage(rng.choice([None, 0, 1, 137, -6, 255, -255]), rng.choice([None, "", noise, "OOMKilled"]), text)
        assert t.rule and json.dumps(t.evidence())
    huge = (real[0] + "\n") * (1_048_576 // len(real[0]) + 1)
    r, t = triage(1, None, huge)
    assert len(huge) > 1_000_000 and t.rule
    assert read_failure(1, "x" * 2_000_000, None).scheduler_reason is None


def test_launchers_name_the_host_and_the_signal():
    # ArjunaCluster/ArjunaUsers#48: an interactive srun step killed on node c002
    r, t = triage(None, None, "srun: error: c002: task 0: Killed\nsrun: Force Terminated StepId=120.0", ["c001", "c002"])
    assert (r.signal, r.failed_hosts, t.node, t.rule) == ("SIGKILL", ["c002"], "c002", "sigkill")
    # ArjunaCluster/ArjunaUsers#52: the batch script's shell and slurmstepd report the cgroup's OOM killer
    log = ("/var/spool/slurmd/job00191/slurm_script: line 28:  8156 Killed                  python3 main.py --prop "
           "hform --epochs 400 --lr_milestones 50 100 200 --gamma 0.25 --normalizing_const_AO 10000.0 --lr_generator "
           "0.001 --lr_conv 0.001\nslurmstepd: error: Detected 1 oom-kill event(s) in StepId=191.batch cgroup. Some of "
           "your processes may have been killed by the cgroup out-of-memory handler.")
    r, t = triage(None, None, log)
    assert r.signal == "SIGKILL" and t.rule == "host_out_of_memory"
    # nextflow-io/nextflow#5932: srun's own words for the same
    assert triage(None, None, "srun: error: sdumont6156: task 0: Out Of Memory")[1].rule == "host_out_of_memory"
    # a sentence that merely contains the word is no signal
    assert triage(None, None, "Training step 5 terminated early")[0].signal is None
