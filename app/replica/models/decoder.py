"""The decoder-only forward every served family runs, over one flat batch of tokens from many sequences.

No padding to the longest sequence: prefill chunks and decode tokens sit side by side in one [T] batch.
K/V go into the paged cache through `slot_mapping`; attention reads them back through block tables.
q/k/v and gate/up are fused into one matmul each; LoRA deltas are added to the fused outputs by the
`lora` object of the batch (None = base model only). Every linear is a PackedLinear (app/replica/linear.py): on
CPU its weight is prepacked at load for the GEMM kernel measured fastest at each batch size. Around the GEMMs the
work is in place where HF's rounding allows it (residual adds, rotary on q/k inside the fused qkv output,
act*up), so fp32 greedy output matches HF transformers. What differs between families is config
(app/config/model_families.py) and weight names (one loader per family, app/replica/models/registry.py).
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from loraland_kernels import fused

from app.config.model_config import ModelConfig
from app.replica.kv_cache import KVCache
from app.replica.kv_layout import KVLayout
from app.replica.linear import KERNELS, GemmTuner, PackedLinear, Plan, default_tuner, plain_linear
from app.replica.models.attention import paged_attention, stale_slots
from app.replica.models.batch import ForwardBatch
from app.replica.models.layer import Layer
from app.replica.models.norms import RMSNorm, act_mul_
from app.replica.models.registry import layer_loader
from app.replica.models.rope import Rope, rotate_
from app.replica.models.weights import WeightReader
from app.replica.sequence import Sequence

# rows a linear sees per step: lm_head only the sampled positions (at most one per running sequence)
MAX_ROWS = 4096
MAX_SAMPLED_ROWS = 256


class Model:
    """`gemm` picks the linear kernels on CPU: "auto" (measured per shape and batch size, plans cached on disk
    by default_tuner), a GemmTuner, or one kernel for every linear and batch size ("aten" is plain F.linear,
    the unpacked path; "onednn", "mkl"). CUDA always runs F.linear."""

    def __init__(
        self,
        folder: str | Path,
        config: ModelConfig,
        dtype: torch.dtype,
        device: torch.device,
        gemm: str | GemmTuner = "auto",
    ):
        self.cfg, self.dtype, self.device = config, dtype, device
        if isinstance(gemm, str) and gemm != "auto" and gemm not in KERNELS:
            raise ValueError(f"gemm {gemm!r} is not supported: use 'auto' or one of {list(KERNELS)}")
        tuner = (default_tuner() if gemm == "auto" else gemm) if device.type == "cpu" else None

        def linear(w: torch.Tensor, b: torch.Tensor | None = None, rows: int = MAX_ROWS) -> PackedLinear:
            if tuner is None:
                return plain_linear(w, b)
            if isinstance(tuner, str):
                return PackedLinear(w, b, Plan.fixed(tuner))
            return PackedLinear(w, b, tuner.plan(w, b, rows))

        c = config
        load_layer = layer_loader(c)
        w = WeightReader(folder, dtype, device)
        self.embed = w.get("model.embed_tokens.weight")
        if tuple(self.embed.shape) != (c.vocab_size, c.hidden_size):
            raise ValueError(
                f"embed_tokens has shape {tuple(self.embed.shape)}, config says "
                f"({c.vocab_size}, {c.hidden_size})"
            )
        self.norm = RMSNorm(w.get("model.norm.weight"), c.rms_norm_eps, c.norm_style)
        lm = w.get("lm_head.weight", required=not c.tie_word_embeddings)
        self.lm_head = linear(self.embed if lm is None else lm, rows=MAX_SAMPLED_ROWS)
        self.layers: list[Layer] = [load_layer(w, i, c, linear) for i in range(c.num_layers)]
        w.close()
        self.windows = c.windows()
        self.kv_layout = KVLayout.of(self.windows)  # which layers share block tables and cache tensors
        glob = Rope(c.rope_theta, c.head_dim, c.rope_scaling, c.partial_rotary_factor, device)
        local = (
            glob if c.local_rope_theta is None else Rope(c.local_rope_theta, c.head_dim, None, 1.0, device)
        )
        self.ropes = [glob] if local is glob else [glob, local]
        self.layer_rope = [1 if (win is not None and local is not glob) else 0 for win in self.windows]
        self.embed_scale = (
            None
            if c.embed_scale is None
            else torch.tensor(c.embed_scale, dtype=torch.float32).to(dtype).item()
        )
        self.q_size = c.num_heads * c.head_dim
        self.kv_size = c.num_kv_heads * c.head_dim
        self.fused = fused.enabled(device)  # the fused CPU ops (loraland_kernels.fused) are built and loaded

    def linears(self) -> list[PackedLinear]:
        return [self.lm_head] + [lin for layer in self.layers for lin in layer.linears()]

    def nbytes(self) -> int:
        ts = {id(t): t for t in (self.embed, self.norm.weight)}
        ts |= {id(t): t for layer in self.layers for t in layer.norm_weights() + layer.moe_tensors()}
        for lin in self.linears():
            ts |= {id(t): t for t in lin.tensors()}  # a tied lm_head run by aten is the embedding itself
        return sum(t.numel() * t.element_size() for t in ts.values())

    @property
    def prefix_cache_safe(self) -> bool:
        """False for LongRoPE: the same tokens' K/V differ with the sequence's final length (short vs long
        factors), which a prefix-cache key does not hold."""
        return self.ropes[0].longrope_at is None

    def stale_kv(self, seq: Sequence) -> bool:
        """A sequence that grew past LongRoPE's switch since its cached K/V were computed with the short factors:
        they must be computed again with the long ones, as transformers recomputes its cache then."""
        at = self.ropes[0].longrope_at
        return at is not None and seq.num_computed > 0 and seq.kv_basis <= at < seq.num_tokens

    @torch.inference_mode()
    def forward(self, b: ForwardBatch, kv: KVCache) -> torch.Tensor:
        """Returns float32 logits [len(b.logits_idx), vocab]."""
        c = self.cfg
        H, Hkv, d = c.num_heads, c.num_kv_heads, c.head_dim
        qs, ks = self.q_size, self.kv_size
        h = F.embedding(b.input_ids, self.embed)  # a fresh tensor: the residual stream is updated in place
        lora = b.lora
        if lora is not None:  # each token's adapter's embed_tokens (LoRA or copy), before any layer reads h
            lora.embed(b.input_ids, h)
        if self.embed_scale is not None:
            h.mul_(self.embed_scale)
        rope = [r.cos_sin(b.positions, b.seq_lens, self.dtype) for r in self.ropes]
        fast = self.fused
        lay = self.kv_layout
        groups = [b.group(g) for g in range(lay.num_groups)]
        bs = kv.k[0].shape[1]
        stale = [stale_slots(gb, bs) if b.decode_idx is not None and not fast else None for gb in groups]
        delta = None  # the last block's output, added to the residual stream h inside the next norm
        for li, L in enumerate(self.layers):
            x = L.attn_norm.add_norm(h, delta)
            qkv = L.qkv(x)
            if lora is not None:
                lora.apply(li, "qkv", x, qkv)
            q = qkv[:, :qs].unflatten(1, (H, d))
            k = qkv[:, qs : qs + ks].unflatten(1, (Hkv, d))
            v = qkv[:, qs + ks :].unflatten(1, (Hkv, d))
            if L.q_norm is not None:
                q.copy_(L.q_norm(q.reshape(-1, d)).view_as(q))
                k.copy_(L.k_norm(k.reshape(-1, d)).view_as(k))
            cos, sin = rope[self.layer_rope[li]]
            # this layer's KV group: its block tables, and its tensor of the group's blocks
            gb, gstale = groups[lay.layer_group[li]], stale[lay.layer_group[li]]
            kc, vc = kv.k[lay.layer_slot[li]], kv.v[lay.layer_slot[li]]
            if fast:  # rotary on q and k, k and v into the cache: one pass
                fused.rope_cache_(qkv, H, Hkv, d, cos, sin, gb.slot_mapping, kc, vc)
            else:
                _rotate_qk_(qkv, qs + ks, H + Hkv, d, cos, sin)
                kc.view(-1, Hkv, d).index_copy_(0, gb.slot_mapping, k)
                vc.view(-1, Hkv, d).index_copy_(0, gb.slot_mapping, v)
            if gstale is not None:
                kc.view(-1, Hkv, d).index_fill_(0, gstale, 0.0)
                vc.view(-1, Hkv, d).index_fill_(0, gstale, 0.0)
            attn = paged_attention(q, k, v, gb, kc, vc, self.windows[li], c.attn_scale)
            o = L.o(attn)
            if lora is not None:
                lora.apply(li, "o", attn, o)
            x = L.mlp_norm.add_norm(h, o if L.attn_out_norm is None else L.attn_out_norm(o))
            if L.moe is not None:  # LoRA on the router logits and the experts, inside
                dn = L.moe(x, lora, li)
            else:
                gu = L.gate_up(x)
                if lora is not None:
                    lora.apply(li, "gate_up", x, gu)
                m = act_mul_(gu, c.hidden_act)
                dn = L.down(m)
                if lora is not None:
                    lora.apply(li, "down", m, dn)
            delta = dn if L.mlp_out_norm is None else L.mlp_out_norm(dn)
        # only the sampled rows go on: the last block's output is added to those rows alone
        h = self.norm.add_norm(h.index_select(0, b.logits_idx), delta.index_select(0, b.logits_idx))
        logits = self.lm_head(h)
        if lora is not None:  # each row is a sampled (or prompt-logprob) position: its own token's adapter
            lora.head(b.logits_idx, h, logits)
        if c.final_logit_softcap is not None:
            cap = c.final_logit_softcap
            logits = torch.tanh(logits / cap) * cap
        return logits.float()


def _rotate_qk_(
    qkv: torch.Tensor, width: int, heads: int, d: int, cos: torch.Tensor, sin: torch.Tensor
) -> None:
    """RoPE on the q and k heads of the fused output in one pass (their first 2 * cos.shape[-1] dims)."""
    rotate_(qkv[:, :width].unflatten(1, (heads, d)), cos, sin)
