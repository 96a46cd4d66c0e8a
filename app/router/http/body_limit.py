"""A request-body size limit for the HTTP API, enforced before the body is in memory.

A body whose Content-Length is over the limit is answered 413 without reading a byte of it; a chunked body (no
Content-Length) is counted while the route reads it and refused as soon as it passes the limit, so the server
never holds more than the limit plus one chunk. Pure ASGI middleware: it covers every route, present and future.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from app.router.http.errors import HTTPFailure, error_reply

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


class BodyTooLarge(HTTPFailure):
    """413; an HTTPFailure, so a route that catches errors while reading the body answers it as is."""

    def __init__(self, limit: int):
        super().__init__(
            413,
            f"the request body is over this server's limit of {limit} bytes (max_request_bytes): send a "
            "shorter prompt or split the request",
            code="request_too_large",
            param="body",
        )


def _declared_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers") or ():
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None  # the server rejects a malformed length itself; count what arrives
    return None


class BodyLimit:
    def __init__(self, app: Callable[[Scope, Receive, Send], Awaitable[None]], max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _declared_length(scope)
        if declared is not None and declared > self.max_bytes:
            await self._refuse(send)
            return
        received = 0
        started = False

        async def counted() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise BodyTooLarge(self.max_bytes)
            return message

        async def tracked(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, counted, tracked)
        except BodyTooLarge:
            if started:
                raise
            await self._refuse(send)

    async def _refuse(self, send: Send) -> None:
        reply = error_reply(BodyTooLarge(self.max_bytes))
        body = json.dumps(reply.body).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        # The unread rest of the body makes the connection unusable for another request: say it is closing.
        headers.append((b"connection", b"close"))
        await send({"type": "http.response.start", "status": 413, "headers": headers})
        await send({"type": "http.response.body", "body": body})
