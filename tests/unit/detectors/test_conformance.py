"""One contract, every detector: the checks each detector in ``cases.CASES`` must pass."""

from __future__ import annotations

import inspect
import json
import pickle
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import detectors
from detectors import SEVERITIES, Detector, FaultClass, Finding

from .cases import CASES, COVERED, Case

case_param = pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])


def _score(det, case: Case, inputs):
    return det.score(*case.score_args(inputs))


def test_every_public_detector_has_a_case():
    public = {
        obj
        for name in detectors.__all__
        if inspect.isclass(obj := getattr(detectors, name))
        and issubclass(obj, Detector)
        and obj is not Detector
    }
    assert public == COVERED


@case_param
def test_hyper_parameters_are_kept_under_their_own_names(case: Case):
    det = case.make()
    for name, value in case.params.items():
        assert getattr(det, name) == value
    assert set(det.get_params()) == set(inspect.signature(case.cls).parameters)


@case_param
def test_defaults_construct_and_round_trip_through_clone(case: Case):
    det = case.cls()
    twin = det.clone()
    assert twin is not det and twin == det
    assert repr(det).startswith(case.cls.__name__ + "(")


@pytest.mark.parametrize(
    ("case", "name", "value"),
    [(c, n, v) for c in CASES for n, v in c.invalid],
    ids=[f"{c.id}-{n}={v!r}" for c in CASES for n, v in c.invalid],
)
def test_invalid_hyper_parameter_raises_naming_it(case: Case, name, value):
    with pytest.raises(ValueError, match=re.escape(name)):
        case.cls(**{**case.params, name: value})


@case_param
def test_wrong_input_shape_raises_naming_the_shape(case: Case):
    det = case.make()
    for build in case.bad_shapes:
        inputs = build()
        with pytest.raises(ValueError, match="shape"):
            det.detect(*inputs)


@case_param
def test_warmup_is_neutral(case: Case):
    det = case.make()
    inputs = case.warmup()
    score = _score(det, case, inputs)
    assert score.shape == case.score_shape(inputs)
    assert np.all(score == 0.0)
    assert det.detect(*inputs) == []


@case_param
def test_healthy_input_yields_no_findings(case: Case):
    det = case.make()
    assert det.detect(*case.healthy()) == []


@case_param
def test_injected_anomaly_scores_higher_and_is_found(case: Case):
    det = case.make()
    healthy = _score(det, case, case.healthy())
    anomalous = _score(det, case, case.anomalous())
    assert anomalous.max() > healthy.max()
    assert det.detect(*case.anomalous())


@case_param
def test_score_shape_and_dtype(case: Case):
    det = case.make()
    for inputs in (case.healthy(), case.anomalous()):
        score = _score(det, case, inputs)
        assert score.shape == case.score_shape(inputs)
        assert score.dtype == np.float64
        assert np.all(np.isfinite(score))


@case_param
def test_findings_are_well_formed_and_serialisable(case: Case):
    det = case.make()
    inputs = case.anomalous()
    score_shape = case.score_shape(inputs)
    for f in det.detect(*inputs):
        assert isinstance(f, Finding)
        assert f.fault_class in {c.value for c in FaultClass}
        assert f.severity in SEVERITIES
        assert f.score > 0
        assert f.index >= 0
        assert f.gpu is None or f.gpu >= 0
        json.dumps(f.to_dict(), allow_nan=False)
    if len(score_shape) == 2:  # node x GPU detectors: findings point inside the batch
        for f in det.detect(*inputs):
            assert f.index < score_shape[0] and f.gpu < score_shape[1]


@case_param
def test_results_are_deterministic(case: Case):
    inputs = case.anomalous()
    first, second = case.make(), case.make()
    np.testing.assert_array_equal(_score(first, case, inputs), _score(second, case, inputs))
    assert first.detect(*inputs) == first.detect(*inputs) == second.detect(*inputs)


@case_param
def test_pickle_round_trip(case: Case):
    det = case.make()
    clone = pickle.loads(pickle.dumps(det))
    assert clone == det and clone.get_params() == det.get_params()
    inputs = case.anomalous()
    np.testing.assert_array_equal(_score(clone, case, inputs), _score(det, case, inputs))
    assert clone.detect(*inputs) == det.detect(*inputs)


@case_param
def test_inputs_are_not_modified(case: Case):
    det = case.make()
    inputs = case.anomalous()
    before = [np.array(a, copy=True) for a in inputs]
    det.score(*case.score_args(inputs))
    det.detect(*inputs)
    for a, b in zip(inputs, before, strict=True):
        np.testing.assert_array_equal(a, b)


def test_detectors_import_no_pipeline_io_or_cluster_modules():
    forbidden = {"pipeline", "actuators", "faust", "mode", "aiokafka", "kafka", "kubernetes"}
    code = (
        "import sys, detectors, detectors.tools.build_xid_table;"
        "print(sorted({m.split('.')[0] for m in sys.modules}))"
    )
    root = Path(detectors.__file__).resolve().parents[1]
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=root
    )
    loaded = set(json.loads(out.stdout.replace("'", '"')))
    assert not loaded & forbidden
