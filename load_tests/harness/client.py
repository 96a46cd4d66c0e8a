"""The HTTP side of a load test: one /v1/completions request timed from its SSE chunks, and a run of many.

Times are time.perf_counter() seconds. TTFT is from sending the request to the first chunk that carries
text; TPOT is (end-to-end - TTFT) / (output tokens - 1), the mean gap between later tokens.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx

from load_tests.harness.workload import RequestSpec


class ServerUnreachable(RuntimeError):
    """The server could not be asked anything (refused connection, bad URL, wrong API key)."""


@dataclass(frozen=True)
class ClientConfig:
    base_url: str  # up to and including /v1
    api_key: str | None = None
    stream: bool = True
    timeout: float = 600.0  # total seconds per request
    temperature: float = 0.0
    extra_body: dict = field(default_factory=dict)

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


@dataclass
class RequestRecord:
    index: int
    model: str
    prompt_len: int
    max_tokens: int
    ok: bool = False
    error_kind: str | None = None  # http_<status> | timeout | connection | stream_error | incomplete_stream
    error_detail: str | None = None
    start: float = 0.0  # seconds after the run started
    ttft: float | None = None
    e2e: float | None = None
    output_tokens: int = 0
    tokens_source: str = "none"  # usage (the server's count) | chunks (one per text chunk)
    chunk_times: list[float] = field(default_factory=list)  # seconds after sending, one per text chunk

    @property
    def tpot(self) -> float | None:
        if self.ttft is None or self.e2e is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:], strict=False)]


def _body(cfg: ClientConfig, spec: RequestSpec) -> dict:
    body = {
        "model": spec.model,
        "prompt": spec.prompt,
        "max_tokens": spec.max_tokens,
        "temperature": cfg.temperature,
        # ignore_eos makes every output exactly max_tokens long, so runs are comparable across servers.
        "ignore_eos": True,
        "stream": cfg.stream,
    }
    if cfg.stream:
        body["stream_options"] = {"include_usage": True}
    return body | cfg.extra_body


def _fail(rec: RequestRecord, kind: str, detail: str) -> RequestRecord:
    rec.ok, rec.error_kind, rec.error_detail = False, kind, detail[:300]
    return rec


async def _stream(
    client: httpx.AsyncClient, cfg: ClientConfig, body: dict, rec: RequestRecord, t0: float
) -> None:
    async with client.stream("POST", "/completions", json=body, headers=cfg.headers()) as resp:
        if resp.status_code >= 400:
            text = (await resp.aread()).decode(errors="replace")
            _fail(rec, f"http_{resp.status_code}", text)
            return
        usage_tokens, chunks, done = None, 0, False
        async for line in resp.aiter_lines():
            if not line.startswith("data:"):
                continue  # blank separators, ": keep-alive" comments, event: lines
            data = line[5:].strip()
            if data == "[DONE]":
                done = True
                break
            try:
                obj = json.loads(data)
            except json.JSONDecodeError:
                _fail(rec, "stream_error", f"chunk is not JSON: {data[:100]}")
                return
            if "error" in obj:
                _fail(rec, "stream_error", json.dumps(obj["error"]))
                return
            now = time.perf_counter() - t0
            if any(c.get("text") for c in obj.get("choices") or []):
                chunks += 1
                rec.chunk_times.append(now)
                if rec.ttft is None:
                    rec.ttft = now
            if obj.get("usage"):
                usage_tokens = obj["usage"].get("completion_tokens")
        rec.e2e = time.perf_counter() - t0
        if not done:
            _fail(rec, "incomplete_stream", "the stream ended without data: [DONE]")
            return
        rec.output_tokens, rec.tokens_source = (
            (usage_tokens, "usage") if usage_tokens is not None else (chunks, "chunks")
        )
        rec.ok = True


async def _plain(
    client: httpx.AsyncClient, cfg: ClientConfig, body: dict, rec: RequestRecord, t0: float
) -> None:
    resp = await client.post("/completions", json=body, headers=cfg.headers())
    rec.e2e = time.perf_counter() - t0
    if resp.status_code >= 400:
        _fail(rec, f"http_{resp.status_code}", resp.text)
        return
    usage = (resp.json().get("usage") or {}).get("completion_tokens")
    rec.output_tokens, rec.tokens_source = (usage, "usage") if usage is not None else (0, "none")
    rec.ok = True


async def send_one(
    client: httpx.AsyncClient, cfg: ClientConfig, spec: RequestSpec, run_t0: float
) -> RequestRecord:
    """One request; never raises for server or network faults: they become the record's error_kind."""
    rec = RequestRecord(spec.index, spec.model, spec.prompt_len, spec.max_tokens)
    t0 = time.perf_counter()
    rec.start = t0 - run_t0
    call = _stream if cfg.stream else _plain
    try:
        await asyncio.wait_for(call(client, cfg, _body(cfg, spec), rec, t0), cfg.timeout)
    except (asyncio.TimeoutError, httpx.TimeoutException) as e:
        _fail(rec, "timeout", f"no complete answer within {cfg.timeout:g} s ({type(e).__name__})")
    except httpx.TransportError as e:  # refused, reset, closed mid-stream
        _fail(rec, "connection", f"{type(e).__name__}: {e}")
    except (ValueError, KeyError, TypeError) as e:  # a 2xx whose body is not an OpenAI completion
        _fail(rec, "bad_response", f"{type(e).__name__}: {e}")
    if rec.e2e is None:
        rec.e2e = time.perf_counter() - t0
    return rec


def make_client(cfg: ClientConfig, max_connections: int | None) -> httpx.AsyncClient:
    limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections)
    timeout = httpx.Timeout(cfg.timeout, pool=None)
    return httpx.AsyncClient(base_url=cfg.base_url.rstrip("/"), limits=limits, timeout=timeout)


async def probe(cfg: ClientConfig) -> list[str]:
    """GET /models: the ids the server lists. Raises ServerUnreachable with a one-line reason."""
    url = cfg.base_url.rstrip("/") + "/models"
    try:
        async with httpx.AsyncClient(timeout=10.0) as c:
            resp = await c.get(url, headers=cfg.headers())
    except httpx.TransportError as e:
        raise ServerUnreachable(f"cannot reach {url}: {type(e).__name__}: {e or 'no answer'}") from None
    except httpx.InvalidURL as e:
        raise ServerUnreachable(f"bad --base-url {cfg.base_url!r}: {e}") from None
    if resp.status_code in (401, 403):
        raise ServerUnreachable(
            f"{url} refused the API key (HTTP {resp.status_code}): pass a valid --api-key"
        )
    if resp.status_code >= 400:
        return []  # some servers do not list models; the run itself will tell
    try:
        return [m["id"] for m in resp.json().get("data", [])]
    except (ValueError, KeyError, TypeError, AttributeError):
        return []


async def run_requests(
    cfg: ClientConfig,
    specs: list[RequestSpec],
    concurrency: int | None,
    on_done: Callable[[RequestRecord], None] = lambda r: None,
) -> tuple[list[RequestRecord], float]:
    """Send every spec: at most `concurrency` in flight (None = unbounded), each not before its send_at.
    Returns the records in spec order and the run's wall time (first send to last answer)."""
    sem = asyncio.Semaphore(concurrency) if concurrency else None
    async with make_client(cfg, concurrency) as client:
        t0 = time.perf_counter()

        async def one(spec: RequestSpec) -> RequestRecord:
            if spec.send_at is not None:
                await asyncio.sleep(max(0.0, t0 + spec.send_at - time.perf_counter()))
            if sem is None:
                rec = await send_one(client, cfg, spec, t0)
            else:
                async with sem:
                    rec = await send_one(client, cfg, spec, t0)
            on_done(rec)
            return rec

        records = await asyncio.gather(*(one(s) for s in specs))
        return list(records), time.perf_counter() - t0
