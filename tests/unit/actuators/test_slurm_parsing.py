"""Parsing Slurm's one-line output and typing its errors (no controller needed)."""

from __future__ import annotations

import pytest

from actuators.base import PermanentError, TemporaryError
from actuators.slurm import CommandResult, SlurmBackend, expand_hostlist, job_id, parse_oneliner

JOB_LINE = (
    "JobId=2 JobName=wrap UserId=root(0) GroupId=root(0) MCS_label=N/A Priority=4294901756 Nice=0 "
    "Account=(null) QOS=(null) JobState=PENDING Reason=BeginTime Dependency=(null) Requeue=1 Restarts=1 "
    "BatchFlag=1 Reboot=0 ExitCode=0:0 RunTime=00:00:00 TimeLimit=UNLIMITED ExcNodeList=n1 NodeList= "
    "NumNodes=2 Comment=diagnostics_for=n3 StdErr=/tmp/x.err Power="
)
NODE_LINE = (
    "NodeName=n2 Arch=x86_64 CoresPerSocket=1 CPUAlloc=0 CPUTot=1 State=IDLE+DRAIN ThreadsPerCore=1 "
    "Partitions=gpu Reason=fleetmedic 5d619ea6: gpu_hardware (node n2, incident c3) [root@2026-12-02T13:47:52]"
)


def test_a_job_line_parses_into_its_fields_including_empty_and_nested_values():
    info = parse_oneliner(JOB_LINE)
    assert info["JobId"] == "2"
    assert info["JobState"] == "PENDING"
    assert info["Restarts"] == "1"
    assert info["ExcNodeList"] == "n1"
    assert info["NodeList"] == ""
    assert info["Comment"] == "diagnostics_for=n3"
    assert info["Power"] == ""
    assert SlurmBackend.attempt_of(info) == 2


def test_a_node_reason_with_spaces_and_brackets_is_kept_whole():
    info = parse_oneliner(NODE_LINE)
    assert info["State"] == "IDLE+DRAIN"
    assert info["Reason"].startswith("fleetmedic 5d619ea6: gpu_hardware (node n2, incident c3)")


@pytest.mark.parametrize("expr,names", [
    ("n[1-3]", ["n1", "n2", "n3"]),
    ("n[1-2,4],gpu7", ["n1", "n2", "n4", "gpu7"]),
    ("node[08-10]", ["node08", "node09", "node10"]),
    ("n1", ["n1"]),
    ("", []),
    ("(null)", []),
])
def test_hostlists_expand(expr, names):
    assert expand_hostlist(expr) == names


def test_job_targets_accept_the_topic_prefix_and_refuse_other_names():
    assert job_id("slurm-42") == "42"
    assert job_id("42") == "42"
    with pytest.raises(PermanentError):
        job_id("train-0001")


@pytest.mark.parametrize("err,kind", [
    ("slurm_load_jobs error: Unable to contact slurm controller (connect failure)", TemporaryError),
    ("Socket timed out on send/recv operation", TemporaryError),
    ("slurm_update error: Invalid node name specified", PermanentError),
    ("slurm_requeue error: Invalid job id specified", PermanentError),
])
def test_command_errors_are_typed(err, kind):
    exc = SlurmBackend._error(["scontrol", "x"], CommandResult(1, "", err))
    assert isinstance(exc, kind)
    assert err[:20] in str(exc)
