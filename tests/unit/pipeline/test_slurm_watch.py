"""The Slurm watcher turns state changes into job events (pure diffing, no controller)."""

from __future__ import annotations

from pipeline.watch.slurm import SlurmJobWatcher


def line(jid, state, nodes="n[1-2]", restarts=0, exit_code="0:0", reason="None", comment="(null)", stderr="/dev/null"):
    return {"JobId": str(jid), "JobState": state, "NodeList": nodes, "Restarts": str(restarts),
            "ExitCode": exit_code, "Reason": reason, "Comment": comment, "StdErr": stderr, "ExcNodeList": "(null)"}


def watcher():
    return SlurmJobWatcher(clock=lambda: 1000.0)


def test_a_running_job_is_started_once_and_a_failure_carries_exit_code_reason_and_log_tail(tmp_path):
    err = tmp_path / "j.err"
    err.write_text("step 1\nRuntimeError: CUDA error: unspecified launch failure\n")
    w = watcher()
    ev = w.diff([line(7, "PENDING", nodes="")])
    assert ev == []
    ev = w.diff([line(7, "RUNNING")])
    assert [(e.job, e.event.value, e.nodes, e.attempt) for e in ev] == [("slurm-7", "started", ["n1", "n2"], 1)]
    assert w.diff([line(7, "RUNNING")]) == []
    ev = w.diff([line(7, "FAILED", exit_code="1:0", reason="NonZeroExitCode", stderr=str(err))])
    assert [e.event.value for e in ev] == ["failed"]
    assert ev[0].exit_code == 1 and ev[0].reason == "FAILED: NonZeroExitCode"
    assert "unspecified launch failure" in ev[0].log_tail
    assert ev[0].scheduler == "slurm"


def test_a_requeued_job_running_again_is_a_new_attempt():
    w = watcher()
    w.diff([line(3, "RUNNING")])
    w.diff([line(3, "FAILED", exit_code="0:9")])
    assert w.diff([line(3, "PENDING", nodes="", restarts=1)]) == []
    ev = w.diff([line(3, "RUNNING", nodes="n[3-4]", restarts=1)])
    assert [(e.event.value, e.attempt, e.nodes) for e in ev] == [("started", 2, ["n3", "n4"])]


def test_a_signal_is_reported_as_a_negative_exit_code():
    w = watcher()
    w.diff([line(4, "RUNNING")])
    ev = w.diff([line(4, "FAILED", exit_code="0:9")])
    assert ev[0].exit_code == -9


def test_diagnostics_jobs_say_which_node_they_test():
    w = watcher()
    w.diff([line(9, "RUNNING", nodes="n2", comment="diagnostics_for=n2")])
    ev = w.diff([line(9, "COMPLETED", nodes="n2", comment="diagnostics_for=n2")])
    assert [(e.event.value, e.diagnostics_for) for e in ev] == [("completed", "n2")]


def test_a_job_that_finished_between_polls_still_gets_a_start_then_its_end():
    w = watcher()
    ev = w.diff([line(5, "COMPLETED")])
    assert [e.event.value for e in ev] == ["started", "completed"]


def test_cancelled_jobs_produce_no_failure():
    w = watcher()
    w.diff([line(6, "RUNNING")])
    assert w.diff([line(6, "CANCELLED", exit_code="0:15")]) == []
