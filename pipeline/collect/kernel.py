"""Kernel-log collector: the driver's own Xid and NVSwitch SXid lines, from journald,
``/dev/kmsg`` or a syslog file.

On real nodes the NVIDIA driver reports every Xid as a kernel-log line::

    NVRM: Xid (PCI:0000:3b:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus.

with text NVML's event API does not carry: the unit and registers that decide an NVLink5
Xid (144-150), the recovery action of Xid 154, the process the driver blames.  The
collector follows one source:

``journald``
    ``journalctl -k -o json -f`` (or a file of such JSON lines): ``MESSAGE`` is a
    string, or an array of byte values when the text is not valid UTF-8 (systemd's
    "Journal JSON Format"); the time is ``__REALTIME_TIMESTAMP`` (microseconds).
``kmsg``
    ``/dev/kmsg`` (or a file in its format): ``priority,sequence,usec,flags;message``
    records with ``\\xNN`` escapes, continuation lines starting with a space
    (``Documentation/ABI/testing/dev-kmsg``); the time is the boot time plus ``usec``.
``file``
    a syslog file (``/var/log/kern.log``): ``Mar  1 12:00:00 host kernel: [123.4] NVRM:
    ...``; followed as it grows and across rotation; the time is when the line is read.

Each line is parsed by :mod:`detectors.nvrm`; an Xid's PCI bus id is mapped to its GPU
index by NVML's ``pciInfo`` (or, without NVML, by the bus ids in
``/proc/driver/nvidia/gpus``, in bus order as NVML enumerates them).  The events go to
a sink (the agent's :class:`XidMerger`), which holds NVML's events briefly so that one
Xid seen by both sources is sent once, with the kernel's text.

The parsing functions are pure; the reader runs in a thread, as NVML's event wait does.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from detectors.nvrm import normalize_pci, parse_sxid, parse_xid

log = logging.getLogger(__name__)

#: longest kernel message kept (the driver's lines are far shorter)
MAX_MESSAGE = 4096


@dataclass(frozen=True, slots=True)
class KernelLine:
    """One kernel message and when it was logged (Unix seconds; None when the source
    does not say)."""

    message: str
    ts: float | None = None


# ------------------------------------------------------------------ record formats


def _journal_text(value: Any) -> str | None:
    """A journald JSON field as text: a string, an array of byte values, or an array of
    those (a field with several values: the last one)."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and value and all(isinstance(b, int) and 0 <= b <= 255 for b in value):
        return bytes(value).decode("utf-8", errors="replace")
    if isinstance(value, list) and value:
        return _journal_text(value[-1])
    return None


def parse_journal_record(line: str | bytes) -> KernelLine | None:
    """One line of ``journalctl -o json`` output; None when it is not a kernel record with
    a message (or not JSON at all)."""
    try:
        rec = json.loads(line)
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(rec, dict):
        return None
    if rec.get("_TRANSPORT") not in (None, "kernel") and rec.get("SYSLOG_IDENTIFIER") != "kernel":
        return None
    text = _journal_text(rec.get("MESSAGE"))
    if not text:
        return None
    ts = None
    raw = rec.get("__REALTIME_TIMESTAMP") or rec.get("_SOURCE_REALTIME_TIMESTAMP")
    try:
        ts = int(str(raw)) / 1e6 if raw is not None else None
    except ValueError:
        ts = None
    return KernelLine(text[:MAX_MESSAGE], ts)


_KMSG = re.compile(r"^(\d+),(\d+),(\d+),([^;,]*)(?:,[^;]*)?;(.*)$", re.DOTALL)
_ESCAPE = re.compile(r"\\x([0-9a-fA-F]{2})")


def _unescape(text: str) -> str:
    raw = _ESCAPE.sub(lambda m: chr(int(m.group(1), 16)), text)
    return raw.encode("latin-1", errors="replace").decode("utf-8", errors="replace")


def parse_kmsg_record(line: str | bytes, boot_time: float | None = None) -> KernelLine | None:
    """One ``/dev/kmsg`` record (``prio,seq,usec,flags;text``); None for a continuation
    line or anything else.  ``boot_time`` (Unix seconds) turns the record's microseconds
    since boot into wall time."""
    if isinstance(line, bytes):
        line = line.decode("utf-8", errors="replace")
    if not line or line[0] == " ":
        return None  # a " KEY=value" continuation line
    m = _KMSG.match(line.rstrip("\n"))
    if not m:
        return None
    text = _unescape(m.group(5))
    ts = boot_time + int(m.group(3)) / 1e6 if boot_time is not None else None
    return KernelLine(text[:MAX_MESSAGE], ts)


_ISO = re.compile(r"^(\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}(?:\.\d+)?(?:Z|[+-]\d{2}:?\d{2})?)\s")


def parse_syslog_line(line: str | bytes, now: float | None = None) -> KernelLine | None:
    """One syslog-file line (RFC 3164 or an ISO timestamp, any prefix before the kernel's
    text); None for an empty line.  The time is the ISO timestamp when there is one, else
    ``now`` (RFC 3164 stamps have no year or zone)."""
    if isinstance(line, bytes):
        line = line.decode("utf-8", errors="replace")
    line = line.rstrip("\n")
    if not line.strip():
        return None
    ts = now
    m = _ISO.match(line)
    if m:
        from datetime import datetime

        try:
            ts = datetime.fromisoformat(m.group(1).replace("Z", "+00:00")).timestamp()
        except ValueError:
            ts = now
    return KernelLine(line[:MAX_MESSAGE], ts)


# ------------------------------------------------------------------ lines to events

BusMap = Callable[[str], "int | None"]


def xid_event(text: str, gpu_of_bus: BusMap) -> dict[str, Any] | None:
    """The Xid event (a ``telemetry.gpu`` ``xids`` entry) on a kernel line, or None."""
    x = parse_xid(text)
    if x is None:
        return None
    ev: dict[str, Any] = {"gpu": gpu_of_bus(x.pci_bus_id), "code": x.code, "source": "kernel",
                          "pci_bus_id": x.pci_bus_id}
    if x.detail:
        ev["detail"] = x.detail[:1024]
    if x.pid is not None:
        ev["pid"] = x.pid
    if x.process:
        ev["process"] = x.process[:256]
    return ev


_COMPANION = re.compile(r"^\s*(?:Severity \d+ Engine instance|Data \{)", re.IGNORECASE)


def sxid_event(text: str) -> dict[str, Any] | None:
    """The SXid event (an ``sxids`` entry) on a kernel line; None for other lines and for
    the companion lines of an event ("Severity ... Engine instance", "Data {...}")."""
    s = parse_sxid(text)
    if s is None or (s.fatal is None and _COMPANION.match(s.detail)):
        return None
    ev: dict[str, Any] = {"code": s.code, "switch_pci_bus_id": s.pci_bus_id}
    if s.fatal is not None:
        ev["fatal"] = s.fatal
    if s.link is not None and 0 <= s.link <= 1024:
        ev["link"] = s.link
    if s.detail:
        ev["detail"] = s.detail[:1024]
    return ev


def proc_gpu_buses(root: str | Path = "/proc/driver/nvidia/gpus") -> list[str]:
    """The GPUs' bus ids the driver lists (``/proc/driver/nvidia/gpus/<bus id>/``), in bus
    order: NVML's default enumeration order, so a list index is an NVML index."""
    try:
        names = os.listdir(root)
    except OSError:
        return []
    return sorted(b for b in (normalize_pci(n) for n in names) if b)


# ------------------------------------------------------------------ following a source


def boot_time() -> float:
    """Wall-clock time of boot (for /dev/kmsg's microseconds since boot)."""
    try:
        with open("/proc/uptime") as f:
            return time.time() - float(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return time.time() - time.monotonic()


def _follow_file(path: Path, stop: threading.Event, *, from_start: bool, poll_s: float,
                 start_at: int | None = None) -> Iterator[bytes]:
    """Lines appended to ``path``, following rotation (a new inode) and truncation.
    ``start_at``: the offset to begin at (where the file ended when following began)."""
    f = None
    inode = None
    try:
        while not stop.is_set():
            if f is None:
                try:
                    f = path.open("rb")
                except OSError:
                    stop.wait(poll_s)
                    continue
                inode = os.fstat(f.fileno()).st_ino
                if not from_start:
                    size = os.fstat(f.fileno()).st_size
                    f.seek(min(start_at, size) if start_at is not None else size)
                from_start = True  # a rotated file is read from its start
            line = f.readline()
            if line.endswith(b"\n"):
                yield line
                continue
            if line:  # a partial line: wait for the rest
                f.seek(-len(line), os.SEEK_CUR)
            try:
                st = path.stat()
                if st.st_ino != inode or st.st_size < f.tell():
                    f.close()
                    f = None
                    continue
            except OSError:
                pass
            stop.wait(poll_s)
    finally:
        if f is not None:
            f.close()


def _read_kmsg(path: Path, stop: threading.Event, *, from_start: bool, start_at: int | None = None) -> Iterator[bytes]:
    """Records of the kernel's ring buffer device: each read() returns one record; an
    overwritten record (EPIPE) is skipped.  A regular file in the same format is read
    line by line."""
    if path.is_file():
        yield from _follow_file(path, stop, from_start=from_start, poll_s=0.2, start_at=start_at)
        return
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        if not from_start:
            os.lseek(fd, 0, os.SEEK_END)
        while not stop.is_set():
            try:
                yield os.read(fd, 8192)
            except BlockingIOError:
                stop.wait(0.2)
            except BrokenPipeError:
                log.warning("kernel log: records overwritten before they were read (EPIPE); continuing")
    finally:
        os.close(fd)


class KernelLogCollector:
    """Follows one kernel-log source in a thread and hands its Xid and SXid events to
    ``sink(kind, event)`` (kind ``"xid"`` or ``"sxid"``).

    ``source``: ``journald`` (``journalctl -k -o json -f``), ``journald:PATH`` (a file of
    journal JSON lines), ``kmsg`` (``/dev/kmsg``), ``kmsg:PATH``, ``file:PATH`` (a syslog
    file).  ``from_start`` reads what the source already holds (tests, replays); by
    default only new lines count.
    """

    def __init__(self, source: str, gpu_of_bus: BusMap, sink: Callable[[str, dict[str, Any]], None], *,
                 from_start: bool = False, clock: Callable[[], float] = time.time) -> None:
        kind, _, arg = source.partition(":")
        if kind not in ("journald", "kmsg", "file") or (kind == "file" and not arg):
            raise ValueError(f"collect.kernel_log: unknown source {source!r} "
                             "(journald, journald:PATH, kmsg, kmsg:PATH, file:PATH, auto, off)")
        self.kind, self.path = kind, arg or None
        self.source = source
        self.gpu_of_bus = gpu_of_bus
        self.sink = sink
        self.from_start = from_start
        self.clock = clock
        self.lines = 0
        self.events = 0
        self.unreadable = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._start_at: int | None = None
        self._boot: float | None = None

    def handle(self, raw: str | bytes) -> None:
        """One raw record of the source: parse, map, hand over (never raises)."""
        try:
            if self.kind == "journald":
                kl = parse_journal_record(raw)
            elif self.kind == "kmsg":
                kl = parse_kmsg_record(raw, self._boot)
            else:
                kl = parse_syslog_line(raw, self.clock())
        except Exception as exc:  # a record no parser expected: counted, never fatal
            self.unreadable += 1
            log.debug("kernel log: unreadable record (%s)", exc)
            return
        if kl is None:
            return
        self.lines += 1
        text = kl.message
        if "Xid" not in text:
            return
        ev = xid_event(text, self.gpu_of_bus)
        kind = "xid"
        if ev is None:
            ev, kind = sxid_event(text), "sxid"
        if ev is None:
            return
        ev["ts"] = kl.ts if kl.ts is not None else self.clock()
        self.events += 1
        self.sink(kind, ev)

    def _records(self) -> Iterator[bytes]:
        if self.kind == "journald" and self.path is None:
            cmd = ["journalctl", "-k", "-o", "json", "-f", "--no-pager"]
            if not self.from_start:
                cmd += ["--since", "now"]
            self._proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
            assert self._proc.stdout is not None
            for line in self._proc.stdout:
                if self._stop.is_set():
                    break
                yield line
            if not self._stop.is_set():
                log.error("kernel log: journalctl exited (%s)", self._proc.poll())
            return
        if self.kind == "kmsg":
            yield from _read_kmsg(Path(self.path or "/dev/kmsg"), self._stop, from_start=self.from_start,
                                  start_at=self._start_at)
            return
        yield from _follow_file(Path(self.path or ""), self._stop, from_start=self.from_start, poll_s=0.2,
                                start_at=self._start_at)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                for raw in self._records():
                    for part in raw.splitlines(keepends=True) if self.kind != "kmsg" else [raw]:
                        self.handle(part)
                if self._stop.is_set():
                    return
            except Exception as exc:
                log.warning("kernel log %s: %s; reopening in 5 s", self.source, exc)
            self._stop.wait(5.0)

    def open(self) -> KernelLogCollector:
        self._boot = boot_time() if self.kind == "kmsg" else None
        # a file is followed from where it ends now: nothing written after open() is missed
        self._start_at = None
        if self.path and not self.from_start:
            try:
                self._start_at = Path(self.path).stat().st_size if Path(self.path).is_file() else None
            except OSError:
                self._start_at = None
        if self.kind == "journald" and self.path is None and shutil.which("journalctl") is None:
            raise RuntimeError("collect.kernel_log is journald but journalctl is not installed")
        if self.kind in ("kmsg", "file") and self.path and not Path(self.path).exists():
            log.warning("kernel log %s does not exist yet; waiting for it", self.path)
        if self.kind == "kmsg" and self.path is None and not os.access("/dev/kmsg", os.R_OK):
            raise RuntimeError("collect.kernel_log is kmsg but /dev/kmsg cannot be read (root or CAP_SYSLOG)")
        self._thread = threading.Thread(target=self._run, name="kernel-log", daemon=True)
        self._thread.start()
        log.info("kernel log: following %s", self.source)
        return self

    def close(self) -> None:
        self._stop.set()
        if self._proc is not None:
            self._proc.terminate()
        if self._thread is not None:
            self._thread.join(2.0)


def auto_source() -> str | None:
    """The kernel-log source this node offers: journald when journalctl runs, else
    /dev/kmsg when readable, else None."""
    journal = any(Path(p).is_dir() for p in ("/run/log/journal", "/var/log/journal"))
    if journal and shutil.which("journalctl") is not None:
        try:
            done = subprocess.run(["journalctl", "-k", "-n", "0", "--no-pager"], capture_output=True, timeout=5)
            ok = done.returncode == 0 and b"No journal files" not in done.stderr + done.stdout
        except (OSError, subprocess.TimeoutExpired):
            ok = False
        if ok:
            return "journald"
    if os.access("/dev/kmsg", os.R_OK):
        return "kmsg"
    return None


# ------------------------------------------------------------------ one event, two sources


class XidMerger:
    """Xid events from NVML and from the kernel log, each sent once.

    The driver reports an Xid to both: NVML's event (code and GPU) and the kernel line
    (code, bus id, text).  While a kernel source is on, NVML's event is held for
    ``hold_s``; the kernel's line of the same GPU and code within ``window_s`` takes
    its place (it carries the text).  Repeats of one GPU and code within ``window_s``
    (Xid 13 prints a line per failing unit) are one event.  Without a kernel source
    nothing is held.  The clock is event time of the sources' own stamps.
    """

    def __init__(self, *, window_s: float = 10.0, hold_s: float = 1.5, kernel: bool = False,
                 clock: Callable[[], float] = time.time) -> None:
        self.window_s = window_s
        self.hold_s = hold_s if kernel else 0.0
        self.clock = clock
        self._lock = threading.Lock()
        self._held: list[tuple[float, dict[str, Any]]] = []  # (due, event) from NVML
        self._ready: list[dict[str, Any]] = []
        self._sxids: list[dict[str, Any]] = []
        self._seen: dict[tuple[Any, ...], float] = {}  # (gpu or bus, code) -> last time, sent events
        self.duplicates = 0

    def _key(self, ev: dict[str, Any]) -> tuple[Any, ...]:
        where = ev.get("gpu") if ev.get("gpu") is not None else ev.get("pci_bus_id")
        return (where, ev["code"])

    def _fresh(self, key: tuple[Any, ...], ts: float) -> bool:
        last = self._seen.get(key)
        self._seen[key] = ts if last is None or ts - last > self.window_s else last
        if len(self._seen) > 4096:
            cut = ts - self.window_s
            self._seen = {k: t for k, t in self._seen.items() if t >= cut}
        return last is None or ts - last > self.window_s

    def add_nvml(self, ev: dict[str, Any]) -> None:
        now = self.clock()
        with self._lock:
            if self.hold_s <= 0:
                if self._fresh(self._key(ev), now):
                    self._ready.append(ev)
                else:
                    self.duplicates += 1
                return
            self._held.append((now + self.hold_s, ev))

    def add_kernel(self, kind: str, ev: dict[str, Any]) -> None:
        ts = float(ev.pop("ts", None) or self.clock())
        with self._lock:
            if kind == "sxid":
                key = ("sxid", ev.get("switch_pci_bus_id"), ev["code"], ev.get("link"))
                if self._fresh(key, ts):
                    self._sxids.append(ev)
                else:
                    self.duplicates += 1
                return
            key = self._key(ev)
            twin = next((i for i, (_, h) in enumerate(self._held) if self._key(h) == key), None)
            if twin is not None:  # NVML saw it too: the kernel's line, with its text, replaces it
                del self._held[twin]
                self.duplicates += 1
            if self._fresh(key, ts):
                self._ready.append(ev)
            else:
                self.duplicates += 1

    def take(self) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """The Xid and SXid events due now (for the next ``telemetry.gpu`` record)."""
        now = self.clock()
        with self._lock:
            due = [ev for t, ev in self._held if t <= now]
            self._held = [(t, ev) for t, ev in self._held if t > now]
            for ev in due:
                if self._fresh(self._key(ev), now):
                    self._ready.append(ev)
                else:
                    self.duplicates += 1
            xids, self._ready = self._ready, []
            sxids, self._sxids = self._sxids, []
        return xids, sxids

    def pending(self) -> int:
        with self._lock:
            return len(self._held) + len(self._ready) + len(self._sxids)

    def next_due(self) -> float | None:
        with self._lock:
            return min((t for t, _ in self._held), default=None)
