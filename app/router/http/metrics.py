"""The ingress's metrics: one request's outcome, tokens and timing; and GET /metrics for
the whole cluster (this process's registry read live, plus every other LoRA-Land process's latest snapshot from
the catalog: app/metrics.py has the story).

GET /metrics needs the admin token when auth is on: the series name tenants and adapters.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from app import metrics
from app import metrics_core as mc
from app.router.http.errors import error_reply

log = logging.getLogger("loraland.ingress")

_VERSION = re.compile(r"@\d+")


def adapter_text(spec: Any) -> str | None:
    """What a request ran, without versions: 'a', 'a|b', 'a*0.5+b*0.5'; None for the base model."""
    return _VERSION.sub("", spec.canonical()) if spec.stages else None


class RequestObserver:
    """One request's metrics, from its arrival to its last byte. Tell it the caller once authenticated and the
    model once resolved; `finish` (once) records the outcome, tokens, TTFT, TPOT and duration."""

    __slots__ = ("t0", "on", "adapter", "tenant", "text", "finished")

    def __init__(self) -> None:
        self.t0 = time.monotonic()
        self.on = metrics.enabled()
        self.adapter = self.tenant = metrics.NONE
        self.text: str | None = None
        self.finished = False

    def caller(self, caller: Any) -> None:
        if self.on:
            self.tenant = metrics.tenant_label(caller.tenant)

    def resolved(self, spec: Any) -> None:
        if self.on:
            self.text = adapter_text(spec)
            self.adapter = metrics.adapter_label(self.text)

    def failed(self, exc: BaseException) -> None:
        self.finish(error_reply(exc).status, error=exc)

    def finish(
        self, status: int | str, stream: Any = None, n: int = 1, error: BaseException | None = None
    ) -> None:
        """`status`: the HTTP status sent (or the one an error event carried), or "cancelled" (client gone)."""
        if not self.on or self.finished:
            return
        self.finished = True
        end = time.monotonic()
        outcome = status if isinstance(status, str) else f"{status // 100}xx"
        metrics.REQUESTS.labels(self.adapter, self.tenant, outcome).inc()
        choices = getattr(stream, "choices", None) or {}
        if choices:
            prompt = sum(c.prompt_tokens for i, c in choices.items() if i % max(1, n) == 0)
            completion = [c.completion_tokens for c in choices.values()]
            metrics.PROMPT_TOKENS.labels(self.adapter, self.tenant).inc(prompt)
            metrics.COMPLETION_TOKENS.labels(self.adapter, self.tenant).inc(sum(completion))
            first = getattr(stream, "first_delta_at", None)
            if first is not None:
                metrics.TTFT.labels(self.adapter).observe(max(0.0, first - self.t0))
                if max(completion) > 1:
                    metrics.TPOT.labels(self.adapter).observe(max(0.0, end - first) / (max(completion) - 1))
        if self.text is not None or self.adapter == metrics.BASE:
            metrics.E2E.labels(self.adapter).observe(end - self.t0)
            metrics.used(self.text or metrics.BASE)
        if error is not None and not isinstance(status, str) and status >= 400:
            metrics.event(
                "error", where="request", status=status, adapter=self.text, tenant=self.tenant,
                message=str(error)[:300], **metrics.identity(),
            )  # fmt: skip


# ---------------------------------------------------------------- the cluster's /metrics
def cluster_snapshots(catalog: Any) -> list[dict]:
    """This process's snapshot (live) and every other process's latest one from the catalog; the catalog's
    part is skipped when it cannot be read (the scrape still gets this process)."""
    snaps = [metrics.snapshot()]
    try:
        cat = catalog.get() if catalog is not None else None
    except Exception:
        cat = None
    if cat is not None:
        from app.catalog.telemetry import TelemetryBoard

        try:
            snaps += [s for s in TelemetryBoard(cat).snapshots() if s.get("process") != metrics.PROCESS]
        except Exception as e:
            log.info("metrics: other processes' snapshots unavailable (%s); serving this process's only", e)
    return snaps


CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"  # the Prometheus text format


def exposition(snaps: list[dict]) -> str:
    """The text format for the cluster: every snapshot's families, each series labelled with its process."""
    return mc.text((snap.get("labels") or {}, snap.get("families") or []) for snap in snaps)


def add_metrics_route(api: FastAPI, auth: Any, catalog: Any) -> None:
    """GET /metrics: the Prometheus text format for the whole cluster (admin token when auth is on)."""

    @api.get("/metrics")
    async def prometheus_metrics(request: Request) -> Response:
        try:
            auth.admin_for(request)
        except Exception as e:
            reply = error_reply(e)
            return JSONResponse(reply.body, status_code=reply.status, headers=reply.headers)
        body = await asyncio.to_thread(lambda: exposition(cluster_snapshots(catalog)))  # off the event loop
        return Response(body, media_type=CONTENT_TYPE)
