"""Recordings: written and read back alike, bad lines named, replays paced by event time."""

from __future__ import annotations

import asyncio

import orjson
import pytest

from pipeline.sim.recording import Recorded, RecordingError, read, replay, schedule, write

T0 = 1_700_000_000.0


def _rec(topic: str, ts: float, key: str = "node-0001", **extra) -> Recorded:
    return Recorded(topic, key, ts, orjson.dumps({"schema": "x/1", "ts": ts, **extra}))


def test_a_recording_reads_back_in_event_time_order_with_bad_payloads_kept_raw(tmp_path) -> None:
    recs = [_rec("telemetry.gpu", T0 + 10), _rec("telemetry.job", T0 + 5, key="job-1"),
            Recorded("telemetry.gpu", None, T0 + 7, b"{not json"), _rec("telemetry.network", T0 + 5)]
    path = tmp_path / "r.jsonl"
    assert write(path, recs) == 4
    back = read(path)
    # event-time order, ties in file order; payloads byte-identical (raw text kept as text)
    assert [(r.topic, r.ts) for r in back] == [("telemetry.job", T0 + 5), ("telemetry.network", T0 + 5),
                                                ("telemetry.gpu", T0 + 7), ("telemetry.gpu", T0 + 10)]
    assert back[2].value == b"{not json" and back[2].key is None
    assert orjson.loads(back[3].value) == orjson.loads(recs[0].value)


@pytest.mark.parametrize("line, words", [
    (b'{"topic": "telemetry.gpu", "ts": 1}', "value or raw"),
    (b'{"topic": "verdicts", "ts": 1, "value": {}}', "not an input topic"),
    (b'{"topic": "telemetry.gpu", "ts": "soon", "value": {}}', "ts must be a number"),
    (b'[1, 2]', "not a recording line"),
    (b'{oops', "not a recording line"),
])
def test_a_bad_line_is_named_with_its_file_and_number(tmp_path, line, words) -> None:
    path = tmp_path / "r.jsonl"
    path.write_bytes(_rec("telemetry.gpu", T0).line() + b"\n\n" + line + b"\n")
    with pytest.raises(RecordingError) as e:
        read(path)
    assert f"{path}:3:" in str(e.value) and words in str(e.value)


def test_schedule_divides_event_time_by_the_speed() -> None:
    recs = [_rec("telemetry.gpu", T0 + t) for t in (0, 10, 10, 250)]
    assert schedule(recs, 1.0) == [0, 10, 10, 250]
    assert schedule(recs, 100.0) == [0, 0.1, 0.1, 2.5]
    assert schedule(recs, float("inf")) == [0, 0, 0, 0]
    with pytest.raises(ValueError):
        schedule(recs, 0.0)


def test_replay_sends_each_record_at_its_time_and_reports_how_far_behind_it_fell() -> None:
    now = [100.0]
    sent: list[tuple[float, float]] = []

    async def sleep(s: float) -> None:
        now[0] += s

    async def send(r: Recorded) -> None:
        sent.append((now[0], r.ts))
        if r.ts == T0 + 20:
            now[0] += 0.5  # a slow send: the next record goes out late

    recs = [_rec("telemetry.gpu", T0 + t) for t in (0, 10, 20, 21, 40)]
    out = asyncio.run(replay(send, recs, 10.0, clock=lambda: now[0], sleep=sleep))
    assert [round(w - 100.0, 6) for w, _ in sent] == [0, 1, 2, 2.5, 4]
    assert out["records"] == 5 and out["event_span_s"] == 40 and out["max_behind_s"] == pytest.approx(0.4)
