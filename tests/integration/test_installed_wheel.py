"""fleetmedic as a platform team installs it: a wheel built from this tree, installed with
its dependencies into a fresh virtualenv outside the repository, run from a directory of
its own.

The wheel is built from a copy of the tree (the files git tracks or would track), so that
the build leaves nothing behind in the checkout. The demo starts its own Kafka with the
``deploy/kafka.sh`` that the wheel carries, in a state directory of the test's own.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.integration


def _run(argv: list[str], *, cwd: Path, env: dict[str, str], timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL, check=False)


def _ok(res: subprocess.CompletedProcess[str], what: str) -> str:
    assert res.returncode == 0, f"{what} failed (rc={res.returncode}):\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}"
    return res.stdout


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Build the wheel from a copy of the tree and install it into a fresh virtualenv."""
    base = tmp_path_factory.mktemp("wheel")
    src, dist, venv = base / "src", base / "dist", base / "venv"
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=REPO, capture_output=True,
                            check=True).stdout.decode().split("\0")
    for rel in filter(None, listed):
        path = REPO / rel
        if path.is_file():
            (src / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, src / rel)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    build = _run([sys.executable, "-m", "pip", "wheel", "-v", "--no-deps", "-w", str(dist), str(src)],
                 cwd=base, env=env, timeout=600)
    log = _ok(build, "pip wheel") + build.stderr
    warnings = [ln.strip() for ln in log.splitlines() if "Warning" in ln and "setuptools" in ln.lower()]
    assert not warnings, f"the build warns: {warnings}"
    wheels = sorted(dist.glob("fleetmedic-*.whl"))
    assert len(wheels) == 1, wheels
    _ok(_run([sys.executable, "-m", "venv", str(venv)], cwd=base, env=env, timeout=300), "venv")
    _ok(_run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", str(wheels[0])], cwd=base, env=env,
             timeout=900), "pip install")
    work = base / "work"
    work.mkdir()
    return {"venv": venv, "work": work, "base": base, "wheel": wheels[0]}


def _env(installed: dict[str, Path], **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "VIRTUAL_ENV", "FLEETMEDIC_BOOTSTRAP", "FLEETMEDIC_CONFIG")
           and not k.startswith("FLEETMEDIC_KAFKA__")}
    env["PATH"] = f"{installed['venv'] / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    env["FLEETMEDIC_STATE"] = str(installed["base"] / "state")
    env.update(extra)
    return env


def test_the_installed_package_runs_from_outside_the_repository(installed: dict[str, Path]) -> None:
    venv, work = installed["venv"], installed["work"]
    env = _env(installed)
    where = _ok(_run([str(venv / "bin" / "python"), "-c", "import pipeline, detectors, schemas; "
                      "print(pipeline.__file__, detectors.__file__, schemas.__file__)"], cwd=work, env=env,
                     timeout=120), "import")
    for path in where.split():
        assert Path(path).is_relative_to(venv), f"{path} is not the installed copy"
    fm = str(venv / "bin" / "fleetmedic")
    helptext = _ok(_run([fm, "--help"], cwd=work, env=env, timeout=120), "fleetmedic --help")
    assert "demo" in helptext and "worker" in helptext
    config = json.loads(_ok(_run([fm, "config"], cwd=work, env=env, timeout=120), "fleetmedic config"))
    assert {"kafka", "worker", "detectors", "safety"} <= set(config)
    # a setting that is wrong fails at start, naming the field, installed as in a checkout
    bad = _run([fm, "config"], cwd=work, env={**env, "FLEETMEDIC_KAFKA__PARTITIONS": "zero"}, timeout=120)
    assert bad.returncode == 2 and "partitions" in bad.stderr, bad.stderr


def test_results_go_to_the_current_directory_and_missing_data_is_named(installed: dict[str, Path]) -> None:
    """``eval-failures`` reads the failure corpus the wheel carries and writes under
    ``./fleetmedic-results``; nothing lands in site-packages; a data set that is not
    there is an error that says how to point at it, not a traceback."""
    venv, work = installed["venv"], installed["work"]
    env = _env(installed)
    site = next(venv.glob("lib/python3*/site-packages"))
    before = {p for p in site.rglob("*") if "__pycache__" not in p.parts}
    fm = str(venv / "bin" / "fleetmedic")
    out = _ok(_run([fm, "eval-failures"], cwd=work, env=env, timeout=600), "fleetmedic eval-failures")
    result = json.loads((work / "fleetmedic-results" / "failures.json").read_text())
    assert result["excerpts"] > 20 and result["split"] == "eval", out[-500:]
    after = {p for p in site.rglob("*") if "__pycache__" not in p.parts}
    assert after == before, f"written into site-packages: {sorted(map(str, after - before))[:5]}"
    missing = _run([fm, "eval-nab"], cwd=work, env={**env, "FLEETMEDIC_DATA": str(installed["base"] / "no-data")},
                   timeout=120)
    assert missing.returncode == 2, missing.stderr
    assert "FLEETMEDIC_DATA" in missing.stderr and "--data" in missing.stderr and "Traceback" not in missing.stderr


def test_the_installed_demo_starts_its_own_kafka_and_runs(installed: dict[str, Path]) -> None:
    """A 20 s demo: the broker script, the failure corpus and the kernel-log lines all
    come from the wheel; its summary is the last line, and the broker is stopped after."""
    venv, work = installed["venv"], installed["work"]
    env = _env(installed)
    res = _run([str(venv / "bin" / "fleetmedic"), "demo", "--duration", "20", "--nodes", "8"], cwd=work, env=env,
               timeout=900)
    out = _ok(res, "fleetmedic demo")
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["faults_injected"] > 0 and summary["verdicts"] > 0 and summary["actions_settled"] > 0, summary
    assert summary["false_isolations"] == 0, summary
    assert "kafka.sh: stopped" in res.stderr, res.stderr[-2000:]
    status = _run(["bash", str(next(venv.glob("lib/python3*/site-packages/pipeline/_files/deploy/kafka.sh"))),
                   "status"], cwd=work, env=env, timeout=60)
    assert status.returncode != 0, "the demo's broker is still running"
