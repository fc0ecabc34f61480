"""The closed-loop evaluation: its scenario file, a quick run of every policy, and the
reactive oracle and checkpoint-now on small hand-made fault sequences."""

from __future__ import annotations

import copy
import dataclasses
import tomllib

import pytest

from pipeline.eval import closedloop, field


@pytest.fixture(scope="module")
def raw() -> dict:
    with open(field.PATH, "rb") as fh:
        return tomllib.load(fh)


def test_field_loads_with_published_numbers():
    f = field.load()
    assert f.nodes * f.gpus_per_node == f.interruption_gpus == 16384
    assert f.interruptions == 419 and f.days == 54.0
    assert abs(sum(f.shares().values()) - 1.0) < 1e-9
    assert abs(sum(c.count for c in f.causes) / f.interruptions - 1.0) < 1e-9
    # the printed percentages sum to ~100% (Table 5's faulty-GPU row prints 30.1% for 148 of 419)
    assert 94.0 <= sum(c.percent for c in f.causes) <= 101.0
    assert 3.7 < f.per_node_day * 1000 < 3.9  # between RSC-2 (2.34) and RSC-1 (6.50)
    assert f.rsc2_per_1000_node_days < f.per_node_day * 1000 < f.rsc1_per_1000_node_days
    kinds = {k for c in f.causes for k in c.kinds}
    assert {"xid79", "ecc_dbe", "sbe_rise", "xid_gsp", "xid_sram", "leaf", "nic", "hidden"} <= kinds


@pytest.mark.parametrize("path,value,needle", [
    (("people", "human_sigma"), -1.0, "people.human_sigma"),
    (("workload", "checkpoint_minutes"), 0, "workload.checkpoint_minutes"),
    (("workload", "job_size_shares"), [0.5, 0.5, 0.5, 0.5], "workload.job_size_shares"),
    (("causes", "hbm3", "kinds"), {"ecc_dbe": 0.5, "warp_core": 0.5}, "causes.hbm3.kinds"),
    (("causes", "gsp", "count"), 18, "causes"),
    (("causes", "nic", "percent"), 9.0, "causes.nic.percent"),
    (("scenario", "nodes"), "many", "scenario.nodes"),
    (("hidden", "origin_known"), ["gsp"], "hidden.origin_known"),
    (("hidden", "origin_known"), "host_hardware", "hidden.origin_known"),
    (("precursors", "hbm3", "share"), 0.7, "precursors.hbm3.share"),
    (("precursors", "hbm3", "source"), "  ", "precursors.hbm3.source"),
    (("precursors", "faulty_gpu", "kinds"), ["xid79"], "precursors.faulty_gpu.kinds"),
    (("precursors", "thermal", "kinds"), [], "precursors.thermal.kinds"),
    (("precursors", "false_alarms_per_true"), -1.0, "precursors.false_alarms_per_true"),
    (("checkpoint_now", "non_honouring_share"), 1.5, "checkpoint_now.non_honouring_share"),
])
def test_bad_value_names_the_field(raw, path, value, needle):
    d = copy.deepcopy(raw)
    cur = d
    for k in path[:-1]:
        cur = cur[k]
    cur[path[-1]] = value
    with pytest.raises(ValueError, match=needle.replace(".", r"\.")):
        field.parse(d)


def test_every_cause_states_its_precursor_share(raw):
    d = copy.deepcopy(raw)
    del d["precursors"]["gsp"]
    with pytest.raises(ValueError, match=r"precursors\.gsp: missing"):
        field.parse(d)


def test_precursor_figures_carry_their_sources():
    f = field.load()
    figures = f.precursor_figures()
    assert {x["name"] for x in figures} >= {f"precursors.{c.name}.share" for c in f.causes}
    assert {"checkpoint_now.save_seconds", "checkpoint_now.non_honouring_share",
            "precursors.false_alarms_per_true"} <= {x["name"] for x in figures}
    assert all(x["source"].strip() for x in figures)
    # the degrading kinds carry the signs: Llama 3's mix puts about one failure in six there
    assert 0.15 < f.precursor_share() < 0.20


def test_fault_sequence_is_seeded_and_follows_the_rate():
    f = field.load()
    a = closedloop.draw_incidents(f, 2048, 54.0, seed=3)
    b = closedloop.draw_incidents(f, 2048, 54.0, seed=3)
    assert [(i.t, i.kind, i.u) for i in a] == [(i.t, i.kind, i.u) for i in b]
    assert 419 - 4 * 20.5 < len(a) < 419 + 4 * 20.5  # Poisson: mean 419, sd ~20.5
    assert all(i.lead_s > 0 for i in a if i.kind in ("sbe_rise", "nvlink", "thermal"))


@pytest.fixture(scope="module")
def quick() -> dict:
    return closedloop.run(quick=True, seed=1, say=lambda *a: None)


def test_quick_run_has_every_policy(quick):
    assert set(quick["policies"]) == set(closedloop.POLICIES)
    for name, p in quick["policies"].items():
        assert {"ettr", "gpu_hours_lost", "healthy_nodes_isolated", "needed_human"} <= set(p), name
        assert 0.0 < p["ettr"] <= 1.0
        assert p["gpu_hours_lost"] >= 0
    assert {"policies", "faults", "by_cause", "sources", "seconds"} <= set(quick)
    assert quick["scenario"]["faults"] == len(quick["faults"]) > 0


def test_quick_run_fleetmedic_beats_the_baselines(quick):
    p = quick["policies"]
    fm = p["fleetmedic"]
    assert fm["ettr"] > p["retry_only"]["ettr"]
    assert fm["ettr"] > p["manual"]["ettr"]
    assert fm["gpu_hours_lost"] < p["naive_cordon"]["gpu_hours_lost"]
    assert fm["gpu_hours_lost"] < p["manual"]["gpu_hours_lost"]
    assert p["naive_cordon"]["healthy_nodes_isolated"] > 0
    assert fm["healthy_nodes_isolated"] == 0
    assert p["manual"]["needed_human"] >= fm["needed_human"]


def test_quick_run_used_the_real_pipeline(quick):
    # every fault went through a micro-simulation whose verdicts came from the real correlator
    assert all(f["job_action"] is not None or f["iso_s"] is not None for f in quick["faults"])
    hw = [f for f in quick["faults"] if f["kind"] in ("xid79", "xid_gsp", "ecc_dbe", "xid_sram")]
    assert all(f["node_class"] in ("gpu_hardware", "gpu_memory") for f in hw)
    assert quick["sources"]["llama3"].startswith("Grattafiori")


def test_micro_simulation_of_one_incident():
    o = closedloop.micro("ecc_dbe", 5, 0.0, fleet=2048)
    assert o["applied"] and o["node_class"] == "gpu_memory" and o["iso_s"] is not None and o["iso_s"] < 30
    assert o["job_action"] == "requeue" and o["job_exclude"] == [o["node"]]
    assert o["false_isolations"] == []
    t = closedloop.micro("nccl_timeout", 5, 0.0, fleet=2048)
    assert t["job_action"] == "requeue" and t["iso_s"] is None and t["job_class"] == "unknown"


def test_main_help(capsys):
    with pytest.raises(SystemExit) as e:
        closedloop.main(["--help"])
    assert e.value.code == 0
    assert "--quick" in capsys.readouterr().out


def test_loss_breakdown_adds_up(quick):
    for name, p in quick["policies"].items():
        by, cause = p["job_gpu_hours_lost_by"], p["job_gpu_hours_lost_by_cause"]
        assert set(by) <= {"since_checkpoint", "down", "restart", "checkpoint_save"}, name
        assert "checkpoint_save" not in by or name == "fleetmedic_checkpoint_now", name
        assert sum(by.values()) == pytest.approx(p["job_gpu_hours_lost"], abs=1.0), name
        assert sum(cause.values()) == pytest.approx(p["job_gpu_hours_lost"], abs=1.0), name
        assert "-" not in cause, name  # every loss follows a failure with a known cause
    # a person's delay is what manual handling adds: its time down dwarfs fleetmedic's
    assert quick["policies"]["manual"]["job_gpu_hours_lost_by"]["down"] > \
        quick["policies"]["fleetmedic"]["job_gpu_hours_lost_by"].get("down", 0.0)


def test_instant_person_floor_is_below_manual(quick):
    r = quick["ratios"]
    manual = quick["policies"]["manual"]
    assert 0 < r["instant_person_gpu_hours"] < manual["gpu_hours_lost"]
    assert r["instant_person_over_manual"] == pytest.approx(r["instant_person_gpu_hours"] / manual["gpu_hours_lost"], abs=1e-3)


def test_quick_run_reports_the_oracle_and_the_precursor_model(quick):
    p, r = quick["policies"], quick["ratios"]
    oracle = p["reactive_oracle"]
    # the floor of the reactive policies: every baseline reacts later or worse
    for name in ("manual", "naive_cordon", "retry_only"):
        assert oracle["gpu_hours_lost"] <= p[name]["gpu_hours_lost"], name
    assert oracle["healthy_nodes_isolated"] == 0 and oracle["precursor_false_alarms"] == 0
    assert r["fleetmedic_over_reactive_oracle"] == pytest.approx(
        p["fleetmedic"]["gpu_hours_lost"] / oracle["gpu_hours_lost"], abs=1e-3)
    assert r["checkpoint_now_over_reactive_oracle"] == pytest.approx(
        p["fleetmedic_checkpoint_now"]["gpu_hours_lost"] / oracle["gpu_hours_lost"], abs=1e-3)
    pr = quick["precursors"]
    assert set(pr["by_cause"]) == {c.name for c in field.load().causes}
    assert all(f["source"] for f in pr["figures"])
    assert set(quick["sensitivity"]) == {"no_false_alarms", "false_alarms_at_dram_bound", "every_job_answers"}


# ------------------------------------------------------------ hand-made fault sequences

NODES, DAYS, SEED = 64, 3.0, 7
CAUSE = {"xid79": "faulty_gpu", "user_bug": "software_bug", "hidden": "host_hardware", "sbe_rise": "hbm3"}


@pytest.fixture(scope="module")
def small() -> field.Field:
    # one job size, so that where a fault strikes changes nothing but the job's phase
    return dataclasses.replace(field.load(), job_sizes=(8,), job_size_shares=(1.0,))


@pytest.fixture(scope="module")
def outcomes(small) -> dict[str, dict]:
    """One real micro-simulation per kind, shared by the incidents of that kind."""
    lead = small.ramps["sbe_rise"] * 60.0
    return {kind: closedloop.micro(kind, 11, lead if kind == "sbe_rise" else 0.0, fleet=2048)
            for kind in ("xid79", "user_bug", "hidden", "sbe_rise")}


def _incidents(kinds: list[str], outcomes: dict[str, dict], *, every_h: float = 5.0, at_phase_s: float = 0.0,
               small: field.Field) -> list[closedloop.Incident]:
    out = []
    for i, kind in enumerate(kinds):
        o = outcomes[kind]
        t = (i + 1) * every_h * closedloop.HOUR
        lead = o["fail_s"] if kind == "sbe_rise" else 0.0
        if kind == "sbe_rise":
            # the sign is found at_phase_s into the jobs' checkpoint interval
            t += at_phase_s - o["iso_s"]
        out.append(closedloop.Incident(id=i, t=t, cause=CAUSE[kind], kind=kind, u=(0.13 + 0.37 * i) % 1.0,
                                       lead_s=lead, seed=i, outcome=o))
    return out


def _run(small, incidents, names, *, false_alarms=(), non_honouring_share=None) -> dict:
    def no_lemons(kind: str, key: int) -> dict:
        raise AssertionError("no lemons in these runs")

    return closedloop.run_fleets(small, NODES, DAYS, SEED, incidents, set(), closedloop._settings(NODES), no_lemons,
                                 false_alarms=list(false_alarms), names=names,
                                 non_honouring_share=non_honouring_share)


def test_oracle_never_loses_more_than_fleetmedic_without_signs(small, outcomes):
    kinds = ["xid79", "user_bug", "hidden", "xid79", "hidden", "user_bug", "xid79", "hidden"]
    got = _run(small, _incidents(kinds, outcomes, small=small), ("fleetmedic", "reactive_oracle"))
    fm, oracle = got["fleetmedic"], got["reactive_oracle"]
    assert oracle["gpu_hours_lost"] <= fm["gpu_hours_lost"]
    # one failure per fault, nothing down: the node isolated, the job back at once
    assert oracle["job_failures"] == len(kinds) <= fm["job_failures"]
    assert set(oracle["job_gpu_hours_lost_by"]) <= {"since_checkpoint", "restart"}
    assert oracle["healthy_nodes_isolated"] == 0
    assert oracle["counts"]["stopped"] == kinds.count("user_bug")


def test_checkpoint_now_removes_the_loss_since_the_checkpoint(small, outcomes):
    o = outcomes["sbe_rise"]
    assert o["iso_s"] is not None and o["iso_s"] + small.checkpoint_save_s < o["fail_s"], o
    incidents = _incidents(["sbe_rise"] * 4, outcomes, at_phase_s=100.0, small=small)
    got = _run(small, incidents, ("fleetmedic", "fleetmedic_checkpoint_now", "reactive_oracle"), non_honouring_share=0.0)
    fm, cn, oracle = got["fleetmedic"], got["fleetmedic_checkpoint_now"], got["reactive_oracle"]
    # every job saved on request and moved before its node failed: nothing since a checkpoint lost
    assert cn["counts"]["checkpoint_now_acked"] == len(incidents)
    assert "since_checkpoint" not in cn["job_gpu_hours_lost_by"]
    assert cn["job_gpu_hours_lost_by"]["checkpoint_save"] > 0
    assert cn["job_failures"] == 0 and cn["healthy_nodes_isolated"] == 0
    # found 100 s into the interval, plain fleetmedic waits for its deadline and loses the work since
    assert fm["job_gpu_hours_lost_by"]["since_checkpoint"] > 0
    assert cn["gpu_hours_lost"] < fm["gpu_hours_lost"] < oracle["gpu_hours_lost"]


def test_unanswered_requests_move_the_job_as_fleetmedic_does(small, outcomes):
    incidents = _incidents(["sbe_rise", "xid79", "sbe_rise", "hidden"], outcomes, at_phase_s=100.0, small=small)
    alarms = [closedloop.FalseAlarm(t=h * closedloop.HOUR, kind="sbe_rise", u=0.5) for h in (7.0, 31.0)]
    got = _run(small, incidents, ("fleetmedic", "fleetmedic_checkpoint_now"), false_alarms=alarms,
               non_honouring_share=1.0)
    fm, cn = got["fleetmedic"], got["fleetmedic_checkpoint_now"]
    assert cn["counts"]["checkpoint_now_unanswered"] > 0 and "checkpoint_now_acked" not in cn["counts"]
    for key in ("gpu_hours_lost", "job_gpu_hours_lost_by", "job_failures", "precursor_false_alarms"):
        assert cn[key] == fm[key], key


def test_benign_rises_cost_fleetmedic_but_isolate_no_healthy_node(small, outcomes):
    incidents = _incidents(["xid79", "hidden"], outcomes, small=small)
    alarms = [closedloop.FalseAlarm(t=h * closedloop.HOUR, kind="sbe_rise", u=u) for h, u in ((2.0, 0.1), (20.0, 0.6))]
    names = ("fleetmedic", "fleetmedic_checkpoint_now", "reactive_oracle")
    quiet = _run(small, incidents, names, non_honouring_share=0.0)
    noisy = _run(small, incidents, names, false_alarms=alarms, non_honouring_share=0.0)
    for name in ("fleetmedic", "fleetmedic_checkpoint_now"):
        assert noisy[name]["precursor_false_alarms"] == len(alarms), name
        assert noisy[name]["healthy_nodes_isolated"] == 0, name
        assert noisy[name]["gpu_hours_lost"] > quiet[name]["gpu_hours_lost"], name
        assert "false_alarm" in noisy[name]["job_gpu_hours_lost_by_cause"], name
    # the oracle reacts to failures only: a sign that leads to none changes nothing for it
    assert noisy["reactive_oracle"]["gpu_hours_lost"] == quiet["reactive_oracle"]["gpu_hours_lost"]


def test_false_alarms_are_seeded_and_follow_their_rate():
    f = field.load()
    rate = closedloop.false_alarm_rate(f, 1.0)
    assert rate == pytest.approx(f.precursor_share() * f.per_node_day)
    a = closedloop.draw_false_alarms(f, 2048, 54.0, 3, rate)
    assert a == closedloop.draw_false_alarms(f, 2048, 54.0, 3, rate)
    mean = rate * 2048 * 54.0
    assert abs(len(a) - mean) < 4 * mean ** 0.5
    assert {x.kind for x in a} <= set(field.PRECURSOR_KINDS)
    assert closedloop.draw_false_alarms(f, 2048, 54.0, 3, 0.0) == []


def test_checkpoint_now_floor_trades_the_work_since_the_checkpoint_for_a_save():
    oracle = {"gpu_hours_lost": 1000.0, "job_gpu_hours_lost_by_kind": {
        "sbe_rise": {"since_checkpoint": 60.0, "restart": 40.0}, "nvlink": {"since_checkpoint": 30.0, "restart": 20.0},
        "xid79": {"since_checkpoint": 500.0, "restart": 350.0}}}
    # a save of 120 s on a job whose 600 s restart cost 60 GPU-h in all costs 12 GPU-h
    assert closedloop.checkpoint_now_floor(oracle, 120.0, 600.0) == pytest.approx(1000.0 - 90.0 + 12.0)
