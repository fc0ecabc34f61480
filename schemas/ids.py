"""Stable record ids: the same parts give the same id in every process and every replay."""

from __future__ import annotations

import hashlib


def stable_id(*parts: object, n: int = 16) -> str:
    """The first ``n`` hex digits of the SHA-1 of the parts joined by ``|``."""
    return hashlib.sha1("|".join(str(p) for p in parts).encode()).hexdigest()[:n]
