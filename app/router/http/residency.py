"""Residency for routers outside us (llm-d, Dynamo, KServe): which adapter versions each replica holds, and a
stream of what changes.

`GET /v1/residency` (admin): the replicas' last heartbeats (app/catalog/replicas.py, each a ReplicaStats), per
replica the adapters it holds as `name@version` with their tier (`device`: in a device slot, `host`: in the host
cache, servable without a fetch), its device slots in use and free, load, queue and KV use. Our own router ranks
replicas from the same ReplicaStats (app/router/routing/request_router.py).

`GET /v1/residency/events` (admin): server-sent events, one JSON object per `data:` line, each with a `type`:
first a `snapshot` (the body of GET /v1/residency), then `loaded` / `evicted` / `tier` (an adapter version came
into, left, or moved between tiers of a replica), `replica_up` / `replica_down`, and the catalog's adapter events
`staged` / `warm` / `registered` / `removed` / `pinned` / `unloadable` (a new version stored and pushed to the
holders, a holder's answer to the push, the new version now the newest, a removal, a pin change, a version found
not to load) as they are published. Residency changes are found by comparing heartbeats every `poll_s` (query
parameter, default 0.5 s), so they lag the replica by up to one heartbeat period plus poll_s; catalog events
arrive at once. `duration_s` (optional) ends the stream after that many seconds. A `: keep-alive` comment is
sent every 15 s of silence. Format in docs/api.md#residency.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from app.router.http.auth import Authenticator
from app.router.http.errors import HTTPFailure

CATALOG_EVENTS = frozenset(
    {"staged", "warm", "registered", "removed", "pinned", "unloadable"}
)  # not key events
KEEPALIVE_S = 15.0


def _split(ref: str) -> tuple[str, int | None]:
    name, at, version = ref.rpartition("@")
    return (name, int(version)) if at and version.isdigit() else (ref, None)


def residency_of(replicas: dict[str, Any], now: float | None = None) -> dict:
    """GET /v1/residency's body from Catalog.replicas() (replica id -> ReplicaInfo)."""
    out = []
    for rid, info in sorted(replicas.items()):
        extra = info.extra or {}
        device = set(extra.get("device_resident") or ())
        adapters = []
        for ref in sorted(set(info.resident) | device):
            name, version = _split(ref)
            adapters.append({"ref": ref, "adapter": name, "version": version,
                             "tier": "device" if ref in device else "host"})  # fmt: skip
        node = {k: extra[k] for k in ("actor_name", "node_ip", "node_id") if k in extra}
        out.append(
            {
                "replica_id": rid,
                "node": node,
                "heartbeat": info.heartbeat,
                "adapters": adapters,
                "device_slots_used": len(device),
                "free_slots": info.free_slots,
                "load": info.load,
                "queue_len": info.queue_len,
                "running": extra.get("running"),
                "kv_usage": info.kv_usage,
            }
        )
    return {"object": "residency", "at": time.time() if now is None else now, "replicas": out}


def residency_diff(old: dict, new: dict) -> list[dict]:
    """The events that turn residency `old` into `new` (both residency_of bodies), in a stable order."""
    at = new["at"]
    before = {r["replica_id"]: {a["ref"]: a for a in r["adapters"]} for r in old["replicas"]}
    after = {r["replica_id"]: {a["ref"]: a for a in r["adapters"]} for r in new["replicas"]}
    events: list[dict] = []
    for rid in sorted(after.keys() - before.keys()):
        events.append({"type": "replica_up", "replica": rid, "at": at})
    for rid in sorted(before.keys() | after.keys()):
        was, now = before.get(rid, {}), after.get(rid, {})
        for ref in sorted(now.keys() - was.keys()):
            a = now[ref]
            events.append({"type": "loaded", "replica": rid, "ref": ref, "adapter": a["adapter"],
                           "version": a["version"], "tier": a["tier"], "at": at})  # fmt: skip
        for ref in sorted(was.keys() - now.keys()):
            a = was[ref]
            events.append({"type": "evicted", "replica": rid, "ref": ref, "adapter": a["adapter"],
                           "version": a["version"], "tier": a["tier"], "at": at})  # fmt: skip
        for ref in sorted(was.keys() & now.keys()):
            if was[ref]["tier"] != now[ref]["tier"]:
                a = now[ref]
                events.append({"type": "tier", "replica": rid, "ref": ref, "adapter": a["adapter"],
                               "version": a["version"], "tier": a["tier"], "from_tier": was[ref]["tier"],
                               "at": at})  # fmt: skip
    for rid in sorted(before.keys() - after.keys()):
        events.append({"type": "replica_down", "replica": rid, "at": at})
    return events


def catalog_event(event: dict) -> dict | None:
    """A catalog pub/sub event as the stream sends it (adapter events only, no free-text reasons)."""
    kind = event.get("type")
    if kind not in CATALOG_EVENTS or not isinstance(event.get("name"), str):
        return None
    out = {"type": kind, "adapter": event["name"], "version": event.get("version"), "at": time.time()}
    if event.get("versions") is not None:
        out["versions"] = event["versions"]
    if kind == "pinned":
        out["pinned"] = bool(event.get("pinned", True))
    if kind == "warm":  # a replica's answer to a pushed version, with the replica's own clock
        out.update(replica=event.get("replica"), ok=bool(event.get("ok")), at=event.get("at", out["at"]))
    return out


def _sse(event: dict) -> bytes:
    return f"data: {json.dumps(event)}\n\n".encode()


def _float_param(request: Request, name: str, default: float | None, lo: float, hi: float) -> float | None:
    raw = request.query_params.get(name)
    if raw is None:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not lo <= value <= hi:
        raise HTTPFailure(400, f"{name} must be a number in [{lo}, {hi}], got {raw!r}", code="invalid_value")
    return value


def add_residency_routes(api: FastAPI, auth: Authenticator, service: Any, guarded: Any) -> None:
    """Mount GET /v1/residency and GET /v1/residency/events (`guarded`: ingress.py's error wrapper)."""

    async def snapshot() -> dict:
        return residency_of(await asyncio.to_thread(service.catalog.get().replicas))

    @api.get("/v1/residency")
    @guarded
    async def residency(request: Request) -> Response:
        auth.admin_for(request)
        return JSONResponse(await snapshot())

    @api.get("/v1/residency/events")
    @guarded
    async def residency_events(request: Request) -> Response:
        auth.admin_for(request)
        poll_s = _float_param(request, "poll_s", 0.5, 0.05, 60.0)
        duration_s = _float_param(request, "duration_s", None, 0.0, 86400.0)
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[dict] = asyncio.Queue(maxsize=10_000)

        def on_event(event: dict) -> None:  # the catalog's listener thread
            shaped = catalog_event(event)
            if shaped is not None:
                loop.call_soon_threadsafe(lambda: queue.full() or queue.put_nowait(shaped))

        unsubscribe = await asyncio.to_thread(service.catalog.subscribe, on_event)
        try:
            first = await snapshot()
        except BaseException:
            unsubscribe()
            raise
        return StreamingResponse(
            _events(first, queue, snapshot, poll_s, duration_s, unsubscribe),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache"},
        )


async def _events(
    state: dict, queue: asyncio.Queue, snapshot: Any, poll_s: float, duration_s: float | None, stop: Any
) -> AsyncIterator[bytes]:
    end = None if duration_s is None else time.monotonic() + duration_s
    try:
        yield _sse({**state, "type": "snapshot"})
        next_poll, quiet_since = time.monotonic() + poll_s, time.monotonic()
        while end is None or time.monotonic() < end:
            wait = next_poll - time.monotonic()
            if end is not None:
                wait = min(wait, end - time.monotonic())
            try:
                event = await asyncio.wait_for(queue.get(), timeout=max(0.0, wait))
                quiet_since = time.monotonic()
                yield _sse(event)
                continue
            except asyncio.TimeoutError:
                pass
            if time.monotonic() >= next_poll:
                next_poll = time.monotonic() + poll_s
                try:
                    new = await snapshot()
                except Exception:  # Redis away: say nothing until it answers again
                    continue
                for event in residency_diff(state, new):
                    quiet_since = time.monotonic()
                    yield _sse(event)
                state = new
            if time.monotonic() - quiet_since >= KEEPALIVE_S:
                quiet_since = time.monotonic()
                yield b": keep-alive\n\n"
    finally:
        await asyncio.to_thread(stop)
