"""Bytes <-> records, with a reason for every message that cannot be decoded."""

from __future__ import annotations

from typing import TypeVar

from pydantic import ValidationError

from .records import DeadLetter, Record

R = TypeVar("R", bound=Record)

#: Messages larger than this are refused before parsing.
MAX_MESSAGE_BYTES = 1_000_000
#: How much of a bad payload a dead letter keeps.
DEADLETTER_PAYLOAD_BYTES = 2048


_WIRE = {"wire": True}


class DecodeError(ValueError):
    """A message that is not a valid record; ``reason`` says why, for the dead letter."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def _summarise(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors(include_url=False)[:5]:
        loc = ".".join(str(p) for p in err.get("loc", ())) or "<record>"
        if err.get("type") == "json_invalid":
            return f"invalid JSON: {err.get('msg')}"
        if loc == "schema" and err.get("type") == "literal_error":
            return f"unsupported schema version {err.get('input')!r}: {err.get('msg')}"
        parts.append(f"{loc}: {err.get('msg')}")
    more = exc.error_count() - len(parts)
    if more > 0:
        parts.append(f"(+{more} more)")
    return "invalid record: " + "; ".join(parts)


def decode(model: type[R], data: bytes | str | None, *, max_bytes: int = MAX_MESSAGE_BYTES) -> R:
    """Parse and validate one message as ``model``; raise :class:`DecodeError` if invalid."""
    if data is None:
        raise DecodeError("empty message (no value)")
    if len(data) > max_bytes:
        raise DecodeError(f"oversized message: {len(data)} bytes > limit {max_bytes}")
    try:
        return model.model_validate_json(data, context=_WIRE)
    except ValidationError as exc:
        raise DecodeError(_summarise(exc)) from None


def encode(record: Record) -> bytes:
    return record.to_json()


def dead_letter(
    *,
    source_topic: str,
    reason: str,
    payload: bytes | str | None,
    ts: float,
    key: bytes | str | None = None,
    partition: int | None = None,
    offset: int | None = None,
) -> DeadLetter:
    if isinstance(payload, bytes):
        text = payload[:DEADLETTER_PAYLOAD_BYTES].decode("utf-8", errors="replace")
    else:
        text = (payload or "")[:DEADLETTER_PAYLOAD_BYTES]
    if isinstance(key, bytes):
        key = key.decode("utf-8", errors="replace")
    return DeadLetter(
        ts=ts,
        source_topic=source_topic,
        partition=partition,
        offset=offset,
        key=key,
        reason=reason[:1000],
        payload=text,
    )
