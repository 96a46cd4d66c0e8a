"""The plain-Python half of a replica (no Ray): one LLMKernel, adapters pulled on demand through the
AdapterHub (verified against the catalog's sha256s), heartbeats and catalog events, and `generate`, which
answers a `ReplicaRequest` with the reply stream app/protocol.py defines: a `ReplicaHello`, then `ChoiceDelta`s,
or one `Failure` (errors travel in-band, typed, so they survive Ray's serialization; the ingress alone maps them
to HTTP statuses). app/replica/deployment.py wraps it for Serve.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from app import metrics
from app.catalog.telemetry import start_process_metrics
from app.config.app_config import AppConfig
from app.config.settings import Settings
from app.errors import AdapterUnavailable, InvalidAdapter, LoraLandError
from app.protocol import (
    ChoiceDelta,
    DeltaBatch,
    Failure,
    ReplicaHello,
    ReplicaRequest,
    ReplyItem,
    TokenizeCall,
    TokenizeReply,
)
from app.replica import metrics as replica_metrics

log = logging.getLogger("loraland.replica")


def render_chat(
    messages: list[dict[str, str]], tokenizer: Any = None, *, add_generation_prompt: bool = True
) -> str:
    """The prompt for a chat: the tokenizer's chat template when it has one, else a plain transcript."""
    if tokenizer is not None and getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt
        )
    lines = [f"{m['role']}: {m['content']}" for m in messages]
    return "\n".join(lines) + ("\nassistant:" if add_generation_prompt else "")


class ReplicaCore:
    """Kernel + adapter loading + catalog heartbeats; `generate` is what the deployment exposes."""

    def __init__(
        self, cfg: AppConfig, replica_id: str, *, kernel: Any = None, catalog: Any = None, extra=None
    ):
        from app.catalog.sources import AdapterHub
        from loraland import LLMKernel

        self.cfg, self.replica_id, self.extra = cfg, replica_id, dict(extra or {})
        settings = Settings.from_env()
        changes: dict[str, Any] = {"redis_url": cfg.redis_url or settings.redis_url}
        if cfg.cache_dir:
            changes["cache_dir"] = Path(cfg.cache_dir)
        self.settings = dataclasses.replace(settings, **changes)
        self.catalog = catalog if catalog is not None else self._connect()
        self.hub = AdapterHub(catalog=self.catalog, settings=self.settings)
        self.kernel = kernel if kernel is not None else LLMKernel(cfg.model, cfg.kernel, hub=self.hub)
        self._held: dict[str, str] = {}  # ref -> name, adapters this replica registered with its kernel
        self._loading: dict[str, asyncio.Future] = {}
        self._generating = 0  # generate() calls in progress: the routers correct their counts with it
        self._unloadable: dict[str, str] = {}  # ref -> why its load failed here (never retried; bounded)
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._unsubscribe = None
        self._tenant_weights: dict[str, float] | None = None  # what the kernel was last given
        self._reconciled = time.monotonic()  # last pass of the TTL fallback for missed catalog events
        self._gauges = replica_metrics.ReplicaGauges(self)  # read when /metrics or a snapshot collects
        metrics.COLLECTORS.append(self._gauges)
        self._metrics: Any = None  # the snapshot publisher, once started
        self._texts: Any = None  # LogprobText, once a request asks for log probabilities

    def _connect(self):
        if not self.settings.redis_url:
            return None
        from app.catalog.store import Catalog

        try:
            return Catalog(self.settings.redis_url)
        except LoraLandError as e:  # serve what we can; heartbeats retry
            log.warning("catalog unreachable at start (%s); serving without placement until it returns", e)
            return None

    # ------------------------------------------------------------------ background: heartbeats, events
    def start(self) -> None:
        self._metrics = start_process_metrics(self.cfg.metrics, lambda: self.catalog, replica=self.replica_id)
        t = threading.Thread(target=self._heartbeat_loop, name="loraland-heartbeat", daemon=True)
        t.start()
        self._threads.append(t)
        if self.catalog is not None:
            try:
                self._unsubscribe = self.catalog.subscribe(self._on_event)
            except Exception as e:
                log.warning("cannot subscribe to catalog events (%s); removed adapters unload on restart", e)

    def _heartbeat_loop(self) -> None:
        failing = False
        while not self._stop.is_set():
            try:
                self.heartbeat_once()
                if failing:
                    log.info("catalog heartbeats are back")
                failing = False
            except Exception as e:
                if not failing:
                    log.warning(
                        "catalog heartbeat failed (%s); still serving, retrying every %ss",
                        e,
                        self.cfg.heartbeat_s,
                    )
                failing = True
            self._stop.wait(self.cfg.heartbeat_s)

    def heartbeat_once(self) -> None:
        if self.catalog is None:
            self.catalog = self._connect()
            if self.catalog is None:
                return
        s = self.routing_stats()
        busy = s["running"] + s["queue_len"]
        self.catalog.heartbeat(
            self.replica_id,
            resident=s["resident"],
            free_slots=s["free_slots"],
            load=busy / max(1, self.cfg.max_ongoing_requests),
            queue_len=s["queue_len"],
            kv_usage=s["kv_usage"],
            ttl_s=self.cfg.heartbeat_ttl_s,
            extra={"device_resident": s["device_resident"], "running": s["running"], **self.extra},
        )
        self.sync_tenant_weights()
        if time.monotonic() - self._reconciled >= self.cfg.heartbeat_ttl_s:
            self._reconciled = time.monotonic()
            self.reconcile()

    def reconcile(self) -> None:
        """Unload held adapters whose record is gone: the fallback when a "removed" event was missed."""
        from app.replica.warmup import stale_refs

        try:
            for ref in stale_refs(self.catalog, self._held):
                name, _, version = ref.rpartition("@")
                log.info("adapter %s is no longer in the catalog; unloading it", ref)
                self._on_event({"type": "removed", "name": name, "version": int(version)})
        except Exception as e:
            log.warning("catalog reconciliation failed (%s); retrying in %ss", e, self.cfg.heartbeat_ttl_s)

    async def warm_up(self) -> list[str]:
        """Load the catalog's hottest adapters (cfg.warm_adapters, at most the device slots) before traffic."""
        from app.replica.warmup import warm_up

        limit = min(self.cfg.warm_adapters, int(self.kernel.config.max_adapters))
        warmed = await warm_up(self, limit) if self.catalog is not None else []
        self.extra["warmed"] = warmed  # in the heartbeats: what this replica loaded before its first request
        return warmed

    def sync_tenant_weights(self) -> None:
        """Fair shares from the catalog's tenant records (`weight`, 1 when absent); a bad value keeps the old."""
        try:
            rows = self.catalog.list_tenants()
            weights = {t["name"]: float(t["weight"]) for t in rows if t.get("weight") is not None}
            if weights != self._tenant_weights:
                self.kernel.set_tenant_weights(weights)
                self._tenant_weights = weights
        except Exception as e:
            log.warning("tenant weights not updated from the catalog (%s); keeping the previous ones", e)

    def _on_event(self, event: dict) -> None:
        name, kind = event.get("name"), event.get("type")
        versions = event.get("versions") or ([event["version"]] if event.get("version") is not None else None)
        for ref, held_name in list(self._held.items()):
            if held_name != name or (versions is not None and ref not in {f"{name}@{v}" for v in versions}):
                continue
            try:
                if kind == "removed":
                    self._held.pop(ref, None)
                    self.kernel.unload_adapter(name)
                elif kind == "pinned":
                    (self.kernel.pin if event.get("pinned", True) else self.kernel.unpin)(name)
            except Exception as e:  # already gone, or in use: the kernel's LRU finishes the job
                log.info("catalog event %s for %s: %s", kind, ref, e)

    # ------------------------------------------------------------------ stats
    def held_refs(self) -> tuple[list[str], list[str]]:
        """(refs in the kernel's memory, host or device, refs of those in a device slot); the kernel reports
        bare names. Registered adapters the host LRU dropped are left out: serving one means reading it again,
        and the router must not count this replica as holding it (what `resident` in the stats says)."""
        s = self.kernel.stats()
        in_memory = s.get("in_memory")
        if in_memory is None:  # a kernel that does not say: everything registered
            in_memory = s.get("loaded")
        loaded, on_device = set(in_memory or ()), set(s.get("resident") or ())
        held = sorted(ref for ref, name in self._held.items() if name in loaded)
        return held, [ref for ref in held if self._held[ref] in on_device]

    def routing_stats(self) -> dict[str, Any]:
        s = self.kernel.stats()
        held, on_device = self.held_refs()
        return {
            "replica_id": self.replica_id,
            "resident": held,
            "device_resident": on_device,
            "free_slots": int(s.get("free_slots", 0)),
            "queue_len": int(s.get("queue_len", 0)),
            "running": int(s.get("running", 0)),
            "kv_usage": float(s.get("kv_usage", 0.0)),
            "loading": sorted(self._loading),
            "ongoing": self._generating,
            "at": time.time(),  # wall clock: the router compares it with when it sent an adapter here
            **self.extra,
        }

    # ------------------------------------------------------------------ adapters
    async def ensure(self, record: dict) -> None:
        """Fetch (verified) and register one adapter version with the kernel, once, off the event loop."""
        ref = record["ref"]
        if ref in self._held:
            return
        reason = self._unloadable.get(ref) or record.get("unloadable")
        if reason:  # a load already failed for good (here, or on a replica that marked the catalog record)
            err = InvalidAdapter(
                f"model: the adapter {ref!r} failed to load on this server and is marked unloadable: "
                f"{reason}. Fix it and register a new version"
            )
            err.param = "model"
            raise err
        pending = self._loading.get(ref)
        if pending is None:
            timer = replica_metrics.LoadTimer(self.hub, record)  # before the load: the source is its origin
            pending = asyncio.ensure_future(self._load(record))
            pending.add_done_callback(timer.finished)
            self._loading[ref] = pending
            pending.add_done_callback(lambda _f: self._loading.pop(ref, None))
        await asyncio.shield(pending)

    def _registered(self, ref: str, name: str) -> None:
        # The kernel keeps one live version per name: registering v2 retires v1 for new requests.
        for old in [r for r, n in self._held.items() if n == name and r != ref]:
            self._held.pop(old, None)
        self._held[ref] = name

    async def _load(self, record: dict) -> None:
        t0 = time.monotonic()
        try:
            # The kernel fetches through the hub with the catalog's checksums, now and whenever it re-reads
            # the adapter after evicting it from host memory (the disk cache may have dropped it by then).
            await asyncio.to_thread(
                self.kernel.load_adapter,
                record["name"],
                record["uri"],
                version=record["version"],
                files=record.get("files") or None,
            )
        except InvalidAdapter as e:  # a bad adapter stays bad: remember it here and in the catalog
            await self._mark_unloadable(record["ref"], str(e))
            raise
        except LoraLandError:
            raise
        except Exception as e:
            # The details (URI, local paths) go to the server log only: the tenant gets the adapter's name.
            log.warning("adapter %s: fetching %s failed: %r", record["ref"], record["uri"], e)
            raise AdapterUnavailable(
                f"adapter {record['ref']}: its files could not be fetched ({type(e).__name__}); retry later"
            ) from e
        self._registered(record["ref"], record["name"])
        if record.get("pinned"):
            self.kernel.pin(record["name"])
        log.info("loaded adapter %s from %s in %.3fs", record["ref"], record["uri"], time.monotonic() - t0)

    async def _mark_unloadable(self, ref: str, reason: str) -> None:
        while len(self._unloadable) >= 4096:  # oldest first: a forgotten one costs one more failed load
            self._unloadable.pop(next(iter(self._unloadable)))
        self._unloadable[ref] = reason
        if self.catalog is None:
            return
        try:
            await asyncio.to_thread(self.catalog.mark_unloadable, ref, reason)
        except Exception as e:  # this replica still remembers; others find out on their own first load
            log.warning("cannot mark %s unloadable in the catalog (%s)", ref, e)

    async def inspect(self, uri: str) -> dict | Failure:
        """inspect_adapter's summary, or its Failure (sent in-band to the ingress, like generate's)."""
        try:
            return await self.inspect_adapter(uri)
        except Exception as e:
            if not isinstance(e, LoraLandError):
                log.exception("inspecting %s failed on replica %s", uri, self.replica_id)
            return Failure.of(e)

    async def inspect_adapter(self, uri: str) -> dict:
        """Fetch an adapter named over HTTP (local roots restricted) and validate it against this base model."""
        from app.replica.lora.checks import check_adapter
        from app.replica.lora.peft_format import adapter_summary, read_adapter

        path = await asyncio.to_thread(self.hub.fetch, uri, untrusted=True)
        max_rank = self.kernel.config.max_lora_rank
        await asyncio.to_thread(check_adapter, path, max_rank=max_rank)  # what no base model is needed for
        await asyncio.to_thread(
            read_adapter, path, self.kernel.model_config, max_rank=self.kernel.config.max_lora_rank
        )
        summary = await asyncio.to_thread(adapter_summary, path)
        return {**summary, "base_model": self.kernel.model_config.identity()}

    # ------------------------------------------------------------------ tokenizer
    async def tokenize(self, call: TokenizeCall) -> TokenizeReply | Failure:
        """vLLM's /tokenize and /detokenize with this replica's tokenizer (on a thread: a prompt may be long);
        errors travel in-band as a Failure, like generate's."""
        try:
            return await asyncio.to_thread(self._tokenize, call)
        except Exception as e:
            if not isinstance(e, LoraLandError):
                log.exception("tokenize failed on replica %s", self.replica_id)
            return Failure.of(e)

    def _tokenize(self, call: TokenizeCall) -> TokenizeReply:
        from app.errors import InvalidRequest

        tok, limit = self.kernel.tokenizer, self.kernel.max_model_len
        if call.tokens is not None:
            vocab = len(tok)
            bad = next((t for t in call.tokens if not 0 <= t < vocab), None)
            if bad is not None:
                err = InvalidRequest(f"tokens: {bad} is not a token id of this model (0 <= id < {vocab})")
                err.param = "tokens"
                raise err
            return TokenizeReply(text=tok.decode(list(call.tokens)), max_model_len=limit)
        if call.messages is not None:
            text = render_chat(list(call.messages), tok, add_generation_prompt=call.add_generation_prompt)
        else:
            text = call.text or ""
        if len(text) > self.kernel.max_prompt_chars:
            err = InvalidRequest(
                f"prompt: {len(text)} characters, more than max_model_len ({limit} tokens) can hold"
            )
            err.param = "prompt"
            raise err
        ids = tok.encode(text, add_special_tokens=call.add_special_tokens)
        return TokenizeReply(tokens=tuple(ids), max_model_len=limit)

    # ------------------------------------------------------------------ generation
    async def generate(self, request: ReplicaRequest) -> AsyncIterator[ReplyItem]:
        self._generating += 1
        try:
            async for item in self._generate(request):
                yield item
        finally:
            self._generating -= 1

    async def _generate(self, request: ReplicaRequest) -> AsyncIterator[ReplyItem]:
        yield ReplicaHello(self.replica_id)
        replica_metrics.note_request(request.records)
        try:
            for record in request.records:
                await self.ensure(record)
            if request.messages is not None:
                prompts: list = [render_chat(list(request.messages), self.kernel.tokenizer)]
            else:
                prompts = list(request.prompts)
            async for item in self._fan_in(
                prompts,
                request.adapter or None,
                request.n,
                dict(request.sampling),
                tenant=request.tenant,
                echo=request.echo,
            ):
                yield item
        except Exception as e:
            if not isinstance(e, LoraLandError):
                log.exception("request failed on replica %s", self.replica_id)
            yield Failure.of(e)

    async def _fan_in(
        self,
        prompts: list,
        adapter: str | None,
        n: int,
        sampling: dict,
        *,
        tenant: str | None = None,
        echo: bool = False,
    ) -> AsyncIterator[ChoiceDelta | DeltaBatch]:
        """All choices (prompts x n) run concurrently in the kernel's batch; what they produced by each time the
        consumer runs leaves as one item: a ChoiceDelta, or a DeltaBatch of one delta per choice. A
        failed sequence raises out of its kernel stream (LLMKernel.generate), and so out of this one. With
        `echo`, each choice's first delta carries its prompt's text (token ids decoded)."""
        first: set[int] = set()  # choices whose first delta went out
        queue: asyncio.Queue = asyncio.Queue()
        streams = []
        for i, prompt in enumerate(prompts):
            for j in range(n):
                kw = dict(sampling)
                if n > 1 and isinstance(kw.get("seed"), int):
                    # Same seed for every choice would repeat one answer n times; wrap within signed 64 bits so
                    # a valid seed near the top of the range stays valid (an out-of-range one is still refused).
                    s = kw["seed"]
                    if -(2**63) <= s < 2**63:
                        kw["seed"] = (s + j + 2**63) % 2**64 - 2**63
                # kernel.generate is an async generator: nothing runs (or fails) until a pump iterates it, so
                # a bad prompt's error comes out of the queue like any other.
                streams.append((i * n + j, self.kernel.generate(prompt, adapter, tenant=tenant, **kw)))

        async def pump(index: int, stream) -> None:
            try:
                async for d in stream:
                    await queue.put((index, d, None))
            except Exception as e:
                await queue.put((index, None, e))

        tasks = [asyncio.ensure_future(pump(idx, st)) for idx, st in streams]
        remaining = len(tasks)
        try:
            while remaining:
                got = [await queue.get()]
                while not queue.empty():
                    got.append(queue.get_nowait())
                # Whatever piled up while the consumer was busy goes out as one item: one delta per choice
                # (a lagging stream catches up in one), all choices in one message (each Ray message costs
                # CPU in this process, the ingress and the proxy alike).
                items: dict[int, ChoiceDelta] = {}
                for index, d, exc in got:
                    if exc is not None:
                        raise exc
                    if d.finish_reason is not None:
                        remaining -= 1
                    delta = ChoiceDelta(
                        index,
                        d.text,
                        d.finish_reason,
                        d.prompt_tokens,
                        d.completion_tokens,
                        None if d.logprobs is None else self._logprob_text().convert(d.logprobs),
                    )
                    if index not in first:
                        first.add(index)
                        if echo:
                            delta.prompt_text = self._prompt_text(prompts[index // n])
                        if d.prompt_logprobs is not None:
                            delta.prompt_logprobs = self._logprob_text().convert(d.prompt_logprobs)
                    if index in items:
                        items[index].merge(delta)
                    else:
                        items[index] = delta
                batch = tuple(items.values())
                yield batch[0] if len(batch) == 1 else DeltaBatch(batch)
        finally:
            for t in tasks:  # a client that went away aborts its sequences in the kernel
                t.cancel()

    def _prompt_text(self, prompt: str | tuple[int, ...] | list[int]) -> str:
        return prompt if isinstance(prompt, str) else self.kernel.tokenizer.decode(list(prompt))

    def _logprob_text(self) -> Any:
        """Token texts for log probabilities, from the kernel's tokenizer (built on first use, then cached)."""
        if self._texts is None:
            from app.replica.logprob_text import LogprobText

            self._texts = LogprobText(self.kernel.tokenizer)
        return self._texts

    def close(self) -> None:
        self._stop.set()
        if self._metrics is not None:
            self._metrics.stop()
        if self._gauges in metrics.COLLECTORS:
            metrics.COLLECTORS.remove(self._gauges)
        if self._unsubscribe is not None:
            try:
                self._unsubscribe()
            except Exception:
                pass
        if self.catalog is not None:
            try:
                self.catalog.drop_replica(self.replica_id)
            except Exception:
                pass
        self.kernel.close()
