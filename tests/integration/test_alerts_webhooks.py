"""Alert webhooks from a real worker on the real broker to receivers on loopback.

One receiver answers 503 to its first two posts (then 200), one is signed with a secret,
one is a closed port: every verdict reaches each live receiver exactly once, signed; the
dead receiver's deliveries are given up and recorded on ``actions``; the isolations go on
as if no receiver existed.  The escalation webhook (``actuators.webhook_url``) is a port
that takes connections and never answers: the actions after an escalation do not wait
for it, and its give-up is recorded.
"""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path

import pytest
from aiohttp import web

from actuators.webhook import SIGNATURE_HEADER, verify

from .harness import BackgroundLoop, ClusterAPI, Worker, collect, free_port, lose_gpus, produce, serve

pytestmark = pytest.mark.integration

SECRET = "it-hook-secret"


class Sink:
    """An aiohttp receiver in a background loop; ``fail_first`` posts answer 503."""

    def __init__(self, bg: BackgroundLoop, fail_first: int = 0) -> None:
        self.bg = bg
        self.fail_first = fail_first
        self.posts = 0
        self.received: list[tuple[dict[str, str], bytes]] = []

        async def hook(request: web.Request) -> web.Response:
            body = await request.read()
            self.posts += 1
            if self.posts <= self.fail_first:
                return web.Response(status=503, text="not now")
            self.received.append((dict(request.headers), body))
            return web.Response(status=200, text="ok")

        self.runner, self.port = serve(bg, [("POST", "/hook", hook)])

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/hook"

    def close(self) -> None:
        self.bg.run(self.runner.cleanup())


@pytest.fixture(scope="module")
def setup(kafka_bootstrap, tmp_path_factory):
    from pipeline.config import load_settings

    bg = BackgroundLoop()
    flaky, signed = Sink(bg, fail_first=2), Sink(bg)
    dead_port = free_port()  # nothing listens there
    mute = socket.socket()  # the kernel takes connections into the backlog; nobody answers
    mute.bind(("127.0.0.1", 0))
    mute.listen(64)
    cfg = Path(tmp_path_factory.mktemp("alerts")) / "fleetmedic.toml"
    cfg.write_text(f"""
[actuators]
max_attempts = 2
webhook_url = "http://127.0.0.1:{mute.getsockname()[1]}/hook"

[alerts]
max_attempts = 4
base_delay_s = 0.2
max_delay_s = 1.0

[[alerts.webhooks]]
name = "flaky"
url = "{flaky.url}"
format = "alertmanager"

[[alerts.webhooks]]
name = "signed"
url = "{signed.url}"
format = "cloudevents"
secret = "{SECRET}"

[[alerts.webhooks]]
name = "dead"
url = "http://127.0.0.1:{dead_port}/hook"
timeout_s = 2
""")
    api = ClusterAPI(load_settings(environ={}))
    worker = Worker(kafka_bootstrap, sim_url=api.url, env={"FLEETMEDIC_CONFIG": str(cfg),
                                                          "FLEETMEDIC_SAFETY__FLEET_SIZE": "40"})
    worker.start()
    yield kafka_bootstrap, worker, api, flaky, signed
    worker.stop()
    api.close()
    flaky.close()
    signed.close()
    bg.stop()
    mute.close()


def test_every_verdict_reaches_each_receiver_once_and_a_dead_one_delays_nothing(setup):
    bootstrap, worker, api, flaky, signed = setup
    nodes = ["al-0", "al-1", "al-2"]
    api.add_nodes(nodes)
    lose_gpus(bootstrap, worker, nodes)
    # the isolations are carried out whatever the receivers do
    collect(bootstrap, worker.topic("actions"),
            lambda rs: sum(1 for a in rs if a["action"] == "isolate" and a["outcome"] == "applied"
                           and a["target"] in nodes) == 3, timeout=60)
    verdicts = collect(bootstrap, worker.topic("verdicts"),
                       lambda rs: sum(1 for v in rs if v["subject"] in nodes) >= 3)
    ids = sorted(v["id"] for v in verdicts if v["subject"] in nodes)
    assert len(ids) == 3, verdicts
    # each live receiver: exactly one delivery per verdict (the flaky one after two 503s)
    deadline = time.time() + 30
    while time.time() < deadline and (len(flaky.received) < 3 or len(signed.received) < 3):
        time.sleep(0.2)
    time.sleep(1.0)  # nothing more comes
    got_flaky = sorted(json.loads(b)["alerts"][0]["annotations"]["verdict_id"] for _, b in flaky.received)
    got_signed = sorted(json.loads(b)["id"] for _, b in signed.received)
    assert got_flaky == ids, f"{got_flaky} != {ids}\n{worker.log_tail()}"
    assert got_signed == ids
    assert flaky.posts == 5  # two refused, three delivered
    for headers, body in signed.received:
        assert verify(SECRET, body, headers[SIGNATURE_HEADER])
        assert json.loads(body)["specversion"] == "1.0"
    # every delivery's outcome is an actions record; the dead receiver's are given up, not dropped
    alerts = collect(bootstrap, worker.topic("actions"),
                     lambda rs: sum(1 for a in rs if a["backend"] == "webhook:dead") >= 3, timeout=60)
    mine = [a for a in alerts if a["backend"].startswith("webhook:") and a["verdict_id"] in ids]
    by = {(a["backend"], a["verdict_id"]): a for a in mine}
    assert all(by[("webhook:flaky", i)]["outcome"] == "applied" for i in ids)
    assert sorted(by[("webhook:flaky", i)]["attempts"] for i in ids)[-1] == 3
    assert all(by[("webhook:signed", i)]["outcome"] == "applied" for i in ids)
    dead = [by[("webhook:dead", i)] for i in ids]
    assert all(a["outcome"] == "failed" and a["attempts"] == 4 and "gave up" in a["detail"] for a in dead)
    assert all(a["action"] == "escalate" for a in mine)
    assert worker.alive()


def test_prometheus_metrics_count_what_the_worker_did(setup):
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    bootstrap, worker, api, flaky, signed = setup
    port = worker.env["FLEETMEDIC_WORKER__WEB_PORT"]
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for fam in text_string_to_metric_families(text) for s in fam.samples}

    def total(name: str, **labels: str) -> float:
        return sum(v for (n, ls), v in samples.items() if n == name and labels.items() <= dict(ls).items())

    assert total("fleetmedic_verdicts_total", fault_class="gpu_hardware") >= 3
    assert total("fleetmedic_actions_total", action="isolate", outcome="applied") >= 3
    assert total("fleetmedic_records_total", result="ok") >= 3
    assert total("fleetmedic_detect_seconds_count", detector="GPU") >= 1
    assert total("fleetmedic_detect_seconds_sum", detector="GPU") > 0
    assert total("fleetmedic_breaker_budget") == 4  # 10% of the 40-node fleet
    assert total("fleetmedic_breaker_isolations") == 3
    lag = [v for (n, ls), v in samples.items() if n == "fleetmedic_event_lag_seconds"]
    # wall time minus the newest event time: the test's samples are stamped up to 2 s ahead
    assert lag and all(-5 < v < 120 for v in lag)


def test_an_escalation_webhook_that_never_answers_delays_no_later_action(setup):
    from schemas import PlannedAction, Verdict

    bootstrap, worker, api, flaky, signed = setup
    api.add_nodes(["esc-0", "esc-1"])
    now = time.time()
    esc = Verdict(ts=now, id="v-it-esc", incident="inc-it-esc", scope="node", subject="esc-0",
                  fault_class="unknown", confidence=0.6,
                  actions=[PlannedAction(action="escalate", target="esc-0", params={"reason": "lemon"})])
    iso = Verdict(ts=now, id="v-it-iso", incident="inc-it-iso", scope="node", subject="esc-1",
                  fault_class="gpu_hardware", confidence=0.9,
                  actions=[PlannedAction(action="isolate", target="esc-1")])
    topic = worker.topic("verdicts")
    # one key, one partition: the isolation is read after the escalation
    produce(bootstrap, [(topic, "esc", esc.to_json()), (topic, "esc", iso.to_json())])
    actions = collect(bootstrap, worker.topic("actions"),
                      lambda rs: any(a["verdict_id"] == "v-it-esc" and a["backend"] == "webhook" for a in rs),
                      timeout=90)
    order = [(a["verdict_id"], a["action"], a["backend"], a["outcome"]) for a in actions
             if a["verdict_id"] in ("v-it-esc", "v-it-iso")]
    hook = next(i for i, a in enumerate(order) if a[2] == "webhook")
    isolated = next(i for i, a in enumerate(order) if a[:2] == ("v-it-iso", "isolate"))
    # the isolation was carried out while the webhook still hung (two attempts of 10 s)
    assert isolated < hook, order
    assert order[isolated][3] == "applied"
    assert order[hook][3] == "failed" and order[hook][1] == "escalate", order
    assert worker.alive()
