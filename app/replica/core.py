"""The plain-Python half of a replica (no Ray): one LLMKernel, the adapters it fetches on demand, its catalog
sync, and `generate`, which answers a `ReplicaRequest` with ChoiceDeltas / DeltaBatches or raises an
app.errors exception. app/replica/deployment.py is the Ray edge: it turns exceptions into `Failure`s.

A request is checked whole (prompts against the model, sampling, response_format) before any adapter is
fetched for it; then its cold adapters load concurrently; then its choices run in the shared batch.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from app import metrics
from app.catalog.sources import AdapterHub
from app.catalog.telemetry import start_process_metrics
from app.config.app_config import AppConfig
from app.config.settings import Settings
from app.protocol import ChoiceDelta, DeltaBatch, ReplicaRequest, ReplicaStats, TokenizeCall, TokenizeReply
from app.replica import metrics as replica_metrics
from app.replica.adapter_fetch import AdapterFetcher
from app.replica.catalog_sync import CatalogSync, connect_catalog
from app.replica.fan_in import fan_in
from app.replica.faults import install_fault_hook
from app.replica.kernel import LLMKernel
from app.replica.logprob_text import LogprobText
from app.replica.prompts import prepare_prompts, tokenize_call
from app.replica.warmup import warm_up

log = logging.getLogger("loraland.replica")


class ReplicaCore:
    """Kernel + adapter fetching + catalog sync; `generate` is what the deployment exposes."""

    def __init__(
        self,
        cfg: AppConfig,
        replica_id: str,
        *,
        kernel: LLMKernel | None = None,
        catalog: Any = None,
        node: dict[str, str | int] | None = None,
    ):
        self.cfg, self.replica_id, self.node = cfg, replica_id, dict(node or {})
        settings = Settings.from_env()
        changes: dict[str, Any] = {"redis_url": cfg.redis_url or settings.redis_url}
        if cfg.cache_dir:
            changes["cache_dir"] = Path(cfg.cache_dir)
        self.settings = dataclasses.replace(settings, **changes)
        catalog = catalog if catalog is not None else connect_catalog(self.settings.redis_url)
        self.hub = AdapterHub(catalog=catalog, settings=self.settings)
        self.kernel = kernel if kernel is not None else LLMKernel(cfg.model, cfg.kernel, hub=self.hub)
        install_fault_hook(self.kernel)  # tests only: nothing unless the environment asks for it
        self.fetcher = AdapterFetcher(self.kernel, self.hub)
        self.sync = CatalogSync(
            cfg, replica_id, self.settings.redis_url, catalog, self.kernel, self.fetcher, self.stats
        )
        self.fetcher.on_unloadable = self.sync.mark_unloadable
        self.warmed: tuple[str, ...] | None = None  # what warm_up loaded before the first request
        self._generating = 0  # generate() calls in progress: the routers correct their counts with it
        self._texts: LogprobText | None = None  # token texts for log probabilities, built on first use
        # read when /metrics or a snapshot collects
        self._gauges = replica_metrics.ReplicaGauges(replica_id, self.kernel.stats, self.hub.cache.root)
        metrics.COLLECTORS.append(self._gauges)
        self._metrics: Any = None  # the snapshot publisher, once started

    @property
    def catalog(self) -> Any:
        return self.sync.catalog

    def start(self) -> None:
        self._metrics = start_process_metrics(self.cfg.metrics, lambda: self.catalog, replica=self.replica_id)
        self.sync.start()

    async def warm_up(self) -> list[str]:
        """Load the catalog's hottest adapters (cfg.warm_adapters, at most the device slots) before traffic."""
        limit = min(self.cfg.warm_adapters, int(self.kernel.config.max_adapters))
        warmed = await warm_up(self.catalog, self.fetcher, limit) if self.catalog is not None else []
        self.warmed = tuple(warmed)  # in the heartbeats: what this replica loaded before its first request
        return warmed

    def healthy(self) -> bool:
        return self.kernel.is_alive()

    # ------------------------------------------------------------------ stats
    def stats(self) -> ReplicaStats:
        """What this replica reports to the router (routing stats) and the catalog (heartbeats)."""
        s = self.kernel.stats()
        held, on_device = self.fetcher.resident()
        return ReplicaStats(
            replica_id=self.replica_id,
            resident=tuple(held),
            device_resident=tuple(on_device),
            loading=tuple(sorted(self.fetcher.loading)),
            free_slots=s.free_slots,
            queue_len=s.queue_len,
            running=s.running,
            ongoing=self._generating,
            kv_usage=s.kv_usage,
            at=time.time(),  # wall clock: the router compares it with when it sent an adapter here
            node=self.node,
            warmed=self.warmed,
        )

    # ------------------------------------------------------------------ requests
    async def generate(self, request: ReplicaRequest) -> AsyncIterator[ChoiceDelta | DeltaBatch]:
        self._generating += 1
        try:
            replica_metrics.note_request(request.records)
            prompts = await prepare_prompts(self.kernel, request)  # a request that cannot run fetches nothing
            await self.fetcher.ensure_all(request.records)
            async for item in fan_in(self.kernel, request, prompts, self._logprob_text):
                yield item
        finally:
            self._generating -= 1

    async def inspect_adapter(self, uri: str) -> dict:
        """Fetch an adapter named over HTTP (local roots restricted) and validate it against this base model."""
        from app.replica.lora.checks import check_adapter
        from app.replica.lora.peft_format import adapter_summary, read_adapter

        path = await asyncio.to_thread(self.hub.fetch, uri, untrusted=True)
        max_rank = self.kernel.config.max_lora_rank
        await asyncio.to_thread(check_adapter, path, max_rank=max_rank)  # what no base model is needed for
        await asyncio.to_thread(read_adapter, path, self.kernel.model_config, max_rank=max_rank)
        summary = await asyncio.to_thread(adapter_summary, path)
        return {**summary, "base_model": self.kernel.model_config.identity()}

    async def tokenize(self, call: TokenizeCall) -> TokenizeReply:
        """vLLM's /tokenize and /detokenize, on a thread (a prompt may be long)."""
        return await asyncio.to_thread(tokenize_call, self.kernel, call)

    def _logprob_text(self, entries: list) -> list:
        if self._texts is None:
            self._texts = LogprobText(self.kernel.tokenizer)
        return self._texts.convert(entries)

    def close(self) -> None:
        self.sync.close()
        if self._metrics is not None:
            self._metrics.stop()
        if self._gauges in metrics.COLLECTORS:
            metrics.COLLECTORS.remove(self._gauges)
        self.kernel.close()
