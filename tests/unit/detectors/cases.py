"""Per-detector parameters and inputs for the conformance suite.

Each :class:`Case` supplies a detector with non-default hyper-parameters and
input builders for that configuration. Inputs are tuples of arrays passed to
``detect``; ``score_args`` picks the ones ``score`` takes. ``warmup`` is the
detector's neutral situation: too little history for windowed detectors, an
empty batch for stateless ones.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

from detectors import (
    HardFaultDetector,
    PeerDetector,
    RateChangeDetector,
    ThrottleDetector,
    UnivariateDetector,
    XidDetector,
)

Inputs = tuple[np.ndarray, ...]


@dataclass(frozen=True)
class Case:
    id: str
    cls: type
    params: dict[str, Any]
    invalid: list[tuple[str, Any]]
    healthy: Callable[[], Inputs]
    anomalous: Callable[[], Inputs]
    warmup: Callable[[], Inputs]
    bad_shapes: list[Callable[[], Inputs]]
    score_shape: Callable[[Inputs], tuple[int, ...]]
    score_args: Callable[[Inputs], Inputs] = field(default=lambda a: a)

    def make(self):
        return self.cls(**self.params)


# -- Xid ----------------------------------------------------------------------


def _xid(codes, rows=None, gpus=None) -> Inputs:
    codes = np.asarray(codes, dtype=np.int64)
    rows = np.arange(len(codes)) if rows is None else np.asarray(rows)
    gpus = np.zeros(len(codes), dtype=np.int64) if gpus is None else np.asarray(gpus)
    return codes, rows, gpus


XID = Case(
    id="xid",
    cls=XidDetector,
    params={"ignore": (43, 45)},
    invalid=[("ignore", (-1,)), ("ignore", "13"), ("ignore", 5), ("ignore", (1.5,))],
    healthy=lambda: _xid([43, 45, 43]),  # only codes this configuration ignores
    anomalous=lambda: _xid([106, 79, 43], gpus=[0, 3, 1]),  # test message, fallen off the bus
    warmup=lambda: _xid([]),
    bad_shapes=[
        lambda: (np.array([[79]]), np.array([0]), np.array([0])),
        lambda: (np.array([79, 13]), np.array([0]), np.array([0, 1])),
    ],
    score_shape=lambda a: a[0].shape,
    score_args=lambda a: a[:1],
)

# -- hard faults ----------------------------------------------------------------

N_NODES, N_GPUS = 6, 8


def _hard(dbe_at=None, lost_at=None, remap_at=None, n=N_NODES) -> Inputs:
    dbe = np.zeros((n, N_GPUS), dtype=np.int64)
    lost = np.zeros((n, N_GPUS), dtype=bool)
    remap = np.zeros((n, N_GPUS), dtype=bool)
    if dbe_at:
        dbe[dbe_at] = 2
    if lost_at:
        lost[lost_at] = True
    if remap_at:
        remap[remap_at] = True
    return dbe, remap, lost


HARD = Case(
    id="hard_fault",
    cls=HardFaultDetector,
    params={},
    invalid=[],
    healthy=lambda: _hard(),
    anomalous=lambda: _hard(dbe_at=(1, 3), lost_at=(4, 0), remap_at=(1, 3)),
    warmup=lambda: _hard(n=0),
    bad_shapes=[
        lambda: (np.zeros((N_NODES, N_GPUS, 1)), *_hard()[1:]),
        lambda: (_hard()[0], np.zeros((N_NODES, N_GPUS - 1), dtype=bool), _hard()[2]),
    ],
    score_shape=lambda a: a[0].shape,
)

# -- counter rate ---------------------------------------------------------------

RATE_PARAMS = {
    "window": 100,
    "recent": 25,
    "alpha": 1e-3,
    "min_events": 4,
    "kind": "nvlink_error_rate",
    "fault_class": "nvlink",
    "critical_ratio": 8.0,
}


def _counts(t: int = 100, surge: float = 0.0, seed: int = 11) -> Inputs:
    rng = np.random.default_rng(seed)
    counts = rng.poisson(0.05, (N_NODES, t, 4)).astype(np.int64)
    if surge:
        counts[2, -25:, 1] += rng.poisson(surge, 25)
    return (counts,)


RATE = Case(
    id="rate_change",
    cls=RateChangeDetector,
    params=RATE_PARAMS,
    invalid=[
        ("window", 0),
        ("window", 40),  # shorter than 2 * recent
        ("window", 100.0),
        ("recent", 0),
        ("alpha", 0.0),
        ("alpha", 1.5),
        ("alpha", float("nan")),
        ("min_events", 0),
        ("kind", ""),
        ("fault_class", "bogus"),
        ("critical_ratio", 0.5),
    ],
    healthy=lambda: _counts(),
    anomalous=lambda: _counts(surge=1.0),
    warmup=lambda: _counts(t=45, surge=3.0),  # 20 baseline intervals < recent
    bad_shapes=[lambda: (np.zeros((N_NODES, 100)),), lambda: (np.zeros(100),)],
    score_shape=lambda a: (a[0].shape[0], a[0].shape[2]),
)

# -- thermal throttling ------------------------------------------------------------


def _throttle(t: int = 40, hot: bool = False) -> Inputs:
    rng = np.random.default_rng(5)
    thermal = np.zeros((N_NODES, t, N_GPUS), dtype=bool)
    thermal[0, ::9, 0] = True  # an occasional blip stays below min_fraction
    temp = 60.0 + rng.normal(0.0, 1.0, (N_NODES, t, N_GPUS))
    if hot:
        thermal[1, -min(t, 25):, 2] = True
        temp[1, -min(t, 25):, 2] = 91.0
    return thermal, temp


THROTTLE = Case(
    id="throttle",
    cls=ThrottleDetector,
    params={"window": 30, "min_fraction": 0.6, "warmup": 5},
    invalid=[
        ("window", 0),
        ("min_fraction", 0.0),
        ("min_fraction", 1.5),
        ("warmup", 0),
        ("warmup", 31),  # longer than window
    ],
    healthy=lambda: _throttle(),
    anomalous=lambda: _throttle(hot=True),
    warmup=lambda: _throttle(t=4, hot=True),
    bad_shapes=[
        lambda: (np.zeros((N_NODES, 40), dtype=bool), np.zeros((N_NODES, 40))),
        lambda: (np.zeros((N_NODES, 40, N_GPUS), dtype=bool), np.zeros((N_NODES, 39, N_GPUS))),
    ],
    score_shape=lambda a: (a[0].shape[0], a[0].shape[2]),
)

# -- peers -------------------------------------------------------------------------


def _peers(m: int = 16, at: int | None = None, factor: float = 1.0, base: float = 1.0) -> Inputs:
    rng = np.random.default_rng(3)
    values = base * (1.0 + rng.normal(0.0, 0.02, m))
    if at is not None:
        values[at] = base * factor
    return (values,)


_PEER_INVALID = [
    ("threshold", 0.0),
    ("threshold", -1.0),
    ("threshold", float("nan")),
    ("min_peers", 2),
    ("direction", "up"),
    ("kind", ""),
    ("rel_floor", -0.1),
]

PEER = Case(
    id="peer_step_time",
    cls=PeerDetector,
    params={"threshold": 4.5, "min_peers": 5, "direction": "high", "kind": "peer_step_time",
            "rel_floor": 0.02},
    invalid=_PEER_INVALID,
    healthy=lambda: _peers(),
    anomalous=lambda: _peers(at=5, factor=1.5),
    warmup=lambda: _peers(m=4, at=1, factor=3.0),
    bad_shapes=[lambda: (np.ones((4, 4)),), lambda: (np.float64(1.0),)],
    score_shape=lambda a: a[0].shape,
)

PEER_POWER = Case(
    id="peer_power",
    cls=PeerDetector,
    params={"threshold": 5.0, "min_peers": 4, "direction": "low", "kind": "peer_power",
            "rel_floor": 0.05},
    invalid=_PEER_INVALID,
    healthy=lambda: _peers(base=650.0),
    anomalous=lambda: _peers(at=3, factor=0.5, base=650.0),
    warmup=lambda: _peers(m=3, at=1, factor=0.1, base=650.0),
    bad_shapes=[lambda: (np.ones((2, 8)),)],
    score_shape=lambda a: a[0].shape,
)

# -- univariate streams ----------------------------------------------------------------


def _series(t: int = 400, spike: float = 0.0) -> Inputs:
    values = 60.0 + np.random.default_rng(8).normal(0.0, 1.0, (5, t))
    values[3, -1] += spike
    return (values,)


UNIVARIATE = Case(
    id="univariate",
    cls=UnivariateDetector,
    params={"long_window": 300, "short_window": 3, "quiet_window": 100, "repeat_factor": 0.5,
            "warmup": 50, "relearn_z": 6.0, "relearn_after": 8, "decades": 40.0,
            "threshold": 0.15, "critical": 0.6, "kind": "gpu_temp",
            "fault_class": "node_degrading", "severity": "warning"},
    invalid=[("long_window", 1), ("short_window", 200), ("quiet_window", 0),
             ("repeat_factor", -0.1), ("warmup", 1), ("threshold", 1.5), ("severity", "bad")],
    healthy=lambda: _series(),
    anomalous=lambda: _series(spike=15.0),
    warmup=lambda: _series(t=49, spike=50.0),
    bad_shapes=[lambda: (np.zeros(40),), lambda: (np.zeros((2, 3, 4)),)],
    score_shape=lambda a: (a[0].shape[0],),
)

CASES = [XID, HARD, RATE, THROTTLE, PEER, PEER_POWER, UNIVARIATE]

#: Every public detector class must appear in CASES (checked by the suite).
COVERED = {case.cls for case in CASES}


def shared_data_dir() -> Path | None:
    """The shared data folder next to the repository (``<repo>/../shared/data``), if present."""
    here = Path(__file__).resolve()
    root = next(
        (p for p in here.parents if (p / "detectors").is_dir() and (p / "tests").is_dir()), None
    )
    if root is None:
        return None
    data = (root.parent / "shared" / "data").resolve()
    return data if data.is_dir() else None
