"""The node where a Slurm job failed first, from ``sacct``'s step records (no controller).

Unless said otherwise the text is what ``sacct -j <id> --parsable2 --noheader
--format=JobID,State,ExitCode,NodeList,Start,End`` printed on Slurm 22.05.8 (Debian 12
``slurm-wlm`` 22.05.8-4+deb12u3, slurmdbd with MariaDB 10.11), on the cluster of
``deploy/slurm.sh`` with ``FLEETMEDIC_SLURM_ACCOUNTING=1``. ``--parsable2``: "Output will
be '|' delimited without a '|' at the end" (sacct(1) of that release). Rows with the same
``.batch``/``.extern``/``.0`` shapes and "CANCELLED by <uid>" states are in public
reports, e.g. https://github.com/martius-lab/cluster_utils/issues/87 (``--parsable2``,
another field order) and https://github.com/SDU-eScience/UCloud/issues/70 (``sacct -b -P
-n``).
"""

from __future__ import annotations

from datetime import datetime

from actuators.slurm_text import SacctRow, origin_node, parse_sacct

#: sbatch -N2: two one-node sruns in the background, ``wait -n; exit 1``; the srun on n2
#: exits 3 after a second, the one on n1 (sleep 300) is cancelled when the script ends
TWO_ONE_NODE_STEPS = """\
1|FAILED|1:0|n[1-2]|2026-12-06T23:31:38|2026-12-06T23:31:39
1.batch|FAILED|1:0|n1|2026-12-06T23:31:38|2026-12-06T23:31:39
1.0|CANCELLED|0:15|n1|2026-12-06T23:31:38|2026-12-06T23:31:39
1.1|FAILED|3:0|n2|2026-12-06T23:31:38|2026-12-06T23:31:39
"""
#: sbatch -N2: ``srun -K -N2 -n2`` whose task 1 (on n2) exits 4; srun's own log says
#: "srun: error: n2: task 1: Exited with exit code 4", sacct has the step on n[1-2]
ONE_TWO_NODE_STEP = """\
4|FAILED|15:0|n1|2026-12-06T23:31:56|2026-12-06T23:31:57
4.batch|FAILED|15:0|n1|2026-12-06T23:31:56|2026-12-06T23:31:57
4.0|FAILED|4:0|n[1-2]|2026-12-06T23:31:56|2026-12-06T23:31:57
"""
#: sbatch -N1 --wrap 'exit 5': no srun, the batch script fails on its node
BATCH_ONLY = """\
3|FAILED|5:0|n1|2026-12-06T23:31:38|2026-12-06T23:31:38
3.batch|FAILED|5:0|n1|2026-12-06T23:31:38|2026-12-06T23:31:38
"""
#: the same kind of job as ONE_TWO_NODE_STEP without -K (the other task sleeps on), scancelled
CANCELLED_BY_ROOT = """\
2|CANCELLED by 0|0:0|n[1-2]|2026-12-06T23:31:38|2026-12-06T23:31:56
2.batch|CANCELLED|0:15|n1|2026-12-06T23:31:38|2026-12-06T23:31:56
2.0|FAILED|4:0|n[1-2]|2026-12-06T23:31:38|2026-12-06T23:31:56
"""
#: that job while it ran
RUNNING = """\
2|RUNNING|0:0|n[1-2]|2026-12-06T23:31:38|Unknown
2.batch|RUNNING|0:0|n1|2026-12-06T23:31:38|Unknown
2.0|RUNNING|0:0|n[1-2]|2026-12-06T23:31:38|Unknown
"""


def test_rows_parse_into_job_and_steps_with_nodes_and_times():
    rows = parse_sacct(TWO_ONE_NODE_STEPS)
    assert [(r.job, r.step, r.state, r.exit_code, r.nodes) for r in rows] == [
        ("1", None, "FAILED", "1:0", ("n1", "n2")),
        ("1", "batch", "FAILED", "1:0", ("n1",)),
        ("1", "0", "CANCELLED", "0:15", ("n1",)),
        ("1", "1", "FAILED", "3:0", ("n2",)),
    ]
    assert rows[3].end == datetime(2026, 12, 6, 23, 31, 39) and rows[3].ended


def test_a_running_job_has_no_end_and_cancelled_by_keeps_its_state_word():
    assert [r.ended for r in parse_sacct(RUNNING)] == [False, False, False]
    assert parse_sacct(CANCELLED_BY_ROOT)[0].state == "CANCELLED"


def test_lines_of_another_format_are_skipped_not_misread():
    # sacct -b -P -n (JobID|State|ExitCode), from https://github.com/SDU-eScience/UCloud/issues/70
    brief = "1655360|FAILED|127:0\n1655360.batch|FAILED|127:0\n1655360.0|FAILED|127:0\n"
    # --parsable2 --format=JobID,NodeList,State,ExitCode, from
    # https://github.com/martius-lab/cluster_utils/issues/87
    other_order = "239023|galvani-cn001|COMPLETED|0:0\n239023.0|galvani-cn001|CANCELLED|0:10\n"
    assert parse_sacct(brief) == [] and parse_sacct(other_order) == []
    assert parse_sacct("Slurm accounting storage is disabled\n") == []


def test_the_one_node_step_that_failed_names_its_node_before_the_batch_step_of_the_same_second():
    node, why = origin_node(parse_sacct(TWO_ONE_NODE_STEPS))
    assert node == "n2", why
    assert "1.1" in why


def test_a_step_on_several_nodes_names_none_even_when_the_batch_step_names_one():
    # the batch step (on n1) failed because the srun failed: it is not the origin
    node, why = origin_node(parse_sacct(ONE_TWO_NODE_STEP))
    assert node is None
    assert "several nodes" in why and "4.0" in why
    assert origin_node(parse_sacct(CANCELLED_BY_ROOT))[0] is None


def test_a_batch_script_that_fails_by_itself_names_its_node():
    assert origin_node(parse_sacct(BATCH_ONLY))[0] == "n1"


def test_nothing_is_named_while_no_step_has_failed():
    assert origin_node(parse_sacct(RUNNING)) == (None, "no step failed")
    assert origin_node([]) == (None, "no step failed")


def _step(step: str, state: str, nodes: tuple[str, ...], end: str | None) -> SacctRow:
    return SacctRow(job="7", step=step, state=state, exit_code="1:0", nodes=nodes,
                    start=datetime(2026, 12, 6, 10, 0, 0), end=datetime.fromisoformat(end) if end else None)


def test_the_earliest_end_wins_and_cancelled_or_timed_out_steps_are_not_failures():
    rows = [
        _step("0", "CANCELLED", ("n1",), "2026-12-06T10:00:05"),   # cancelled: not where it failed
        _step("1", "TIMEOUT", ("n2",), "2026-12-06T10:00:06"),     # a time limit hits every node
        _step("2", "NODE_FAIL", ("n3",), "2026-12-06T10:00:10"),
        _step("3", "FAILED", ("n4",), "2026-12-06T10:00:12"),
    ]
    assert origin_node(rows)[0] == "n3"


def test_failures_in_the_same_second_on_different_nodes_name_none():
    rows = [_step("0", "FAILED", ("n1",), "2026-12-06T10:00:10"), _step("1", "FAILED", ("n2",), "2026-12-06T10:00:10")]
    node, why = origin_node(rows)
    assert node is None and "same second" in why
    same_node = [_step("0", "FAILED", ("n1",), "2026-12-06T10:00:10"),
                 _step("1", "OUT_OF_MEMORY", ("n1",), "2026-12-06T10:00:10")]
    assert origin_node(same_node)[0] == "n1"


def test_a_failed_step_without_nodes_or_end_names_none():
    assert origin_node([_step("0", "FAILED", (), "2026-12-06T10:00:10")])[0] is None
    assert origin_node([_step("0", "FAILED", ("n1",), None)]) == (None, "no failed step has an end time")


def test_none_assigned_is_no_node():
    # sbatch --begin=now+3600, scancelled while pending: sacct's NodeList says "None assigned"
    rows = parse_sacct("1|CANCELLED by 0|0:0|None assigned|2026-12-06T23:39:32|2026-12-06T23:39:32\n")
    assert rows[0].nodes == () and rows[0].state == "CANCELLED" and rows[0].ended
