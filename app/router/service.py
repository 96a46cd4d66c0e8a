"""What the HTTP routes do, without HTTP: resolve the caller's `model` to adapter versions, build the
`ReplicaRequest` and run it on a replica (a ReplicaStream over a Backend: app/router/routing/replica_client.py), list
models and placement, register adapters. The FastAPI layer (ingress.py) only adapts to it.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from typing import Any

from app.adapter_record import AdapterRecord
from app.config.app_config import AppConfig
from app.errors import CatalogUnavailable, InvalidRequest, UnknownAdapter
from app.names import ModelSpec, parse_model, resolved
from app.protocol import ChoiceDelta, ReplicaRequest
from app.router.http import openai_requests as bodies
from app.router.http import openai_responses as resp
from app.router.http import openai_sampling as samp
from app.router.http import tool_calls
from app.router.http.auth import Caller
from app.router.http.tool_calls import ToolPlan
from app.router.routing.replica_client import Backend, ReplicaStream, call
from app.sampling_params import SamplingParams

RECORD_TTL_S = 2.0  # how stale a resolved name@v record may be (a DELETE elsewhere takes this long to bite)


class CatalogProxy:
    """Connects lazily and reconnects: the ingress starts, and serves cached records, while Redis is down."""

    def __init__(self, url: str | None, catalog: Any = None):
        self.url, self._catalog = url, catalog
        self._lock = threading.Lock()  # the auth's event thread and request threads may connect at once

    def get(self) -> Any:
        if self._catalog is None:
            if not self.url:
                raise CatalogUnavailable("no catalog configured: start the server with --redis URL")
            from app.catalog.store import Catalog

            with self._lock:
                if self._catalog is None:
                    self._catalog = Catalog(self.url)
        return self._catalog

    def tenant_for_key(self, api_key: str) -> str | None:
        return self.get().tenant_for_key(api_key)

    def subscribe(self, callback: Callable[[dict], None]) -> Callable[[], None]:
        """The catalog's change events (key rotations for the Authenticator); see Catalog.subscribe."""
        return self.get().subscribe(callback)


class IngressService:
    def __init__(self, cfg: AppConfig, backend: Backend, catalog: CatalogProxy):
        self.cfg, self.backend, self.catalog = cfg, backend, catalog
        self._records: dict[str, tuple[Any, float]] = {}

    # ------------------------------------------------------------------ model field -> adapter versions
    async def _record(self, ref: str) -> Any:
        hit = self._records.get(ref)
        # "name" (the newest) is looked up every time: a request admitted after load_lora_adapter returned, on
        # any ingress, gets the new version. A pinned "name@v" never changes: its record is cached.
        if hit is not None and "@" in ref and time.monotonic() - hit[1] < RECORD_TTL_S:
            return hit[0]
        try:
            record = await asyncio.to_thread(lambda: self.catalog.get().get(ref))
        except Exception as e:
            if hit is not None:  # Redis is down: the last known record keeps the adapter usable
                return hit[0]
            if isinstance(e, CatalogUnavailable):
                raise
            raise CatalogUnavailable(f"catalog lookup failed: {e}") from e
        if record is None:
            self._records.pop(ref, None)
        else:
            self._records[ref] = (record, time.monotonic())
        return record

    def forget(self, name: str) -> None:
        for ref in [r for r in self._records if r == name or r.startswith(name + "@")]:
            self._records.pop(ref, None)

    async def resolve(self, model: Any, caller: Caller) -> tuple[ModelSpec, list[AdapterRecord]]:
        try:
            spec = parse_model(model, self.cfg.base_ids)
        except InvalidRequest as e:
            raise bodies.clipped(e) from None
        records, versions = [], {}
        for term in spec.terms():
            record = await self._record(term.ref)
            if record is None or (
                caller.tenant is not None and not self.catalog.get().can_use(caller.tenant, record)
            ):
                # Same answer for "missing" and "someone else's": a tenant learns nothing about others.
                err = UnknownAdapter(
                    f"model: the adapter {bodies.clip(term.ref)!r} does not exist or you do not have access to it "
                    "(GET /v1/models lists what you can use)"
                )
                err.param = "model"
                raise err
            records.append(record)
            versions[term.ref] = record.version
        return resolved(spec, versions), records

    # ------------------------------------------------------------------ running on a replica
    def request(
        self,
        req: Any,
        spec: ModelSpec,
        records: list[Any],
        chat: bool,
        rid: str,
        caller: Caller | None = None,
        tools: ToolPlan | None = None,
    ) -> ReplicaRequest:
        """What the replica needs for a validated OpenAI request `req` resolved to `spec` and `records`, its
        sampling built and validated here, once (a bad value is a 400 before any replica is asked); the
        caller's tenant goes along for the replica's fair admission. 400 when prompts x n exceeds the
        per-request cap (AppConfig.max_sequences_per_request): one request must not fill every tenant's queue.
        `tools`: a chat's tool plan (tool_calls.plan_of's, made here when not given): the template gets its
        tools, and a required or named call constrains the output (tool_calls.py)."""
        plan = tools if tools is not None or not chat else tool_calls.plan_of(req)
        sampling = samp.sampling_of(req)
        if plan is not None and plan.constrained:
            tool_calls.check_constraint(req, plan)
            sampling["response_format"] = plan.constraint()
        prompts = () if chat else tuple(p if isinstance(p, str) else tuple(p) for p in bodies.prompts_of(req))
        cap = self.cfg.max_sequences_per_request
        if max(1, len(prompts)) * req.n > cap:
            raise bodies.invalid(
                "prompt",
                f"{len(prompts)} prompts x n={req.n} = {len(prompts) * req.n} sequences, over this server's cap "
                f"of {cap} per request (max_sequences_per_request): split the request",
            )
        return ReplicaRequest(
            request_id=rid,
            spec=spec,
            records=tuple(records),
            prompts=prompts,
            messages=tuple(tool_calls.chat_messages(req)) if chat else None,
            tools=plan.tools if plan is not None else (),
            sampling=SamplingParams.from_kwargs(**sampling),
            n=req.n,
            tenant=caller.tenant if caller is not None else None,
            echo=bool(getattr(req, "echo", False)) and not chat,
        )

    def stream(self, request: ReplicaRequest) -> ReplicaStream:
        """The request's reply stream on some replica (nothing is sent until its open() or collect())."""
        return ReplicaStream(self.backend, request, self.cfg.request_timeout_s)

    @staticmethod
    def usage_of(choices: dict[int, ChoiceDelta], n: int) -> dict:
        # Every sample of a prompt reports the same prompt tokens: count them once per prompt.
        prompt = sum(c.prompt_tokens for i, c in choices.items() if i % n == 0)
        use = resp.usage(prompt, sum(c.completion_tokens for c in choices.values()))
        flags = [c.alora_activated for c in choices.values() if c.alora_activated is not None]
        if flags:  # an aLoRA adapter: False when any prompt lacked the invocation (served as the base model)
            use["alora_activated"] = all(flags)
        return use

    # ------------------------------------------------------------------ listings
    async def models(self, caller: Caller) -> dict:
        base = self.cfg.model_name
        data = [
            {
                "id": base,
                "object": "model",
                "created": 0,
                "owned_by": "loraland",
                "root": self.cfg.model,
                "parent": None,
            }
        ]
        records = await asyncio.to_thread(lambda: self.catalog.get().list(caller.tenant))
        newest: dict[str, Any] = {}
        for r in records:
            if r.name not in newest or r.version > newest[r.name].version:
                newest[r.name] = r
        for r in sorted(newest.values(), key=lambda r: r.name):
            data.append(
                {
                    "id": r.name,
                    "object": "model",
                    "created": int(r.created),
                    "owned_by": r.tenant or "public",
                    "root": r.ref,
                    "parent": base,
                    "version": r.version,
                }
            )
        return {"object": "list", "data": data}

    async def placement(self) -> dict:
        cat = self.catalog.get()
        replicas = await asyncio.to_thread(cat.replicas)
        placement = await asyncio.to_thread(cat.placement)
        return {
            "placement": placement,
            "replicas": {rid: info.to_dict() for rid, info in replicas.items()},
        }

    async def register(self, body: dict) -> dict:
        """Admin: fetch + validate an adapter on a replica, then record it in the catalog."""
        name = body.get("name")
        if not isinstance(name, str) or not name:
            raise bodies.invalid("name", "required: the adapter's name, e.g. 'acme/sql-expert'")
        source = body.get("source") or body.get("uri")
        if source is None and self.cfg.adapter_store:
            source = f"{self.cfg.adapter_store.rstrip('/')}/{name}"
        if not isinstance(source, str) or not source:
            raise bodies.invalid(
                "source", "required (s3://bucket/prefix, hf://org/repo, or a folder under the allowed roots)"
            )
        tenant, public = body.get("tenant"), body.get("public", False)
        if tenant is not None and not isinstance(tenant, str):
            raise bodies.invalid("tenant", "must be a tenant name or null")
        if not isinstance(public, bool):
            raise bodies.invalid("public", "must be true or false")
        from app.names import check_name

        check_name(name)
        info = await call(self.backend, "inspect_adapter", source)
        record = await asyncio.to_thread(
            lambda: self.catalog.get().register(
                name,
                source,
                files=info["files"],
                size=info["size"],
                rank=info["rank"],
                alpha=info["alpha"],
                target_modules=info["target_modules"],
                base_model=info["base_model"],
                tenant=tenant,
                public=public,
                use_rslora=bool(info.get("use_rslora")),
            )
        )
        self.forget(name)
        return record.to_dict()
