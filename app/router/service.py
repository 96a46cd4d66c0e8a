"""What the HTTP routes do, without HTTP: resolve the caller's `model` to adapter versions, run the request on a
replica (through a Backend) and shape OpenAI replies. The FastAPI layer (ingress.py) only adapts to it.

A Backend streams a request's reply items (see app/replica/deployment.py) from some replica: Ray Serve's
handle in production (the adapter ref is the multiplexed model id, so the affinity router sees it), or a
ReplicaCore in the same process for tests of this layer.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from typing import Any, Protocol

from app.config.app_config import AppConfig
from app.errors import CatalogUnavailable, UnknownAdapter
from app.names import ModelSpec, parse_model, resolved
from app.router import openai_schema as oa
from app.router.auth import Caller
from app.router.http_errors import HTTPFailure, replica_failed

log = logging.getLogger("loraland.ingress")

RECORD_TTL_S = 2.0  # how stale a resolved adapter record may be (a DELETE elsewhere takes this long to bite)


class Backend(Protocol):
    def stream(self, request: dict, model_id: str) -> AsyncIterator[dict]: ...

    async def call(self, method: str, *args: Any) -> Any: ...


class ReplicaError(HTTPFailure):
    """An error a replica reported in-band, with the status and OpenAI fields it chose."""

    def __init__(self, payload: dict):
        err, retry = payload["error"], payload.get("retry_after")
        super().__init__(
            int(payload.get("status", 500)),
            err.get("message", "error"),
            type=err.get("type", "server_error"),
            code=err.get("code"),
            param=err.get("param"),
            retry_after_s=float(retry) if retry else None,
        )


def _raise_if_error(item: dict) -> dict:
    if "error" in item:
        raise ReplicaError(item)
    return item


class CatalogProxy:
    """Connects lazily and reconnects: the ingress starts, and serves cached records, while Redis is down."""

    def __init__(self, url: str | None, catalog: Any = None):
        self.url, self._catalog = url, catalog

    def get(self) -> Any:
        if self._catalog is None:
            if not self.url:
                raise CatalogUnavailable("no catalog configured: start the server with --redis URL")
            from app.catalog.store import Catalog

            self._catalog = Catalog(self.url)
        return self._catalog

    def tenant_for_key(self, api_key: str) -> str | None:
        return self.get().tenant_for_key(api_key)


class IngressService:
    def __init__(self, cfg: AppConfig, backend: Backend, catalog: CatalogProxy):
        self.cfg, self.backend, self.catalog = cfg, backend, catalog
        self._records: dict[str, tuple[Any, float]] = {}

    # ------------------------------------------------------------------ model field -> adapter versions
    async def _record(self, ref: str) -> Any:
        hit = self._records.get(ref)
        if hit is not None and time.monotonic() - hit[1] < RECORD_TTL_S:
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

    async def resolve(self, model: Any, caller: Caller) -> tuple[ModelSpec, list[Any]]:
        spec = parse_model(model, self.cfg.base_ids)
        records, versions = [], {}
        for term in spec.terms():
            record = await self._record(term.ref)
            if record is None or (
                caller.tenant is not None and not self.catalog.get().can_use(caller.tenant, record)
            ):
                # Same answer for "missing" and "someone else's": a tenant learns nothing about others.
                err = UnknownAdapter(
                    f"model: the adapter {term.ref!r} does not exist or you do not have access to it "
                    "(GET /v1/models lists what you can use)"
                )
                err.param = "model"
                raise err
            records.append(record)
            versions[term.ref] = record.version
        return resolved(spec, versions), records

    # ------------------------------------------------------------------ running on a replica
    async def _next(self, stream: AsyncIterator[dict]) -> dict:
        return await asyncio.wait_for(stream.__anext__(), timeout=self.cfg.request_timeout_s)

    async def open(self, payload: dict, model_id: str) -> tuple[str | None, dict, AsyncIterator[dict]]:
        """Start the request and read its first output (or error), retrying once if the replica died first."""
        for attempt in (0, 1):
            stream = self.backend.stream(payload, model_id)
            try:
                item = await self._next(stream)
                replica = item.get("replica")
                if replica is not None:
                    item = await self._next(stream)
                return replica, _raise_if_error(item), stream
            except Exception as e:
                _cancel(stream)
                if attempt == 0 and replica_failed(e):
                    log.warning("replica died before answering %s; retrying once", payload.get("request_id"))
                    continue
                raise
        raise AssertionError("unreachable")

    async def collect(self, payload: dict, model_id: str) -> tuple[str | None, dict[int, dict]]:
        """Run to completion; a replica death mid-way is retried once (nothing was sent to the client)."""
        for attempt in (0, 1):
            choices: dict[int, dict] = {}
            stream = None
            try:
                replica, item, stream = await self.open(payload, model_id)
                while True:
                    _merge(choices, item)
                    try:
                        item = _raise_if_error(await self._next(stream))
                    except StopAsyncIteration:
                        return replica, choices
            except Exception as e:
                if stream is not None:
                    _cancel(stream)
                if attempt == 0 and replica_failed(e):
                    continue
                raise
        raise AssertionError("unreachable")

    def payload(self, req: Any, spec: ModelSpec, records: list[Any], chat: bool, rid: str) -> dict:
        out: dict[str, Any] = {
            "request_id": rid,
            "adapter": spec.canonical() or None,
            "records": [r.to_dict() for r in records],
            "sampling": oa.sampling_of(req),
            "n": req.n,
        }
        if chat:
            out["messages"] = oa.messages_of(req)
        else:
            out["prompts"] = oa.prompts_of(req)
        return out

    @staticmethod
    def usage_of(choices: dict[int, dict], n: int) -> dict:
        prompt = sum(c["prompt_tokens"] for i, c in choices.items() if i % n == 0)
        return oa.usage(prompt, sum(c["completion_tokens"] for c in choices.values()))

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
            raise oa.invalid("name", "required: the adapter's name, e.g. 'acme/sql-expert'")
        source = body.get("source") or body.get("uri")
        if source is None and self.cfg.adapter_store:
            source = f"{self.cfg.adapter_store.rstrip('/')}/{name}"
        if not isinstance(source, str) or not source:
            raise oa.invalid(
                "source", "required (s3://bucket/prefix, hf://org/repo, or a folder under the allowed roots)"
            )
        tenant, public = body.get("tenant"), body.get("public", False)
        if tenant is not None and not isinstance(tenant, str):
            raise oa.invalid("tenant", "must be a tenant name or null")
        if not isinstance(public, bool):
            raise oa.invalid("public", "must be true or false")
        from app.names import check_name

        check_name(name)
        reply = await self.backend.call("inspect_adapter", source)
        if "error" in reply:
            raise ReplicaError(reply)
        info = reply["ok"]
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


def _merge(choices: dict[int, dict], item: dict) -> None:
    c = choices.setdefault(item["index"], {"index": item["index"], "text": "", "finish_reason": None})
    c["text"] += item["text"]
    c["prompt_tokens"] = item["prompt_tokens"]
    c["completion_tokens"] = item["completion_tokens"]
    if item["finish_reason"] is not None:
        c["finish_reason"] = oa.finish_reason(item["finish_reason"])


def _cancel(stream: Any) -> None:
    """Stop a replica stream we no longer read (Serve's generator has cancel(); a local one has aclose())."""
    cancel = getattr(stream, "cancel", None)
    if callable(cancel):
        try:
            cancel()
        except Exception:
            pass
    elif hasattr(stream, "aclose"):
        asyncio.ensure_future(stream.aclose())
