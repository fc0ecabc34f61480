"""Checkpoint-now on Slurm: observe the job, compare, signal its batch shell, report
(the Slurm commands answered by a script; the real controller is in
tests/integration/test_slurm_cluster.py).

The job lines are ``scontrol show job -o`` of Slurm 22.05.8, shortened; the error texts
are what its ``scontrol`` and ``scancel`` print.
"""

from __future__ import annotations

import asyncio

import pytest

from actuators.base import ActionRequest, PermanentError, TemporaryError
from actuators.slurm import CHECKPOINT_MARKS_KEPT, CommandResult, SlurmBackend
from schemas import ActionName, Outcome

DEADLINE = 1765000000.0


def job_line(state="RUNNING", nodes="n[1-2]", admin_comment=None):
    line = (f"JobId=42 JobName=train UserId=root(0) GroupId=root(0) JobState={state} Reason=None Requeue=1 "
            f"Restarts=0 BatchFlag=1 ExitCode=0:0 NodeList={nodes} BatchHost=n1 NumNodes=2 "
            f"Comment=(null) ")
    if admin_comment is not None:
        line += f"AdminComment={admin_comment}  "
    return line + "StdErr=/tmp/train.err StdIn=/dev/null StdOut=/tmp/train.out Power="


class ScriptedSlurm(SlurmBackend):
    """A backend whose commands get scripted answers: ``answers[(argv[0], argv[1])]`` is
    a list of ``CommandResult``, the last one repeated; every call is kept."""

    def __init__(self, answers):
        super().__init__()
        self.answers = {k: list(v) for k, v in answers.items()}
        self.calls = []

    async def run(self, *argv, check=True, stdin=None):
        self.calls.append(argv)
        queue = self.answers[(argv[0], argv[1])]
        res = queue.pop(0) if len(queue) > 1 else queue[0]
        if check and res.rc != 0:
            raise self._error(argv, res)
        return res


def ok(out=""):
    return CommandResult(0, out, "")


def checkpoint(backend, verdict="v-7f3a", deadline=DEADLINE, node="n2"):
    params = {"deadline": deadline, "node": node} if deadline is not None else {"node": node}
    return asyncio.run(backend.apply(ActionRequest(verdict_id=verdict, action=ActionName.checkpoint,
                                                   target="slurm-42", params=params, reason="node_degrading")))


def signals(backend):
    return [c for c in backend.calls if c[0] == "scancel"]


def comment_updates(backend):
    return [c[3] for c in backend.calls if c[:2] == ("scontrol", "update")]


def test_a_running_job_gets_usr1_on_its_batch_shell_and_the_request_is_recorded():
    b = ScriptedSlurm({("scontrol", "show"): [ok(job_line())], ("scancel", "--signal=USR1"): [ok()],
                       ("scontrol", "update"): [ok()]})
    got = checkpoint(b)
    assert got.outcome is Outcome.applied
    assert signals(b) == [("scancel", "--signal=USR1", "--batch", "42")]
    assert comment_updates(b) == [f"AdminComment=fleetmedic-checkpoint:v-7f3a@{DEADLINE:.0f}"]
    assert "2025-12-06T05:46:40Z" in got.detail and str(int(DEADLINE)) in got.detail and "n1" in got.detail


def test_the_same_verdict_again_signals_nothing():
    b = ScriptedSlurm({("scontrol", "show"): [ok(job_line(admin_comment=f"fleetmedic-checkpoint:v-7f3a@{DEADLINE:.0f}"))],
                       ("scancel", "--signal=USR1"): [ok()], ("scontrol", "update"): [ok()]})
    got = checkpoint(b)
    assert got.outcome is Outcome.already_so and "already asked" in got.detail
    assert signals(b) == [] and comment_updates(b) == []


def test_another_verdict_signals_again_and_what_others_wrote_stays():
    mine = [f"fleetmedic-checkpoint:v-{i}@{DEADLINE:.0f}" for i in range(CHECKPOINT_MARKS_KEPT)]
    b = ScriptedSlurm({("scontrol", "show"): [ok(job_line(admin_comment="; ".join(["rma 4711;urgent", *mine])))],
                       ("scancel", "--signal=USR1"): [ok()], ("scontrol", "update"): [ok()]})
    assert checkpoint(b, verdict="v-new").outcome is Outcome.applied
    assert len(signals(b)) == 1
    # the site's note as it was; the oldest of our marks makes room for the new one
    assert comment_updates(b) == ["AdminComment=" + "; ".join(
        ["rma 4711;urgent", *mine[1:], f"fleetmedic-checkpoint:v-new@{DEADLINE:.0f}"])]


@pytest.mark.parametrize("state,why", [("PENDING", "not running"), ("COMPLETED", "ended"), ("FAILED", "ended"),
                                       ("SUSPENDED", "not running")])
def test_a_job_that_is_not_running_has_nothing_to_save(state, why):
    b = ScriptedSlurm({("scontrol", "show"): [ok(job_line(state=state))]})
    got = checkpoint(b)
    assert got.outcome is Outcome.already_so and why in got.detail and state in got.detail
    assert signals(b) == []


def test_a_job_no_longer_on_the_degrading_node_is_left_alone():
    b = ScriptedSlurm({("scontrol", "show"): [ok(job_line(nodes="n[3-4]"))]})
    got = checkpoint(b, node="n2")
    assert got.outcome is Outcome.already_so and "no longer runs on n2" in got.detail
    assert signals(b) == []


def test_an_unknown_job_is_a_permanent_error():
    b = ScriptedSlurm({("scontrol", "show"): [CommandResult(1, "", "slurm_load_jobs error: Invalid job id specified\n")]})
    with pytest.raises(PermanentError, match="Invalid job id"):
        checkpoint(b)


def test_a_request_without_a_deadline_is_a_permanent_error():
    b = ScriptedSlurm({("scontrol", "show"): [ok(job_line())]})
    with pytest.raises(PermanentError, match="deadline"):
        checkpoint(b, deadline=None)
    assert b.calls == []


def test_a_job_that_ends_before_the_signal_has_nothing_to_save():
    b = ScriptedSlurm({
        ("scontrol", "show"): [ok(job_line()), ok(job_line(state="COMPLETED"))],
        # what scancel --signal=USR1 --batch says of a job that has completed
        ("scancel", "--signal=USR1"): [CommandResult(
            1, "", "scancel: error: Kill job error on job id 42: Invalid job id specified\n")],
    })
    got = checkpoint(b)
    assert got.outcome is Outcome.already_so and "COMPLETED" in got.detail


def test_a_controller_that_does_not_answer_is_retried():
    b = ScriptedSlurm({
        ("scontrol", "show"): [ok(job_line())],
        ("scancel", "--signal=USR1"): [CommandResult(1, "", "scancel: error: Kill job error on job id 42: "
                                                            "Unable to contact slurm controller (connect failure)\n")],
    })
    with pytest.raises(TemporaryError):
        checkpoint(b)


def test_a_signal_sent_but_not_recorded_is_still_applied_and_says_so():
    b = ScriptedSlurm({("scontrol", "show"): [ok(job_line())], ("scancel", "--signal=USR1"): [ok()],
                       ("scontrol", "update"): [CommandResult(1, "", "slurm_update error: Access/permission denied\n")]})
    got = checkpoint(b)
    assert got.outcome is Outcome.applied and "not recorded" in got.detail and "permission" in got.detail


def test_a_verdict_id_cannot_break_the_one_line_record():
    mark = SlurmBackend.checkpoint_mark("v 1=2;3", DEADLINE)
    assert mark == f"fleetmedic-checkpoint:v_1_2_3@{DEADLINE:.0f}"
