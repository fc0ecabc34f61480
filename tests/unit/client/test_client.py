"""The checkpoint-now client a training job imports (``fleetmedic.client``).

The annotations file is laid out as the kubelet's ``AtomicWriter`` lays out a downward API
volume (kubernetes/kubernetes ``pkg/volume/util/atomic_writer.go``; the "Expose Pod
Information to Containers Through Files" task page): the visible ``annotations`` is a
symlink to ``..data/annotations``, ``..data`` a symlink to a timestamped directory, and an
update writes a new directory and renames a new ``..data`` over the old one.  Its lines are
``fieldpath.FormatMap``'s: ``key="value"`` with Go's ``%q``, sorted by key.  The lines
around ours are the kubelet output printed in the Kubernetes docs' downward API volume
example (docs/user-guide/downward-api/volume/README.md, Kubernetes 1.1).
"""

from __future__ import annotations

import io
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from types import FrameType, ModuleType
from typing import Any

import jsonschema
import pytest

import fleetmedic.client as fm
from fleetmedic.client import ANNOTATION, CheckpointClient, format_deadline, parse_annotations, parse_deadline
from schemas import JobEvent, JobEventKind
from schemas.codec import decode
from schemas.jsonschema import JSON_DIR

ROOT = Path(__file__).resolve().parents[3]
DEADLINE = "2026-12-07T01:02:03Z"
DEADLINE_TS = 1796605323.0  # date -u -d 2026-12-07T01:02:03Z +%s
#: what the kubelet wrote for the Kubernetes docs' example pod
KUBELET_LINES = {
    "build": "two",
    "builder": "john-doe",
    "kubernetes.io/config.seen": "2015-08-24T13:47:23.432459138Z",
    "kubernetes.io/config.source": "api",
}


def go_quote(value: str) -> str:
    """Go's ``strconv.Quote`` for the values used here (``%q`` in ``FormatMap``)."""
    short = {"\a": r"\a", "\b": r"\b", "\f": r"\f", "\n": r"\n", "\r": r"\r", "\t": r"\t", "\v": r"\v",
             "\\": r"\\", '"': r"\""}
    out = []
    for ch in value:
        if ch in short:
            out.append(short[ch])
        elif ch.isprintable():
            out.append(ch)
        elif ord(ch) < 0x80:
            out.append(f"\\x{ord(ch):02x}")
        elif ord(ch) <= 0xFFFF:
            out.append(f"\\u{ord(ch):04x}")
        else:
            out.append(f"\\U{ord(ch):08x}")
    return '"' + "".join(out) + '"'


def format_map(values: dict[str, str]) -> str:
    """``fieldpath.FormatMap``: sorted keys, ``key=%q`` lines, no final newline."""
    return "\n".join(f"{key}={go_quote(values[key])}" for key in sorted(values))


class Podinfo:
    """A downward API volume as the kubelet's AtomicWriter keeps it."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.generation = 0
        root.mkdir(parents=True, exist_ok=True)

    @property
    def annotations(self) -> str:
        return str(self.root / "annotations")

    def write(self, annotations: dict[str, str], labels: dict[str, str] | None = None,
              namespace: str | None = None) -> None:
        self.generation += 1
        stamp = self.root / f"..2026_12_07_01_02_{self.generation:02d}.{self.generation:09d}"
        stamp.mkdir()
        files = {"annotations": format_map(annotations)}
        if labels is not None:
            files["labels"] = format_map(labels)
        if namespace is not None:
            files["namespace"] = namespace
        for name, text in files.items():
            (stamp / name).write_text(text)
        data = self.root / "..data"
        old = os.readlink(data) if data.is_symlink() else None
        os.symlink(stamp.name, self.root / "..data_tmp")
        os.replace(self.root / "..data_tmp", data)  # rename(2): the swap readers never see half of
        for name in files:
            if not (self.root / name).is_symlink():
                os.symlink(f"..data/{name}", self.root / name)
        if old is not None:
            shutil.rmtree(self.root / old)


class Clocks:
    def __init__(self) -> None:
        self.wall = 1796600000.0
        self.mono = 100.0

    def advance(self, seconds: float) -> None:
        self.wall += seconds
        self.mono += seconds


@pytest.fixture
def clocks() -> Clocks:
    return Clocks()


@pytest.fixture
def podinfo(tmp_path: Path) -> Podinfo:
    return Podinfo(tmp_path / "podinfo")


@pytest.fixture(autouse=True)
def sigusr1_restored() -> Iterator[None]:
    before = signal.getsignal(signal.SIGUSR1)
    yield
    fm.uninstall()
    signal.signal(signal.SIGUSR1, before if before is not None else signal.SIG_DFL)


def make_client(clocks: Clocks, tmp_path: Path, podinfo: Podinfo | None = None, **env: str) -> CheckpointClient:
    environ = {"FLEETMEDIC_JOB": "research/llm-pretrain", "FLEETMEDIC_SCHEDULER": "kubernetes",
               "FLEETMEDIC_ACK_FILE": str(tmp_path / "acks.jsonl"),
               "FLEETMEDIC_PODINFO_ANNOTATIONS": podinfo.annotations if podinfo else str(tmp_path / "none")}
    environ.update(env)
    return CheckpointClient(environ=environ, clock=lambda: clocks.wall, monotonic=lambda: clocks.mono)


def acks(tmp_path: Path) -> list[dict[str, Any]]:
    path = tmp_path / "acks.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def job_validator() -> Any:
    schema = json.loads((JSON_DIR / "job.schema.json").read_text())
    cls = jsonschema.validators.validator_for(schema)
    cls.check_schema(schema)
    return cls(schema)


# --------------------------------------------------------------------------- formats


def test_the_kubelets_annotation_lines_parse_back_to_the_values() -> None:
    values = dict(KUBELET_LINES)
    values["key2"] = "multi\nline\n"  # a block scalar annotation: %q keeps it on one line
    values["note"] = 'say "hi"\\ café \x01 \u2028'
    values[ANNOTATION] = DEADLINE
    text = format_map(values)
    assert text.splitlines()[0] == 'build="two"'
    assert 'key2="multi\\nline\\n"' in text.splitlines()
    assert parse_annotations(text) == values


def test_lines_that_do_not_parse_are_left_out() -> None:
    text = ('build="two"\n'
            'broken="no closing quote\n'
            'bad="\\q"\n'
            'noequals\n'
            '=""\n'
            'trailing="a"b"\n'
            f'{ANNOTATION}="{DEADLINE}')  # the last line cut short
    assert parse_annotations(text) == {"build": "two"}


@pytest.mark.parametrize(("text", "expected"), [
    (DEADLINE, DEADLINE_TS),
    ("2026-12-07T01:02:03.25Z", DEADLINE_TS + 0.25),
    ("2026-12-07T01:02:03+00:00", DEADLINE_TS),
    ("2026-12-06T20:02:03-05:00", DEADLINE_TS),
    ("2026-12-07t01:02:03z", DEADLINE_TS),
    (" 2026-12-07T01:02:03Z\n", DEADLINE_TS),
    ("1796605323", DEADLINE_TS),
    ("1796605323.5", DEADLINE_TS + 0.5),
])
def test_deadlines_in_rfc3339_or_unix_seconds(text: str, expected: float) -> None:
    assert parse_deadline(text) == pytest.approx(expected, abs=1e-6)


@pytest.mark.parametrize("text", ["", "soon", "2026-12-07", "2026-12-07T01:02:03", "2026-13-07T01:02:03Z",
                                  "2026-12-07T01:02:03+25:00", "nan", "inf", "-5", "0x10"])
def test_malformed_deadlines_are_refused(text: str) -> None:
    with pytest.raises(ValueError):
        parse_deadline(text)


def test_a_deadline_is_written_as_rfc3339_utc_seconds() -> None:
    assert format_deadline(DEADLINE_TS + 0.9) == DEADLINE
    assert parse_deadline(format_deadline(DEADLINE_TS)) == DEADLINE_TS


# --------------------------------------------------------------------------- the signal


def test_sigusr1_is_a_checkpoint_request(clocks: Clocks, tmp_path: Path) -> None:
    client = make_client(clocks, tmp_path)
    client.install_signal()
    assert not client.checkpoint_requested()
    signal.raise_signal(signal.SIGUSR1)
    assert client.checkpoint_requested()
    assert client.deadline() is None  # the signal carries none
    assert [r.channel for r in client.pending()] == ["signal"]


def test_the_previous_handler_is_chained_and_restored(clocks: Clocks, tmp_path: Path) -> None:
    calls: list[int] = []

    def previous(signum: int, frame: FrameType | None) -> None:
        calls.append(signum)

    signal.signal(signal.SIGUSR1, previous)
    client = make_client(clocks, tmp_path)
    client.install_signal()
    client.install_signal()  # idempotent: still one handler in front of the previous one
    signal.raise_signal(signal.SIGUSR1)
    assert calls == [signal.SIGUSR1]
    assert client.checkpoint_requested()
    client.uninstall_signal()
    assert signal.getsignal(signal.SIGUSR1) is previous


def test_an_ignored_signal_stays_ignored_after_uninstall(clocks: Clocks, tmp_path: Path) -> None:
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    client = make_client(clocks, tmp_path)
    client.install_signal()
    signal.raise_signal(signal.SIGUSR1)
    assert client.checkpoint_requested()
    client.uninstall_signal()
    assert signal.getsignal(signal.SIGUSR1) == signal.SIG_IGN


def test_installing_the_handler_off_the_main_thread_is_a_clear_error() -> None:
    before = signal.getsignal(signal.SIGUSR1)
    errors: list[BaseException] = []
    seen: list[bool] = []

    def run() -> None:
        try:
            fm.install(job="research/llm-pretrain", scheduler="kubernetes")
        except RuntimeError as exc:
            errors.append(exc)
        client = fm.install(job="research/llm-pretrain", scheduler="kubernetes", signum=None)
        seen.append(client.checkpoint_requested())

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    assert len(errors) == 1 and "main thread" in str(errors[0])
    assert seen == [False]
    assert signal.getsignal(signal.SIGUSR1) == before


def test_a_signal_after_the_acknowledgement_is_a_new_request(clocks: Clocks, tmp_path: Path) -> None:
    client = make_client(clocks, tmp_path)
    client.install_signal()
    signal.raise_signal(signal.SIGUSR1)
    assert client.checkpoint_requested()
    client.acknowledge(10)
    assert not client.checkpoint_requested()
    signal.raise_signal(signal.SIGUSR1)
    assert client.checkpoint_requested()


def test_a_signal_arriving_while_the_job_saves_is_not_lost(clocks: Clocks, tmp_path: Path) -> None:
    client = make_client(clocks, tmp_path)
    client.install_signal()
    signal.raise_signal(signal.SIGUSR1)
    assert client.checkpoint_requested()
    signal.raise_signal(signal.SIGUSR1)  # after the loop looked, before it acknowledged
    client.acknowledge(10)
    assert client.checkpoint_requested()


# --------------------------------------------------------------------------- the annotation


def test_the_annotation_appearing_through_the_kubelets_swap_is_a_request(
        clocks: Clocks, tmp_path: Path, podinfo: Podinfo) -> None:
    podinfo.write(KUBELET_LINES)
    client = make_client(clocks, tmp_path, podinfo)
    assert not client.checkpoint_requested()
    podinfo.write({**KUBELET_LINES, ANNOTATION: DEADLINE})
    clocks.advance(1.0)
    assert client.checkpoint_requested()
    assert client.deadline() == DEADLINE_TS
    assert [(r.channel, r.token) for r in client.pending()] == [("annotation", DEADLINE)]


def test_the_file_is_looked_at_once_per_poll_interval(clocks: Clocks, tmp_path: Path, podinfo: Podinfo) -> None:
    podinfo.write(KUBELET_LINES)
    client = make_client(clocks, tmp_path, podinfo, FLEETMEDIC_POLL_S="5")
    assert not client.checkpoint_requested()
    podinfo.write({**KUBELET_LINES, ANNOTATION: DEADLINE})
    clocks.advance(4.0)
    assert not client.checkpoint_requested()
    clocks.advance(1.0)
    assert client.checkpoint_requested()


def test_acknowledge_clears_the_request_and_writes_a_valid_checkpoint_record(
        clocks: Clocks, tmp_path: Path, podinfo: Podinfo) -> None:
    podinfo.write({**KUBELET_LINES, ANNOTATION: DEADLINE})
    client = make_client(clocks, tmp_path, podinfo)
    assert client.checkpoint_requested()
    record = client.acknowledge(1200)
    assert not client.checkpoint_requested()
    assert client.deadline() is None
    lines = (tmp_path / "acks.jsonl").read_text().splitlines()
    assert len(lines) == 1 and json.loads(lines[0]) == record
    assert record == {"schema": "job/1", "ts": clocks.wall, "job": "research/llm-pretrain", "event": "checkpoint",
                      "scheduler": "kubernetes", "attempt": 1, "checkpoint_step": 1200}
    job_validator().validate(record)
    event = decode(JobEvent, lines[0])  # as the worker reads telemetry.job
    assert (event.event, event.checkpoint_step, event.job) == (JobEventKind.checkpoint, 1200, "research/llm-pretrain")


def test_after_an_ack_only_a_new_annotation_value_is_a_request(
        clocks: Clocks, tmp_path: Path, podinfo: Podinfo) -> None:
    podinfo.write({**KUBELET_LINES, ANNOTATION: DEADLINE})
    client = make_client(clocks, tmp_path, podinfo)
    assert client.checkpoint_requested()
    client.acknowledge(5)
    podinfo.write({**KUBELET_LINES, ANNOTATION: DEADLINE, "unrelated": "change"})
    clocks.advance(1.0)
    assert not client.checkpoint_requested()
    later = "2026-12-07T02:00:00.5+00:00"
    podinfo.write({**KUBELET_LINES, ANNOTATION: later})
    clocks.advance(1.0)
    assert client.checkpoint_requested()
    assert client.deadline() == DEADLINE_TS + 3477.5


def test_a_malformed_deadline_is_logged_once_and_means_now(
        clocks: Clocks, tmp_path: Path, podinfo: Podinfo, caplog: pytest.LogCaptureFixture) -> None:
    podinfo.write({ANNOTATION: "in five minutes"})
    client = make_client(clocks, tmp_path, podinfo)
    with caplog.at_level(logging.WARNING, logger="fleetmedic.client"):
        assert client.checkpoint_requested()
        assert client.deadline() == clocks.wall
        podinfo.write({ANNOTATION: "in five minutes", "other": "x"})
        clocks.advance(1.0)
        assert client.checkpoint_requested()
    warnings = [r for r in caplog.records if "malformed deadline" in r.getMessage()]
    assert len(warnings) == 1 and "in five minutes" in warnings[0].getMessage()


def test_the_same_malformed_deadline_in_a_new_request_is_not_logged_again(
        clocks: Clocks, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    flag = tmp_path / "checkpoint-requested"
    client = make_client(clocks, tmp_path, FLEETMEDIC_REQUEST_FILE=str(flag))
    with caplog.at_level(logging.WARNING, logger="fleetmedic.client"):
        flag.write_text("tomorrow")
        assert client.checkpoint_requested() and client.deadline() == clocks.wall
        client.acknowledge(1)
        flag.write_text("tomorrow")
        clocks.advance(1.0)
        assert client.checkpoint_requested() and client.deadline() == clocks.wall
    assert len([r for r in caplog.records if "malformed deadline" in r.getMessage()]) == 1


def test_a_missing_or_half_written_annotations_file_is_no_request_and_no_error(
        clocks: Clocks, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "annotations"  # a plain file written in place, not through the kubelet
    client = make_client(clocks, tmp_path, FLEETMEDIC_PODINFO_ANNOTATIONS=str(path))
    with caplog.at_level(logging.WARNING, logger="fleetmedic.client"):
        assert not client.checkpoint_requested()
        path.write_text(f'build="two"\n{ANNOTATION}="2026-12-07T01:0')
        clocks.advance(1.0)
        assert not client.checkpoint_requested()
        with path.open("a") as fh:
            fh.write('2:03Z"\n')
        clocks.advance(1.0)
        assert client.checkpoint_requested()
        assert client.deadline() == DEADLINE_TS
        path.unlink()
        clocks.advance(1.0)
        assert client.checkpoint_requested()  # a request stays until it is acknowledged
    assert caplog.records == []


def test_the_kubernetes_job_id_comes_from_the_pods_labels(clocks: Clocks, tmp_path: Path, podinfo: Podinfo) -> None:
    labels = {"training.kubeflow.org/job-name": "llm-pretrain", "training.kubeflow.org/replica-type": "worker"}
    podinfo.write({ANNOTATION: DEADLINE}, labels=labels, namespace="research")
    client = CheckpointClient(environ={"FLEETMEDIC_PODINFO_ANNOTATIONS": podinfo.annotations,
                                       "FLEETMEDIC_ACK_FILE": str(tmp_path / "acks.jsonl")},
                              clock=lambda: clocks.wall, monotonic=lambda: clocks.mono)
    assert client.checkpoint_requested()
    record = client.acknowledge(3)
    assert record is not None
    assert (record["job"], record["scheduler"]) == ("research/llm-pretrain", "kubernetes")
    podinfo.write({}, labels={"batch.kubernetes.io/job-name": "eval"}, namespace="research")
    assert client.job_id() == "research/eval"


# --------------------------------------------------------------------------- other channels


def test_the_environment_variable_asks_with_or_without_a_deadline(clocks: Clocks, tmp_path: Path) -> None:
    environ = {"FLEETMEDIC_JOB": "slurm-1", "FLEETMEDIC_SCHEDULER": "slurm",
               "FLEETMEDIC_ACK_FILE": str(tmp_path / "acks.jsonl"),
               "FLEETMEDIC_PODINFO_ANNOTATIONS": str(tmp_path / "none"), "FLEETMEDIC_CHECKPOINT_REQUESTED": "0"}
    client = CheckpointClient(environ=environ, clock=lambda: clocks.wall, monotonic=lambda: clocks.mono)
    assert not client.checkpoint_requested()
    environ["FLEETMEDIC_CHECKPOINT_REQUESTED"] = "1"
    assert client.checkpoint_requested() and client.deadline() is None
    client.acknowledge(1)
    assert not client.checkpoint_requested()
    environ["FLEETMEDIC_CHECKPOINT_REQUESTED"] = DEADLINE
    assert client.checkpoint_requested() and client.deadline() == DEADLINE_TS


def test_the_request_file_asks_and_the_ack_removes_it(clocks: Clocks, tmp_path: Path) -> None:
    flag = tmp_path / "checkpoint-requested"
    client = make_client(clocks, tmp_path, FLEETMEDIC_REQUEST_FILE=str(flag))
    assert not client.checkpoint_requested()
    flag.write_text(DEADLINE + "\n")
    clocks.advance(1.0)
    assert client.checkpoint_requested() and client.deadline() == DEADLINE_TS
    client.acknowledge(9)
    assert not flag.exists()
    flag.touch()  # the batch script's trap, on the next signal
    clocks.advance(1.0)
    assert client.checkpoint_requested() and client.deadline() is None


def test_a_checkpoint_requested_record_for_this_job_is_a_request(clocks: Clocks, tmp_path: Path) -> None:
    client = make_client(clocks, tmp_path)
    ask = {"schema": "job/1", "ts": clocks.wall, "job": "research/llm-pretrain", "event": "checkpoint_requested",
           "scheduler": "kubernetes", "checkpoint_deadline": DEADLINE_TS}
    assert not client.observe_record({**ask, "job": "research/other"})
    assert not client.observe_record({**ask, "event": "checkpoint"})
    assert not client.observe_record(b"not json")
    assert not client.checkpoint_requested()
    assert client.observe_record(json.dumps(ask).encode())
    assert client.checkpoint_requested() and client.deadline() == DEADLINE_TS


def test_the_earliest_pending_deadline_wins(clocks: Clocks, tmp_path: Path, podinfo: Podinfo) -> None:
    podinfo.write({ANNOTATION: DEADLINE})
    client = make_client(clocks, tmp_path, podinfo, FLEETMEDIC_CHECKPOINT_REQUESTED=str(DEADLINE_TS - 60))
    assert client.deadline() == DEADLINE_TS - 60


# --------------------------------------------------------------------------- acknowledgements


def test_slurm_identity_comes_from_the_job_environment(clocks: Clocks, tmp_path: Path) -> None:
    client = CheckpointClient(environ={"SLURM_JOB_ID": "4242", "SLURM_RESTART_COUNT": "2"},
                              clock=lambda: clocks.wall, stdout=io.StringIO())
    record = client.ack_record(77)
    assert record is not None
    assert (record["job"], record["scheduler"], record["attempt"]) == ("slurm-4242", "slurm", 3)
    job_validator().validate(record)
    given = CheckpointClient(job="slurm-1", scheduler="slurm", attempt=4, environ={"SLURM_JOB_ID": "4242"})
    assert given.ack_record(1) is not None and (given.job_id(), given.attempt()) == ("slurm-1", 4)


def test_without_an_ack_file_the_record_goes_to_stdout(clocks: Clocks) -> None:
    out = io.StringIO()
    client = CheckpointClient(environ={"SLURM_JOB_ID": "4242"}, clock=lambda: clocks.wall, stdout=out)
    record = client.acknowledge(8)
    assert out.getvalue() == json.dumps(record, separators=(",", ":")) + "\n"


def test_an_unknown_job_clears_the_request_and_says_why(
        clocks: Clocks, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    out = io.StringIO()
    client = CheckpointClient(environ={"FLEETMEDIC_CHECKPOINT_REQUESTED": "1",
                                       "FLEETMEDIC_PODINFO_ANNOTATIONS": str(tmp_path / "none")},
                              stdout=out)
    assert client.checkpoint_requested()
    with caplog.at_level(logging.ERROR, logger="fleetmedic.client"):
        assert client.acknowledge(4) is None
    assert not client.checkpoint_requested()
    assert out.getvalue() == ""
    assert any("FLEETMEDIC_JOB" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("step", [-1, True, 2**62 + 1, 1.5, "7"])
def test_a_step_the_record_cannot_carry_is_refused(clocks: Clocks, tmp_path: Path, step: Any) -> None:
    client = make_client(clocks, tmp_path)
    with pytest.raises(ValueError):
        client.acknowledge(step)
    assert acks(tmp_path) == []


def test_an_attempt_or_job_the_record_cannot_carry_is_refused(clocks: Clocks, tmp_path: Path) -> None:
    with pytest.raises(ValueError):
        CheckpointClient(attempt=0, environ={})
    client = make_client(clocks, tmp_path, FLEETMEDIC_JOB="x" * 254)
    assert client.acknowledge(1) is None
    assert acks(tmp_path) == []
    bad_env = make_client(clocks, tmp_path, FLEETMEDIC_ATTEMPT="zero")
    assert bad_env.attempt() == 1


class FakeProducer:
    sent: list[tuple[str, bytes, bytes]] = []
    fail = False

    def __init__(self, **kwargs: Any) -> None:
        self.kwargs = kwargs

    def send(self, topic: str, *, key: bytes, value: bytes) -> FakeProducer:
        if self.fail:
            raise RuntimeError("broker unreachable")
        self.sent.append((topic, key, value))
        return self

    def get(self, timeout: float) -> None:
        return None

    def close(self, timeout: float) -> None:
        return None


@pytest.fixture
def fake_kafka(monkeypatch: pytest.MonkeyPatch) -> type[FakeProducer]:
    module = ModuleType("kafka")
    module.KafkaProducer = FakeProducer  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "kafka", module)
    monkeypatch.setattr(FakeProducer, "sent", [])
    monkeypatch.setattr(FakeProducer, "fail", False)
    return FakeProducer


def test_with_a_bootstrap_server_the_record_goes_to_kafka_keyed_by_job(
        clocks: Clocks, tmp_path: Path, fake_kafka: type[FakeProducer]) -> None:
    client = make_client(clocks, tmp_path, FLEETMEDIC_BOOTSTRAP="kafka:9092")
    record = client.acknowledge(12)
    assert [(t, k) for t, k, _ in fake_kafka.sent] == [("fleetmedic.telemetry.job", b"research/llm-pretrain")]
    assert json.loads(fake_kafka.sent[0][2]) == record
    assert decode(JobEvent, fake_kafka.sent[0][2]).checkpoint_step == 12
    assert acks(tmp_path) == []
    prefixed = make_client(clocks, tmp_path, FLEETMEDIC_BOOTSTRAP="kafka:9092", FLEETMEDIC_TOPIC_PREFIX="prod.")
    prefixed.acknowledge(13)
    assert fake_kafka.sent[1][0] == "prod.telemetry.job"


def test_aiokafka_publishes_when_kafka_python_is_missing(
        clocks: Clocks, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    sent: list[tuple[str, bytes, bytes | None]] = []
    stopped: list[bool] = []

    class AIOKafkaProducer:
        def __init__(self, **kwargs: Any) -> None:
            assert kwargs["bootstrap_servers"] == "kafka:9092"

        async def start(self) -> None:
            return None

        async def send_and_wait(self, topic: str, value: bytes, key: bytes | None = None) -> None:
            sent.append((topic, value, key))

        async def stop(self) -> None:
            stopped.append(True)

    module = ModuleType("aiokafka")
    module.AIOKafkaProducer = AIOKafkaProducer  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "kafka", None)
    monkeypatch.setitem(sys.modules, "aiokafka", module)
    client = make_client(clocks, tmp_path, FLEETMEDIC_BOOTSTRAP="kafka:9092")
    record = client.acknowledge(21)
    assert [(t, json.loads(v), k) for t, v, k in sent] == [
        ("fleetmedic.telemetry.job", record, b"research/llm-pretrain")]
    assert stopped == [True] and acks(tmp_path) == []


def test_a_failed_publish_falls_back_to_the_line(
        clocks: Clocks, tmp_path: Path, fake_kafka: type[FakeProducer], caplog: pytest.LogCaptureFixture) -> None:
    fake_kafka.fail = True
    client = make_client(clocks, tmp_path, FLEETMEDIC_BOOTSTRAP="kafka:9092")
    with caplog.at_level(logging.WARNING, logger="fleetmedic.client"):
        record = client.acknowledge(12)
    assert acks(tmp_path) == [record]
    assert any("broker unreachable" in r.getMessage() for r in caplog.records)


def test_without_a_kafka_library_the_record_is_a_line(
        clocks: Clocks, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setitem(sys.modules, "kafka", None)  # import raises ImportError
    monkeypatch.setitem(sys.modules, "aiokafka", None)
    client = make_client(clocks, tmp_path, FLEETMEDIC_BOOTSTRAP="kafka:9092")
    with caplog.at_level(logging.WARNING, logger="fleetmedic.client"):
        first, second = client.acknowledge(1), client.acknowledge(2)
    assert acks(tmp_path) == [first, second]
    assert len([r for r in caplog.records if "neither kafka-python nor aiokafka" in r.getMessage()]) == 1


# --------------------------------------------------------------------------- module API and command line


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> pytest.MonkeyPatch:
    for key in list(os.environ):
        if key.startswith(("FLEETMEDIC_", "SLURM_")) or key in ("KUBERNETES_SERVICE_HOST", "POD_NAMESPACE"):
            monkeypatch.delenv(key)
    monkeypatch.setenv("FLEETMEDIC_PODINFO_ANNOTATIONS", str(tmp_path / "podinfo" / "annotations"))
    monkeypatch.setenv("FLEETMEDIC_ACK_FILE", str(tmp_path / "acks.jsonl"))
    monkeypatch.setenv("FLEETMEDIC_ACK_STATE", str(tmp_path / "state.json"))
    monkeypatch.setenv("FLEETMEDIC_POLL_S", "0")
    return monkeypatch


def test_the_module_functions_drive_one_client(clean_env: pytest.MonkeyPatch, tmp_path: Path) -> None:
    before = signal.getsignal(signal.SIGUSR1)
    client = fm.install(job="slurm-99", scheduler="slurm")
    assert fm.install() is client
    assert not fm.checkpoint_requested()
    signal.raise_signal(signal.SIGUSR1)
    assert fm.checkpoint_requested() and fm.deadline() is None
    record = fm.acknowledge(31)
    assert record is not None and record["job"] == "slurm-99"
    assert not fm.checkpoint_requested()
    fm.uninstall()
    assert signal.getsignal(signal.SIGUSR1) == before


def test_the_command_line_acknowledges_across_processes(
        clean_env: pytest.MonkeyPatch, tmp_path: Path, podinfo: Podinfo, capsys: pytest.CaptureFixture[str]) -> None:
    clean_env.setenv("SLURM_JOB_ID", "555")
    assert fm.main(["check"]) == 1
    podinfo.write({ANNOTATION: DEADLINE})
    assert fm.main(["check"]) == 0
    assert capsys.readouterr().out == f"{int(DEADLINE_TS)}\n"
    assert fm.main(["ack", "--step", "40"]) == 0
    assert [(a["job"], a["checkpoint_step"]) for a in acks(tmp_path)] == [("slurm-555", 40)]
    assert fm.main(["check"]) == 1  # the annotation is still there, and acknowledged
    assert fm.main(["wait", "--timeout", "0.01"]) == 1
    podinfo.write({ANNOTATION: "2026-12-07T01:05:00Z"})
    assert fm.main(["wait", "--timeout", "5"]) == 0
    assert capsys.readouterr().out == f"{int(DEADLINE_TS) + 177}\n"


def test_importing_the_client_loads_the_standard_library_alone() -> None:
    code = ("import sys; before = set(sys.modules); import fleetmedic.client; "
            "print('\\n'.join(sorted(set(sys.modules) - before)))")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    loaded = {name.split(".")[0] for name in done.stdout.split()}
    assert "fleetmedic" in loaded
    assert loaded - {"fleetmedic"} - set(sys.stdlib_module_names) == set()


def test_the_command_line_help_runs_as_a_module() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLEETMEDIC_")}
    done = subprocess.run([sys.executable, "-m", "fleetmedic.client", "--help"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "ack" in done.stdout and "wait" in done.stdout and "FLEETMEDIC_ACK_FILE" in done.stdout


def test_the_documented_loop_answers_a_request(tmp_path: Path) -> None:
    flag = tmp_path / "checkpoint-requested"
    flag.write_text(DEADLINE)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FLEETMEDIC_", "SLURM_"))}
    env.update(PYTHONPATH=str(ROOT), FLEETMEDIC_JOB="slurm-777", FLEETMEDIC_SCHEDULER="slurm",
               FLEETMEDIC_REQUEST_FILE=str(flag), FLEETMEDIC_ACK_FILE=str(tmp_path / "acks.jsonl"),
               FLEETMEDIC_PODINFO_ANNOTATIONS=str(tmp_path / "none"))
    done = subprocess.run([sys.executable, str(ROOT / "docs/examples/checkpoint_now_loop.py"), "--steps", "5",
                           "--step-time", "0", "--checkpoint-dir", str(tmp_path / "ckpt")],
                          env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    records = acks(tmp_path)
    assert [(r["job"], r["event"], r["checkpoint_step"]) for r in records] == [("slurm-777", "checkpoint", 0)]
    for record in records:
        job_validator().validate(record)
    assert not flag.exists()
    assert (tmp_path / "ckpt" / "step-0.json").exists()
