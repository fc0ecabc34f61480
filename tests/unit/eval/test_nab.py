"""The NAB scorer: hand-built cases with known weights, the published Numenta scores, the harness."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from pipeline.eval import nab

STANDARD = nab.Profile("standard", tp=1.0, fp=0.11, fn=1.0)
LOW_FN = nab.Profile("reward_low_FN_rate", tp=1.0, fp=0.11, fn=2.0)
DATA = Path(__file__).resolve().parents[3].parent / "shared" / "data" / "nab"


def _file(n=1000, windows=((400, 499),)):
    return nab.LabelledFile.build("cat/f.csv", np.zeros(n), windows)


def _score(f, rows, profile=STANDARD):
    s = np.zeros(len(f.values))
    s[list(rows)] = 1.0
    return nab.score_file(f, s, 0.5, profile).score


def test_probation_is_fifteen_percent_capped_at_750():
    assert nab.probation_length(4032) == 604
    assert nab.probation_length(15833) == 750


def test_scaled_sigmoid_landmarks():
    assert nab.scaled_sigmoid(-1.0) == pytest.approx(0.98661, abs=1e-5)
    assert nab.scaled_sigmoid(0.0) == pytest.approx(0.0)
    assert nab.scaled_sigmoid(3.0) == -1.0


def test_detection_at_window_start_earns_the_full_tp_weight_and_later_less():
    f = _file()
    assert _score(f, [400]) == pytest.approx(1.0)
    assert 0.8 < _score(f, [450]) < 0.95  # halfway in
    assert 0 < _score(f, [499]) < 0.1  # at the right edge


def test_only_the_first_detection_in_a_window_counts():
    f = _file()
    assert _score(f, [420, 430, 440, 499]) == pytest.approx(_score(f, [420]))


def test_missed_window_costs_fn_weight_per_profile():
    f = _file()
    assert _score(f, []) == -1.0
    assert _score(f, [], LOW_FN) == -2.0


def test_false_positive_just_after_a_window_costs_less_than_one_far_away():
    f = _file()
    near = _score(f, [400, 505]) - _score(f, [400])
    far = _score(f, [400, 900]) - _score(f, [400])
    assert -0.11 < near < 0 and far == pytest.approx(-0.11)
    before = _score(f, [300, 400]) - _score(f, [400])  # before any window: the full fpWeight
    assert before == pytest.approx(-0.11)


def test_probationary_period_is_not_scored():
    f = _file()
    assert _score(f, [10, 100, 400]) == pytest.approx(1.0)


def test_sweep_matches_direct_scoring_at_every_threshold_and_finds_the_best():
    rng = np.random.default_rng(0)
    files = [_file(), _file(800, ((300, 350), (600, 700)))]
    scores = [rng.random(len(f.values)) for f in files]
    th, totals = nab.corpus_sweep(files, scores, STANDARD)
    assert th[0] == np.inf and totals[0] == -3.0
    for t, tot in zip(th[1::97], totals[1::97], strict=True):
        direct = sum(nab.score_file(f, s, t, STANDARD).score for f, s in zip(files, scores, strict=True))
        assert tot == pytest.approx(direct, abs=1e-9)
    best_t, best = nab.optimise_threshold(files, scores, STANDARD)
    assert best == pytest.approx(totals.max()) and best_t in th


def test_normalise_null_is_zero_and_perfect_is_hundred():
    assert nab.normalise(-5.0, 5, STANDARD) == 0.0
    assert nab.normalise(5.0, 5, STANDARD) == 100.0


@pytest.fixture(scope="module")
def corpus():
    if not (DATA / "labels" / "combined_windows.json").is_file():
        pytest.fail(f"NAB data missing under {DATA}")
    return nab.load_corpus(DATA, [
        "realAWSCloudwatch/ec2_cpu_utilization_5f5533.csv",
        "realTweets/Twitter_volume_FB.csv",
        "artificialWithAnomaly/art_daily_jumpsup.csv",
    ])


def test_published_numenta_scores_are_reproduced_per_file(corpus):
    check = nab.scorer_check(corpus, say=lambda _: None)
    for prof in check["profiles"].values():
        assert prof["per_file_max_abs_diff"] < 1e-6
        assert prof["row_counts_match"] and prof["sweep_matches_direct_score"]
        assert prof["abs_diff"] < 1e-6


def test_missing_data_dir_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="NAB data not found"):
        nab.load_corpus(tmp_path)
    assert nab.main(["--quick", "--data", str(tmp_path)]) == 2


def test_quick_run_writes_the_required_keys(tmp_path):
    out = tmp_path / "nab" / "nab.json"
    lines = []
    res = nab.run(quick=True, out=out, say=lines.append)
    written = json.loads(out.read_text())
    for key in ("scorer_check_abs_diff", "standard", "reward_low_FP_rate", "reward_low_FN_rate",
                "files", "published", "rank", "note"):
        assert key in written
    assert written["scorer_check_abs_diff"] < 1e-6
    assert set(written["files"]) == set(nab.QUICK_FILES)
    assert 0 < written["standard"] <= 100 and written["standard"] == res["standard"]
    assert written["published"]["numenta"]["files_covered"] == len(nab.QUICK_FILES)
    assert any("fleetmedic" in line for line in lines)
