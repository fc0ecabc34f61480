"""The live dashboard in headless Chromium (Debian's, installed by deploy/chromium.sh):
during a run a node turns isolated on the page without a reload, its node page shows the
anomaly history and the verdict's evidence.  Screenshots go to a temporary directory, or
to $FLEETMEDIC_SCREENSHOTS when set (bench/results/ holds the committed ones)."""

from __future__ import annotations

import os
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from .harness import ROOT, ClusterAPI, Worker, gpu_sample, produce

pytestmark = pytest.mark.integration

SHOTS = Path(os.environ.get("FLEETMEDIC_SCREENSHOTS") or tempfile.mkdtemp(prefix="fleetmedic-shots-"))


def _chromium() -> tuple[str, str]:
    out = subprocess.run(["bash", str(ROOT / "deploy" / "chromium.sh"), "ensure"], capture_output=True, text=True,
                         timeout=900)
    assert out.returncode == 0, f"deploy/chromium.sh ensure failed:\n{out.stderr[-3000:]}"
    paths = dict(line.split("=", 1) for line in out.stdout.strip().splitlines()[-2:])
    return paths["CHROME"], paths["DRIVER"]


@pytest.fixture(scope="module")
def browser():
    import os

    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    chrome, driver = _chromium()
    os.environ.setdefault("SE_OFFLINE", "true")  # never let Selenium Manager look for a driver online
    opts = webdriver.ChromeOptions()
    opts.binary_location = chrome
    for a in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu", "--window-size=1400,900"):
        opts.add_argument(a)
    b = webdriver.Chrome(service=Service(executable_path=driver), options=opts)
    b.set_page_load_timeout(30)
    yield b
    b.quit()


@pytest.fixture(scope="module")
def run(kafka_bootstrap):
    from pipeline.config import load_settings

    api = ClusterAPI(load_settings(environ={}))
    worker = Worker(kafka_bootstrap, sim_url=api.url, env={"FLEETMEDIC_SAFETY__FLEET_SIZE": "200"})
    worker.start()
    yield kafka_bootstrap, worker, api
    worker.stop()
    api.close()


def _wait(fn, timeout: float = 30.0, what: str = "condition"):
    end = time.time() + timeout
    while time.time() < end:
        v = fn()
        if v:
            return v
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def test_a_node_turns_isolated_live_and_its_page_shows_why(browser, run):
    bootstrap, worker, api = run
    nodes = [f"db-{i:03d}" for i in range(120)]
    api.add_nodes(nodes)
    now = time.time()
    topic = worker.topic("telemetry.gpu")
    # a healthy fleet first: every node reports, the page shows them all
    produce(bootstrap, [(topic, n, gpu_sample(n, now)) for n in nodes])
    # the node track learns of nodes from anomalies and notices; a few warnings make tiles appear
    sbe = [(topic, "db-007", gpu_sample("db-007", now + 5 * k, sbe=[k * 40] + [0] * 7)) for k in range(1, 4)]
    produce(bootstrap, sbe)
    port = worker.env["FLEETMEDIC_WORKER__WEB_PORT"]
    browser.get(f"http://127.0.0.1:{port}/dashboard")
    _wait(lambda: "live" in browser.find_element("id", "live").text, what="the event stream")
    assert "Sign-in is off" in browser.find_element("id", "banner").text
    browser.execute_script("window.__notReloaded = true;")
    # a GPU falls off the bus on db-042: the worker isolates the node
    lost = [False] * 8
    lost[3] = True
    produce(bootstrap, [(topic, "db-042", gpu_sample("db-042", time.time(), lost=lost, xids=[(3, 79)]))])
    _wait(lambda: browser.execute_script("return window.fleetmedic.state('db-042')") in ("isolated", "diagnosing"),
          what="db-042 isolated on the page")
    iso_color = browser.execute_script("return window.fleetmedic.colors[window.fleetmedic.state('db-042')]")
    _wait(lambda: browser.execute_script("return window.fleetmedic.tileColor('db-042')") == iso_color,
          what="db-042's tile painted")
    assert browser.execute_script("return window.__notReloaded === true")  # no reload happened
    events = browser.find_element("id", "events").text
    assert "gpu_hardware node db-042" in events and "isolate db-042" in events
    SHOTS.mkdir(parents=True, exist_ok=True)
    browser.save_screenshot(str(SHOTS / "dashboard_fleet.png"))
    # the node page: state, anomaly history plots, the verdict's evidence
    x, y = browser.execute_script("return window.fleetmedic.tileCenter('db-042')")
    from selenium.webdriver.common.action_chains import ActionChains

    canvas = browser.find_element("id", "fleet")
    w, h = canvas.size["width"], canvas.size["height"]
    ActionChains(browser).move_to_element_with_offset(canvas, int(x - w / 2), int(y - h / 2)).click().perform()
    _wait(lambda: browser.find_element("id", "nodetitle").text == "db-042", what="the node page")
    _wait(lambda: browser.find_elements("id", "node-state"), what="the node's state")
    assert browser.find_element("id", "node-state").text in ("isolated", "diagnosing", "healthy")
    _wait(lambda: browser.find_elements("css selector", "#sparks svg path"), what="anomaly plots")
    for svg in browser.find_elements("css selector", "#sparks svg"):
        # one line through every anomaly of the kind, and a dot on each
        d = svg.find_element("css selector", "path").get_attribute("d")
        dots = len(svg.find_elements("css selector", "circle"))
        assert dots >= 1 and d.startswith("M") and d.count("L") == dots - 1, (d, dots)
    evidence = browser.find_element("id", "nodeverdicts").text
    assert "gpu_hardware" in evidence and '"kind": "gpu_lost"' in evidence and '"gpu": 3' in evidence
    browser.save_screenshot(str(SHOTS / "dashboard_node.png"))
    assert (SHOTS / "dashboard_node.png").stat().st_size > 10_000


def test_ten_thousand_nodes_are_one_canvas_not_ten_thousand_elements(browser, run):
    _, worker, _ = run
    port = worker.env["FLEETMEDIC_WORKER__WEB_PORT"]
    browser.get(f"http://127.0.0.1:{port}/dashboard")
    _wait(lambda: "live" in browser.find_element("id", "live").text, what="the event stream")
    before = browser.execute_script("return document.getElementsByTagName('*').length")
    took = browser.execute_script("""
        const t0 = performance.now();
        for (let i = 0; i < 10000; i++) window.fleetmedic.feed("node", {node: "big-" + String(i).padStart(5, "0"), state: "healthy"});
        for (let i = 0; i < 10000; i += 7) window.fleetmedic.feed("node", {node: "big-" + String(i).padStart(5, "0"), state: "suspect"});
        window.fleetmedic.feed("node", {node: "big-09999", state: "failed"});
        return performance.now() - t0;""")
    after = browser.execute_script("return document.getElementsByTagName('*').length")
    assert after == before  # node updates repaint tiles; they add no elements
    assert browser.execute_script("return window.fleetmedic.tileColor('big-09999')") == "#c62828"
    assert browser.execute_script("return window.fleetmedic.tileColor('big-00007')") == "#f9a825"
    assert int(browser.find_element("id", "counts").text.split()[0]) >= 10000
    print(f"11,430 node events on a 10,000-node page in {took:.0f} ms")


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
        assert int(browser.find_element("id", "counts").text.split()[0]) >= 2
        assert not browser.find_element("id", "signin").is_displayed()
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
