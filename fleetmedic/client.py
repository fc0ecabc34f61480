"""Checkpoint-now, from inside a training job: see that fleetmedic asks for a checkpoint,
and tell it when one is saved.

Before fleetmedic takes a degrading node away from a running job, it asks the job to save
its state now, waits for the job's ``checkpoint`` record on ``telemetry.job``, then
requeues the job off the node; at the deadline without one it moves the job from its last
checkpoint anyway.  The request reaches the job on one of these channels:

* Kubernetes: the annotation ``fleetmedic.io/checkpoint-requested`` on the job's pods, its
  value the deadline in RFC 3339 UTC; a downward API volume exposes it in the file
  ``/etc/podinfo/annotations`` (``$FLEETMEDIC_PODINFO_ANNOTATIONS``);
* Slurm: ``SIGUSR1`` to the batch shell (``scancel --signal=USR1 --batch``), which the
  script forwards to this process or ``exec``\\s it;
* Kafka: a ``checkpoint_requested`` record on ``telemetry.job``, for jobs that read Kafka
  themselves and hand it to :func:`observe_record`;
* for shell-driven jobs, ``$FLEETMEDIC_CHECKPOINT_REQUESTED`` or the file named by
  ``$FLEETMEDIC_REQUEST_FILE`` (a batch script's ``trap`` can touch it).

In a training loop::

    import fleetmedic.client as fm
    fm.install()                        # SIGUSR1 handler (chains the previous one)
    for step in ...:
        train_step()
        if fm.checkpoint_requested():   # a flag, and a stat() per poll interval at most
            save(step)
            fm.acknowledge(step)        # the checkpoint record; clears the request

A request stays pending until it is acknowledged, and an acknowledged one is not reported
again; a new one (a new annotation value, another signal) is.  The acknowledgement is a
``job/1`` ``checkpoint`` record, sent to Kafka when ``$FLEETMEDIC_BOOTSTRAP`` is set and
``kafka-python`` or ``aiokafka`` can be imported, else written as one JSON line to
``$FLEETMEDIC_ACK_FILE`` or stdout for a sidecar or the launcher to ship.

The module imports the standard library alone; a Kafka library is imported only when an
acknowledgement is sent through it.  ``python -m fleetmedic.client --help`` shows the
command line for shell scripts (``check``, ``wait``, ``ack``).
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import math
import os
import re
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from types import FrameType
from typing import Any, TextIO

__all__ = [
    "ANNOTATION",
    "CheckpointClient",
    "Request",
    "acknowledge",
    "checkpoint_requested",
    "deadline",
    "format_deadline",
    "install",
    "main",
    "observe_record",
    "parse_annotations",
    "parse_deadline",
    "uninstall",
]

log = logging.getLogger(__name__)

#: the pod annotation fleetmedic sets; its value is the deadline, RFC 3339 UTC
ANNOTATION = "fleetmedic.io/checkpoint-requested"
DEFAULT_ANNOTATIONS_PATH = "/etc/podinfo/annotations"
SCHEMA = "job/1"
TOPIC = "telemetry.job"
DEFAULT_TOPIC_PREFIX = "fleetmedic."
DEFAULT_POLL_S = 1.0
#: largest step a ``job/1`` record accepts
MAX_STEP = 2**62
MAX_ATTEMPT = 100_000
MAX_JOB = 253
MAX_SCHEDULER = 64
#: how long an acknowledgement may take to reach Kafka before it is written as a line
KAFKA_TIMEOUT_S = 10.0
#: the job id fleetmedic's Slurm watcher gives ``$SLURM_JOB_ID``
SLURM_JOB_PREFIX = "slurm-"
#: pod labels naming the workload that owns a pod: a Kubeflow training job, a batch Job
JOB_LABELS = ("training.kubeflow.org/job-name", "batch.kubernetes.io/job-name", "job-name")
SERVICE_ACCOUNT_NAMESPACE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"

ENV_JOB = "FLEETMEDIC_JOB"
ENV_SCHEDULER = "FLEETMEDIC_SCHEDULER"
ENV_ATTEMPT = "FLEETMEDIC_ATTEMPT"
ENV_ANNOTATIONS = "FLEETMEDIC_PODINFO_ANNOTATIONS"
ENV_REQUESTED = "FLEETMEDIC_CHECKPOINT_REQUESTED"
ENV_REQUEST_FILE = "FLEETMEDIC_REQUEST_FILE"
ENV_ACK_FILE = "FLEETMEDIC_ACK_FILE"
ENV_ACK_STATE = "FLEETMEDIC_ACK_STATE"
ENV_BOOTSTRAP = "FLEETMEDIC_BOOTSTRAP"
ENV_TOPIC_PREFIX = "FLEETMEDIC_TOPIC_PREFIX"
ENV_POLL = "FLEETMEDIC_POLL_S"

#: values of the environment variable or the request file that ask without a deadline
_YES = frozenset({"", "1", "true", "yes", "on"})
_NO = frozenset({"0", "false", "no", "off"})
#: the most of a request file that is read
_MAX_REQUEST_FILE = 4096

_Handler = Callable[[int, FrameType | None], Any] | int | signal.Handlers | None


# --------------------------------------------------------------------------- formats


_GO_ESCAPES = {"a": "\a", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t", "v": "\v",
               "\\": "\\", '"': '"', "'": "'"}
_HEX = re.compile(r"[0-9A-Fa-f]+")


def _hex_at(text: str, start: int, width: int) -> int:
    digits = text[start:start + width]
    if len(digits) != width or not _HEX.fullmatch(digits):
        raise ValueError(f"bad hex escape {text[start - 2:start + width]!r}")
    return int(digits, 16)


def _go_unquote(literal: str) -> str:
    """The string a Go ``%q`` literal (``strconv.Quote``) stands for.

    Raises ValueError for anything that is not one whole literal, e.g. a line the writer
    has not finished."""
    if len(literal) < 2 or literal[0] != '"' or literal[-1] != '"':
        raise ValueError("not a double-quoted string")
    body = literal[1:-1]
    out = bytearray()
    i, n = 0, len(body)
    while i < n:
        c = body[i]
        if c == '"':
            raise ValueError("unescaped quote inside the string")
        if c != "\\":
            out += c.encode()
            i += 1
            continue
        if i + 1 >= n:
            raise ValueError("backslash at the end of the string")
        e = body[i + 1]
        if e in _GO_ESCAPES:
            out += _GO_ESCAPES[e].encode()
            i += 2
        elif e == "x":  # a byte that is not valid UTF-8
            out.append(_hex_at(body, i + 2, 2))
            i += 4
        elif e in "uU":
            width = 4 if e == "u" else 8
            code = _hex_at(body, i + 2, width)
            if code > 0x10FFFF or 0xD800 <= code <= 0xDFFF:
                raise ValueError(f"bad code point U+{code:X}")
            out += chr(code).encode()
            i += 2 + width
        elif e in "01234567":  # strconv.Unquote's octal byte; Quote never writes one
            digits = body[i + 1:i + 4]
            if len(digits) != 3 or any(d not in "01234567" for d in digits) or int(digits, 8) > 255:
                raise ValueError(f"bad octal escape \\{digits}")
            out.append(int(digits, 8))
            i += 4
        else:
            raise ValueError(f"unknown escape \\{e}")
    return out.decode("utf-8", "replace")


def parse_annotations(text: str) -> dict[str, str]:
    """Annotations (or labels) as the kubelet writes them into a downward API volume.

    One ``key="value"`` line per entry, keys sorted, the value quoted with Go's ``%q``
    (``fieldpath.FormatMap`` in kubernetes/kubernetes).  Lines that do not parse, such as
    the last line of a file still being written, are left out."""
    values: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, literal = line.partition("=")
        if not sep or not key:
            continue
        try:
            values[key] = _go_unquote(literal)
        except ValueError:
            continue
    return values


_RFC3339 = re.compile(
    r"(\d{4})-(\d{2})-(\d{2})[Tt ](\d{2}):(\d{2}):(\d{2})(\.\d+)?([Zz]|[+-]\d{2}:\d{2})")


def parse_deadline(value: str) -> float:
    """Unix seconds of a deadline: RFC 3339 with a zone (``2026-12-07T01:02:03Z``,
    fractional seconds and ``+00:00`` too) or plain Unix seconds.  ValueError otherwise."""
    text = value.strip()
    m = _RFC3339.fullmatch(text)
    if m is None:
        try:
            ts = float(text)
        except ValueError:
            raise ValueError(f"not an RFC 3339 time or Unix seconds: {value!r}") from None
        if not math.isfinite(ts) or ts < 0:
            raise ValueError(f"not a time: {value!r}")
        return ts
    year, month, day, hour, minute, second = (int(g) for g in m.groups()[:6])
    frac, zone = m.group(7), m.group(8)
    if zone in ("Z", "z"):
        tz = timezone.utc
    else:
        offset = timedelta(hours=int(zone[1:3]), minutes=int(zone[4:6]))
        tz = timezone(-offset if zone[0] == "-" else offset)
    leap = second == 60  # RFC 3339 allows a leap second; count it as the next second
    stamp = datetime(year, month, day, hour, minute, 59 if leap else second, tzinfo=tz).timestamp()
    return stamp + (1.0 if leap else 0.0) + (float(frac) if frac else 0.0)


def format_deadline(ts: float) -> str:
    """The annotation's spelling of a deadline: RFC 3339 UTC, whole seconds, ``Z``."""
    return datetime.fromtimestamp(math.floor(ts), timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _read_small(path: str, limit: int = 1 << 20) -> str | None:
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            return fh.read(limit)
    except OSError:
        return None


def _checked_attempt(attempt: int | None) -> int | None:
    if attempt is not None and (isinstance(attempt, bool) or not isinstance(attempt, int)
                                or not 1 <= attempt <= MAX_ATTEMPT):
        raise ValueError(f"attempt must be an int in [1, {MAX_ATTEMPT}], not {attempt!r}")
    return attempt


def _require_main_thread() -> None:
    if threading.current_thread() is not threading.main_thread():
        raise RuntimeError(
            "fleetmedic.client: the checkpoint signal handler can only be installed from the main thread "
            "(Python runs signal handlers there); call install() before starting threads, or "
            "install(signum=None) to watch the other channels only")


# --------------------------------------------------------------------------- the client


@dataclass(frozen=True)
class Request:
    """One checkpoint request as this process saw it."""

    #: ``signal``, ``annotation``, ``env``, ``file`` or ``record``
    channel: str
    #: what tells this request from the channel's next one (the annotation's value, ...)
    token: str
    #: Unix seconds by which the checkpoint should be saved; None when the channel gives none
    deadline: float | None
    #: wall-clock time it was first seen
    seen: float


class CheckpointClient:
    """Checkpoint requests of one job, and its acknowledgements.

    Everything it reads (environment, files, clocks, stdout) can be passed in; by default
    it reads the process's.  :meth:`checkpoint_requested` is safe to call from any
    thread; the signal handler only counts signals (and calls the handler it replaced)."""

    def __init__(
        self,
        *,
        job: str | None = None,
        scheduler: str | None = None,
        attempt: int | None = None,
        environ: Mapping[str, str] | None = None,
        annotations_path: str | None = None,
        request_file: str | None = None,
        ack_file: str | None = None,
        state_path: str | None = None,
        poll_interval_s: float | None = None,
        clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
        stdout: TextIO | None = None,
    ) -> None:
        self._environ: Mapping[str, str] = os.environ if environ is None else environ
        env = self._environ
        self._job = job
        self._scheduler = scheduler
        self._attempt = _checked_attempt(attempt)
        self.annotations_path = annotations_path or env.get(ENV_ANNOTATIONS) or DEFAULT_ANNOTATIONS_PATH
        self.request_file = request_file or env.get(ENV_REQUEST_FILE) or None
        self.ack_file = ack_file if ack_file is not None else env.get(ENV_ACK_FILE) or None
        self.state_path = state_path or env.get(ENV_ACK_STATE) or None
        self.poll_interval_s = poll_interval_s if poll_interval_s is not None else self._env_poll()
        self._clock = clock
        self._monotonic = monotonic
        self._stdout = stdout
        self._lock = threading.RLock()
        # written by the signal handler, read under the lock
        self._signals = 0
        self._signals_seen = 0
        self._signals_acked = 0
        self._signal_seen_at: float | None = None
        self._previous: dict[int, _Handler] = {}
        self._pending: dict[str, Request] = {}
        self._acked: dict[str, str] = {}
        self._warned: set[str] = set()
        self._last_poll = -math.inf
        self._annotations_sig: tuple[int, int, int, int] | None = None
        self._load_state()

    # ---- configuration

    def configure(self, *, job: str | None = None, scheduler: str | None = None, attempt: int | None = None,
                  annotations_path: str | None = None, poll_interval_s: float | None = None) -> None:
        """Change what was given (None keeps the current setting)."""
        with self._lock:
            if job is not None:
                self._job = job
            if scheduler is not None:
                self._scheduler = scheduler
            if attempt is not None:
                self._attempt = _checked_attempt(attempt)
            if annotations_path is not None and annotations_path != self.annotations_path:
                self.annotations_path = annotations_path
                self._annotations_sig = None
                self._last_poll = -math.inf
            if poll_interval_s is not None:
                self.poll_interval_s = poll_interval_s

    def _env_poll(self) -> float:
        raw = self._environ.get(ENV_POLL)
        if not raw:
            return DEFAULT_POLL_S
        try:
            value = float(raw)
        except ValueError:
            value = -1.0
        if not math.isfinite(value) or value < 0:
            log.warning("%s=%r is not a number of seconds; polling every %g s", ENV_POLL, raw, DEFAULT_POLL_S)
            return DEFAULT_POLL_S
        return value

    def _warn_once(self, key: str, msg: str, *args: object) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning(msg, *args)

    # ---- who we are

    def scheduler_name(self) -> str | None:
        """``slurm`` or ``kubernetes`` (or what was given); None when it cannot be told."""
        if self._scheduler:
            return self._scheduler
        env = self._environ
        if env.get(ENV_SCHEDULER):
            return env[ENV_SCHEDULER]
        if env.get("SLURM_JOB_ID"):
            return "slurm"
        if env.get("KUBERNETES_SERVICE_HOST") or self._kubernetes_job() is not None:
            return "kubernetes"
        return None

    def job_id(self) -> str | None:
        """The job's key on ``telemetry.job``, as fleetmedic's watchers spell it.

        Given, else ``$FLEETMEDIC_JOB``, else on Slurm ``slurm-$SLURM_JOB_ID``, else on
        Kubernetes ``<namespace>/<name>`` of the workload the pod's labels name."""
        if self._job:
            return self._job
        env = self._environ
        if env.get(ENV_JOB):
            return env[ENV_JOB]
        scheduler = self.scheduler_name()
        if scheduler == "slurm" and env.get("SLURM_JOB_ID"):
            return f"{SLURM_JOB_PREFIX}{env['SLURM_JOB_ID']}"
        if scheduler == "kubernetes":
            return self._kubernetes_job()
        return None

    def _kubernetes_job(self) -> str | None:
        podinfo = os.path.dirname(self.annotations_path)
        labels = parse_annotations(_read_small(os.path.join(podinfo, "labels")) or "")
        name = next((labels[k] for k in JOB_LABELS if labels.get(k)), None)
        if name is None:
            return None
        namespace = ((_read_small(os.path.join(podinfo, "namespace")) or "").strip()
                     or self._environ.get("POD_NAMESPACE", "").strip()
                     or (_read_small(SERVICE_ACCOUNT_NAMESPACE) or "").strip())
        return f"{namespace}/{name}" if namespace else None

    def attempt(self) -> int:
        """The attempt the watcher numbers: given, ``$FLEETMEDIC_ATTEMPT``, on Slurm
        ``$SLURM_RESTART_COUNT + 1``, else 1."""
        if self._attempt is not None:
            return self._attempt
        env = self._environ
        for key, offset in ((ENV_ATTEMPT, 0), ("SLURM_RESTART_COUNT", 1)):
            raw = env.get(key)
            if not raw:
                continue
            try:
                value = int(raw) + offset
            except ValueError:
                value = 0
            if 1 <= value <= MAX_ATTEMPT:
                return value
            self._warn_once(f"attempt:{key}={raw}", "%s=%r is not an attempt number; ignored", key, raw)
        return 1

    def topic(self) -> str:
        prefix = self._environ.get(ENV_TOPIC_PREFIX)
        return f"{DEFAULT_TOPIC_PREFIX if prefix is None else prefix}{TOPIC}"

    # ---- the signal

    def install_signal(self, signum: int = signal.SIGUSR1) -> None:
        """Count ``signum`` as a checkpoint request, then call the handler it replaces.

        Idempotent.  Only the main thread may install a signal handler in Python."""
        _require_main_thread()
        with self._lock:
            current = signal.getsignal(signum)
            if current == self._on_signal:
                return
            signal.signal(signum, self._on_signal)
            self._previous[signum] = current

    def uninstall_signal(self) -> None:
        """Put back the handlers :meth:`install_signal` replaced (where ours is still set)."""
        if not self._previous:
            return
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("fleetmedic.client: signal handlers can only be restored from the main thread")
        with self._lock:
            for signum, previous in list(self._previous.items()):
                if signal.getsignal(signum) == self._on_signal:
                    signal.signal(signum, previous if previous is not None else signal.SIG_DFL)
                    del self._previous[signum]
                else:
                    log.warning("signal %d's handler was replaced after ours; leaving it (it may still call ours)",
                                signum)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        # only count: the main thread runs this between two bytecodes of whatever it was doing
        self._signals += 1
        previous = self._previous.get(signum)
        if callable(previous):
            previous(signum, frame)

    # ---- requests

    def checkpoint_requested(self) -> bool:
        """True while a request is pending: a signal, a new annotation value, the
        environment variable or the request file, or a record passed to
        :meth:`observe_record`.  Reads files at most once per poll interval."""
        with self._lock:
            self._poll()
            return bool(self._pending) or self._signals_seen > self._signals_acked

    def deadline(self) -> float | None:
        """The earliest deadline of the pending requests (Unix seconds), or None when
        nothing is pending or no request came with one (Slurm's signal carries none)."""
        with self._lock:
            self._poll()
            deadlines = [r.deadline for r in self._pending.values() if r.deadline is not None]
            return min(deadlines) if deadlines else None

    def pending(self) -> list[Request]:
        """The pending requests, signal first."""
        with self._lock:
            self._poll()
            out = list(self._pending.values())
            if self._signals_seen > self._signals_acked:
                out.insert(0, Request("signal", str(self._signals_seen), None, self._signal_seen_at or self._clock()))
            return out

    def observe_record(self, record: Mapping[str, Any] | bytes | str) -> bool:
        """Take a ``job/1`` ``checkpoint_requested`` record read off ``telemetry.job``.

        True when it asks this job (or this job's id is unknown) for a checkpoint."""
        data: Any = record
        if isinstance(record, (bytes, str)):
            try:
                data = json.loads(record)
            except ValueError:
                return False
        if not isinstance(data, Mapping) or data.get("event") != "checkpoint_requested":
            return False
        job = self.job_id()
        if job is not None and data.get("job") != job:
            return False
        raw = data.get("checkpoint_deadline")
        text = "" if raw is None else str(raw)
        token = f"{data.get('ts')}|{text}"
        with self._lock:
            self._offer("record", token, text or None)
            return True

    def _poll(self) -> None:
        if self._signals != self._signals_seen:
            self._signals_seen = self._signals
            if self._signal_seen_at is None:
                self._signal_seen_at = self._clock()
        self._poll_env()
        now = self._monotonic()
        if now - self._last_poll < self.poll_interval_s:
            return
        self._last_poll = now
        self._poll_annotations()
        self._poll_request_file()

    def _poll_env(self) -> None:
        raw = self._environ.get(ENV_REQUESTED)
        if raw is None or raw.strip().lower() in _NO or not raw.strip():
            return
        self._offer("env", raw, None if raw.strip().lower() in _YES else raw)

    def _poll_annotations(self) -> None:
        try:
            st = os.stat(self.annotations_path)  # follows annotations -> ..data/annotations
        except OSError:
            self._annotations_sig = None  # not on Kubernetes, or not mounted: nothing asked
            return
        sig = (st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size)
        if sig == self._annotations_sig:
            return
        text = _read_small(self.annotations_path)
        if text is None:
            return  # gone between stat and open (the kubelet swapped ..data): next poll
        # a line still being written is left out; finishing it changes the size, so it is read then
        self._annotations_sig = sig
        value = parse_annotations(text).get(ANNOTATION)
        if value is not None:
            self._offer("annotation", value, value)

    def _poll_request_file(self) -> None:
        if not self.request_file:
            return
        try:
            st = os.stat(self.request_file)
        except OSError:
            return
        token = f"{st.st_dev}:{st.st_ino}:{st.st_mtime_ns}"
        pending = self._pending.get("file")
        if self._acked.get("file") == token or (pending is not None and pending.token == token):
            return
        text = (_read_small(self.request_file, _MAX_REQUEST_FILE) or "").strip()
        self._offer("file", token, None if text.lower() in _YES else text)

    def _offer(self, channel: str, token: str, deadline_text: str | None) -> None:
        if self._acked.get(channel) == token:
            return
        current = self._pending.get(channel)
        if current is not None and current.token == token:
            return
        now = self._clock()
        when: float | None = None
        if deadline_text is not None:
            try:
                when = parse_deadline(deadline_text)
            except ValueError:
                self._warn_once(f"deadline:{channel}:{deadline_text}",
                                "checkpoint request on %s with a malformed deadline %r: treating it as now",
                                channel, deadline_text)
                when = now
        if current is not None and current.deadline is not None:
            # a channel's newer request keeps the earlier of the two deadlines
            when = current.deadline if when is None else min(when, current.deadline)
        self._pending[channel] = Request(channel, token, when, current.seen if current else now)

    # ---- acknowledging

    def acknowledge(self, step: int, *, emit: bool = True) -> dict[str, Any] | None:
        """A checkpoint of ``step`` is saved: clear the requests reported so far and, with
        ``emit``, send the ``checkpoint`` record (returned; None when the job or its
        scheduler is unknown, which is logged).  In a distributed job every rank clears
        its requests and one rank emits."""
        if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step <= MAX_STEP:
            raise ValueError(f"step must be an int in [0, 2**62], not {step!r}")
        with self._lock:
            for channel, request in self._pending.items():
                self._acked[channel] = request.token
            answered_file = self._pending.get("file")
            self._pending.clear()
            self._signals_acked = max(self._signals_acked, self._signals_seen)
            self._signal_seen_at = None
            if answered_file is not None and self._remove_request_file(answered_file.token):
                # the file's absence is the acknowledgement: the next file is a new request, even
                # one that gets the removed file's inode and timestamp back
                del self._acked["file"]
            self._save_state()
        if not emit:
            return None
        record = self.ack_record(step)
        if record is not None:
            self._emit(record)
        return record

    def ack_record(self, step: int) -> dict[str, Any] | None:
        """The ``job/1`` ``checkpoint`` record for ``step`` (None, logged, when the job id
        or the scheduler is unknown)."""
        job, scheduler = self.job_id(), self.scheduler_name()
        if not job or not scheduler:
            log.error("cannot acknowledge the checkpoint of step %d: %s is unknown (set %s and %s, pass "
                      "install(job=..., scheduler=...), or --job and --scheduler on the command line)", step,
                      "the job id" if not job else "the scheduler", ENV_JOB, ENV_SCHEDULER)
            return None
        if len(job) > MAX_JOB or len(scheduler) > MAX_SCHEDULER:
            log.error("cannot acknowledge the checkpoint of step %d: the job id (%d characters, at most %d) or the "
                      "scheduler (%d, at most %d) is too long for a job/1 record", step, len(job), MAX_JOB,
                      len(scheduler), MAX_SCHEDULER)
            return None
        return {"schema": SCHEMA, "ts": self._clock(), "job": job, "event": "checkpoint", "scheduler": scheduler,
                "attempt": self.attempt(), "checkpoint_step": step}

    def _remove_request_file(self, token: str) -> bool:
        path = self.request_file
        if not path:
            return False
        try:
            st = os.stat(path)
            if f"{st.st_dev}:{st.st_ino}:{st.st_mtime_ns}" != token:
                return False  # touched again since it was read: a new request, left for the next poll
            os.remove(path)
            return True
        except OSError:
            return False  # gone already, or not ours to remove: its token stays acknowledged

    def _emit(self, record: dict[str, Any]) -> None:
        line = json.dumps(record, separators=(",", ":"))
        bootstrap = self._environ.get(ENV_BOOTSTRAP, "").strip()
        if bootstrap:
            try:
                if _send_to_kafka(bootstrap, self.topic(), record["job"], line.encode()):
                    return
                self._warn_once("no-kafka-library", "%s is set but neither kafka-python nor aiokafka can be "
                                "imported; writing checkpoint records as lines", ENV_BOOTSTRAP)
            except Exception as exc:  # any failure to publish: the line still tells
                log.warning("could not publish the checkpoint record to %s at %s (%s); writing it as a line",
                            self.topic(), bootstrap, exc)
        self._write_line(line)

    def _write_line(self, line: str) -> None:
        data = line + "\n"
        if self.ack_file and self.ack_file != "-":
            try:
                fd = os.open(self.ack_file, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
                try:
                    os.write(fd, data.encode())  # one write with O_APPEND: lines from several ranks stay whole
                finally:
                    os.close(fd)
                return
            except OSError as exc:
                log.error("could not append the checkpoint record to %s (%s); writing it to stdout", self.ack_file, exc)
        stream = self._stdout or sys.stdout
        stream.write(data)
        stream.flush()

    # ---- acknowledged requests across processes (the command line)

    def _load_state(self) -> None:
        if not self.state_path:
            return
        text = _read_small(self.state_path)
        if text is None:
            return
        try:
            acked = json.loads(text).get("acked", {})
            self._acked.update({str(k): str(v) for k, v in acked.items()})
        except (ValueError, AttributeError):
            log.warning("ignoring the unreadable acknowledgement state %s", self.state_path)

    def _save_state(self) -> None:
        if not self.state_path:
            return
        tmp = f"{self.state_path}.{os.getpid()}.tmp"
        try:
            with open(tmp, "w", encoding="utf-8") as fh:
                json.dump({"acked": self._acked}, fh)
            os.replace(tmp, self.state_path)
        except OSError as exc:
            log.warning("could not save the acknowledgement state %s (%s)", self.state_path, exc)


def _send_to_kafka(bootstrap: str, topic: str, key: str, value: bytes, timeout_s: float = KAFKA_TIMEOUT_S) -> bool:
    """Publish one record with kafka-python, else aiokafka; False when neither imports."""
    try:
        kafka: Any = importlib.import_module("kafka")
    except ImportError:
        kafka = None
    if kafka is not None:
        producer = kafka.KafkaProducer(bootstrap_servers=bootstrap.split(","),
                                       request_timeout_ms=int(timeout_s * 1000), max_block_ms=int(timeout_s * 1000))
        try:
            producer.send(topic, key=key.encode(), value=value).get(timeout=timeout_s)
        finally:
            producer.close(timeout=timeout_s)
        return True
    try:
        aiokafka: Any = importlib.import_module("aiokafka")
    except ImportError:
        return False
    import asyncio  # here, not at the top: only an acknowledgement through aiokafka needs it

    async def send() -> None:
        producer = aiokafka.AIOKafkaProducer(bootstrap_servers=bootstrap, request_timeout_ms=int(timeout_s * 1000))
        await asyncio.wait_for(producer.start(), timeout_s)
        try:
            await asyncio.wait_for(producer.send_and_wait(topic, value, key=key.encode()), timeout_s)
        finally:
            await producer.stop()

    _run_in_thread(send, 2 * timeout_s + 1)
    return True


def _run_in_thread(make: Callable[[], Coroutine[Any, Any, None]], timeout_s: float) -> None:
    # a thread of its own, so that a caller's running event loop (if any) is left alone
    import asyncio

    errors: list[BaseException] = []

    def target() -> None:
        try:
            asyncio.run(make())
        except BaseException as exc:  # handed to the caller
            errors.append(exc)

    thread = threading.Thread(target=target, name="fleetmedic-checkpoint-ack", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise TimeoutError(f"no answer from Kafka in {timeout_s:g} s")
    if errors:
        raise errors[0]


# --------------------------------------------------------------------------- module API

_default: CheckpointClient | None = None
_default_lock = threading.Lock()


def _client() -> CheckpointClient:
    global _default
    with _default_lock:
        if _default is None:
            _default = CheckpointClient()
        return _default


def install(job: str | None = None, scheduler: str | None = None, *, attempt: int | None = None,
            signum: int | None = signal.SIGUSR1, annotations_path: str | None = None,
            poll_interval_s: float | None = None) -> CheckpointClient:
    """Start answering checkpoint requests in this process; idempotent.

    Installs the ``signum`` handler (chaining the previous one; main thread only, pass
    ``signum=None`` to skip it) and sets what the acknowledgement says about the job
    (by default from the environment, see :meth:`CheckpointClient.job_id`)."""
    global _default
    if signum is not None:
        _require_main_thread()
    with _default_lock:
        if _default is None:
            _default = CheckpointClient(job=job, scheduler=scheduler, attempt=attempt,
                                        annotations_path=annotations_path, poll_interval_s=poll_interval_s)
        else:
            _default.configure(job=job, scheduler=scheduler, attempt=attempt, annotations_path=annotations_path,
                               poll_interval_s=poll_interval_s)
        client = _default
    if signum is not None:
        client.install_signal(signum)
    if client.job_id() is None or client.scheduler_name() is None:
        log.warning("fleetmedic.client: the job id or scheduler is unknown, so acknowledgements will not be sent; "
                    "set %s and %s or pass install(job=..., scheduler=...)", ENV_JOB, ENV_SCHEDULER)
    return client


def uninstall() -> None:
    """Restore the signal handlers :func:`install` replaced and forget its state."""
    global _default
    with _default_lock:
        client, _default = _default, None
    if client is not None:
        client.uninstall_signal()


def checkpoint_requested() -> bool:
    """True while a checkpoint request is pending (see :meth:`CheckpointClient.checkpoint_requested`)."""
    return _client().checkpoint_requested()


def deadline() -> float | None:
    """The pending request's deadline, Unix seconds, or None."""
    return _client().deadline()


def acknowledge(step: int, *, emit: bool = True) -> dict[str, Any] | None:
    """A checkpoint of ``step`` is saved: clear the request and send the checkpoint record."""
    return _client().acknowledge(step, emit=emit)


def observe_record(record: Mapping[str, Any] | bytes | str) -> bool:
    """Hand over a ``checkpoint_requested`` record read off ``telemetry.job``."""
    return _client().observe_record(record)


# --------------------------------------------------------------------------- command line


def _default_state_path(client: CheckpointClient) -> str:
    name = client.job_id() or f"uid{os.getuid()}"
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", name)
    return os.path.join(tempfile.gettempdir(), f"fleetmedic-checkpoint-{safe}.json")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m fleetmedic.client",
        description="Answer fleetmedic's checkpoint-now requests from a shell script (docs/checkpoint-now.md).",
        epilog=f"Environment: {ENV_JOB}, {ENV_SCHEDULER}, {ENV_ATTEMPT}, {ENV_ANNOTATIONS}, {ENV_REQUESTED}, "
               f"{ENV_REQUEST_FILE}, {ENV_ACK_FILE}, {ENV_BOOTSTRAP}, {ENV_TOPIC_PREFIX}, {ENV_POLL}, {ENV_ACK_STATE}.")
    p.add_argument("--job", help=f"the job id (default: ${ENV_JOB}, slurm-$SLURM_JOB_ID, or the pod's workload)")
    p.add_argument("--scheduler", help="kubernetes or slurm (default: from the environment)")
    p.add_argument("--attempt", type=int, help="the attempt number (default: $SLURM_RESTART_COUNT + 1, else 1)")
    p.add_argument("--state", help="where acknowledged requests are remembered between commands "
                                   f"(default: ${ENV_ACK_STATE}, else a file in the temporary directory)")
    sub = p.add_subparsers(dest="command", required=True)
    sub.add_parser("check", help="exit 0 if a checkpoint is requested (printing the deadline, Unix seconds, "
                                 "when there is one), else 1")
    w = sub.add_parser("wait", help="block until a checkpoint is requested, then exit 0 (printing the deadline "
                                    "when there is one); SIGUSR1 to this process counts too")
    w.add_argument("--timeout", type=float, help="give up after this many seconds (exit 1)")
    a = sub.add_parser("ack", help="acknowledge: send the checkpoint record of --step and clear the request")
    a.add_argument("--step", type=int, required=True, help="the step the checkpoint holds")
    a.add_argument("--no-emit", action="store_true", help="clear the request without sending a record")
    return p


def _print_deadline(client: CheckpointClient) -> None:
    when = client.deadline()
    if when is not None:
        print(math.floor(when), flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="fleetmedic.client: %(levelname)s %(message)s")
    who = dict(job=args.job, scheduler=args.scheduler, attempt=args.attempt)
    probe = CheckpointClient(**who)
    client = CheckpointClient(**who, state_path=args.state or probe.state_path or _default_state_path(probe))
    if args.command == "check":
        if client.checkpoint_requested():
            _print_deadline(client)
            return 0
        return 1
    if args.command == "wait":
        client.install_signal(signal.SIGUSR1)
        give_up = None if args.timeout is None else time.monotonic() + max(0.0, args.timeout)
        while not client.checkpoint_requested():
            left = math.inf if give_up is None else give_up - time.monotonic()
            if left <= 0:
                return 1
            time.sleep(min(0.05, left))  # the signal flag is read every turn; files per poll interval
        _print_deadline(client)
        return 0
    if args.step < 0 or args.step > MAX_STEP:
        print(f"--step must be in [0, 2**62], not {args.step}", file=sys.stderr)
        return 2
    client.checkpoint_requested()  # see what is pending, so the acknowledgement clears it
    record = client.acknowledge(args.step, emit=not args.no_emit)
    return 0 if args.no_emit or record is not None else 1


if __name__ == "__main__":
    sys.exit(main())
