"""The model package: one decoder forward (decoder.py) over the families' weights (one loader file per family,
registry.py), with the pieces it is built from: batch layout, attention over the paged cache, RoPE, norms."""

from app.replica.models.batch import ForwardBatch, LoraHook, PrefillAttn
from app.replica.models.decoder import Model
from app.replica.models.dtypes import cpu_has_fast_bf16, resolve_dtype

__all__ = ["ForwardBatch", "LoraHook", "Model", "PrefillAttn", "cpu_has_fast_bf16", "resolve_dtype"]
