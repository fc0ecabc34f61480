"""The Slurm watcher turns state changes into job events (pure diffing, no controller),
and a failure into the node where it began (``sacct``'s answers from a fake client)."""

from __future__ import annotations

import asyncio
import re

import pytest

from pipeline.watch.slurm import AccountingDisabled, Scontrol, SlurmJobWatcher
from tests.unit.actuators.test_slurm_sacct import ONE_TWO_NODE_STEP, TWO_ONE_NODE_STEPS


def renumbered(sacct: str, jid: int) -> str:
    """``sacct`` rows of the local cluster's job, as rows of job ``jid``."""
    return re.sub(r"^\d+(?=[|.])", str(jid), sacct, flags=re.M)


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


# --------------------------------------------------------------------- origin_node
#: sacct of a 2-node job whose one-node srun on n2 failed first (Slurm 22.05.8, slurmdbd:
#: the rows of tests/unit/actuators/test_slurm_sacct.py, where they come from)
SACCT_N2_FIRST = renumbered(TWO_ONE_NODE_STEPS, 7)
SACCT_NOT_YET = """\
7|RUNNING|0:0|n[1-2]|2026-12-06T23:31:38|Unknown
7.batch|RUNNING|0:0|n1|2026-12-06T23:31:38|Unknown
7.1|FAILED|3:0|n2|2026-12-06T23:31:38|2026-12-06T23:31:39
"""
SACCT_TWO_NODE_STEP = renumbered(ONE_TWO_NODE_STEP, 7)


def oneliner(info):
    return " ".join(f"{k}={v}" for k, v in info.items())


class FakeSlurm:
    """``scontrol show job -o`` and ``sacct`` answers, one per poll; every sacct call kept."""

    def __init__(self, sacct):
        self.jobs: list[dict] = []
        self.sacct_answers = list(sacct)
        self.sacct_calls: list[str] = []

    async def show_jobs(self):
        return "\n".join(oneliner(j) for j in self.jobs) + "\n"

    async def sacct(self, jid):
        self.sacct_calls.append(jid)
        answer = self.sacct_answers.pop(0) if len(self.sacct_answers) > 1 else self.sacct_answers[0]
        if isinstance(answer, Exception):
            raise answer
        return answer


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def polls(w, slurm, clock, *states, every=2.0, jid=7):
    """Each state of job ``jid`` in turn, a poll each, ``every`` seconds apart; the events of each poll."""
    out = []
    for st in states:
        slurm.jobs = [line(jid, st, exit_code="1:0" if st == "FAILED" else "0:0",
                           reason="NonZeroExitCode" if st == "FAILED" else "None")]
        out.append(asyncio.run(w.poll()))
        clock.t += every
    return out


def test_a_failed_job_carries_the_node_whose_step_failed_first():
    slurm, clock = FakeSlurm([SACCT_N2_FIRST]), Clock()
    w = SlurmJobWatcher(slurm, clock=clock)
    _, failed = polls(w, slurm, clock, "RUNNING", "FAILED")
    assert [(e.event.value, e.origin_node) for e in failed] == [("failed", "n2")]
    assert slurm.sacct_calls == ["7"]  # sacct only for the failure


def test_a_step_on_two_nodes_leaves_origin_node_empty():
    slurm, clock = FakeSlurm([SACCT_TWO_NODE_STEP]), Clock()
    w = SlurmJobWatcher(slurm, clock=clock)
    _, failed = polls(w, slurm, clock, "RUNNING", "FAILED")
    assert [(e.event.value, e.origin_node) for e in failed] == [("failed", None)]


def test_a_failure_waits_for_the_database_to_record_the_end_then_goes_out_with_its_first_time():
    slurm, clock = FakeSlurm([SACCT_NOT_YET, SACCT_N2_FIRST]), Clock()
    w = SlurmJobWatcher(slurm, clock=clock, origin_wait_s=10.0)
    _, held, sent, after = polls(w, slurm, clock, "RUNNING", "FAILED", "FAILED", "FAILED")
    assert held == []  # no sleep: the next poll asks again
    assert [(e.event.value, e.origin_node, e.ts) for e in sent] == [("failed", "n2", 1002.0)]
    assert after == []


def test_a_failure_goes_out_without_origin_once_the_wait_is_over():
    slurm, clock = FakeSlurm([SACCT_NOT_YET]), Clock()
    w = SlurmJobWatcher(slurm, clock=clock, origin_wait_s=5.0)
    got = polls(w, slurm, clock, "RUNNING", "FAILED", "FAILED", "FAILED", "FAILED", "FAILED")
    # seen failed at 1002; held at 1004 and 1006; 6 s > 5 s at 1008
    assert [[e.event.value for e in p] for p in got] == [["started"], [], [], [], ["failed"], []]
    assert got[4][0].origin_node is None and got[4][0].ts == 1002.0


def test_a_sacct_error_is_asked_again_like_a_late_record():
    slurm, clock = FakeSlurm([RuntimeError("sacct timed out after 20s"), SACCT_N2_FIRST]), Clock()
    w = SlurmJobWatcher(slurm, clock=clock)
    got = polls(w, slurm, clock, "RUNNING", "FAILED", "FAILED")
    assert [[(e.event.value, e.origin_node) for e in p] for p in got] == [[("started", None)], [], [("failed", "n2")]]


def test_without_accounting_failures_go_out_at_once_and_sacct_is_not_asked_again(caplog):
    slurm, clock = FakeSlurm([AccountingDisabled("Slurm accounting storage is disabled")]), Clock()
    w = SlurmJobWatcher(slurm, clock=clock)
    with caplog.at_level("WARNING"):
        _, failed = polls(w, slurm, clock, "RUNNING", "FAILED")
        _, again = polls(w, slurm, clock, "RUNNING", "FAILED", jid=8)
    assert [e.origin_node for e in failed + again] == [None, None]
    assert slurm.sacct_calls == ["7"]
    assert w.accounting is False
    assert "accounting storage is disabled" in caplog.text and "slurmdbd" in caplog.text


def test_a_node_that_is_not_the_jobs_is_not_taken():
    other = SACCT_N2_FIRST.replace("n2", "n9").replace("n[1-2]", "n[1,9]")
    slurm, clock = FakeSlurm([other]), Clock()
    w = SlurmJobWatcher(slurm, clock=clock)
    _, failed = polls(w, slurm, clock, "RUNNING", "FAILED")
    assert [e.origin_node for e in failed] == [None]


@pytest.mark.parametrize("answer", [SACCT_NOT_YET, RuntimeError("slurmdbd down")])
def test_a_held_failure_goes_out_before_a_newer_event_of_the_same_job(answer):
    slurm, clock = FakeSlurm([answer]), Clock()
    w = SlurmJobWatcher(slurm, clock=clock, origin_wait_s=60.0)
    polls(w, slurm, clock, "RUNNING", "FAILED")
    slurm.jobs = [line(7, "RUNNING", nodes="n[3-4]", restarts=1)]
    ev = asyncio.run(w.poll())
    assert [(e.event.value, e.attempt) for e in ev] == [("failed", 1), ("started", 2)]


def _fake_sacct(tmp_path, body):
    sacct = tmp_path / "sacct"
    sacct.write_text("#!/bin/sh\n" + body)
    sacct.chmod(0o755)
    return Scontrol(bin_dir=str(tmp_path))


def test_the_client_asks_sacct_for_the_steps_in_the_parsed_format(tmp_path):
    client = _fake_sacct(tmp_path, 'echo "$@"\n')
    assert asyncio.run(client.sacct("42")).split() == [
        "-j", "42", "--parsable2", "--noheader", "--format=JobID,State,ExitCode,NodeList,Start,End"]


def test_the_client_tells_no_accounting_from_other_sacct_errors(tmp_path):
    # sacct's words on a cluster with AccountingStorageType=accounting_storage/none (22.05.8)
    off = _fake_sacct(tmp_path, 'echo "Slurm accounting storage is disabled" >&2; exit 1\n')
    with pytest.raises(AccountingDisabled):
        asyncio.run(off.sacct("42"))
    with pytest.raises(AccountingDisabled, match="not found"):
        asyncio.run(Scontrol(bin_dir=str(tmp_path / "nowhere")).sacct("42"))
    # and its words (22.05.8) while slurmdbd is down
    down = _fake_sacct(tmp_path, "cat >&2 <<'EOF'\n"
                                 "sacct: error: slurm_persist_conn_open_without_init: failed to open persistent "
                                 "connection to host:127.0.0.1:48813: Connection refused\n"
                                 "sacct: error: Sending PersistInit msg: Connection refused\n"
                                 "sacct: error: Problem talking to the database: Connection refused\n"
                                 "EOF\nexit 1\n")
    with pytest.raises(RuntimeError, match="Connection refused") as err:
        asyncio.run(down.sacct("42"))
    assert not isinstance(err.value, AccountingDisabled)
