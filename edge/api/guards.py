"""What stands in front of the daemon's routes: the API key, the body size limit, the concurrency limit.

`RequestGuard` is plain ASGI middleware (it must see the body before FastAPI parses it): a request
to /v1/ without the daemon's key gets 401, as vLLM's `--api-key` does (health and metrics stay
open, for probes and scrapers); a body over the limit gets 413 before any of it is parsed or
tokenized. `ConcurrencyLimit` counts generations in flight; the app answers 429 over it.
"""

from __future__ import annotations

import hmac
import json
from typing import Any, Awaitable, Callable

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


async def send_error(send: Send, status: int, message: str, kind: str, code: str | None = None,
                     headers: list[tuple[bytes, bytes]] | None = None) -> None:
    """An OpenAI error object, straight on the ASGI channel."""
    body = json.dumps({"error": {"message": message, "type": kind, "param": None, "code": code}}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            *(headers or [])]})
    await send({"type": "http.response.body", "body": body})


class RequestGuard:
    def __init__(self, app: ASGIApp, api_key: str | None, max_request_bytes: int) -> None:
        self.app = app
        self.api_key = api_key
        self.max_request_bytes = max_request_bytes

    def _authorized(self, scope: Scope) -> bool:
        header = dict(scope.get("headers") or []).get(b"authorization", b"")
        expected = f"Bearer {self.api_key}".encode()
        return hmac.compare_digest(header, expected)  # constant time: the key cannot be guessed byte by byte

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.api_key and scope["path"].startswith("/v1/") and not self._authorized(scope):
            await send_error(send, 401, "missing or wrong API key: send the header 'Authorization: Bearer <key>'",
                             "invalid_request_error", "invalid_api_key", [(b"www-authenticate", b"Bearer")])
            return
        body = None if self._declared_size(scope) > self.max_request_bytes else await self._read_body(receive)
        if body is None:
            await send_error(send, 413, f"request body over {self.max_request_bytes} bytes", "invalid_request_error",
                             "request_too_large")
            return
        await self.app(scope, self._replay(body, receive), send)

    @staticmethod
    def _declared_size(scope: Scope) -> int:
        try:
            return int(dict(scope.get("headers") or []).get(b"content-length", b"0"))
        except ValueError:
            return 0  # h11 refuses a malformed Content-Length before we get here; count the bytes instead

    async def _read_body(self, receive: Receive) -> bytes | None:
        """The whole body, or None as soon as it passes the limit (whatever Content-Length claimed)."""
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return b"".join(chunks)  # the client left; the app will see the disconnect
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_request_bytes:
                return None
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    @staticmethod
    def _replay(body: bytes, receive: Receive) -> Receive:
        """The body once, then the real channel (so that a disconnect is still seen)."""
        pending = [{"type": "http.request", "body": body, "more_body": False}]

        async def replayed() -> Message:
            return pending.pop() if pending else await receive()

        return replayed


class ConcurrencyLimit:
    """Generations in flight, at most `limit` (0: no limit). Single event loop: no lock needed."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.in_flight = 0

    def try_acquire(self, n: int = 1) -> bool:
        """Take `n` places (a request's n generations) or none."""
        if self.limit and self.in_flight + n > self.limit:
            return False
        self.in_flight += n
        return True

    def release(self, n: int = 1) -> None:
        self.in_flight -= n
