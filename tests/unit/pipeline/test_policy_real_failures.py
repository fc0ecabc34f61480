"""The job and node tracks on real output: what a failure's text, its history and the
driver's Xids decide together.

Texts are the failure corpus's tune split and the driver's lines of
``tests/fixtures/kernel-log/lines.toml``; the decisions run through
:class:`pipeline.eval.replay.LocalPipeline`, which calls the worker's own policy functions.
"""

from __future__ import annotations

import tomllib
from pathlib import Path

from pipeline.config import Settings
from pipeline.eval.failures import excerpt
from detectors.nvrm import parse_xid
from pipeline.eval.replay import LocalPipeline
from schemas import JobEvent, JobEventKind

from .builders import T0, gpu_sample

REPO = Path(__file__).resolve().parents[3]
LINES = tomllib.loads((REPO / "tests/fixtures/kernel-log/lines.toml").read_text())["line"]
NODES = ["n0", "n1", "n2", "n3"]


def _xid(code: int, contains: str = "") -> dict:
    text = next(ln["text"] for ln in LINES if ln.get("xid") == code and contains in ln["text"])
    x = parse_xid(text)
    return {"code": x.code, "detail": x.detail, "pci_bus_id": x.pci_bus_id, "source": "kernel"}


def _started(lp: LocalPipeline, job: str, nodes: list[str], ts: float, attempt: int = 1) -> None:
    lp.feed([JobEvent(ts=ts, job=job, event=JobEventKind.started, nodes=nodes, attempt=attempt)])


def _fail(lp: LocalPipeline, job: str, nodes: list[str], ts: float, case_id: str, attempt: int = 1,
          origin: str | None = None):
    f = excerpt(case_id).failed_fields()
    lp.feed([JobEvent(ts=ts, job=job, event=JobEventKind.failed, nodes=nodes, attempt=attempt, origin_node=origin,
                      **f)])
    return lp.finish(ts + 10)


def _job(vs, job):
    return [v for v in vs if v.scope == "job" and v.subject == job]


def _isolated(lp: LocalPipeline) -> list[str]:
    return sorted({v.subject for v in lp.verdicts if v.scope == "node" and any(a.action.value == "isolate"
                                                                             for a in v.actions)})


def test_hardware_output_with_its_origin_requeues_without_the_node_and_isolates_it():
    lp = LocalPipeline(Settings())
    _started(lp, "j", NODES, T0)
    vs = _fail(lp, "j", NODES, T0 + 60, "g-darknet-3496-k80-ecc-uncorrectable", origin="n2")
    [jv] = _job(vs, "j")
    assert (jv.actions[0].action.value, jv.actions[0].params["exclude"], jv.fault_class.value) == \
        ("requeue", ["n2"], "gpu_memory")
    [nv] = [v for v in vs if v.scope == "node"]
    assert nv.subject == "n2" and nv.incident == jv.incident and nv.fault_class.value == "gpu_memory"
    assert nv.evidence["job_output"]["triage"]["rule"] == "cuda_hardware_error"
    assert _isolated(lp) == ["n2"]


def test_hardware_output_that_names_no_node_moves_the_job_and_isolates_nothing():
    lp = LocalPipeline(Settings())
    _started(lp, "j", NODES, T0)
    vs = _fail(lp, "j", NODES, T0 + 60, "g-darknet-3496-k80-ecc-uncorrectable")
    [jv] = _job(vs, "j")
    assert jv.actions[0].action.value == "requeue" and jv.actions[0].params["exclude"] == []
    assert _isolated(lp) == []


def test_a_users_bug_is_retried_once_then_stopped_and_no_node_hears_of_it():
    lp = LocalPipeline(Settings())
    for attempt in (1, 2):
        _started(lp, "j", NODES, T0 + 1000 * attempt, attempt)
        vs = _fail(lp, "j", NODES, T0 + 1000 * attempt + 60, "u-hymba-6-importerror-transformers-version",
                   attempt, origin="n0")
        [jv] = _job(vs, "j")
        assert jv.actions[0].action.value == ("retry" if attempt == 1 else "stop")
        assert jv.fault_class.value == "user_error"
    assert lp.node_to_health["n0"]["failed_jobs"] == []


def test_weak_evidence_runs_again_elsewhere_and_the_same_failure_there_stops_the_job():
    lp = LocalPipeline(Settings())
    _started(lp, "j", NODES, T0)
    [first] = _job(_fail(lp, "j", NODES, T0 + 60, "w-accelerate-314-slow-file-scan", origin="n0"), "j")
    assert (first.actions[0].action.value, first.fault_class.value) == ("requeue", "unknown")
    assert first.evidence["decided_by"] == "nccl_watchdog_timeout"
    other = ["m0", "m1", "m2", "m3"]
    _started(lp, "j", other, T0 + 1000, 2)
    [second] = _job(_fail(lp, "j", other, T0 + 1060, "w-accelerate-314-slow-file-scan", 2, origin="m0"), "j")
    assert (second.actions[0].action.value, second.fault_class.value) == ("stop", "user_error")
    assert second.evidence["decided_by"] == "same_failure_on_other_nodes"
    assert _isolated(lp) == []


def test_the_same_weak_failure_on_the_same_nodes_is_moved_then_stopped_for_a_person():
    s = Settings()
    lp = LocalPipeline(s)
    actions = []
    for attempt in range(1, s.policy.unknown_repeats + 1):
        _started(lp, "j", NODES, T0 + 1000 * attempt, attempt)
        [jv] = _job(_fail(lp, "j", NODES, T0 + 1000 * attempt + 60, "w-accelerate-314-slow-file-scan", attempt), "j")
        actions.append(jv.actions[0].action.value)
    assert actions[:-1] == ["requeue"] * (s.policy.unknown_repeats - 1) and actions[-1] == "stop"
    assert jv.fault_class.value == "unknown" and jv.actions[0].params["escalate"] is True


def test_a_contained_xid_on_the_jobs_gpu_restarts_the_job_even_when_its_output_says_uncorrectable_ecc():
    lp = LocalPipeline(Settings())
    _started(lp, "j", NODES, T0)
    lp.feed([gpu_sample("n1", T0 + 50, xids=[{"gpu": 3, **_xid(94, "PCI:0000:00:08")}])])
    vs = _fail(lp, "j", NODES, T0 + 60, "g-darknet-3496-k80-ecc-uncorrectable", origin="n1")
    [jv] = _job(vs, "j")
    assert (jv.actions[0].action.value, jv.fault_class.value) == ("restart", "gpu_memory")
    assert jv.evidence["decided_by"] == "driver_contained_xid" and jv.evidence["driver"][0]["xid"] == 94
    assert _isolated(lp) == []


def test_an_application_xid_with_an_ambiguous_error_is_the_applications():
    lp = LocalPipeline(Settings())
    _started(lp, "j", NODES, T0)
    lp.feed([gpu_sample("n2", T0 + 55, xids=[{"gpu": 1, **_xid(31, "MMU Fault")}])])
    [jv] = _job(_fail(lp, "j", NODES, T0 + 60, "g-mineru-426-unspecified-launch-failure-bad-card"), "j")
    assert (jv.actions[0].action.value, jv.fault_class.value) == ("retry", "user_error")
    assert jv.evidence["decided_by"] == "driver_application_xid"


def test_xid_13_repeating_on_one_gpu_in_two_jobs_isolates_the_node_but_one_jobs_burst_does_not():
    lp = LocalPipeline(Settings())
    lines = [_xid(13, "GPC 7, TPC 7"), _xid(13, "Multiple Warp"), _xid(13, "ESR 0x57c730")]
    _started(lp, "job-a", ["n0"], T0)
    for k, x in enumerate(lines):  # one crash prints several lines, and it repeats within the job
        lp.feed([gpu_sample("n0", T0 + 20 + 30 * k, xids=[{"gpu": 5, **x}])])
    assert _isolated(lp) == []
    lp.feed([JobEvent(ts=T0 + 500, job="job-a", event=JobEventKind.completed, nodes=["n0"])])
    _started(lp, "job-b", ["n0"], T0 + 600)
    lp.feed([gpu_sample("n0", T0 + 700, xids=[{"gpu": 2, **lines[0]}])])  # another GPU: still the app's
    assert _isolated(lp) == []
    lp.feed([gpu_sample("n0", T0 + 760, xids=[{"gpu": 5, **lines[0]}])])
    assert _isolated(lp) == ["n0"]
    [nv] = [v for v in lp.verdicts if v.scope == "node" and v.subject == "n0"]
    assert nv.fault_class.value == "gpu_hardware" and nv.evidence["jobs"] == ["job-a", "job-b"]
    diagnose = next(a for a in nv.actions if a.action.value == "diagnose")
    assert diagnose.params["remedy"] == "field_diagnostics"


def test_any_code_five_times_on_one_gpu_in_a_day_is_escalated_once_and_the_node_stays():
    lp = LocalPipeline(Settings())
    x = _xid(43, "pt_main_thread")
    for k in range(7):
        lp.feed([gpu_sample("n3", T0 + 600 * k, xids=[{"gpu": 4, **x}])])
    esc = [v for v in lp.verdicts if any(a.action.value == "escalate" for a in v.actions)]
    assert len(esc) == 1 and esc[0].evidence["times"] == 5
    assert _isolated(lp) == []


def test_a_code_the_catalog_does_not_list_is_escalated_never_silenced():
    lp = LocalPipeline(Settings())
    lp.feed([gpu_sample("n1", T0, xids=[{"gpu": 0, "code": 4242}])])
    [v] = lp.verdicts
    assert v.actions[0].action.value == "escalate" and "catalog does not list" in v.evidence["rule"]
    assert _isolated(lp) == []


def test_the_xid_154_recovery_action_and_nvlink5_subcodes_decide_isolation():
    lp = LocalPipeline(Settings())
    lp.feed([gpu_sample("n0", T0, xids=[{"gpu": 0, **_xid(154, "to 0x1 (GPU Reset Required)")}]),
             gpu_sample("n1", T0, xids=[{"gpu": 0, **_xid(154, "to 0x0 (None)")}]),
             gpu_sample("n2", T0, xids=[{"gpu": 0, **_xid(149, "0x021425c6")}]),
             gpu_sample("n3", T0, xids=[{"gpu": 0, **_xid(149, "NETIR_BER_EVENT")}])])
    assert _isolated(lp) == ["n0", "n2"]


def test_three_contained_errors_in_the_degrade_window_isolate_the_node_as_degrading_memory():
    lp = LocalPipeline(Settings())
    x = _xid(94, "PCI:0000:00:08")
    for k in range(3):
        lp.feed([gpu_sample("n2", T0 + 100 * k, xids=[{"gpu": k, **x}])])
    [nv] = [v for v in lp.verdicts if v.scope == "node"]
    assert nv.fault_class.value == "gpu_memory" and nv.actions[0].action.value == "isolate"
