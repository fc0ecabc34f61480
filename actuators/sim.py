"""Backend for the simulated cluster: the simulator serves a small cluster API on loopback.

The API does what a real control plane does for us: it looks at the live state of the
node or job, compares it with what the action wants, and acts only if needed, answering
``applied`` or ``already_so``.  Connection errors and 5xx answers are temporary.
"""

from __future__ import annotations

import aiohttp

from schemas import ActionName, Outcome

from .base import ActionRequest, ActionResult, PermanentError, TemporaryError


class SimBackend:
    name = "sim"

    def __init__(self, url: str, *, timeout: float = 5.0) -> None:
        self.url = url.rstrip("/")
        self.timeout = aiohttp.ClientTimeout(total=timeout)
        self._session: aiohttp.ClientSession | None = None

    def supports(self, action: ActionName) -> bool:
        return True

    async def _client(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(timeout=self.timeout)
        return self._session

    async def apply(self, request: ActionRequest) -> ActionResult:
        body = {
            "key": request.key,
            "verdict_id": request.verdict_id,
            "action": request.action.value,
            "target": request.target,
            "params": request.params,
            "reason": request.reason,
        }
        session = await self._client()
        try:
            async with session.post(f"{self.url}/actions", json=body) as resp:
                data = await resp.json(content_type=None) if resp.content_length != 0 else {}
                if resp.status >= 500 or resp.status == 429:
                    raise TemporaryError(f"simulator answered {resp.status}: {data}")
                if resp.status >= 400:
                    raise PermanentError(f"simulator refused {request.action.value} {request.target}: {resp.status} {data}")
        except (aiohttp.ClientConnectionError, TimeoutError) as exc:
            raise TemporaryError(f"simulator unreachable at {self.url}: {exc!r}") from exc
        return ActionResult(Outcome(data.get("outcome", "applied")), str(data.get("detail", "")))

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
