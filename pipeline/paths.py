"""Where fleetmedic finds the files its commands need, and where it writes their results.

The same from a checkout of the repository and from an installed wheel:

- **Its own files** (the service scripts of ``deploy/``, the failure corpus and the
  kernel-log lines that the simulator draws real text from, the contract document) are
  read from the checkout when there is one, else from the copies that the wheel carries
  as package data under ``pipeline/_files/`` (``[tool.setuptools.package-dir]`` in
  ``pyproject.toml`` maps them there).
- **Results** go to ``bench/results/`` in a checkout, where the README quotes them, and
  to ``./fleetmedic-results/`` (in the current directory) otherwise: never into
  ``site-packages``. Every command that writes one takes ``--out`` as well.
- **Data sets that are not ours** (NAB, the Alibaba PAI traces) are looked for in
  ``$FLEETMEDIC_DATA``, else in ``../shared/data`` beside a checkout; a missing one is
  an error that names the variable.
"""

from __future__ import annotations

import os
from pathlib import Path

_HERE = Path(__file__).resolve().parent
#: the repository root when running from a checkout (``site-packages`` when installed)
CHECKOUT = _HERE.parent
#: where an installed wheel keeps the files below (see ``pyproject.toml``)
PACKAGED = _HERE / "_files"
#: the directory of the data sets that are not part of fleetmedic
DATA_ENV = "FLEETMEDIC_DATA"
#: results outside a checkout
RESULTS_OUTSIDE = "fleetmedic-results"


def in_checkout() -> bool:
    """Whether this code runs from a checkout of the repository (not an installed wheel)."""
    return (CHECKOUT / "pyproject.toml").is_file() and (CHECKOUT / "pipeline" / "paths.py").is_file()


def _own(in_repo: str, packaged: str, *, strict: bool = True) -> Path:
    """One of fleetmedic's own files: from the checkout, else from the wheel's copy.
    Neither there: :class:`FileNotFoundError`, or with ``strict=False`` the first place
    looked (for the error of whoever opens it)."""
    candidates = [CHECKOUT / in_repo] if in_checkout() else []
    candidates.append(PACKAGED / packaged)
    for path in candidates:
        if path.exists():
            return path
    if not strict:
        return candidates[0]
    raise FileNotFoundError(f"{in_repo} is missing: looked for {' and '.join(map(str, candidates))} "
                            "(an incomplete installation? reinstall fleetmedic)")


def deploy_dir() -> Path:
    """The service scripts (``kafka.sh``, ``k8s.sh``, ``slurm.sh``) and their manifests."""
    return _own("deploy", "deploy")


def deploy_script(name: str) -> Path:
    """``deploy/<name>``; the path is given even when the file is absent, for the error
    of whoever runs it."""
    return _own(f"deploy/{name}", f"deploy/{name}", strict=False)


def failure_corpus() -> Path:
    """The failure corpus (``tune/`` and ``eval/`` splits): ``$FLEETMEDIC_FAILURE_CORPUS``,
    else the one fleetmedic ships."""
    env = os.environ.get("FLEETMEDIC_FAILURE_CORPUS")
    return Path(env) if env else _own("tests/data/failures", "failures", strict=False)


def kernel_log_lines() -> Path:
    """Real kernel-log lines (Xid and SXid), each with its public source."""
    return _own("tests/fixtures/kernel-log/lines.toml", "kernel_log/lines.toml", strict=False)


def contract_doc() -> Path:
    """``docs/contract.md``: in a checkout the file that ``fleetmedic contract`` writes."""
    return _own("docs/contract.md", "docs/contract.md")


def results_dir() -> Path:
    """Where results go by default: ``bench/results`` in a checkout, else
    ``./fleetmedic-results``."""
    return CHECKOUT / "bench" / "results" if in_checkout() else Path.cwd() / RESULTS_OUTSIDE


def result(name: str) -> Path:
    """The default path of the result file ``name`` (see :func:`results_dir`)."""
    return results_dir() / name


def data_root() -> Path:
    """The directory of the data sets: ``$FLEETMEDIC_DATA``, else ``../shared/data`` beside
    a checkout (or beside the current directory)."""
    env = os.environ.get(DATA_ENV)
    if env:
        return Path(env)
    base = CHECKOUT if in_checkout() else Path.cwd()
    return base.parent / "shared" / "data"


def data_set(name: str, *, option: str | None = None) -> Path:
    """The data set ``name`` (a directory or file under :func:`data_root`); a missing one
    raises :class:`FileNotFoundError` that says how to point at it."""
    path = data_root() / name
    if not path.exists():
        how = f"set {DATA_ENV} to the directory that holds {name}"
        if option:
            how += f", or pass {option}"
        raise FileNotFoundError(f"data set {name} not found at {path}: {how}")
    return path
