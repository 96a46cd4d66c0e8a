"""vLLM's runtime LoRA endpoints, so an RL trainer that drives vLLM drives us unchanged.

`POST /v1/load_lora_adapter` {"lora_name", "lora_path", "load_inplace": false} and `POST /v1/unload_lora_adapter`
{"lora_name"} (vLLM's `LoadLoRAAdapterRequest` / `UnloadLoRAAdapterRequest`; vLLM serves them when started with
VLLM_ALLOW_RUNTIME_LORA_UPDATING). Like vLLM: success is a plain-text 200, "Success: LoRA adapter '<name>' added
successfully." / "... removed successfully."; a failure is vLLM's JSON error, {"error": {"message", "type"
("BadRequestError", "NotFoundError", ...), "param": null, "code": <the HTTP status>}}; a name already loaded
without `load_inplace` is a 400; unloading a name that is not there is a 404.

Unlike vLLM, a load is a new catalog version: a new name gets version 1, `load_inplace` of a name adds the next
version. A replica fetches and validates it against the base model first (the same path as `POST /v1/adapters`:
local folders only under the allowed roots, s3:// and hf:// URIs); the catalog stages it; the replicas holding
the name load it beside the old version (app/router/routing/version_push.py, up to PUSH_TIMEOUT_S); then it
becomes the newest and the call returns. Every request resolved after that is served by it, warm on the holders;
requests resolved before finish on the old version. Bad input changes nothing in the catalog. Unload removes
every version of the name (or one, `name@v`); requests already running finish on the version they started with.
A runtime load keeps the name's newest MAX_VERSIONS versions in the catalog (older ones are removed).

Who may call: the admin token, or a tenant's key for its own adapters (a name a tenant loads first is its own,
private). The answer names the new version in the header `x-loraland-adapter-version` (`name@v`), and the push in
`x-loraland-warm-replicas` (holders that loaded it / holders) and `x-loraland-push-seconds` (the wait for them);
completions carry the version header for the versions that served them (version_header below).
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from app.catalog.registry import MAX_VERSIONS
from app.names import ModelSpec, check_name, parse_ref
from app.router.http import openai_requests as bodies
from app.router.http.auth import Authenticator, Caller
from app.router.http.errors import error_reply
from app.router.routing.replica_client import call
from app.router.routing.version_push import push_and_promote

VERSION_HEADER = "x-loraland-adapter-version"
WARM_HEADER, PUSH_SECONDS_HEADER = "x-loraland-warm-replicas", "x-loraland-push-seconds"
_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 403: "PermissionDeniedError",
          404: "NotFoundError", 413: "BadRequestError", 429: "RateLimitError"}  # fmt: skip


def version_header(spec: ModelSpec) -> dict[str, str]:
    """The header naming the adapter versions a request was served by: `name@v`, comma-separated for a chain or
    a merge (in the order of the `model` field); none for the base model."""
    refs = [t.ref for t in spec.terms()]
    return {VERSION_HEADER: ",".join(refs)} if refs else {}


class VllmError(Exception):
    """An error answered in vLLM's shape (its `create_error_response`)."""

    def __init__(self, status: int, message: str, type: str | None = None):
        super().__init__(message)
        self.status, self.message = status, message
        self.type = type or _TYPES.get(status, "BadRequestError" if status < 500 else "InternalServerError")


def _vllm_reply(exc: BaseException) -> JSONResponse:
    if not isinstance(exc, VllmError):
        reply = error_reply(exc)
        status = 400 if reply.status == 422 else reply.status  # vLLM: any adapter it cannot load is a 400
        message = reply.body["error"]["message"]
        if status == 503 and "no such folder" in message:  # vLLM: "No adapter found" is a 404
            status = 404
        exc = VllmError(status, message)
        headers = reply.headers
    else:
        headers = {}
    body = {"error": {"message": exc.message, "type": exc.type, "param": None, "code": exc.status}}
    return JSONResponse(body, status_code=exc.status, headers=headers)


def _field(body: dict, name: str) -> str:
    value = body.get(name)
    if value is not None and not isinstance(value, str):
        raise VllmError(400, f"{name} must be a string", "InvalidUserInput")
    return value or ""


def _owned(caller: Caller, record: Any) -> bool:
    return caller.tenant is None or record.tenant == caller.tenant


def add_runtime_lora_routes(api: FastAPI, auth: Authenticator, service: Any) -> None:
    """Mount POST /v1/load_lora_adapter and POST /v1/unload_lora_adapter on `api` (service: IngressService)."""

    def catalog() -> Any:
        return service.catalog.get()

    @api.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request) -> Response:
        try:
            caller = auth.caller_for(request)
            return await _load(caller, bodies.parse_body(await request.body()))
        except Exception as e:
            return _vllm_reply(e)

    @api.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request) -> Response:
        try:
            caller = auth.caller_for(request)
            return await _unload(caller, bodies.parse_body(await request.body()))
        except Exception as e:
            return _vllm_reply(e)

    async def _load(caller: Caller, body: dict) -> Response:
        name, path = _field(body, "lora_name"), _field(body, "lora_path")
        inplace = body.get("load_inplace", False)
        if not name or not path:
            raise VllmError(400, "Both 'lora_name' and 'lora_path' must be provided.", "InvalidUserInput")
        if not isinstance(inplace, bool):
            raise VllmError(400, "load_inplace must be true or false", "InvalidUserInput")
        check_name(name)  # a bad name is our 400 (names must fit the `model` grammar)
        current = await asyncio.to_thread(catalog().get, name)
        if current is not None and not _owned(caller, current):
            raise VllmError(
                403, f"The lora adapter '{name}' belongs to another tenant: load it under another name."
            )
        if current is not None and not inplace:
            raise VllmError(
                400,
                f"The lora adapter '{name}' has already been loaded. If you want to load the adapter in place, "
                "set 'load_inplace' to True.",
                "InvalidUserInput",
            )
        # Fetched and validated on a replica against the served base model before anything is recorded.
        info = await call(service.backend, "inspect_adapter", path)
        tenant = current.tenant if current is not None else caller.tenant
        public = current.public if current is not None else False
        holders = await asyncio.to_thread(catalog().holders, name) if current is not None else None
        record = await asyncio.to_thread(
            lambda: catalog().register(
                name, path, files=info["files"], size=info["size"], rank=info["rank"], alpha=info["alpha"],
                target_modules=info["target_modules"], base_model=info["base_model"], tenant=tenant,
                public=public, use_rslora=bool(info.get("use_rslora")), staged=True, keep=MAX_VERSIONS,
            )
        )  # fmt: skip
        push = await push_and_promote(catalog(), record, holders)
        service.forget(name)
        if push.promoted is None:
            raise VllmError(404, f"The lora adapter '{name}' was unloaded while {record.ref} was loading.")
        headers = {VERSION_HEADER: record.ref, WARM_HEADER: push.summary,
                   PUSH_SECONDS_HEADER: f"{push.seconds:.3f}"}  # fmt: skip
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.", headers=headers)

    async def _unload(caller: Caller, body: dict) -> Response:
        ref = _field(body, "lora_name")
        if not ref and body.get("lora_int_id") is None:
            raise VllmError(
                400, "either 'lora_name' and 'lora_int_id' needs to be provided.", "InvalidUserInput"
            )
        if not ref:
            raise VllmError(400, "lora_int_id is not supported here: name the adapter with lora_name")
        name, _ = parse_ref(ref)
        missing = VllmError(404, f"The lora adapter '{ref}' cannot be found.")
        record = await asyncio.to_thread(catalog().get, ref)
        if record is None or not _owned(caller, record):  # someone else's answers like a missing one
            raise missing
        removed = await asyncio.to_thread(catalog().remove, ref)
        service.forget(name)
        if not removed:
            raise missing
        return PlainTextResponse(f"Success: LoRA adapter '{ref}' removed successfully.")
