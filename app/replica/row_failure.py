"""When one row of an engine step fails (app/replica/engine.py): the error its sequence ends with, and the KV
blocks it leaves behind made safe to reuse. The other rows of the step carry on untouched."""

from __future__ import annotations

import logging

import torch

from app.errors import InternalError, InvalidAdapter, LoraLandError
from app.replica.kv_cache import KVCache
from app.replica.sampling import NonFiniteLogits
from app.replica.sequence import Sequence

log = logging.getLogger("loraland.engine")


def row_error(seq: Sequence, exc: Exception) -> LoraLandError:
    """What the sequence reports for `exc`, raised while sampling its row: non-finite logits are the adapter's
    fault when it has one (the base model alone gives finite logits: a 400), the project's own errors pass as
    they are, and anything else is an internal error whose details stay in the server log."""
    if isinstance(exc, NonFiniteLogits):
        if seq.adapter:
            return InvalidAdapter(
                f"adapter {seq.adapter!r} produced non-finite logits (inf/NaN) for this request, so no "
                "token can be sampled: its weights are likely absurdly large or corrupt; check them"
            )
        return InternalError("the base model produced non-finite logits (inf/NaN)")
    if isinstance(exc, LoraLandError):
        return exc
    log.error("sampling failed for sequence %d only", seq.seq_id, exc_info=exc)
    return InternalError(
        f"internal error while sampling this request ({type(exc).__name__}); see the server log"
    )


def scrub_kv(kv: KVCache, block_ids: list[int], device: torch.device) -> None:
    """Zero the inf/NaN entries of these KV blocks (finite values, shared prefix blocks, stay as they are)."""
    if not block_ids:
        return
    idx = torch.tensor(block_ids, device=device)
    for cache in (*kv.k, *kv.v):
        cache.index_copy_(
            0, idx, torch.nan_to_num(cache.index_select(0, idx), nan=0.0, posinf=0.0, neginf=0.0)
        )
