"""The contract every detector follows, and the finding it reports.

A detector is a plain object over numpy arrays: no I/O, no clock, no client.
The window it judges arrives with each call (the pipeline keeps the windows in
its tables), so a detector holds hyper-parameters only and can be pickled,
cloned and shared between workers.

Every detector has two methods:

``score(*arrays) -> np.ndarray``
    A float array, one value per subject (event, GPU or node). Higher is more
    anomalous. ``0.0`` is the neutral score: it is what a healthy subject, a
    subject still in warm-up, and a subject without data receive. Each
    detector documents its own scale.
``detect(*arrays) -> list[Finding]``
    The subjects whose score crosses the detector's decision rule, as
    :class:`Finding` records with evidence. Warm-up never yields findings.

Hyper-parameters are stored under the names ``__init__`` takes them by and are
validated there; a bad value raises :class:`ValueError` naming the parameter.
Inputs with the wrong shape raise :class:`ValueError` naming the expected and
the received shape.
"""

from __future__ import annotations

import inspect
import numbers
from dataclasses import dataclass, field
from typing import Any, Self, cast

import numpy as np

from schemas.records import FaultClass

__all__ = [
    "SEVERITIES",
    "Detector",
    "FaultClass",
    "Finding",
]


#: Finding severities, least to most severe.
SEVERITIES: tuple[str, ...] = ("info", "warning", "critical")

_FAULT_CLASSES = frozenset(c.value for c in FaultClass)


@dataclass(frozen=True, slots=True)
class Finding:
    """One anomaly a detector found in a batch.

    Attributes
    ----------
    kind:
        What was seen, e.g. ``"xid"``, ``"ecc_dbe"``, ``"peer_step_time"``.
    fault_class:
        One of :class:`FaultClass` (stored as its plain string value).
    severity:
        One of :data:`SEVERITIES`.
    score:
        The detector's score for the subject; higher is more anomalous.
    index:
        Row of the batch the finding refers to (the node row).
    gpu:
        GPU index within the node, ``None`` for a node-level finding.
    evidence:
        Small JSON-serialisable dict of the numbers behind the finding.
    """

    kind: str
    fault_class: str
    severity: str
    score: float
    index: int
    gpu: int | None
    evidence: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.fault_class not in _FAULT_CLASSES:
            raise ValueError(
                f"fault_class must be one of {sorted(_FAULT_CLASSES)}, got {self.fault_class!r}"
            )
        if self.severity not in SEVERITIES:
            raise ValueError(f"severity must be one of {SEVERITIES}, got {self.severity!r}")
        if not isinstance(self.evidence, dict):
            raise ValueError(f"evidence must be a dict, got {type(self.evidence).__name__}")
        # Plain built-in types, so the record serialises without numpy or enums.
        object.__setattr__(self, "fault_class", FaultClass(self.fault_class).value)
        object.__setattr__(self, "score", float(self.score))
        object.__setattr__(self, "index", int(self.index))
        if self.gpu is not None:
            object.__setattr__(self, "gpu", int(self.gpu))

    def to_dict(self) -> dict[str, Any]:
        """The finding as a JSON-serialisable dict."""
        return {
            "kind": self.kind,
            "fault_class": self.fault_class,
            "severity": self.severity,
            "score": self.score,
            "index": self.index,
            "gpu": self.gpu,
            "evidence": dict(self.evidence),
        }


class Detector:
    """Base class: hyper-parameter bookkeeping and input checks.

    Subclasses implement ``score`` and ``detect`` (see the module docstring)
    and validate their hyper-parameters in ``__init__``.
    """

    # Subclasses take their own arrays and options; ``*arrays: Any, **kwargs: Any``
    # accepts any such signature as an override.
    def score(self, *arrays: Any, **kwargs: Any) -> np.ndarray:  # pragma: no cover - interface
        raise NotImplementedError

    def detect(self, *arrays: Any, **kwargs: Any) -> list[Finding]:  # pragma: no cover - interface
        raise NotImplementedError

    # -- hyper-parameters -------------------------------------------------

    @classmethod
    def _param_names(cls) -> list[str]:
        sig = inspect.signature(cls.__init__)
        return [
            name
            for name, p in sig.parameters.items()
            if name != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
        ]

    def get_params(self) -> dict[str, Any]:
        """Hyper-parameters by the names ``__init__`` takes them."""
        return {name: getattr(self, name) for name in self._param_names()}

    def clone(self, **changes: Any) -> Self:
        """A new detector with the same hyper-parameters, apart from ``changes``."""
        params = self.get_params()
        unknown = set(changes) - set(params)
        if unknown:
            raise ValueError(
                f"unknown hyper-parameter(s) {sorted(unknown)} for {type(self).__name__}"
            )
        params.update(changes)
        return type(self)(**params)

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.get_params().items())
        return f"{type(self).__name__}({args})"

    def __eq__(self, other: object) -> bool:
        if type(other) is not type(self):
            return NotImplemented
        return self.get_params() == other.get_params()

    def __hash__(self) -> int:
        return hash((type(self).__name__, tuple(sorted(map(repr, self.get_params().items())))))


# -- validation helpers (shared by the detectors) ---------------------------


def check_int(name: str, value: Any, *, minimum: int | None = None) -> int:
    """Return ``value`` as int, or raise ValueError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value!r}")
    return int(value)


def check_float(
    name: str,
    value: Any,
    *,
    low: float | None = None,
    high: float | None = None,
    low_open: bool = False,
    high_open: bool = False,
) -> float:
    """Return ``value`` as a finite float inside the given bounds, or raise ValueError."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not np.isfinite(cast(float, value)):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    v = float(value)
    if low is not None and (v <= low if low_open else v < low):
        raise ValueError(f"{name} must be {'>' if low_open else '>='} {low}, got {value!r}")
    if high is not None and (v >= high if high_open else v > high):
        raise ValueError(f"{name} must be {'<' if high_open else '<='} {high}, got {value!r}")
    return v


def check_choice(name: str, value: Any, choices: tuple[str, ...] | frozenset[str]) -> str:
    """Return ``value`` if it is one of ``choices``, else raise ValueError."""
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"{name} must be one of {sorted(choices)}, got {value!r}")
    return value


def check_name(name: str, value: Any) -> str:
    """Return ``value`` if it is a non-empty string, else raise ValueError."""
    if not isinstance(value, str) or not value:
        raise ValueError(f"{name} must be a non-empty string, got {value!r}")
    return value


def as_array(name: str, value: Any, ndim: int, dims: str, kind: str) -> np.ndarray:
    """Return ``value`` as an array of ``ndim`` dimensions and dtype kind ``kind``.

    ``dims`` describes the expected shape for the error message, e.g.
    ``"(n, t, g)"``. ``kind`` is ``"b"`` (bool), ``"i"`` (integer) or ``"f"``
    (any real number: bool, integer or float).
    """
    arr = np.asarray(value)
    if arr.ndim != ndim:
        raise ValueError(f"{name} must have shape {dims}, got shape {arr.shape}")
    ok = {
        "b": arr.dtype.kind == "b",
        "i": arr.dtype.kind in "iu",
        "f": arr.dtype.kind in "biuf",
    }[kind]
    if not ok:
        wanted = {"b": "bool", "i": "integer", "f": "real"}[kind]
        raise ValueError(f"{name} must be a {wanted} array, got dtype {arr.dtype}")
    return arr


def check_same_shape(names: tuple[str, ...], arrays: tuple[np.ndarray, ...]) -> None:
    """Raise ValueError unless all arrays share one shape."""
    shapes = [a.shape for a in arrays]
    if any(s != shapes[0] for s in shapes[1:]):
        got = ", ".join(f"{n} {s}" for n, s in zip(names, shapes, strict=True))
        raise ValueError(f"{', '.join(names)} must have the same shape, got shapes {got}")
