"""The dashboard in headless Chromium (Debian's, installed by deploy/chromium.sh), on a
worker fed through the real broker.  It answers "what is broken, why, what did fleetmedic
do, and what needs me": the fleet by leaf switch with names on hover and a searchable,
filterable list; the header's KPIs; verdicts shown whole; a node's GPUs over time with
the findings marked; the jobs view; held isolations approved and rejected on the page.
Screenshots go to a temporary directory, or to $FLEETMEDIC_SCREENSHOTS when set
(bench/results/ holds the committed ones).

The scenario, in event time: 96 nodes under four leaf switches report GPU and fabric
telemetry; job llm-7 runs on eight of them.  An operator has node gpu-0042's page open
(so its telemetry is recorded) while its GPU 3 warms up and, at the end, its step time
rises above its peers'; then GPU 3 falls off the bus (Xid 79) and the job fails.  Two more nodes
lose a GPU after the breaker's budget (one isolation) is used, so they wait for a person.
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

import numpy as np
import orjson
import pytest

from pipeline.eval.network import Fabric

from .harness import ClusterAPI, Worker, api_call, gpu_sample, job_event, produce

pytestmark = pytest.mark.integration

SHOTS = Path(os.environ.get("FLEETMEDIC_SCREENSHOTS") or tempfile.mkdtemp(prefix="fleetmedic-shots-"))
NODES, LEAVES, STEP = 96, 4, 10.0


@pytest.fixture(scope="module")
def browser():
    from pipeline.eval.dashboard import browser as open_browser

    with open_browser() as b:
        yield b


def _wait(fn, timeout: float = 30.0, what: str = "condition"):
    end = time.time() + timeout
    last = None
    while time.time() < end:
        try:
            last = fn()
        except Exception as exc:  # an element that is being redrawn
            last = exc
        if last and not isinstance(last, Exception):
            return last
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what} (last: {last!r})")


def _gpu(node: str, ts: float, rng: np.random.Generator, *, hot: float = 0.0, **kw) -> dict:
    rec = gpu_sample(node, ts, rng=rng, **kw)
    if hot:
        rec["temp"][3] = round(rec["temp"][3] + hot, 1)
    return rec


@pytest.fixture(scope="module")
def fleet(kafka_bootstrap):
    from pipeline.config import load_settings

    fab = Fabric(NODES, LEAVES, STEP, seed=5)
    nodes = fab.names
    bad, held = nodes[42], [nodes[7], nodes[66]]
    job, job_nodes = "llm-7", nodes[40:48]
    api = ClusterAPI(load_settings(environ={}))
    api.add_nodes(nodes)
    api.add_job(job, job_nodes)

    def broken(c) -> None:  # their GPUs really are gone: diagnostics fail on them
        for n in (bad, *held):
            c.nodes[n].broken = True

    api.state(broken)
    worker = Worker(kafka_bootstrap, sim_url=api.url, env={
        "FLEETMEDIC_SAFETY__FLEET_SIZE": "200", "FLEETMEDIC_SAFETY__MAX_ABSOLUTE": "1"})
    worker.start()
    gpu_t, net_t, job_t = (worker.topic(t) for t in ("telemetry.gpu", "telemetry.network", "telemetry.job"))
    rng = np.random.default_rng(3)
    t0 = time.time() - 900
    items = [(job_t, job, job_event(job, "started", t0, job_nodes))]
    for k in range(3):
        fab.step(t0 + k * STEP, [])
        items += [(net_t, s.node, orjson.loads(s.model_dump_json(by_alias=True))) for s in fab.samples(t0 + k * STEP)]
    for k in range(10):
        items += [(gpu_t, n, _gpu(n, t0 + k * STEP, rng)) for n in nodes]
    produce(kafka_bootstrap, items)
    wait = _wait(lambda: (lambda b: b["count"] >= NODES and all(n["switch"] for n in b["nodes"]))(
        api_call(worker, "GET", "/api/v1/nodes")[1]), timeout=60, what="every node with its switch")
    assert wait
    # an operator opens the node's page: its telemetry is recorded from now on
    assert api_call(worker, "GET", f"/api/v1/nodes/{bad}/gpu")[0] == 200
    items = []
    for k in range(10, 40):
        t = t0 + k * STEP
        warm = max(0.0, (k - 15) * 0.6)
        items += [(gpu_t, n, _gpu(n, t, rng, hot=warm if n == bad else 0.0)) for n in nodes]
        steps = {n: round(float(rng.normal(1.0, 0.01)), 4) for n in job_nodes}
        # slower than its peers only in the last half minute: two findings, fewer than the
        # three that would move work off it before its GPU fails (policy.degrade_confirmations)
        steps[bad] = round(1.0 + max(0.0, (k - 36) * 0.15), 4)
        items.append((job_t, job, job_event(job, "progress", t + 1, job_nodes, step=k * 10, step_time=max(steps.values()),
                                            node_step_times=steps)))
    produce(kafka_bootstrap, items)
    lost = [False] * 8
    lost[3] = True
    t_fail = t0 + 40 * STEP
    produce(kafka_bootstrap, [
        # the driver's own words for it, from a real dmesg line (gpud's sxid README, kept in
        # tests/fixtures/kernel-log/formats.md)
        (gpu_t, bad, _gpu(bad, t_fail, rng, lost=lost, xids=[(3, 79, "GPU has fallen off the bus.")])),
        (job_t, job, job_event(job, "failed", t_fail + 0.5, job_nodes, exit_code=1,
                               reason="CUDA error: unspecified launch failure",
                               log_tail="RuntimeError: CUDA error: unspecified launch failure")),
    ])
    api.state(lambda c: setattr(c.jobs[job], "status", "failed"))
    _wait(lambda: api.state(lambda c: c.nodes[bad].cordoned), timeout=60, what=f"{bad} cordoned")
    # the breaker's budget is used: the next two isolations wait for a person
    items = []
    for i, n in enumerate(held):
        lost = [False] * 8
        lost[i + 1] = True
        items.append((gpu_t, n, _gpu(n, t_fail + 20 + i, rng, lost=lost, xids=[(i + 1, 79)])))
    # and the node page goes on receiving samples after the fault
    items += [(gpu_t, bad, _gpu(bad, t_fail + k * STEP, rng, hot=15.0, lost=[False] * 3 + [True] + [False] * 4))
              for k in range(1, 6)]
    produce(kafka_bootstrap, items)
    _wait(lambda: len(api_call(worker, "GET", "/api/v1/held")[1]["held"]) == 2, timeout=60, what="two held isolations")
    yield {"worker": worker, "api": api, "nodes": nodes, "bad": bad, "held": held, "job": job, "job_nodes": job_nodes,
           "fab": fab, "url": f"http://127.0.0.1:{worker.env['FLEETMEDIC_WORKER__WEB_PORT']}/dashboard"}
    worker.stop()
    api.close()


def _open(browser, url: str, hash_: str = "") -> None:
    browser.get(url + hash_)
    _wait(lambda: "live" in browser.find_element("id", "live").text, what="the event stream")


def _text(browser, css: str) -> str:
    return browser.find_element("css selector", css).text


def _set(browser, element_id: str, value: str) -> None:
    browser.execute_script(
        "const e = document.getElementById(arguments[0]); e.value = arguments[1];"
        "e.dispatchEvent(new Event(e.tagName === 'SELECT' ? 'change' : 'input'));", element_id, value)


def _listed(browser) -> list[str]:
    time.sleep(0.8)  # the list is redrawn at most every 0.5 s
    return [li.get_attribute("data-node") for li in browser.find_elements("css selector", "#nodelist li")]


def test_the_fleet_page_shows_what_is_broken_why_and_what_was_done(browser, fleet):
    from selenium.webdriver.common.action_chains import ActionChains

    bad, held, fab = fleet["bad"], fleet["held"], fleet["fab"]
    _open(browser, fleet["url"])
    assert "Sign-in is off" in _text(browser, "#banner")
    fm = "return window.fleetmedic."
    assert browser.execute_script(fm + f"state('{bad}')") in ("isolated", "diagnosing", "failed")
    iso = browser.execute_script(fm + f"colors[window.fleetmedic.state('{bad}')]")
    # the two isolations the breaker held are painted apart: those nodes are still in service
    for n in held:
        _wait(lambda n=n: browser.execute_script(fm + f"tileColor('{n}')") == browser.execute_script(fm + "heldColor"),
              what=f"{n} painted as held")
    _wait(lambda: browser.execute_script(fm + f"tileColor('{bad}')") == iso, what="the isolated node's tile painted")
    # the switches are drawn with their nodes: one block per leaf, each holding its nodes
    blocks = {b["switch"]: b["nodes"] for b in browser.execute_script(fm + "blocks()")}
    assert blocks == {f"leaf-{i:02d}": NODES // LEAVES for i in range(LEAVES)}, blocks
    assert browser.execute_script(fm + f"switchOf('{bad}')") == f"leaf-{int(fab.leaf_of[42]):02d}"
    # the header: nodes out and why, the breaker's budget, what waits for a person, GPU-hours saved
    _wait(lambda: "gpu_hardware" in _text(browser, "#kpi-out"), what="nodes out by fault class: " + _text(browser, "#kpi-out"))
    assert _text(browser, "#kpi-out").startswith("out of service 1 of 96"), _text(browser, "#kpi-out")
    assert "0 of 1 left" in _text(browser, "#kpi-breaker").replace("breaker ", "")
    assert _text(browser, "#kpi-held") == "held for you 2" and _text(browser, "#heldcount") == "2"
    _wait(lambda: "1 job recoveries" in _text(browser, "#kpi-saved"), what="the job recovery counted as saved")
    saved = float(_text(browser, "#kpi-saved").split()[3])
    assert saved > 8 * 8 * 1.0, saved  # eight nodes of eight GPUs spared more than an hour's human delay
    # every verdict whole, its evidence readable, what was done under it
    card = _wait(lambda: next((c for c in browser.find_elements("css selector", "#events li.card")
                               if f"gpu_hardware node {bad}" in c.text and "applied: isolate" in c.text), None),
                 what="the node verdict's card with its isolation applied")
    text = card.text
    assert "finding\ngpu_lost" in text and "GPU\n3" in text, text
    assert "{" not in text and '"' not in text, text  # no raw JSON
    jcard = next(c for c in browser.find_elements("css selector", "#events li.card") if "gpu_hardware job llm-7" in c.text)
    plan = jcard.text.split("\nplan\n")[1].split("\n")[0]
    assert plan.startswith("requeue llm-7;") and f"exclude {bad}" in plan, jcard.text
    # a node's name on hover
    x, y = browser.execute_script(fm + f"tileCenter('{bad}')")
    canvas = browser.find_element("id", "fleet")
    w, h = canvas.size["width"], canvas.size["height"]
    ActionChains(browser).move_to_element_with_offset(canvas, int(x - w / 2), int(y - h / 2)).perform()
    tip = _wait(lambda: browser.find_element("id", "tip").is_displayed() and _text(browser, "#tip"), what="the tooltip")
    assert bad in tip and "gpu_hardware" in tip and f"leaf-{int(fab.leaf_of[42]):02d}" in tip, tip
    browser.save_screenshot(str(SHOTS.joinpath("dashboard_fleet_hover.png")))
    # the list: the nodes that are not healthy, then a search, then the filters
    assert set(_listed(browser)) >= {bad, *held}
    _set(browser, "search", bad)
    assert _listed(browser) == [bad]
    assert _text(browser, "#shown") == "1 match"
    other = fleet["nodes"][0]
    assert browser.execute_script(fm + f"tileColor('{other}')") == browser.execute_script(fm + "dimmed")
    _set(browser, "search", "leaf-02")
    assert len(_listed(browser)) == NODES // LEAVES
    _set(browser, "search", "")
    _set(browser, "f-class", "gpu_hardware")
    got = _listed(browser)
    assert bad in got and all(browser.execute_script(fm + f"faultClass('{n}')") == "gpu_hardware" for n in got)
    _set(browser, "f-class", "")
    _set(browser, "f-state", "healthy")
    got = _listed(browser)
    assert got and bad not in got and all(browser.execute_script(fm + f"state('{n}')") == "healthy" for n in got)
    _set(browser, "f-state", "")
    SHOTS.mkdir(parents=True, exist_ok=True)
    browser.save_screenshot(str(SHOTS / "dashboard_fleet.png"))


def test_the_node_page_plots_each_gpu_over_time_with_the_findings_marked(browser, fleet):
    from selenium.webdriver.common.action_chains import ActionChains

    bad = fleet["bad"]
    _open(browser, fleet["url"])
    x, y = browser.execute_script(f"return window.fleetmedic.tileCenter('{bad}')")
    canvas = browser.find_element("id", "fleet")
    w, h = canvas.size["width"], canvas.size["height"]
    ActionChains(browser).move_to_element_with_offset(canvas, int(x - w / 2), int(y - h / 2)).click().perform()
    _wait(lambda: _text(browser, "#nodetitle") == bad, what="the node page")
    temp = _wait(lambda: browser.find_element("css selector", "#charts figure[data-key=temp]"), what="the temperature chart")
    lines = temp.find_elements("css selector", "path.line")
    assert len(lines) == 8, "one line per GPU"
    # 30 samples before the fault and 5 after, each a point of GPU 0's line
    d = lines[0].get_attribute("d")
    assert d.count("L") + 1 >= 30, d
    # the Xid 79 marked where it happened, on each chart
    xids = temp.find_elements("css selector", "g.marker.xid title")
    assert any("Xid 79 GPU 3" in t.get_attribute("textContent") for t in xids)
    assert "Xid 79 GPU 3" in temp.find_element("css selector", "figcaption").text
    keys = {f.get_attribute("data-key") for f in browser.find_elements("css selector", "#charts figure")}
    assert {"temp", "power", "util", "ecc_sbe", "ecc_dbe"} <= keys, keys
    # a counter that never moved is one line of text, not an empty box
    flat = browser.find_element("css selector", "#charts figure.flat[data-key=ecc_dbe]")
    assert "0 on every GPU" in flat.text and not flat.find_elements("css selector", "svg")
    # time axis labels: clock times
    ticks = [t.text for t in temp.find_elements("css selector", "svg > text") if ":" in t.text]
    assert len(ticks) == 5, ticks
    # its step time against the job's peers, with their band
    step = browser.find_element("css selector", "#timeline figure[data-key=step_time]")
    assert {p.get_attribute("data-label") for p in step.find_elements("css selector", "path.line")} == {"peers' median", bad}
    assert step.find_elements("css selector", "polygon.band")
    node_d = step.find_element("css selector", f"path.line[data-label='{bad}']").get_attribute("d")
    assert node_d.count("L") + 1 >= 25, node_d
    # the findings over time: more than one point, not a lone dot in an empty box
    findings = browser.find_element("css selector", "#timeline figure[data-key=findings]")
    assert findings.find_elements("css selector", "g.marker.anomaly")
    evidence = _text(browser, "#nodeverdicts")
    assert "gpu_hardware node" in evidence and "gpu_lost" in evidence and "{" not in evidence
    assert f"applied: isolate {bad}" in evidence  # what was done, under its verdict
    assert "recording" in _text(browser, "#recording")
    SHOTS.mkdir(parents=True, exist_ok=True)
    browser.set_window_size(1400, 1500)
    browser.save_screenshot(str(SHOTS / "dashboard_node.png"))
    browser.set_window_size(1400, 900)
    assert (SHOTS / "dashboard_node.png").stat().st_size > 10_000


def test_the_jobs_view_shows_attempts_placements_verdicts_and_excluded_nodes(browser, fleet):
    bad, job = fleet["bad"], fleet["job"]
    _open(browser, fleet["url"], "#jobs")
    row = _wait(lambda: browser.find_element("css selector", f"#jobs tr[data-job='{job}']"), what="the job's row")
    cells = [c.text for c in row.find_elements("css selector", "td")]
    assert cells[0] == job and int(cells[3]) >= 1, cells
    _set(browser, "jobsearch", "no-such-job")
    assert not browser.find_elements("css selector", "#jobs tbody tr")
    _set(browser, "jobsearch", "llm")
    browser.find_element("css selector", f"#jobs tr[data-job='{job}'] td:nth-child(2)").click()
    _wait(lambda: _text(browser, "#jobtitle") == f"job {job}", what="the job page")
    _wait(lambda: browser.find_elements("css selector", "#job-excluded"), what="the excluded nodes")
    assert _text(browser, "#job-excluded") == bad
    assert browser.find_element("css selector", f"#jobnodes .chip.excluded[data-node='{bad}']")
    failures = _text(browser, "#jobfailures")
    assert "CUDA error: unspecified launch failure" in failures and "1" in failures
    verdicts = _text(browser, "#jobverdicts")
    assert f"exclude {bad}" in verdicts and f"applied: requeue {job}" in verdicts, verdicts
    SHOTS.mkdir(parents=True, exist_ok=True)
    browser.save_screenshot(str(SHOTS / "dashboard_job.png"))


def test_held_isolations_are_approved_and_rejected_on_the_page(browser, fleet):
    worker, api = fleet["worker"], fleet["api"]
    approve, reject = fleet["held"]
    _open(browser, fleet["url"], "#held")
    cards = _wait(lambda: len(browser.find_elements("css selector", "#heldlist .card.held")) == 2
                  and browser.find_elements("css selector", "#heldlist .card.held"), what="two held isolations")
    by_node = {c.get_attribute("data-node"): c for c in cards}
    assert set(by_node) == {approve, reject}
    assert "gpu_lost" in by_node[approve].text and "{" not in by_node[approve].text
    SHOTS.mkdir(parents=True, exist_ok=True)
    browser.save_screenshot(str(SHOTS / "dashboard_held.png"))
    by_node[approve].find_element("css selector", "button.approve").click()
    _wait(lambda: "approved (verdict op-" in by_node[approve].text, what="the approval answered")
    by_node[reject].find_element("css selector", "button.reject").click()
    _wait(lambda: "rejected (verdict op-" in by_node[reject].text, what="the rejection answered")
    # carried out like any verdict: the approved node is cordoned, the rejected one is not
    _wait(lambda: api.state(lambda c: c.nodes[approve].cordoned), timeout=60, what=f"{approve} cordoned")
    assert api.state(lambda c: c.nodes[reject].cordoned) is False
    assert api_call(worker, "GET", "/api/v1/held")[1]["held"] == []
    assert browser.execute_script(f"return window.fleetmedic.held('{approve}') || window.fleetmedic.held('{reject}')") is False
    _wait(lambda: _text(browser, "#heldcount") == "0", timeout=30, what="nothing held in the header")
    browser.refresh()
    _wait(lambda: browser.find_elements("id", "held-empty"), what="the empty held list")


def test_ten_thousand_nodes_render_and_update_without_stalling(kafka_bootstrap, tmp_path):
    """The measurement make bench reports (bench/results/dashboard.json), at full size and
    one short run: here only that it runs and its figures are well formed."""
    from pipeline.eval.dashboard import run, table

    out = tmp_path / "dashboard.json"
    r = run(bootstrap=kafka_bootstrap, nodes=10_000, logdir=tmp_path / "logs", out=out, runs=1, seconds=2.0,
            shot=SHOTS / "dashboard_10k.png")
    assert orjson.loads(out.read_bytes())["nodes"] == 10_000
    assert r["switch_blocks"] >= 300  # 32 nodes a leaf in the benchmark's fleet
    for key in ("load_ms", "relayout_ms", "idle_frame_p95_ms", "frame_p50_ms", "frame_p95_ms", "frame_p99_ms",
                "frame_max_ms", "stall_ratio", "node_events_per_s"):
        assert isinstance(r[key], float) and r[key] > 0, (key, r[key])
        assert r[f"{key}_min"] <= r[key] <= r[f"{key}_max"]
    assert r["node_events_per_s"] > 100  # the page took the updates it was given
    print(table(r))


def test_signing_in_through_keycloak_with_the_authorization_code_and_pkce(browser, kafka_bootstrap, keycloak):
    """The dashboard's sign-in against a real Keycloak: the page sends the browser to
    Keycloak's login form with an S256 code challenge, takes the code back, exchanges it
    (with the verifier) at Keycloak's token endpoint and reads the fleet with that token."""
    from urllib.parse import parse_qs, urlsplit

    from pipeline.config import load_settings

    api = ClusterAPI(load_settings(environ={}))
    api.add_nodes([f"kc-{i:02d}" for i in range(30)])
    worker = Worker(kafka_bootstrap, sim_url=api.url, env={
        "FLEETMEDIC_AUTH__ENABLED": "true", "FLEETMEDIC_AUTH__ISSUER": keycloak.issuer,
        "FLEETMEDIC_AUTH__AUDIENCE": "fleetmedic", "FLEETMEDIC_AUTH__DASHBOARD_CLIENT": "fleetmedic-dashboard"})
    base = f"http://127.0.0.1:{worker.env['FLEETMEDIC_WORKER__WEB_PORT']}"
    # the administrator registers where this dashboard is served
    keycloak.update_client("fleetmedic-dashboard", redirectUris=[f"{base}/*"], webOrigins=["+"])
    worker.start()
    try:
        produce(kafka_bootstrap, [(worker.topic("telemetry.gpu"), n, gpu_sample(n, time.time()))
                                  for n in ("kc-00", "kc-01")])
        browser.delete_all_cookies()
        browser.get(f"{base}/dashboard")
        browser.execute_script("sessionStorage.clear()")
        browser.get(f"{base}/dashboard")
        _wait(lambda: browser.find_element("id", "signin").is_displayed(), what="the sign-in button")
        assert "Sign in" in browser.find_element("id", "banner").text
        browser.find_element("id", "signin").click()
        _wait(lambda: browser.current_url.startswith(keycloak.issuer), what="Keycloak's login page")
        q = parse_qs(urlsplit(browser.current_url).query)
        assert q["code_challenge_method"] == ["S256"] and len(q["code_challenge"][0]) == 43, q
        assert q["client_id"] == ["fleetmedic-dashboard"] and q["response_type"] == ["code"]
        SHOTS.mkdir(parents=True, exist_ok=True)
        _wait(lambda: browser.find_elements("id", "username"), what="the login form")
        browser.save_screenshot(str(SHOTS / "dashboard_keycloak_login.png"))
        browser.find_element("id", "username").send_keys("ada")
        browser.find_element("id", "password").send_keys(keycloak.password("ada"))
        browser.find_element("id", "kc-login").click()
        _wait(lambda: browser.current_url.startswith(base), timeout=30, what="the way back to the dashboard")
        _wait(lambda: "ada (operator)" in browser.find_element("id", "whoami").text, what="the signed-in user")
        _wait(lambda: "live" in browser.find_element("id", "live").text, what="the event stream")
        assert "code=" not in browser.current_url  # the code is taken out of the address bar
        tok = browser.execute_script("return sessionStorage.getItem('fleetmedic-token')")
        import jwt

        claims = jwt.decode(tok, options={"verify_signature": False})
        assert claims["iss"] == keycloak.issuer and claims["azp"] == "fleetmedic-dashboard"
        assert "fleetmedic" in ([claims["aud"]] if isinstance(claims["aud"], str) else claims["aud"])
        _wait(lambda: int(browser.find_element("id", "counts").text.split()[0]) >= 2, what="the fleet counted")
        assert not browser.find_element("id", "signin").is_displayed()
        # an operator's token: the held list's buttons and the node page's actions are on
        browser.get(f"{base}/dashboard#node=kc-00")
        _wait(lambda: browser.find_elements("id", "act-return"), what="the operator's node actions")
        browser.save_screenshot(str(SHOTS / "dashboard_signed_in.png"))
        # signing out ends the Keycloak session too: the next sign-in asks for a password again
        browser.find_element("id", "signout").click()
        _wait(lambda: browser.current_url.startswith(base) and browser.find_element("id", "signin").is_displayed(),
              timeout=30, what="signed out")
        assert browser.execute_script("return sessionStorage.getItem('fleetmedic-token')") is None
        browser.find_element("id", "signin").click()
        _wait(lambda: browser.find_elements("id", "username"), what="the login form again")
    finally:
        worker.stop()
        api.close()
