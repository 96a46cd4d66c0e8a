"""GET /status: a self-refreshing page for operators (plain HTML + JS in app/router/http/static/, no build step), and
GET /status/data, the JSON it polls: adapters (tier, replicas holding them, requests, tokens, last use; for an
activated LoRA, prompt tokens served from the base model's KV vs prefilled), replicas (load, free slots, queue, KV
use), tenants (usage, quotas), recent errors and adapter loads.

Counts come from the cluster's metric snapshots (app/router/http/metrics.py: cluster_snapshots), placement and
replica state from the catalog's heartbeats. The page itself holds no data, so it is served to anyone; the data
needs the admin token when auth is on (the page asks for it once and keeps it in the tab's sessionStorage).
"""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response

from app import metrics
from app.router.http.errors import error_reply
from app.router.http.metrics import cluster_snapshots

STATIC = Path(__file__).with_name("static")
MAX_ADAPTERS = 500  # rows on the page: the busiest first
MAX_EVENTS = 50


def _series(snaps: list[dict], family: str):
    """(labels dict, value, the snapshot's process labels) of every series of gauge or counter `family`."""
    for snap in snaps:
        for name, kind, _doc, labelnames, series, _buckets in snap.get("families", ()):
            if name == family and kind != "histogram":
                for values, value in series:
                    yield dict(zip(labelnames, values)), value, snap.get("labels") or {}


def _sums(snaps: list[dict], family: str, by: str) -> dict[str, float]:
    """Counter `family`'s total over every process, grouped by its label `by`."""
    out: dict[str, float] = defaultdict(float)
    for labels, value, _who in _series(snaps, family):
        if by in labels:
            out[labels[by]] += value
    return dict(out)


def _per_replica(snaps: list[dict], family: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for labels, value, who in _series(snaps, family):
        rid = labels.get("replica") or who.get("replica")
        if rid is not None:
            out[rid] = value
    return out


def _name_of(ref: str) -> str:
    return ref.rpartition("@")[0] if "@" in ref else ref


def status_data(service: Any) -> dict[str, Any]:
    """Everything the page shows (blocking: run it in a thread). Catalog parts are empty when Redis is down."""
    snaps = cluster_snapshots(service.catalog)
    problems: list[str] = []
    replicas: dict[str, Any] = {}
    records: list[Any] = []
    tenants: list[dict] = []
    quotas: dict[str, Any] = {}
    try:
        cat = service.catalog.get()
        replicas = cat.replicas()
        records = cat.list(None)
        tenants = cat.list_tenants()
        quotas = {sid: q.to_dict() for sid, q in cat.quotas().items()}
    except Exception as e:
        problems.append(f"catalog: {e}")

    requests = _sums(snaps, "loraland_requests", "adapter")
    prompt = _sums(snaps, "loraland_prompt_tokens", "adapter")
    completion = _sums(snaps, "loraland_completion_tokens", "adapter")
    kv_reused = _sums(snaps, "loraland_alora_base_kv_reused_tokens", "adapter")  # activated LoRA only
    kv_prefilled = _sums(snaps, "loraland_alora_prefilled_tokens", "adapter")
    last_used: dict[str, float] = {}
    for snap in snaps:
        for name, t in (snap.get("last_used") or {}).items():
            last_used[name] = max(t, last_used.get(name, 0.0))

    holders: dict[str, list[str]] = defaultdict(list)
    on_device: dict[str, set[str]] = defaultdict(set)
    for rid, info in replicas.items():
        for ref in info.resident:
            holders[_name_of(ref)].append(rid)
        for ref in (info.extra or {}).get("device_resident") or ():
            on_device[_name_of(ref)].add(rid)
    newest: dict[str, Any] = {}
    for r in records:
        if r.name not in newest or r.version > newest[r.name].version:
            newest[r.name] = r
    names = set(newest) | set(requests) | set(last_used)
    rows = []
    for name in names:
        rec = newest.get(name)
        tier = "device" if on_device.get(name) else "host" if holders.get(name) else "remote" if rec else "-"
        rows.append(
            {
                "name": name,
                "version": rec.version if rec else None,
                "tenant": (rec.tenant or "-") if rec else "-",
                "tier": tier,
                "replicas": sorted(holders.get(name, ())),
                "requests": requests.get(name, 0),
                "prompt_tokens": prompt.get(name, 0),
                "completion_tokens": completion.get(name, 0),
                # None: not an activated LoRA, or no request for it yet
                "base_kv": [kv_reused[name], kv_prefilled.get(name, 0)] if name in kv_reused else None,
                "last_used": last_used.get(name),
                "unloadable": bool(rec and rec.unloadable),
            }
        )
    rows.sort(key=lambda r: (-r["requests"], -(r["last_used"] or 0), r["name"]))

    kv_used = _per_replica(snaps, "loraland_kv_blocks_used")
    kv_total = _per_replica(snaps, "loraland_kv_blocks_total")
    hit_ratio = _per_replica(snaps, "loraland_prefix_cache_hit_ratio")
    now = time.time()
    replica_rows = [
        {
            "id": rid,
            "load": info.load,
            "free_slots": info.free_slots,
            "queue": info.queue_len,
            "running": (info.extra or {}).get("running"),
            "kv_usage": info.kv_usage,
            "kv_blocks": [kv_used.get(rid), kv_total.get(rid)],
            "prefix_hit_ratio": hit_ratio.get(rid),
            "adapters": len(info.resident),
            "heartbeat_age_s": round(max(0.0, now - info.heartbeat), 1),
        }
        for rid, info in sorted(replicas.items())
    ]

    t_requests = _sums(snaps, "loraland_requests", "tenant")
    t_prompt = _sums(snaps, "loraland_prompt_tokens", "tenant")
    t_completion = _sums(snaps, "loraland_completion_tokens", "tenant")
    tenant_names = {t["name"] for t in tenants} | set(t_requests)
    tenant_rows = [
        {
            "name": name,
            "requests": t_requests.get(name, 0),
            "prompt_tokens": t_prompt.get(name, 0),
            "completion_tokens": t_completion.get(name, 0),
            "quota": quotas.get(f"tenant:{name}"),
        }
        for name in sorted(tenant_names)
    ]
    outcomes = _sums(snaps, "loraland_requests", "outcome")
    events = sorted((e for s in snaps for e in s.get("events") or ()), key=lambda e: -e["time"])
    return {
        "time": now,
        "model": service.cfg.model_name,
        "processes": len(snaps),
        "outcomes": outcomes,
        "adapters": rows[:MAX_ADAPTERS],
        "adapters_total": len(rows),
        "replicas": replica_rows,
        "tenants": tenant_rows,
        "adapter_quotas": {k.partition(":")[2]: v for k, v in quotas.items() if k.startswith("adapter:")},
        "errors": [e for e in events if e["kind"] == "error"][:MAX_EVENTS],
        "loads": [e for e in events if e["kind"] == "load"][:MAX_EVENTS],
        "metrics_enabled": metrics.enabled(),
        "problems": problems,
    }


def add_status_routes(api: FastAPI, auth: Any, service: Any) -> None:
    page = (STATIC / "status.html").read_text()

    @api.get("/status")
    async def status_page() -> Response:
        return HTMLResponse(page, headers={"Cache-Control": "no-cache"})

    @api.get("/status/data")
    async def status_json(request: Request) -> Response:
        try:
            auth.admin_for(request)
            data = await asyncio.to_thread(status_data, service)
        except Exception as e:
            reply = error_reply(e)
            return JSONResponse(reply.body, status_code=reply.status, headers=reply.headers)
        return JSONResponse(data, headers={"Cache-Control": "no-store"})
