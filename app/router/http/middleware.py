"""Middleware that runs inside Serve's own HTTP proxy, not in the ingress: it answers for an ingress replica that
died under a request (app/router/http/errors.py gives its replies the same OpenAI shape as every other error).

When an ingress replica dies, Serve's HTTP proxy (ray/serve/_private/proxy.py, Ray 2.60) gets an ActorDiedError
for every request that replica held. Before any response it maps that to a 500 and sends nothing
(http_util.send_http_response_on_exception only writes a body for 408/429/503), so uvicorn answers a bare
500 text/plain "Internal Server Error"; after a stream started it just stops, and the client sees the stream
cut without [DONE]. Requests not yet on the dead replica are fine: the proxy's router retries a reservation
that meets a dead replica on another one (router._pick_and_reserve_replica), or waits for one to start.
IngressLossMiddleware wraps the proxy (RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH=PROXY_CALLBACK in the
environment of every Ray node) so those requests end cleanly instead.
"""

from __future__ import annotations

import json

from app.router.http.errors import ErrorReply, HTTPFailure, error_reply

PROXY_CALLBACK = "app.router.http.middleware:proxy_middlewares"
PROXY_CALLBACK_ENV = "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"
# Generation has no side effects: these may run again when the ingress died before answering.
_RETRY_POSTS = ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize")
_MAX_REPLAY_BYTES = 8 << 20  # a larger request body is passed through, not kept for a retry
RETRIED_HEADER = b"x-loraland-ingress-retried"  # on an answer that took a second try (chaos counts them)


def ingress_lost_reply() -> ErrorReply:
    return error_reply(
        HTTPFailure(
            503,
            "the LoRA-Land ingress handling this request stopped before it finished; the request was not "
            "completed, retry it",
            type="service_unavailable",
            code="ingress_unavailable",
            retry_after_s=1.0,
        )
    )


class IngressLossMiddleware:
    """Pure-ASGI middleware around Serve's HTTP proxy for requests whose ingress replica died under them.

    - No response yet: an idempotent request (GET, or POST to the generation and tokenize routes) is sent
      again, up to `retries` times (the proxy routes it to a live ingress, or waits for a new one); otherwise,
      or when the retries fail too, the client gets a 503 OpenAI error with Retry-After. The proxy's response
      start is held until the first body bytes, so a stream whose ingress died before its first event counts as
      "no response yet" and is retried too.
    - A stream (text/event-stream) that had started: it ends with an OpenAI error event carrying "status": 503
      (the ingress's own format for errors after the headers), then [DONE].
    - Anything the proxy answered itself (404, 408, 503...) and every normal response pass through untouched.
    """

    def __init__(self, app, retries: int = 2, backoff_s: float = 0.2):
        self.app, self.retries, self.backoff_s = app, retries, backoff_s

    async def __call__(self, scope, receive, send):
        if scope.get("type") != "http":
            return await self.app(scope, receive, send)
        import asyncio

        method = scope.get("method", "GET")
        retryable = method in ("GET", "HEAD") or (method == "POST" and scope.get("path") in _RETRY_POSTS)
        state = {"disconnected": False}
        body, complete = b"", True
        if method not in ("GET", "HEAD"):
            body, complete = await self._read_body(receive, state)
            retryable = retryable and complete
        attempts = 1 + (self.retries if retryable else 0)
        for attempt in range(attempts):
            out = _Attempt(send, retried=attempt > 0)
            replay = _replay(body, complete, receive, state)
            try:
                await self.app(dict(scope), replay, out.send)
            except Exception:
                if out.body_sent:
                    raise
            if out.body_sent or state["disconnected"]:
                if out.body_sent and not out.finished and out.event_stream and not state["disconnected"]:
                    await self._end_stream(send)
                return
            # Nothing reached the client: no response (the proxy's bare 500), or a start without a body (a
            # stream whose ingress died before its first event). Try again, or say so below.
            if attempt + 1 < attempts:
                await asyncio.sleep(self.backoff_s * (attempt + 1))
        reply = ingress_lost_reply()
        payload = json.dumps(reply.body).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
        headers += [(k.lower().encode(), v.encode()) for k, v in reply.headers.items()]
        await send({"type": "http.response.start", "status": reply.status, "headers": headers})
        await send({"type": "http.response.body", "body": payload, "more_body": False})

    @staticmethod
    async def _read_body(receive, state) -> tuple[bytes, bool]:
        """The request body, and False when it is too large to keep (the rest is left to the proxy)."""
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                state["disconnected"] = True
                return b"".join(chunks), True
            chunk = message.get("body", b"")
            chunks.append(chunk)
            size += len(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks), True
            if size > _MAX_REPLAY_BYTES:
                return b"".join(chunks), False

    @staticmethod
    async def _end_stream(send) -> None:
        reply = ingress_lost_reply()
        event = json.dumps({**reply.body, "status": reply.status}, separators=(",", ":"))
        tail = f"data: {event}\n\ndata: [DONE]\n\n".encode()
        try:
            await send({"type": "http.response.body", "body": tail, "more_body": False})
        except Exception:  # the client went away meanwhile
            pass


class _Attempt:
    """One try's view of `send`: holds the response start until body bytes come, records how far it got, and
    gives the proxy's own plain-text errors (its 408 timeout, 429 back-pressure, 503 unavailable) the OpenAI
    shape every other error has."""

    _PROXY_ERRORS = (408, 429, 500, 502, 503, 504)

    def __init__(self, send, retried: bool = False):
        self._send, self.start = send, None
        self.body_sent = self.finished = self.event_stream = False
        self.retried = retried  # the answer of a second try: it says so in RETRIED_HEADER
        self._plain: list[bytes] | None = None  # the body of a proxy error being rewritten

    async def send(self, message) -> None:
        kind = message.get("type")
        if kind == "http.response.start":
            self.start = message
            headers = dict(message.get("headers") or ())
            ctype = headers.get(b"content-type", b"")
            self.event_stream = ctype.startswith(b"text/event-stream")
            if message.get("status") in self._PROXY_ERRORS and not ctype.startswith(b"application/json"):
                self._plain = []
            return
        if kind == "http.response.body" and self._plain is not None:
            self._plain.append(message.get("body", b""))
            if message.get("more_body", False):
                return
            await self._send_openai_error(b"".join(self._plain).decode(errors="replace").strip())
            self.body_sent = self.finished = True
            return
        if kind == "http.response.body" and not self.body_sent:
            more = message.get("more_body", False)
            if not message.get("body") and more:
                return  # an empty chunk before any bytes: keep holding the start
            if self.start is not None:
                start = self.start
                if self.retried:
                    start = {**start, "headers": [*(start.get("headers") or ()), (RETRIED_HEADER, b"1")]}
                await self._send(start)
            self.body_sent = True
        if kind == "http.response.body" and not message.get("more_body", False):
            self.finished = True
        await self._send(message)

    async def _send_openai_error(self, text: str) -> None:
        status = self.start["status"]
        codes = {408: ("timeout", "the request timed out in Serve's proxy; retry it"),
                 429: ("queue_full", "too many requests are queued; retry after the Retry-After delay"),
                 503: ("service_unavailable", "the service is unavailable; retry it")}  # fmt: skip
        code, default = codes.get(status, ("internal_error", "the request failed in Serve's proxy"))
        etype = {429: "rate_limit_error", 500: "server_error"}.get(status, "service_unavailable")
        body = {"error": {"message": f"{default} ({text[:200]})" if text else default, "type": etype,
                          "param": None, "code": code}}  # fmt: skip
        payload = json.dumps(body).encode()
        keep = [(k, v) for k, v in self.start.get("headers") or () if k.lower() == b"retry-after"]
        if not keep and status in (408, 429, 503, 504):
            keep = [(b"retry-after", b"1")]
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
        await self._send({"type": "http.response.start", "status": status, "headers": headers + keep})
        await self._send({"type": "http.response.body", "body": payload, "more_body": False})


def _replay(body: bytes, complete: bool, receive, state):
    """A receive() that hands out the buffered body once, then the client's own messages (its disconnect)."""
    pending = [{"type": "http.request", "body": body, "more_body": not complete}]

    async def replayed():
        if pending:
            return pending.pop()
        message = await receive()
        if message["type"] == "http.disconnect":
            state["disconnected"] = True
        return message

    return replayed


def proxy_middlewares() -> list:
    """Serve's HTTP proxy callback (RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH): the middlewares it adds."""
    from starlette.middleware import Middleware

    return [Middleware(IngressLossMiddleware)]
