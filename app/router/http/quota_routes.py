"""The admin routes that read and set quotas: GET/PUT /v1/tenants/{name}/quota and /v1/adapters/{name}/quota.
Admission against those quotas is app/router/http/quotas.py; the Redis side is app/catalog/quotas.py.
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from app.catalog.quotas import Quota
from app.router.http.errors import error_reply
from app.router.http.openai_requests import parse_body


def add_quota_routes(api: FastAPI, auth: Any, catalog: Any) -> None:
    """GET/PUT /v1/tenants/{name}/quota and /v1/adapters/{name}/quota (admin token). PUT replaces the quota
    whole: {"concurrent", "requests_per_minute", "tokens_per_minute"}, each a positive integer, or null or
    absent for unlimited. Added before the /v1/adapters/{name} routes, which would otherwise take the path."""

    async def answer(request: Request, kind: str, name: str) -> Response:
        try:
            auth.admin_for(request)
            cat = catalog.get()
            if request.method == "PUT":
                limits = Quota.from_dict(parse_body(await request.body()))
                quota = await asyncio.to_thread(cat.set_quota, kind, name, limits)
            else:
                quota = await asyncio.to_thread(cat.get_quota, kind, name)
            body = {"object": "quota", "scope": kind, "name": name, **(quota or Quota()).to_dict()}
            return JSONResponse(body)
        except Exception as e:
            reply = error_reply(e)
            return JSONResponse(reply.body, status_code=reply.status, headers=reply.headers)

    for kind, path in (("tenant", "/v1/tenants/{name}/quota"), ("adapter", "/v1/adapters/{name:path}/quota")):
        for method in ("GET", "PUT"):
            # One operation per method, each with its own operationId (OpenAPI requires them unique).
            api.add_api_route(
                path, _route(answer, kind), methods=[method], operation_id=f"{method.lower()}_{kind}_quota"
            )


def _route(answer: Any, kind: str) -> Any:
    """The route function for one quota scope (its only parameters are the request and the path's name)."""

    async def route(request: Request, name: str) -> Response:
        return await answer(request, kind, name)

    return route
