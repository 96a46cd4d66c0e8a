"""One Serve replica = one LLMKernel serving every adapter it holds in one shared batch.

Requests arrive through the adapter-affinity router with the adapter as the multiplexed model id, but the
replica does not use `@serve.multiplexed` (one model object per id) or `@serve.batch` (batches split by id):
the kernel holds all adapters and batches requests of different adapters together itself. The work is done
by ReplicaCore (app/replica/core.py); this module is the Ray edge that adapts it to Serve, and to the ingress
in-process: the only place on the replica side where an exception becomes a `Failure`. What crosses between
them is app/protocol.py's dataclasses, never plain dicts (inspect_adapter's summary aside: the admin API's JSON).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable
from typing import Any, TypeVar

from app.config.app_config import AppConfig
from app.errors import LoraLandError
from app.protocol import (
    Failure,
    ReplicaHello,
    ReplicaRequest,
    ReplicaStats,
    ReplyItem,
    TokenizeCall,
    TokenizeReply,
)
from app.replica.core import ReplicaCore

__all__ = ["LocalBackend", "ReplicaCore", "make_replica_deployment"]

log = logging.getLogger("loraland.replica")
T = TypeVar("T")


def _failure(exc: BaseException, replica_id: str, what: str) -> Failure:
    if not isinstance(exc, LoraLandError):
        log.exception("%s failed on replica %s", what, replica_id, exc_info=exc)
    return Failure.of(exc)


async def reply_items(core: ReplicaCore, request: ReplicaRequest) -> AsyncIterator[ReplyItem]:
    """The reply stream app/protocol.py defines: a ReplicaHello, then the core's deltas, or one Failure."""
    yield ReplicaHello(core.replica_id)
    try:
        async for item in core.generate(request):
            yield item
    except Exception as e:
        yield _failure(e, core.replica_id, "request")


async def answer(core: ReplicaCore, call: Awaitable[T], what: str) -> T | Failure:
    """A unary call's result, or its Failure (sent in-band, like generate's)."""
    try:
        return await call
    except Exception as e:
        return _failure(e, core.replica_id, what)


class LocalBackend:
    """The ingress's Backend over a ReplicaCore in the same process (tests of the HTTP layer, no Ray)."""

    def __init__(self, core: ReplicaCore):
        self.core = core

    def stream(self, request: ReplicaRequest) -> AsyncIterator[ReplyItem]:
        return reply_items(self.core, request)

    async def call(self, method: str, *args: Any) -> dict | TokenizeReply | Failure:
        if method == "inspect_adapter":
            return await answer(self.core, self.core.inspect_adapter(*args), method)
        if method == "tokenize":
            return await answer(self.core, self.core.tokenize(*args), method)
        raise ValueError(f"unknown replica method {method!r}")


def _log_info_to_stderr() -> None:
    """Ray leaves a worker's root logger unconfigured (warnings only): show our INFO lines (adapter loads and
    their timings) on the replica's stderr, which Ray writes to its log and streams to the driver."""
    lg = logging.getLogger("loraland")
    if not lg.handlers:
        h = logging.StreamHandler()
        h.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
        lg.addHandler(h)
        lg.setLevel(logging.INFO)
        lg.propagate = False


def make_replica_deployment(cfg: AppConfig):
    """The Serve deployment for replicas, configured from `cfg` (resources, router, stats period)."""
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    # Serve refuses num_replicas next to autoscaling_config: one or the other.
    scale: dict[str, Any] = (
        {"autoscaling_config": dict(cfg.autoscaling)} if cfg.autoscaling else {"num_replicas": cfg.replicas}
    )

    @serve.deployment(
        name="LoraReplica",
        **scale,
        ray_actor_options={"num_cpus": cfg.replica_num_cpus, "num_gpus": cfg.replica_num_gpus},
        max_ongoing_requests=cfg.max_ongoing_requests,
        max_queued_requests=cfg.max_queued_requests,
        request_router_config=RequestRouterConfig(
            request_router_class="app.router.routing.request_router:AdapterAffinityRouter",
            request_router_kwargs=dict(cfg.router),
            request_routing_stats_period_s=cfg.routing_stats_period_s,
            request_routing_stats_timeout_s=max(5.0, 5 * cfg.routing_stats_period_s),
        ),
        health_check_period_s=2.0,
        health_check_timeout_s=30.0,
        graceful_shutdown_timeout_s=5.0,
    )
    class LoraReplica:
        async def __init__(self, config: dict):
            import ray
            import torch

            _log_info_to_stderr()
            ctx = serve.get_replica_context()
            rid = ctx.replica_id
            cfg = AppConfig.from_dict(config)
            torch.set_num_threads(cfg.threads)
            node = {
                "actor_name": rid.to_full_id_str(),
                "threads": cfg.threads,
                "node_ip": ray.util.get_node_ip_address(),
                "node_id": ray.get_runtime_context().get_node_id(),
            }
            self.core = ReplicaCore(cfg, rid.unique_id, node=node)
            self.core.start()
            # Serve routes to a replica only once its constructor returns: the hot adapters load first.
            await self.core.warm_up()

        async def generate(self, request: ReplicaRequest) -> AsyncIterator[ReplyItem]:
            async for item in reply_items(self.core, request):
                yield item

        async def inspect_adapter(self, uri: str) -> dict | Failure:
            return await answer(self.core, self.core.inspect_adapter(uri), "inspect_adapter")

        async def tokenize(self, call: TokenizeCall) -> TokenizeReply | Failure:
            return await answer(self.core, self.core.tokenize(call), "tokenize")

        def record_routing_stats(self) -> ReplicaStats:
            return self.core.stats()

        def check_health(self) -> None:
            # The kernel's step loop runs on its own thread; if it died, no request can finish here.
            if not self.core.healthy():
                raise RuntimeError("the kernel's step loop died")

        def __del__(self):
            core = getattr(self, "core", None)
            if core is not None:
                core.close()

    return LoraReplica
