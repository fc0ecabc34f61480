"""Windowed detectors for fleetmedic: pure numpy/scipy over arrays, no I/O.

Each detector's ``score`` returns one float per subject, higher is more
anomalous and 0 is neutral (healthy, warm-up, no data); ``detect`` returns
:class:`Finding` records. See :mod:`detectors.base` for the shared contract.
"""

from .base import SEVERITIES, Detector, FaultClass, Finding
from .gpu import (
    HW_POWER_BRAKE,
    HW_SLOWDOWN,
    HW_THERMAL,
    SW_THERMAL,
    THERMAL_REASONS,
    HardFaultDetector,
    RateChangeDetector,
    ThrottleDetector,
    thermal_mask,
)
from .peer import PeerDetector
from .univariate import UnivariateDetector
from .xid import XID_TABLE, XidDetector, XidInfo, lookup, resolve

__all__ = [
    "HW_POWER_BRAKE",
    "HW_SLOWDOWN",
    "HW_THERMAL",
    "SEVERITIES",
    "SW_THERMAL",
    "THERMAL_REASONS",
    "XID_TABLE",
    "Detector",
    "FaultClass",
    "Finding",
    "HardFaultDetector",
    "PeerDetector",
    "RateChangeDetector",
    "ThrottleDetector",
    "UnivariateDetector",
    "XidDetector",
    "resolve",
    "XidInfo",
    "lookup",
    "thermal_mask",
]
