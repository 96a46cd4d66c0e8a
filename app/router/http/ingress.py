"""The OpenAI-compatible HTTP API (FastAPI) and the Serve deployment that hosts it.

Routes: POST /v1/completions, POST /v1/chat/completions (stream: true = server-sent events), GET /v1/models;
admin (LORALAND_ADMIN_TOKEN): POST/GET/DELETE /v1/adapters[/{name}], GET /v1/placement, GET/PUT
/v1/tenants/{name}/quota and /v1/adapters/{name}/quota (app/router/http/quota_routes.py); GET /metrics (the
cluster's Prometheus metrics: app/router/http/metrics.py) and GET /status (the status page:
app/router/http/status_page.py); GET /healthz; vLLM's POST /tokenize and /detokenize
(app/router/http/tokenize_routes.py); vLLM's POST /v1/load_lora_adapter and /v1/unload_lora_adapter
(app/router/http/runtime_lora.py); admin GET /v1/residency[/events] (app/router/http/residency.py).
Every error is OpenAI-shaped, with its status chosen in app/router/http/errors.py.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as FrameworkHTTPException

from app.catalog.telemetry import start_process_metrics
from app.config.app_config import AppConfig
from app.config.settings import Settings
from app.router.http import openai_requests as bodies
from app.router.http import openai_responses as resp
from app.router.http import openai_validation as checks
from app.router.http import tool_calls
from app.router.http.auth import Authenticator
from app.router.http.body_limit import BodyLimit
from app.router.http.errors import HTTPFailure, error_reply
from app.router.http.metrics import RequestObserver, add_metrics_route
from app.router.http.quota_routes import add_quota_routes
from app.router.http.quotas import QuotaLimiter
from app.router.http.residency import add_residency_routes
from app.router.http.runtime_lora import add_runtime_lora_routes, version_header
from app.router.http.status_page import add_status_routes
from app.router.http.tokenize_routes import add_tokenize_routes
from app.router.http.tool_stream import ToolOutput
from app.router.routing.replica_client import ReplicaStream, ServeBackend
from app.router.service import CatalogProxy, IngressService

log = logging.getLogger("loraland.ingress")

REPLICA_HEADER = "X-LoraLand-Replica"


def _error_response(exc: BaseException) -> JSONResponse:
    reply = error_reply(exc)
    if reply.status >= 500 and not reply.retryable:
        log.error("request failed: %r", exc, exc_info=exc)
    return JSONResponse(reply.body, status_code=reply.status, headers=reply.headers)


def build_api(service: IngressService, auth: Authenticator, quotas: QuotaLimiter | None = None) -> FastAPI:
    """The FastAPI app for `service`; used by the Serve deployment and directly by in-process tests."""
    api = FastAPI(title="LoRA-Land", docs_url=None, redoc_url=None)
    api.add_middleware(BodyLimit, max_bytes=service.cfg.max_request_bytes)  # 413 before a big body is read
    api.state.quotas = quotas = quotas or QuotaLimiter.for_service(service)

    @api.exception_handler(FrameworkHTTPException)
    async def framework_error(request: Request, exc: FrameworkHTTPException) -> Response:
        # A path no route matches (404) or a method a route lacks (405): OpenAI-shaped like every other error.
        code = {404: "unknown_route", 405: "method_not_allowed"}.get(exc.status_code)
        what = f"{request.method} {request.url.path}"
        message = {
            404: f"no route for {what}; see /openapi.json for the routes",
            405: f"{request.method} is not allowed on {request.url.path}; see /openapi.json",
        }.get(exc.status_code, f"{what}: {exc.detail}")
        reply = error_reply(HTTPFailure(exc.status_code, message, code=code))
        return JSONResponse(
            reply.body, status_code=reply.status, headers={**reply.headers, **(exc.headers or {})}
        )

    add_quota_routes(api, auth, service.catalog)  # first: /v1/adapters/{name:path} would take its paths
    add_metrics_route(api, auth, service.catalog)
    add_status_routes(api, auth, service)
    add_tokenize_routes(api, auth, service)
    add_runtime_lora_routes(api, auth, service)  # vLLM's load/unload_lora_adapter

    async def generate(request: Request, chat: bool) -> Response:
        obs = RequestObserver()  # outcome, tokens, TTFT/TPOT of every request, refused ones too
        try:
            return await answer(request, chat, obs)
        except Exception as e:
            obs.failed(e)
            raise

    async def answer(request: Request, chat: bool, obs: RequestObserver) -> Response:
        caller = auth.caller_for(request)
        obs.caller(caller)
        req = checks.validate(
            bodies.ChatRequest if chat else bodies.CompletionRequest, bodies.parse_body(await request.body())
        )
        plan = tool_calls.plan_of(req) if chat else None  # bad tools are a 400 before anything is resolved
        spec, records = await service.resolve(req.model, caller)
        obs.resolved(spec)
        rid = resp.new_id("chatcmpl" if chat else "cmpl")
        stream = service.stream(service.request(req, spec, records, chat, rid, caller, tools=plan))
        stream = await quotas.admit(stream)  # 429 over a tenant's or adapter's quota
        tools = ToolOutput(plan) if plan is not None and plan.parses else None
        if req.stream:
            return await _stream(service, req, stream, rid, chat, obs, tools, version_header(spec))
        choices = await stream.collect()
        obs.finish(200, stream, req.n)
        body = resp.completion_response(
            rid, req.model, [choices[i] for i in sorted(choices)], service.usage_of(choices, req.n), chat
        )
        if tools is not None:
            tools.shape(body)
        return JSONResponse(body, headers={REPLICA_HEADER: stream.replica or "", **version_header(spec)})

    def guarded(fn):
        # functools.wraps keeps fn's signature visible to FastAPI (path parameters).
        @functools.wraps(fn)
        async def route(request: Request, **kw: Any) -> Response:
            try:
                return await fn(request, **kw)
            except Exception as e:
                return _error_response(e)

        return route

    add_residency_routes(api, auth, service, guarded)  # GET /v1/residency[/events]

    @api.post("/v1/completions")
    @guarded
    async def completions(request: Request) -> Response:
        return await generate(request, chat=False)

    @api.post("/v1/chat/completions")
    @guarded
    async def chat_completions(request: Request) -> Response:
        return await generate(request, chat=True)

    @api.get("/v1/models")
    @guarded
    async def models(request: Request) -> Response:
        caller = auth.caller_for(request)
        return JSONResponse(await service.models(caller))

    @api.get("/v1/placement")
    @guarded
    async def placement(request: Request) -> Response:
        auth.admin_for(request)
        return JSONResponse(await service.placement())

    @api.post("/v1/adapters")
    @guarded
    async def add_adapter(request: Request) -> Response:
        auth.admin_for(request)
        return JSONResponse(await service.register(bodies.parse_body(await request.body())), status_code=201)

    @api.get("/v1/adapters")
    @guarded
    async def list_adapters(request: Request) -> Response:
        auth.admin_for(request)
        records = await asyncio.to_thread(lambda: service.catalog.get().list(None))
        return JSONResponse({"object": "list", "data": [r.to_dict() for r in records]})

    @api.get("/v1/adapters/{name:path}")
    @guarded
    async def get_adapter(request: Request, name: str) -> Response:
        auth.admin_for(request)
        record = await asyncio.to_thread(lambda: service.catalog.get().get(name))
        if record is None:
            from app.errors import UnknownAdapter

            raise UnknownAdapter(f"no adapter {name!r} in the catalog")
        return JSONResponse(record.to_dict())

    @api.delete("/v1/adapters/{name:path}")
    @guarded
    async def delete_adapter(request: Request, name: str) -> Response:
        auth.admin_for(request)
        removed = await asyncio.to_thread(lambda: service.catalog.get().remove(name))
        service.forget(name.partition("@")[0])
        if not removed:
            from app.errors import UnknownAdapter

            raise UnknownAdapter(f"no adapter {name!r} in the catalog")
        return JSONResponse({"id": name, "object": "adapter", "deleted": True, "versions": removed})

    @api.get("/healthz")
    async def healthz() -> Response:
        try:
            await asyncio.to_thread(lambda: service.catalog.get().replicas())
            catalog = "ok"
        except Exception as e:
            catalog = f"unavailable: {e}"
        return JSONResponse({"status": "ok", "model": service.cfg.model_name, "catalog": catalog})

    return api


async def _stream(
    service: IngressService,
    req: Any,
    stream: ReplicaStream,
    rid: str,
    chat: bool,
    obs: RequestObserver,
    tools: ToolOutput | None = None,
    headers: dict[str, str] | None = None,
) -> Response:
    # The first output is awaited before answering, so errors found at admission (unknown adapter, prompt too
    # long, queue full) get their real status code instead of a 200 with an error event.
    first = await stream.open()
    include_usage = bool((req.stream_options or {}).get("include_usage"))

    async def events() -> AsyncIterator[bytes]:
        started: set[int] = set()
        offsets: dict[int, int] = {}  # completions' text_offset: characters of the tokens sent per choice
        item, done = first, False
        try:
            while item is not None:
                idx = item.index
                reason = resp.finish_reason(item.finish_reason)
                text, entries = resp.chunk_of(item, chat)  # echo's prompt comes first in a completion
                if text or reason is not None or idx not in started or entries:
                    logprobs = resp.choice_logprobs(entries, chat, offsets.get(idx, 0))
                    if entries:
                        offsets[idx] = offsets.get(idx, 0) + sum(len(e.token) for e in entries)
                    chunk = resp.stream_chunk(
                        rid, req.model, idx, text, reason, chat, idx not in started, logprobs
                    )
                    for c in tools.chunks(chunk, text, idx not in started) if tools else [chunk]:
                        yield resp.sse(c)
                    started.add(idx)
                item = await stream.next()
            done = True
            obs.finish(200, stream, req.n)
            if include_usage:
                yield resp.sse(
                    resp.usage_chunk(rid, req.model, service.usage_of(stream.choices, req.n), chat)
                )
        except Exception as e:
            # Headers are gone: the error travels as an event the openai client raises as APIError.
            reply = error_reply(e)
            obs.finish(reply.status, stream, req.n, error=e)
            yield resp.sse({**reply.body, "status": reply.status})
        finally:
            if not done:
                stream.cancel()
                obs.finish("cancelled", stream, req.n)  # the client went away (a no-op after an error)
        yield resp.SSE_DONE

    return StreamingResponse(
        events(),
        media_type="text/event-stream",
        headers={REPLICA_HEADER: stream.replica or "", "Cache-Control": "no-cache", **(headers or {})},
    )


def _replica_id() -> str:
    from ray import serve

    return serve.get_replica_context().replica_id.unique_id


def make_ingress_deployment(cfg: AppConfig):
    from ray import serve

    @serve.deployment(
        name="Ingress",
        num_replicas=cfg.ingress_replicas,
        ray_actor_options={"num_cpus": cfg.ingress_num_cpus},
        # The ingress only awaits replicas; its concurrency bound is the replicas' queues, not its own.
        max_ongoing_requests=max(1000, cfg.max_queued_requests),
    )
    @serve.ingress()
    class Ingress:
        def __init__(self, replicas: Any, config: dict):
            self.cfg = AppConfig.from_dict(config)
            settings = Settings.from_env()
            self.catalog = CatalogProxy(self.cfg.redis_url or settings.redis_url)
            self.metrics = start_process_metrics(self.cfg.metrics, self.catalog.get, ingress=_replica_id())
            self.service = IngressService(self.cfg, ServeBackend(replicas), self.catalog)
            self.auth = Authenticator(
                self.catalog, self.cfg.admin_token or settings.admin_token, no_auth=self.cfg.no_auth
            )

        def __serve_build_asgi_app__(self):
            return build_api(self.service, self.auth)

    return Ingress
