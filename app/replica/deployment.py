"""One Serve replica = one LLMKernel serving every adapter it holds in one shared batch.

Requests arrive through the adapter-affinity router with the adapter as the multiplexed model id, but the
replica does not use `@serve.multiplexed` (one model object per id) or `@serve.batch` (batches split by id):
the kernel holds all adapters and batches requests of different adapters together itself. The work is done
by ReplicaCore (app/replica/core.py); this module adapts it to Serve, and to the ingress in-process. What
crosses between them is app/protocol.py's dataclasses, never plain dicts.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any

from app.config.app_config import AppConfig
from app.protocol import Failure, ReplicaRequest, ReplyItem, TokenizeCall, TokenizeReply
from app.replica.core import ReplicaCore
from app.replica.faults import fault_hook_from_env

__all__ = ["LocalBackend", "ReplicaCore", "make_replica_deployment"]


class LocalBackend:
    """The ingress's Backend over a ReplicaCore in the same process (tests of the HTTP layer, no Ray)."""

    def __init__(self, core: ReplicaCore):
        self.core = core

    def stream(self, request: ReplicaRequest, model_id: str) -> AsyncIterator[ReplyItem]:
        return self.core.generate(request)

    async def call(self, method: str, *args: Any) -> dict | TokenizeReply | Failure:
        if method == "inspect_adapter":
            return await self.core.inspect(*args)
        if method == "tokenize":
            return await self.core.tokenize(*args)
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
            request_router_class="app.router.request_router:AdapterAffinityRouter",
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
                "node_ip": ray.util.get_node_ip_address(),
                "node_id": ray.get_runtime_context().get_node_id(),
            }
            self.core = ReplicaCore(
                cfg, rid.unique_id, extra={"actor_name": rid.to_full_id_str(), "threads": cfg.threads, **node}
            )
            self.core.kernel.engine.fault_hook = fault_hook_from_env(self.core.kernel.tokenizer)  # tests only
            self.core.start()
            # Serve routes to a replica only once its constructor returns: the hot adapters load first.
            await self.core.warm_up()

        async def generate(self, request: ReplicaRequest) -> AsyncIterator[ReplyItem]:
            async for item in self.core.generate(request):
                yield item

        async def inspect_adapter(self, uri: str) -> dict | Failure:
            return await self.core.inspect(uri)

        async def tokenize(self, call: TokenizeCall) -> TokenizeReply | Failure:
            return await self.core.tokenize(call)

        def record_routing_stats(self) -> dict[str, Any]:
            return self.core.routing_stats()

        def check_health(self) -> None:
            # The kernel's step loop runs on its own thread; if it died, no request can finish here.
            if not self.core.kernel.engine.is_alive():
                raise RuntimeError("the kernel's step loop died")

        def __del__(self):
            core = getattr(self, "core", None)
            if core is not None:
                core.close()

    return LoraReplica
