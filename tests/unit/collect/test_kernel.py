"""The kernel-log collector on lines real NVIDIA drivers printed.

The driver's lines come from ``tests/fixtures/kernel-log/lines.toml`` (each with its public
source).  No public journald JSON record or raw /dev/kmsg record of an NVRM line exists
that we could find (``tests/fixtures/kernel-log/formats.md``), so the records around the
real text follow the formats as systemd and the kernel document them: journald's
"Journal JSON Format" (string MESSAGE, or an array of byte values when it is not UTF-8;
numeric fields as strings) and ``Documentation/ABI/testing/dev-kmsg``
(``prio,seq,usec,flags;text``, ``\\xNN`` escapes, continuation lines).
"""

from __future__ import annotations

import json
import threading
import time
import tomllib
from pathlib import Path

import pytest

from pipeline.collect.agent import Agent
from pipeline.collect.fake_nvml import FakeNVML
from pipeline.collect.kernel import (
    KernelLogCollector,
    XidMerger,
    parse_journal_record,
    parse_kmsg_record,
    parse_syslog_line,
    proc_gpu_buses,
    sxid_event,
    xid_event,
)
from pipeline.config import CollectSettings
from schemas import GpuSample

REPO = Path(__file__).resolve().parents[3]
LINES = tomllib.loads((REPO / "tests/fixtures/kernel-log/lines.toml").read_text())["line"]
XID_LINES = [ln for ln in LINES if "xid" in ln]
SXID_LINES = [ln for ln in LINES if "sxid" in ln]


def journal(text: str | bytes, usec: int = 1_601_471_260_802_301, transport: str = "kernel") -> str:
    """A ``journalctl -o json`` line around ``text`` (fields as journald writes them)."""
    message: str | list[int] = text if isinstance(text, str) else list(text)
    return json.dumps({"_HOSTNAME": "gpu-node-7", "_TRANSPORT": transport, "SYSLOG_IDENTIFIER": "kernel",
                       "SYSLOG_FACILITY": "0", "PRIORITY": "4", "MESSAGE": message,
                       "__REALTIME_TIMESTAMP": str(usec), "__MONOTONIC_TIMESTAMP": "1806379233",
                       "_SOURCE_MONOTONIC_TIMESTAMP": "1805611354", "_BOOT_ID": "b03ed610f21d46ab8243a495ba5a0058"})


def kmsg(text: str, seq: int = 4001, usec: int = 261_573_217, prio: int = 4) -> str:
    escaped = "".join(c if 32 <= ord(c) < 127 and c != "\\" else f"\\x{ord(c):02x}" for c in text)
    return f"{prio},{seq},{usec},-;{escaped}\n"


def test_every_real_xid_line_parses_in_each_framing_and_maps_to_its_gpu():
    buses = sorted({ln["text"].split("(PCI:")[1][:10] for ln in XID_LINES if "(PCI:" in ln["text"]})
    gpu_of = {b: i for i, b in enumerate(buses)}.get
    for ln in XID_LINES:
        text = ln["text"]
        framings = [parse_journal_record(journal(text)), parse_kmsg_record(kmsg(text), boot_time=1.7e9),
                    parse_syslog_line(ln.get("original") or f"Dec  2 10:43:35 worker4 kernel: [240314.528856] {text}",
                                      now=1.7e9)]
        for kl in framings:
            assert kl is not None, text
            ev = xid_event(kl.message, gpu_of)
            assert ev is not None and ev["code"] == ln["xid"], text
            assert ev["source"] == "kernel" and ev["pci_bus_id"] in text.replace("PCI:", "") or "(0000:" in text
            if "(PCI:" in text:
                assert ev["gpu"] == gpu_of(ev["pci_bus_id"])


def test_every_real_sxid_line_parses_and_companion_lines_are_dropped():
    events = [sxid_event(ln["text"]) for ln in SXID_LINES]
    for ln, ev in zip(SXID_LINES, events):
        if "Engine instance" in ln["text"] or "Data {" in ln["text"]:
            assert ev is None
        else:
            assert ev is not None and ev["code"] == ln["sxid"] and ev["switch_pci_bus_id"]
    fatal = next(ev for ev in events if ev and ev.get("fatal"))
    assert fatal["link"] == 48 and fatal["code"] == 20034


def test_journal_records_as_journald_writes_them():
    text = XID_LINES[0]["text"]
    kl = parse_journal_record(journal(text))
    assert kl.message == text and kl.ts == pytest.approx(1_601_471_260.802301)
    # not valid UTF-8: journald writes MESSAGE as an array of byte values
    raw = text.encode() + b" \xff\xfe"
    kl = parse_journal_record(journal(raw))
    assert kl.message.startswith(text) and xid_event(kl.message, lambda b: 0)["code"] == XID_LINES[0]["xid"]
    # a field with several values, a null message, another transport, garbage: no record, no exception
    assert parse_journal_record(json.dumps({"_TRANSPORT": "kernel", "MESSAGE": ["a", text]})).message == text
    assert parse_journal_record(json.dumps({"_TRANSPORT": "kernel", "MESSAGE": None})) is None
    assert parse_journal_record(journal(text, transport="syslog").replace('"SYSLOG_IDENTIFIER": "kernel", ', "")) \
        is None
    for junk in ("", "{", "[1,2]", "null", b"\xff\xfe{", '{"MESSAGE": 5}'):
        assert parse_journal_record(junk) is None


def test_kmsg_records_with_escapes_continuations_and_the_kernels_own_examples():
    # Documentation/ABI/testing/dev-kmsg's example, and gpud's captured records (pkg/kmsg/testdata)
    assert parse_kmsg_record(" SUBSYSTEM=acpi") is None
    kl = parse_kmsg_record("7,160,424069,-;pci_root PNP0A03:00: host bridge window [io  0x0000-0x0cf7] (ignored)",
                           boot_time=1000.0)
    assert kl.message.startswith("pci_root") and kl.ts == pytest.approx(1000.424069)
    assert parse_kmsg_record("6,4001,261573217,-;nvidia-nvswitch0: open (major=510)").message == \
        "nvidia-nvswitch0: open (major=510)"
    # a future extra field before ';' is ignored; an escaped backslash and newline come back
    kl = parse_kmsg_record("4,4002,261573300,-,caller=T12;" + kmsg("NVRM: a\\b\nc").split(";", 1)[1])
    assert kl.message == "NVRM: a\\b\nc"
    for junk in ("", "hello", "4,x,1,-;text", b"\xff\xff"):
        assert parse_kmsg_record(junk) is None


def test_syslog_lines_with_and_without_the_printk_time():
    for line in ("Dec  2 10:43:35 worker4 kernel: [240314.528856] " + XID_LINES[0]["text"],
                 "Nov 22 18:29:55 hostname kernel: [ 966.503025] NVRM: Xid (0000:01:00): 31, Ch 0000000b, "
                 "engmask 00000120, intr 10000000",
                 "kernel: NVRM: Xid (PCI:0000:dc:00): 45, pid=1818990, name=python3, Ch 00000001 caused by "
                 "previous Xid 149"):
        kl = parse_syslog_line(line, now=5.0)
        assert kl.ts == 5.0 and xid_event(kl.message, lambda b: None) is not None
    kl = parse_syslog_line("2024-03-01T12:00:00.5+00:00 host kernel: " + XID_LINES[0]["text"], now=5.0)
    assert kl.ts == pytest.approx(1709294400.5)


def test_one_xid_seen_by_nvml_and_the_kernel_is_sent_once_with_the_kernels_text():
    now = [100.0]
    m = XidMerger(window_s=10, hold_s=1.5, kernel=True, clock=lambda: now[0])
    m.add_nvml({"gpu": 2, "code": 79, "source": "nvml"})
    assert m.take() == ([], []) and m.next_due() == pytest.approx(101.5)
    now[0] = 100.4
    m.add_kernel("xid", {"gpu": 2, "code": 79, "source": "kernel", "detail": "GPU has fallen off the bus.",
                         "ts": 100.3})
    xids, _ = m.take()
    assert xids == [{"gpu": 2, "code": 79, "source": "kernel", "detail": "GPU has fallen off the bus."}]
    now[0] = 103.0
    assert m.take() == ([], []) and m.duplicates == 1
    # the kernel's line first, NVML's event after it: still one
    m.add_kernel("xid", {"gpu": 5, "code": 48, "source": "kernel", "ts": 103.0})
    m.add_nvml({"gpu": 5, "code": 48, "source": "nvml"})
    now[0] = 105.0
    xids, _ = m.take()
    assert [x["source"] for x in xids] == ["kernel"] and m.duplicates == 2
    # NVML alone: sent when the hold ends
    m.add_nvml({"gpu": 1, "code": 13, "source": "nvml"})
    now[0] = 106.6
    assert [x["source"] for x in m.take()[0]] == ["nvml"]


def test_a_burst_of_one_xid_is_one_event_and_later_ones_are_new():
    m = XidMerger(window_s=10, kernel=True, clock=lambda: 0.0)
    for k, line in enumerate(ln["text"] for ln in XID_LINES if ln["xid"] == 13 and "0000:cb:00" in ln["text"]):
        m.add_kernel("xid", {**xid_event(line, lambda b: 3), "ts": 50.0 + 0.001 * k})
    m.add_kernel("xid", {"gpu": 3, "code": 13, "ts": 75.0})
    xids, _ = m.take()
    assert [x["gpu"] for x in xids] == [3, 3] and m.duplicates >= 2


def test_without_a_kernel_source_nvml_events_are_not_held():
    m = XidMerger(kernel=False, clock=lambda: 0.0)
    m.add_nvml({"gpu": 0, "code": 79})
    assert m.take() == ([{"gpu": 0, "code": 79}], [])


def test_proc_listing_gives_bus_ids_in_nvml_order(tmp_path):
    for name in ("0000:c3:00.0", "0000:1b:00.0", "0000:52:00.0", "not-a-gpu"):
        (tmp_path / name).mkdir()
    assert proc_gpu_buses(tmp_path) == ["0000:1b:00", "0000:52:00", "0000:c3:00"]
    assert proc_gpu_buses(tmp_path / "absent") == []


@pytest.mark.parametrize("kind", ["journald", "kmsg", "file"])
def test_the_collector_follows_a_growing_source(tmp_path, kind):
    path = tmp_path / "log"
    frame = {"journald": lambda t: journal(t) + "\n", "kmsg": kmsg,
             "file": lambda t: f"Dec  2 10:43:35 worker4 kernel: [240314.528856] {t}\n"}[kind]
    path.write_text(frame("NVRM: loading NVIDIA UNIX x86_64 Kernel Module  550.54.15") + frame(XID_LINES[0]["text"]))
    got: list[tuple[str, dict]] = []
    done = threading.Event()

    def sink(k, ev):
        got.append((k, ev))
        if len(got) >= 3:
            done.set()

    c = KernelLogCollector(f"{kind}:{path}", lambda b: 0, sink, from_start=True, clock=lambda: 42.0).open()
    try:
        with path.open("a") as f:  # lines appended while it follows, one of them garbled
            f.write(frame("NVRM: Xid (PCI:0000:00:00): 9999999999, garbled"))
            f.write("\x00\xff not a record at all\n")
            f.write(frame(SXID_LINES[0]["text"]))
            f.write(frame([ln for ln in XID_LINES if ln["xid"] == 154][0]["text"]))
        assert done.wait(10)
    finally:
        c.close()
    assert [(k, ev["code"]) for k, ev in got] == [("xid", XID_LINES[0]["xid"]), ("sxid", SXID_LINES[0]["sxid"]),
                                                   ("xid", 154)]
    assert all(ev["ts"] > 0 for _, ev in got)


def test_an_unknown_source_or_a_missing_tool_fails_at_start_naming_the_setting():
    with pytest.raises(ValueError, match="collect.kernel_log"):
        KernelLogCollector("syslog", lambda b: 0, lambda k, e: None)
    with pytest.raises(ValueError, match="kernel_log"):
        CollectSettings(kernel_log="file")


def test_the_agent_sends_one_xid_with_the_kernels_text_when_nvml_sees_it_too(tmp_path):
    line = next(ln for ln in XID_LINES if ln["xid"] == 154 and "GPU Reset Required" in ln["text"]
                and "0000:3e:00" in ln["text"])
    buses = [f"00000000:{b:02X}:00.0" for b in (0x1B, 0x3E, 0x52, 0x61, 0x9D, 0xC3, 0xD1, 0xDF)]
    fake = FakeNVML(8, seed=3, bus_ids=buses)
    log = tmp_path / "journal.jsonl"
    log.write_text("")
    cfg = CollectSettings(node="gpu-node-7", interval_s=60, infiniband_root=str(tmp_path / "none"),
                          kernel_log=f"journald:{log}")
    agent = Agent(cfg, nvml=fake)
    try:
        fake.inject_xid(1, 154)
        with log.open("a") as f:
            f.write(journal(line["text"], usec=int(time.time() * 1e6)) + "\n")
        deadline = time.time() + 10
        xids: list[dict] = []
        import asyncio

        while time.time() < deadline and not xids:
            recs = asyncio.run(agent.gpu())
            xids = [x for r in recs for x in r["xids"]]
            time.sleep(0.3)
    finally:
        agent.close()
    assert len(xids) == 1
    x = xids[0]
    assert (x["gpu"], x["code"], x["source"], x["pci_bus_id"]) == (1, 154, "kernel", "0000:3e:00")
    assert "GPU Reset Required" in x["detail"]
    GpuSample.model_validate(recs[0])


def test_without_nvml_the_agent_reports_kernel_xids_on_the_drivers_gpus(tmp_path):
    proc = tmp_path / "gpus"
    for b in ("0000:91:00.0", "0000:07:00.0"):
        (proc / b).mkdir(parents=True)
    log = tmp_path / "kmsg"
    log.write_text(kmsg(XID_LINES[0]["text"]))  # Xid 79 on 0000:91:00
    cfg = CollectSettings(node="gpu-node-8", nvml="off", interval_s=60, infiniband_root=str(tmp_path / "none"),
                          kernel_log=f"kmsg:{log}", kernel_log_backlog=True)
    agent = Agent(cfg, proc_gpus=str(proc))
    try:
        import asyncio

        deadline = time.time() + 10
        recs: list[dict] = []
        while time.time() < deadline and not recs:
            recs = asyncio.run(agent.gpu())
            time.sleep(0.2)
    finally:
        agent.close()
    [rec] = recs
    s = GpuSample.model_validate(rec)
    assert s.util == [None, None] and s.pci_bus_id == ["0000:07:00", "0000:91:00"]
    assert [(x.gpu, x.code) for x in s.xids] == [(1, 79)]
