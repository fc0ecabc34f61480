"""The burst bench's CPU meter: what each party used while a side ran, from ``/proc``."""

from __future__ import annotations

import subprocess
import sys
import time

from pipeline.eval.burst import PARTIES, CpuMeter, party_pids


def _spin(seconds: float) -> int:
    end, n = time.process_time() + seconds, 0
    while time.process_time() < end:
        n += 1
    return n


def test_the_meter_counts_this_process_and_a_child_apart_and_the_machine_covers_both() -> None:
    # the child spins half a CPU second once told to, says so, and waits
    child = subprocess.Popen([sys.executable, "-c", "import sys, time\nsys.stdin.readline()\n"
                              "end = time.process_time() + 0.5\nwhile time.process_time() < end: pass\n"
                              "print('done', flush=True)\nsys.stdin.readline()"],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def side() -> int:
        assert child.stdin is not None and child.stdout is not None
        child.stdin.write("go\n")
        child.stdin.flush()
        n = _spin(0.4)
        assert child.stdout.readline().strip() == "done"
        return n

    try:
        meter = CpuMeter({"worker": [child.pid], "apiserver": [], "etcd": [], "broker": []})
        got, cpu = meter.measure("fm_", side)
    finally:
        child.kill()
        child.wait()
    assert got > 0
    assert set(cpu) == {"fm_cpu_worker_s", "fm_cpu_apiserver_s", "fm_cpu_etcd_s", "fm_cpu_broker_s",
                        "fm_cpu_bench_s", "fm_cpu_machine_s"}
    assert 0.38 <= cpu["fm_cpu_bench_s"] < 1.0
    assert 0.48 <= cpu["fm_cpu_worker_s"] < 1.0  # the child's spin, measured apart from this process
    assert cpu["fm_cpu_apiserver_s"] == cpu["fm_cpu_broker_s"] == 0.0
    assert cpu["fm_cpu_machine_s"] >= 0.9 * (cpu["fm_cpu_bench_s"] + cpu["fm_cpu_worker_s"])


def test_a_party_is_found_by_its_name_and_the_broker_only_by_its_main_class() -> None:
    found = party_pids()
    assert set(found) == set(PARTIES)
    # whatever runs here, a found pid is a live process of that name
    for party, pids in found.items():
        name, word = PARTIES[party]
        for pid in pids:
            with open(f"/proc/{pid}/comm") as f:
                assert f.read().strip() == name
            if word:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    assert word.encode() in f.read()
