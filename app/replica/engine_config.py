"""The engine's limits (`EngineConfig`) and the check of one request against them."""

from __future__ import annotations

from dataclasses import dataclass

from app.config.kernel_config import KernelConfig
from app.errors import InvalidRequest
from app.replica.kv_layout import KVLayout
from app.sampling_params import SamplingParams


@dataclass(frozen=True)
class EngineConfig:
    max_model_len: int
    num_kv_blocks: int
    block_size: int = 16
    max_batch_size: int = 32
    max_num_batched_tokens: int = KernelConfig.max_num_batched_tokens  # one default: KernelConfig's
    enable_prefix_caching: bool = True
    max_waiting: int = 4096

    def __post_init__(self) -> None:
        for key in (
            "max_model_len",
            "num_kv_blocks",
            "block_size",
            "max_batch_size",
            "max_num_batched_tokens",
            "max_waiting",
        ):
            if getattr(self, key) < 1:
                raise ValueError(f"{key} must be >= 1, got {getattr(self, key)}")


def check_request(
    prompt_ids: list[int],
    params: SamplingParams,
    cfg: EngineConfig,
    vocab: int,
    layout: KVLayout | None = None,
) -> None:
    """Raise InvalidRequest (naming what to change) if this prompt with these parameters cannot run under `cfg`
    on a model of `vocab` tokens (whose KV groups are `layout`; None: one global group): what a replica checks
    before fetching anything for a request."""
    if not prompt_ids:
        raise InvalidRequest("the prompt is empty: give at least one token")
    n = len(prompt_ids)
    if n >= cfg.max_model_len:
        raise InvalidRequest(
            f"the prompt has {n} tokens but max_model_len is {cfg.max_model_len} "
            "(prompt + at least one new token must fit): shorten the prompt"
        )
    if min(prompt_ids) < 0 or max(prompt_ids) >= vocab:
        raise InvalidRequest(f"prompt token ids must be in [0, {vocab})")
    if outside := sorted(t for t, _ in params.logit_bias if t >= vocab):
        err = InvalidRequest(f"logit_bias: token ids {outside[:5]} are outside the vocabulary [0, {vocab})")
        err.param = "logit_bias"
        raise err
    need = min(n + params.max_tokens, cfg.max_model_len)
    blocks, pool = -(-need // cfg.block_size), cfg.num_kv_blocks
    if (
        layout is not None
    ):  # blocks of `width` layers, all groups: a sliding group holds its window and a chunk
        blocks = layout.blocks_needed(need, cfg.block_size, cfg.max_num_batched_tokens)
        pool = layout.pool_blocks(cfg.num_kv_blocks, len(layout.layer_group))
    if blocks > pool:
        raise InvalidRequest(
            f"prompt ({n} tokens) + max_tokens ({params.max_tokens}) needs {blocks} KV blocks but the cache "
            f"has {pool} of {cfg.block_size} tokens: lower max_tokens or the prompt"
        )
