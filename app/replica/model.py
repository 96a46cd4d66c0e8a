"""Llama-family forward (Llama, Mistral, Qwen2) over one flat batch of tokens from many sequences.

No padding to the longest sequence: prefill chunks and decode tokens sit side by side in one [T] batch.
K/V go into the paged cache through `slot_mapping`; attention reads them back through block tables.
q/k/v and gate/up are fused into one matmul each; LoRA deltas are added to the fused outputs by the
`lora` object of the batch (None = base model only). Every linear is a PackedLinear (app/replica/linear.py): on
CPU its weight is prepacked at load for the GEMM kernel measured fastest at each batch size. Around the GEMMs the
work is in place where HF's rounding allows it (residual adds, rotary on q/k inside the fused qkv output,
SiLU*up), so fp32 greedy output matches HF transformers.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch
import torch.nn.functional as F
from safetensors import safe_open

from app.config.model_config import ModelConfig
from app.replica.kv_cache import KVCache
from app.replica.linear import KERNELS, GemmTuner, PackedLinear, Plan, default_tuner, plain_linear


class LoraHook(Protocol):
    def apply(self, layer: int, group: str, x: torch.Tensor, out: torch.Tensor) -> None:
        """Add every targeted adapter's delta for linear `group` ("qkv", "o", "gate_up", "down") into out."""

    def embed(self, ids: torch.Tensor, h: torch.Tensor) -> None:
        """h = the base embedding of ids [T]: apply each token's adapter's embed_tokens (LoRA or copy) in place."""

    def head(self, rows: torch.Tensor, x: torch.Tensor, logits: torch.Tensor) -> None:
        """logits = lm_head(x), row i of token rows[i]: apply each row's adapter's lm_head (LoRA or copy)."""


@dataclass
class PrefillAttn:
    token_idx: torch.Tensor  # [q_len] positions of this chunk's tokens in the flat batch
    ctx_len: int  # tokens of the sequence in the cache after this step (context + this chunk)
    block_ids: torch.Tensor  # [ceil(ctx_len / block_size)]


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    slot_mapping: torch.Tensor  # [T] flat cache slot of each token (block * block_size + offset)
    decode_idx: torch.Tensor | None  # [Bd] flat index of each single-token (decode) sequence
    decode_block_tables: torch.Tensor | None  # [Bd, max_blocks] (padded with 0)
    decode_ctx_lens: torch.Tensor | None  # [Bd]
    prefills: list[PrefillAttn]
    logits_idx: torch.Tensor  # [n] tokens whose next-token logits are needed
    lora: LoraHook | None = None


def resolve_dtype(dtype: str | torch.dtype, device: torch.device, config: ModelConfig) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    names = {
        "float32": torch.float32,
        "fp32": torch.float32,
        "bfloat16": torch.bfloat16,
        "bf16": torch.bfloat16,
        "float16": torch.float16,
        "fp16": torch.float16,
    }
    if dtype in names:
        return names[dtype]
    if dtype != "auto":
        raise ValueError(f"dtype {dtype!r} is not supported: use 'auto', 'float32', 'bfloat16' or 'float16'")
    if device.type == "cuda":
        return torch.float16 if config.torch_dtype == "float16" else torch.bfloat16
    return torch.bfloat16 if cpu_has_fast_bf16() else torch.float32


def cpu_has_fast_bf16() -> bool:
    """bf16 matmuls only beat fp32 on CPUs with AVX512-BF16 or AMX; elsewhere they are ~4x slower."""
    try:
        flags = Path("/proc/cpuinfo").read_text().split("\nflags", 2)[1].split("\n", 1)[0].split()
    except (OSError, IndexError):
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def rope_inv_freq(cfg: ModelConfig) -> tuple[torch.Tensor, float]:
    """Inverse frequencies (and attention scaling) for default, linear and llama3 RoPE, as HF defines them."""
    d = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    sc = cfg.rope_scaling
    if sc is None:
        return inv, 1.0
    kind = sc.get("rope_type", sc.get("type"))
    if kind == "linear":
        return inv / sc["factor"], 1.0
    # llama3: long wavelengths scaled by `factor`, short kept, smooth in between
    factor, lo, hi = sc["factor"], sc.get("low_freq_factor", 1.0), sc.get("high_freq_factor", 4.0)
    old = sc["original_max_position_embeddings"]
    lo_wavelen, hi_wavelen = old / lo, old / hi
    wavelen = 2 * math.pi / inv
    inv_l = torch.where(wavelen > lo_wavelen, inv / factor, inv)
    smooth = (old / wavelen - lo) / (hi - lo)
    smoothed = (1 - smooth) * inv_l / factor + smooth * inv_l
    is_medium = ~(wavelen < hi_wavelen) * ~(wavelen > lo_wavelen)
    return torch.where(is_medium, smoothed, inv_l), 1.0


def _rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    if x.dtype == torch.float32:  # HF's ops in HF's order (composite on CPU), with fewer temporaries
        return F.rms_norm(x, (x.shape[-1],), w, eps)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return w * xf.to(x.dtype)  # HF rounds to the model dtype before the weight multiply


def _rotate_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotary in place on x [T, heads, d] (cos/sin [T, 1, d/2]): HF's x*cos + rotate_half(x)*sin, the same
    products and sums (no fused multiply-add), without the concatenated copy."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    x2_sin = x2 * sin
    x1_sin = x1 * sin
    x1.mul_(cos).sub_(x2_sin)
    x2.mul_(cos).add_(x1_sin)


def _stale_slots(b: ForwardBatch, block_size: int) -> torch.Tensor | None:
    """Cache slots (block * block_size + offset) past each decode row's length in its own last block. They are
    stale: a reused block's previous owner left them, maybe inf/NaN (a prefill aborted midway). Decode attention
    reads them (and the padding, which repeats the row's first block) under a mask of weight 0, but 0 * NaN is
    NaN, so the forward zeroes them before attention. No one else writes there: the slots are the row's own,
    and its next tokens overwrite them."""
    lens = b.decode_ctx_lens
    used = lens % block_size  # 0: the last block is full
    last = b.decode_block_tables.gather(1, ((lens - 1) // block_size)[:, None])
    off = torch.arange(block_size, device=lens.device)[None, :]
    slots = (last * block_size + off)[(off >= used[:, None]) & (used[:, None] > 0)]
    return slots if slots.numel() else None


def _weight_files(folder: Path) -> dict[str, Path]:
    """tensor name -> file, from a single safetensors file or a sharded index."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        wm = json.loads(index.read_text())["weight_map"]
        return {k: folder / v for k, v in wm.items()}
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        bins = [p.name for p in folder.glob("*.bin")]
        hint = f" (found {bins}: pickled weights are refused, convert them to safetensors)" if bins else ""
        raise ValueError(f"{folder} has no *.safetensors weights{hint}")
    out = {}
    for f in files:
        with safe_open(f, "pt") as fh:
            out.update({k: f for k in fh.keys()})
    return out


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

        folder = Path(folder)
        files = _weight_files(folder)
        handles: dict[Path, object] = {}

        def get(name: str, required: bool = True) -> torch.Tensor | None:
            if name not in files:
                if required:
                    raise ValueError(f"{folder}: weight {name!r} is missing from the safetensors files")
                return None
            f = files[name]
            if f not in handles:
                handles[f] = safe_open(f, "pt")
            return handles[f].get_tensor(name).to(device=device, dtype=dtype)

        c = config
        self.embed = get("model.embed_tokens.weight")
        if tuple(self.embed.shape) != (c.vocab_size, c.hidden_size):
            raise ValueError(
                f"embed_tokens has shape {tuple(self.embed.shape)}, config says "
                f"({c.vocab_size}, {c.hidden_size})"
            )
        self.norm = get("model.norm.weight")
        lm = get("lm_head.weight", required=not c.tie_word_embeddings)
        self.lm_head = linear(self.embed if lm is None else lm, rows=MAX_SAMPLED_ROWS)
        qkv_bias = c.family == "qwen2" or c.attention_bias
        o_bias = c.family != "qwen2" and c.attention_bias
        self.layers = []
        for i in range(c.num_layers):
            p = f"model.layers.{i}."
            a = p + "self_attn."
            q, k, v = (get(a + f"{m}_proj.weight") for m in "qkv")
            layer = {
                "ln1": get(p + "input_layernorm.weight"),
                "ln2": get(p + "post_attention_layernorm.weight"),
                "qkv": linear(
                    torch.cat([q, k, v]),
                    torch.cat([get(a + f"{m}_proj.bias") for m in "qkv"]) if qkv_bias else None,
                ),
                "o": linear(get(a + "o_proj.weight"), get(a + "o_proj.bias") if o_bias else None),
                "gate_up": linear(
                    torch.cat([get(p + "mlp.gate_proj.weight"), get(p + "mlp.up_proj.weight")])
                ),
                "down": linear(get(p + "mlp.down_proj.weight")),
            }
            self.layers.append(layer)
        handles.clear()
        inv, self.attn_scaling = rope_inv_freq(c)
        self.inv_freq = inv.to(device)
        self.q_size = c.num_heads * c.head_dim
        self.kv_size = c.num_kv_heads * c.head_dim

    def linears(self) -> list[PackedLinear]:
        return [self.lm_head] + [
            v for layer in self.layers for v in layer.values() if isinstance(v, PackedLinear)
        ]

    def nbytes(self) -> int:
        ts = {id(t): t for t in (self.embed, self.norm)}
        ts |= {id(t): t for layer in self.layers for t in layer.values() if isinstance(t, torch.Tensor)}
        for lin in self.linears():
            ts |= {id(t): t for t in lin.tensors()}  # a tied lm_head run by aten is the embedding itself
        return sum(t.numel() * t.element_size() for t in ts.values())

    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [T, 1, head_dim / 2]: HF's cat((freqs, freqs)) repeats the same half."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        cos = (freqs.cos() * self.attn_scaling).to(self.dtype)[:, None, :]
        sin = (freqs.sin() * self.attn_scaling).to(self.dtype)[:, None, :]
        return cos, sin

    @torch.inference_mode()
    def forward(self, b: ForwardBatch, kv: KVCache) -> torch.Tensor:
        """Returns float32 logits [len(b.logits_idx), vocab]."""
        c = self.cfg
        H, Hkv, d = c.num_heads, c.num_kv_heads, c.head_dim
        qs, ks = self.q_size, self.kv_size
        h = F.embedding(b.input_ids, self.embed)  # a fresh tensor: the residual stream is updated in place
        cos, sin = self._rope(b.positions)
        lora = b.lora
        if lora is not None:  # each token's adapter's embed_tokens (LoRA or copy), before any layer reads h
            lora.embed(b.input_ids, h)
        stale = _stale_slots(b, kv.k[0].shape[1]) if b.decode_idx is not None else None
        for li, L in enumerate(self.layers):
            x = _rms_norm(h, L["ln1"], c.rms_norm_eps)
            qkv = L["qkv"](x)
            if lora is not None:
                lora.apply(li, "qkv", x, qkv)
            _rotate_(qkv[:, : qs + ks].unflatten(1, (H + Hkv, d)), cos, sin)  # q and k heads in one pass
            q = qkv[:, :qs].unflatten(1, (H, d))
            k = qkv[:, qs : qs + ks].unflatten(1, (Hkv, d))
            v = qkv[:, qs + ks :].unflatten(1, (Hkv, d))
            kc, vc = kv.k[li], kv.v[li]
            kc.view(-1, Hkv, d).index_copy_(0, b.slot_mapping, k)
            vc.view(-1, Hkv, d).index_copy_(0, b.slot_mapping, v)
            if stale is not None:
                kc.view(-1, Hkv, d).index_fill_(0, stale, 0.0)
                vc.view(-1, Hkv, d).index_fill_(0, stale, 0.0)
            attn = self._attention(q, k, v, b, kc, vc)
            o = L["o"](attn)
            if lora is not None:
                lora.apply(li, "o", attn, o)
            h.add_(o)
            x = _rms_norm(h, L["ln2"], c.rms_norm_eps)
            gu = L["gate_up"](x)
            if lora is not None:
                lora.apply(li, "gate_up", x, gu)
            g, u = gu.chunk(2, dim=-1)
            m = F.silu(g).mul_(u)
            dn = L["down"](m)
            if lora is not None:
                lora.apply(li, "down", m, dn)
            h.add_(dn)
        h = _rms_norm(h.index_select(0, b.logits_idx), self.norm, c.rms_norm_eps)
        logits = self.lm_head(h)
        if lora is not None:  # each row is a sampled (or prompt-logprob) position: its own token's adapter
            lora.head(b.logits_idx, h, logits)
        return logits.float()

    def _attention(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        b: ForwardBatch,
        kc: torch.Tensor,
        vc: torch.Tensor,
    ) -> torch.Tensor:
        """q [T, H, d], k/v [T, Hkv, d] of this step (already in the cache too). SDPA gets 4-D inputs: 3-D
        ones with enable_gqa fall back to the unfused math path on CPU (~10x slower)."""
        c = self.cfg
        T = q.shape[0]
        out = torch.empty(T, c.num_heads, c.head_dim, dtype=q.dtype, device=q.device)
        win = c.sliding_window
        if b.decode_idx is not None:
            bt = b.decode_block_tables
            nb, bs = bt.shape[1], kc.shape[1]
            keys = kc[bt].view(bt.shape[0], nb * bs, c.num_kv_heads, c.head_dim)  # gathered: a copy
            vals = vc[bt].view(bt.shape[0], nb * bs, c.num_kv_heads, c.head_dim)
            pos = torch.arange(nb * bs, device=q.device)[None, :]
            lens = b.decode_ctx_lens[:, None]
            mask = pos < lens
            keys, vals = keys.transpose(1, 2), vals.transpose(1, 2)
            if win is not None:
                mask &= pos >= lens - win
            # A query head's group of heads sharing one KV head as that KV head's query rows ([Bd, Hkv, group,
            # d]): the same attention as enable_gqa with one query row, but CPU SDPA's flash kernel runs it 6-7x
            # faster in bf16 (1.3-1.7x in fp32) with the same error (load_tests/bench_attention.py).
            qd = q.index_select(0, b.decode_idx).view(bt.shape[0], c.num_kv_heads, -1, c.head_dim)
            o = F.scaled_dot_product_attention(qd, keys, vals, attn_mask=mask[:, None, None, :])
            out.index_copy_(0, b.decode_idx, o.view(bt.shape[0], c.num_heads, c.head_dim))
        for p in b.prefills:
            n = p.token_idx.shape[0]
            t0 = int(p.token_idx[0])
            # the batch builder lays a chunk's tokens side by side: slice instead of gather/scatter
            rows = slice(t0, t0 + n) if int(p.token_idx[-1]) == t0 + n - 1 else p.token_idx
            qp = q[rows].transpose(0, 1)[None]  # [1, H, n, d]
            if p.ctx_len == n:  # the whole sequence is this chunk: its K/V are the ones just computed
                keys, vals = k[rows].transpose(0, 1)[None], v[rows].transpose(0, 1)[None]
            else:
                keys = kc.index_select(0, p.block_ids).flatten(0, 1)[: p.ctx_len].transpose(0, 1)[None]
                vals = vc.index_select(0, p.block_ids).flatten(0, 1)[: p.ctx_len].transpose(0, 1)[None]
            if p.ctx_len == n and win is None:
                o = F.scaled_dot_product_attention(qp, keys, vals, is_causal=True, enable_gqa=True)
            else:
                qpos = torch.arange(p.ctx_len - n, p.ctx_len, device=q.device)[:, None]
                kpos = torch.arange(p.ctx_len, device=q.device)[None, :]
                mask = kpos <= qpos
                if win is not None:
                    mask &= kpos > qpos - win
                o = F.scaled_dot_product_attention(qp, keys, vals, attn_mask=mask, enable_gqa=True)
            out[rows] = o[0].transpose(0, 1)
        return out.flatten(1)
