"""The dashboard at fleet scale, in a real browser: does a 10,000-node page render and
keep up with live updates without stalling?

A worker is started on its own topics and told of ``nodes`` nodes by their real
telemetry (one GPU and one fabric sample each, so every node has a leaf switch); the
page is opened in headless Chromium (Debian's, installed by ``deploy/chromium.sh``),
and measured from inside the page:

* **load**: from navigation to the whole fleet drawn (``window.fleetmedic.loaded``);
* **relayout**: one full layout and repaint of every switch block and tile;
* **frame times**, from ``requestAnimationFrame`` deltas, first with the page idle (the
  baseline: what the browser gives an untouched page on this machine), then while the
  page's stream handlers take ``rate`` node-state changes per second (the handlers that
  the event stream calls; a whole fleet going through a verdict storm) plus one switch
  change per second, which repaints everything.  ``stall_ratio`` is the p95 frame time
  under updates over the idle p95: 1.0 means the updates cost no frames at all.

Each figure is the median of ``runs`` runs with its minimum and maximum.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from pipeline import paths
from pipeline.config import load_settings
from pipeline.eval.bench import FleetLoad, machine, produce_all, spread
from pipeline.worker.procs import WorkerProcess, wait_ready
from pipeline.worker.topics import ensure_topics


class BrowserMissing(RuntimeError):
    """Chromium or its driver could not be found or installed."""


def chromium_paths() -> tuple[str, str]:
    """The browser and its WebDriver, installing Debian's packages when missing."""
    out = subprocess.run(["bash", str(paths.deploy_script("chromium.sh")), "ensure"], capture_output=True, text=True,
                         timeout=900)
    if out.returncode != 0:
        raise BrowserMissing(f"deploy/chromium.sh ensure failed:\n{out.stderr[-3000:]}")
    found = dict(line.split("=", 1) for line in out.stdout.strip().splitlines()[-2:])
    return found["CHROME"], found["DRIVER"]


@contextmanager
def browser(width: int = 1400, height: int = 900) -> Iterator[Any]:
    """Headless Chromium through Selenium, at a desktop window size."""
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError as exc:  # a wheel installed without the test extra
        raise BrowserMissing("selenium is not installed (pip install 'fleetmedic[test]')") from exc
    chrome, driver = chromium_paths()
    os.environ.setdefault("SE_OFFLINE", "true")  # never let Selenium Manager look for a driver online
    opts = webdriver.ChromeOptions()
    opts.binary_location = chrome
    for a in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
              f"--window-size={width},{height}"):
        opts.add_argument(a)
    b = webdriver.Chrome(service=Service(executable_path=driver), options=opts)
    b.set_page_load_timeout(60)
    b.set_script_timeout(120)
    try:
        yield b
    finally:
        b.quit()


#: the page's own update path driven at ``rate`` node events per second for ``seconds``,
#: in 16 ms ticks; returns how many events it handed to the page
_UPDATES = """
const [rate, seconds, done] = [arguments[0], arguments[1], arguments[arguments.length - 1]];
const fm = window.fleetmedic, names = fm.names(), states = ["healthy", "suspect", "isolated", "diagnosing", "healthy"];
const sws = fm.blocks().map(b => b.switch).filter(Boolean);
let sent = 0, k = 0, lastSwitch = performance.now();
const t0 = performance.now(), per = Math.max(1, Math.round(rate * 0.016));
fm.frameStatsReset();
const timer = setInterval(() => {
  for (let j = 0; j < per; j++, k++) {
    const n = names[(k * 7919) % names.length];
    fm.feed("node", {node: n, state: states[k % states.length], fault_class: k % 3 ? "gpu_hardware" : "nvlink"});
    sent++;
  }
  const now = performance.now();
  if (sws.length && now - lastSwitch >= 1000) {
    lastSwitch = now;
    fm.feed("switch", {switch: sws[k % sws.length], state: k % 2 ? "faulty" : "ok"});
  }
  if (now - t0 >= seconds * 1000) {
    clearInterval(timer);
    requestAnimationFrame(() => requestAnimationFrame(() => done({sent, ms: performance.now() - t0, frames: fm.frameStats()})));
  }
}, 16);
"""


def measure_page(driver: Any, url: str, *, expect_nodes: int, seconds: float = 5.0, rate: int = 2000,
                 runs: int = 3, say: Callable[..., None] = print, shot: Path | None = None) -> dict[str, Any]:
    """Open ``url`` (a dashboard serving ``expect_nodes`` nodes) and measure it; ``shot``:
    where to save a screenshot of the loaded page (after the first run's updates)."""
    loads, relayouts, idle_p95, idle_long, p50, p95, p99, worst, long_frames, ratios, applied = ([] for _ in range(11))
    blocks = 0
    for r in range(runs):
        driver.get(url)
        end = time.monotonic() + 120
        loaded = None
        while time.monotonic() < end:
            loaded = driver.execute_script("return window.fleetmedic && window.fleetmedic.loaded")
            if loaded and loaded["nodes"] >= expect_nodes:
                break
            time.sleep(0.2)
        if not loaded or loaded["nodes"] < expect_nodes:
            raise RuntimeError(f"the page did not load {expect_nodes} nodes in 120 s: {loaded}")
        loads.append(loaded["ms"])
        blocks = len(driver.execute_script("return window.fleetmedic.blocks()"))
        relayouts.append(float(np.median([driver.execute_script("return window.fleetmedic.relayout()") for _ in range(5)])))
        driver.execute_script("window.fleetmedic.frameStatsReset()")
        time.sleep(seconds)
        idle = driver.execute_script("return window.fleetmedic.frameStats()")
        busy = driver.execute_async_script(_UPDATES, rate, seconds)
        f = busy["frames"]
        idle_p95.append(idle["p95_ms"])
        idle_long.append(idle["over_50ms"])
        p50.append(f["p50_ms"]); p95.append(f["p95_ms"]); p99.append(f["p99_ms"]); worst.append(f["max_ms"])
        long_frames.append(f["over_50ms"])
        ratios.append(f["p95_ms"] / idle["p95_ms"] if idle["p95_ms"] else None)
        if shot is not None and r == 0:
            shot.parent.mkdir(parents=True, exist_ok=True)
            driver.save_screenshot(str(shot))
        applied.append(busy["sent"] / (busy["ms"] / 1000.0))
        say(f"  run {r + 1}/{runs}: loaded in {loaded['ms']:.0f} ms, relayout {relayouts[-1]:.1f} ms; frames idle p95 "
            f"{idle['p95_ms']:.1f} ms, under {applied[-1]:,.0f} node events/s p50 {f['p50_ms']:.1f} p95 {f['p95_ms']:.1f} "
            f"p99 {f['p99_ms']:.1f} max {f['max_ms']:.1f} ms ({f['over_50ms']} frames over 50 ms of {f['frames']})")
    return {
        "nodes": expect_nodes, "switch_blocks": blocks, "runs": runs, "seconds_per_phase": seconds,
        **spread("load_ms", loads), **spread("relayout_ms", relayouts),
        **spread("idle_frame_p95_ms", idle_p95), **spread("idle_frames_over_50ms", idle_long),
        **spread("node_events_per_s", applied),
        **spread("frame_p50_ms", p50), **spread("frame_p95_ms", p95), **spread("frame_p99_ms", p99),
        **spread("frame_max_ms", worst), **spread("frames_over_50ms", long_frames),
        **spread("stall_ratio", [r for r in ratios if r is not None]),
    }


def _get(port: int, path: str) -> Any:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=30) as r:
        return json.loads(r.read())


def run(*, bootstrap: str, nodes: int, logdir: Path, out: Path | None, runs: int = 3, seconds: float = 5.0,
        rate: int = 2000, say: Callable[..., None] = print, shot: Path | None = None) -> dict[str, Any]:
    """A worker told of ``nodes`` nodes, and its dashboard measured in Chromium."""
    prefix = f"dash{uuid.uuid4().hex[:6]}."
    env = {**os.environ, "FLEETMEDIC_KAFKA__BOOTSTRAP": bootstrap, "FLEETMEDIC_KAFKA__TOPIC_PREFIX": prefix,
           "FLEETMEDIC_ACTUATORS__BACKEND": "dryrun", "FLEETMEDIC_SAFETY__FLEET_SIZE": str(nodes),
           "FLEETMEDIC_WORKER__LOG_LEVEL": "warning", "FLEETMEDIC_AUTH__ENABLED": "false"}
    s = load_settings(environ=env)
    asyncio.run(ensure_topics(s))
    logdir.mkdir(parents=True, exist_ok=True)
    worker = WorkerProcess(env, logdir / f"dashboard-{prefix}log")
    try:
        wait_ready([worker])
        load = FleetLoad(nodes)
        items = [(s.topic("telemetry.gpu"), k, v) for k, v in load.gpu_round(0)]
        items += [(s.topic("telemetry.network"), k, v) for k, v in load.network_round(0)]
        say(f"dashboard: telling a worker of {nodes:,} nodes ({len(items):,} GPU and fabric samples)")
        asyncio.run(produce_all(bootstrap, items))
        end = time.monotonic() + 120
        listed: list[dict[str, Any]] = []
        while time.monotonic() < end:
            listed = _get(worker.web_port, "/api/v1/nodes")["nodes"]
            if len(listed) >= nodes and all(n["switch"] for n in listed):
                break
            time.sleep(0.5)
        if len(listed) < nodes:
            raise RuntimeError(f"the worker knows {len(listed)} of {nodes} nodes after 120 s:\n{worker.log_tail()}")
        say(f"dashboard: {nodes:,} nodes under {len({n['switch'] for n in listed})} leaf switches; measuring in Chromium")
        with browser() as b:
            result = measure_page(b, f"http://127.0.0.1:{worker.web_port}/dashboard", expect_nodes=nodes,
                                  seconds=seconds, rate=rate, runs=runs, say=say, shot=shot)
    finally:
        worker.stop()
    result["machine"] = machine()
    result["when"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2) + "\n")
    say(table(result))
    return result


def table(r: dict[str, Any]) -> str:
    rows = [
        ("dashboard fleet", f"{r['nodes']:,} nodes in {r['switch_blocks']} switch blocks"),
        ("page load", f"{r['load_ms']:.0f} ms (min {r['load_ms_min']:.0f}, max {r['load_ms_max']:.0f})"),
        ("full relayout", f"{r['relayout_ms']:.1f} ms (min {r['relayout_ms_min']:.1f}, max {r['relayout_ms_max']:.1f})"),
        ("frames, idle page", f"p95 {r['idle_frame_p95_ms']:.1f} ms; {r['idle_frames_over_50ms']:.0f} over 50 ms"),
        (f"frames under {r['node_events_per_s']:,.0f} node events/s",
         f"p50 {r['frame_p50_ms']:.1f}, p95 {r['frame_p95_ms']:.1f} (min {r['frame_p95_ms_min']:.1f}, max "
         f"{r['frame_p95_ms_max']:.1f}), p99 {r['frame_p99_ms']:.1f}, max {r['frame_max_ms']:.1f} ms; "
         f"{r['frames_over_50ms']:.0f} over 50 ms"),
        ("stall ratio (p95 busy / idle)", f"{r['stall_ratio']:.2f} (min {r['stall_ratio_min']:.2f}, max "
                                          f"{r['stall_ratio_max']:.2f})"),
    ]
    w = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{w}}  {v}" for k, v in rows)
