"""A replica's metrics: gauges read from its kernel when the registry is collected (nothing is updated per engine
step, so the step loop pays nothing for them), and adapter-load records with where the files came from.

The gauges carry no `replica` label of their own: the process is named once (metrics.identify), and the label is
added to every series of the process when the ingress merges the cluster's snapshots (app/router/http/metrics.py).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from app import metrics
from app import metrics_core as mc
from app.adapter_record import AdapterRecord
from app.replica.results import KernelStats

log = logging.getLogger("loraland.replica")


def disk_cached(root: Any) -> int:
    """Adapters in the disk cache (folders with a manifest): a directory listing, no file reads."""
    try:
        names = {e.name for e in os.scandir(root)}
    except OSError:
        return 0
    return sum(1 for n in names if not n.startswith(".") and f"{n}.json" in names)


class ReplicaGauges:
    """The kernel's state as gauge families (metrics.COLLECTORS calls it at each snapshot): queue, batch, KV
    blocks, prefix cache, adapters per tier, free slots. Each series names its replica itself: a test process
    may hold several."""

    def __init__(self, replica_id: str, stats: Callable[[], KernelStats], disk_root: Path):
        self.replica_id, self.stats, self.disk_root = replica_id, stats, disk_root

    def __call__(self) -> list[list]:
        rid = [self.replica_id]
        try:
            s = self.stats()
        except Exception as e:  # a kernel that is closing: report nothing rather than fail the scrape
            log.debug("replica gauges unavailable: %s", e)
            return []

        def g(name: str, doc: str, value: float) -> list:
            return mc.family(name, "gauge", doc, ["replica"], [[rid, float(value)]])

        def c(name: str, doc: str, value: float) -> list:
            return mc.family(name, "counter", doc, ["replica"], [[rid, float(value)]])

        disk = disk_cached(self.disk_root)
        tiers = [
            [[*rid, "device"], len(s.resident)],
            [[*rid, "host"], s.host_cached],
            [[*rid, "disk"], disk],
        ]
        return [
            g("loraland_queue_depth", "Sequences waiting for a place in the batch", s.queue_len),
            g("loraland_running_sequences", "Sequences in the running batch", s.running),
            g("loraland_kv_blocks_used", "KV cache blocks in use", s.kv_blocks_used),
            g("loraland_kv_blocks_total", "KV cache blocks", s.kv_blocks_total),
            g(
                "loraland_prefix_cache_hit_ratio",
                "Prefix-cache block lookups that hit, since the replica started",
                s.prefix_hits / s.prefix_queries if s.prefix_queries else 0.0,
            ),
            c("loraland_prefix_cache_queries", "Prefix-cache block lookups", s.prefix_queries),
            c("loraland_prefix_cache_hits", "Prefix-cache block lookups that hit", s.prefix_hits),
            g("loraland_adapter_slots_free", "Free adapter slots on the device", s.free_slots),
            mc.family(
                "loraland_adapters_resident",
                "gauge",
                "Adapters held per tier: device slots, parsed in host memory, files in the disk cache",
                ["replica", "tier"],
                tiers,
            ),
            *base_kv_reuse(self.replica_id, s.alora_kv),
        ]


def base_kv_reuse(replica_id: str, alora_kv: dict[str, tuple[int, int]]) -> list[list]:
    """Activated LoRA's base-KV reuse as two counter families by adapter name (versions summed; names outside
    the top K as OTHER): prompt tokens served from the base model's cached KV blocks, and tokens prefilled."""
    by_name: dict[str, list[int]] = {}
    for key, (reused, prefilled) in alora_kv.items():
        row = by_name.setdefault(metrics.adapter_seen(key.rpartition("@")[0] or key), [0, 0])
        row[0] += reused
        row[1] += prefilled
    labels = ["replica", "adapter"]
    return [
        mc.family(
            "loraland_alora_base_kv_reused_tokens",
            "counter",
            "Prompt tokens of activated-LoRA requests served from the base model's cached KV blocks (the "
            "prefix before the invocation, block-aligned), not prefilled",
            labels,
            [[[replica_id, a], float(v[0])] for a, v in sorted(by_name.items())],
        ),
        mc.family(
            "loraland_alora_prefilled_tokens",
            "counter",
            "Tokens of activated-LoRA requests prefilled (not found in the prefix cache)",
            labels,
            [[[replica_id, a], float(v[1])] for a, v in sorted(by_name.items())],
        ),
    ]


def load_source(hub: Any, uri: str, files: dict[str, str] | None) -> str:
    """Where a load of `uri` will read from: s3, hf, local or disk-cache (an S3 adapter already cached)."""
    if uri.startswith("s3://"):
        try:
            return "disk-cache" if files and hub.cached(uri, files) else "s3"
        except Exception:  # the label is best effort; the load itself reports real problems
            return "s3"
    if uri.startswith("hf://"):
        return "hf"
    return "local"


class LoadTimer:
    """Times one adapter load on a replica and records it: count, latency and bytes by source, or a failure."""

    def __init__(self, hub: Any, record: AdapterRecord):
        self.record = record
        self.source = load_source(hub, record.uri, record.files) if metrics.enabled() else ""
        self.t0 = time.monotonic()

    def done(self) -> None:
        if not metrics.enabled():
            return
        name, seconds = self.record.name, time.monotonic() - self.t0
        nbytes = int(self.record.size or 0)
        metrics.ADAPTER_LOADS.labels(metrics.adapter_seen(name), self.source).inc()
        metrics.ADAPTER_LOAD_SECONDS.labels(self.source).observe(seconds)
        metrics.ADAPTER_LOAD_BYTES.labels(self.source).inc(nbytes)
        metrics.event(
            "load", adapter=self.record.ref, source=self.source, seconds=round(seconds, 4), bytes=nbytes,
            **metrics.identity(),
        )  # fmt: skip

    def finished(self, fut: Any) -> None:
        """The load's done callback: `done` or `failed` from how its future ended (cancelled: nothing)."""
        if fut.cancelled():
            return
        err = fut.exception()
        self.failed(err) if err is not None else self.done()

    def failed(self, err: BaseException) -> None:
        if not metrics.enabled():
            return
        metrics.ADAPTER_LOAD_FAILURES.labels(metrics.adapter_seen(self.record.name)).inc()
        metrics.event(
            "error", where="adapter load", adapter=self.record.ref, status=None,
            message=str(err)[:300], **metrics.identity(),
        )  # fmt: skip


def note_request(records: Iterable[AdapterRecord]) -> None:
    """Count a request's adapters as traffic on this replica, so its own top-K labels follow its load."""
    if metrics.enabled():
        for r in records:
            metrics.adapters(r.name)
