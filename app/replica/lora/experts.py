"""LoRA on a mixture-of-experts model's experts: PEFT's `target_parameters` on the fused 3-D expert weights as
transformers 5 holds them (Qwen3-MoE: `mlp.experts.gate_up_proj` [E, 2I, H], `mlp.experts.down_proj` [E, H, I]).

PEFT's ParamWrapper on a 3-D parameter [E, out, in] keeps one lora_A [r*E, in] and one lora_B [out, r*E]; expert
e's factors are A_e = A.reshape(E, r, in)[e] and B_e = B.reshape(out, r, E)[:, :, e], and its weight becomes
W_e + scale * B_e A_e. Several targeted parameters of one module nest their wrappers in the module's parameter
order (gate_up_proj innermost): the saved keys are `experts.lora_A.weight` for the outermost,
`experts.base_layer.lora_A.weight` for the next, and so on. rank_pattern/alpha_pattern keys match the parameter's
full name (`model.layers.3.mlp.experts.gate_up_proj`), as PEFT matches them.

The router (`mlp.gate.weight` [E, H], a 2-D parameter of transformers 5's TopKRouter, not an nn.Linear) is a
target_parameters entry too (PEFT turns target_modules "gate" into "gate.weight"): its ParamWrapper saves
`mlp.gate.lora_A.weight` [r, H] and `lora_B.weight` [E, r] and computes x (W + s B A)^T. It is read as a linear's
LoRA on module ROUTER_MODULE (peft_format.py) and added to the router logits (app/replica/models/moe.py).

On the device an adapter slot s of a pool holds its experts as virtual slots e*cap + s of one tensor per (layer,
parameter): A [E*cap, in, r], B [E*cap, r, out] with the scale folded into B. The MoE forward hands its (token,
expert) pairs, sorted by expert and then token, to `apply_experts`; a pool's tokens are contiguous and in slot
order, so its pairs are already in virtual-slot order, and the grouped kernels (kernels/loraland_kernels/lora.py)
run over them in place.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from app.config.model_config import ROUTER_MODULE, ModelConfig
from app.replica.lora.peft_config import _pattern_value, refuse

if TYPE_CHECKING:
    import torch

# served parameters, in the order PEFT nests their wrappers (the module's parameter order), -> group name
EXPERT_PARAMS = {"gate_up_proj": "gate_up", "down_proj": "down"}

_EXPERT_KEY = re.compile(
    r"^(?:.*\.)?layers\.(?P<layer>\d+)\.mlp\.experts\.(?P<nest>(?:base_layer\.)*)lora_(?P<ab>A|B)"
    r"(?:\.[\w\-]+)?\.weight$"
)


_ROUTER_KEY = re.compile(
    r"^(?:.*\.)?layers\.(?P<layer>\d+)\.mlp\.gate\.lora_(?P<ab>A|B)(?:\.[\w\-]+)?\.weight$"
)


def is_expert_key(key: str) -> bool:
    return ".mlp.experts." in key


def is_router_key(key: str) -> bool:
    return _ROUTER_KEY.match(key) is not None


def _param_names(model: ModelConfig) -> list[str]:
    """Every parameter of the base model as PEFT's target_parameters sees it (full dotted names)."""
    names = ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"]
    for i in range(model.num_layers):
        p = f"model.layers.{i}."
        names += [p + f"self_attn.{m}.weight" for m in ("q_proj", "k_proj", "v_proj", "o_proj")]
        names += [p + "input_layernorm.weight", p + "post_attention_layernorm.weight"]
        if model.qk_norm:
            names += [p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight"]
        if model.is_moe and model.moe_layers[i]:
            names += [p + "mlp.gate.weight"] + [p + f"mlp.experts.{n}" for n in EXPERT_PARAMS]
        else:
            names += [p + f"mlp.{m}.weight" for m in ("gate_proj", "up_proj", "down_proj")]
    return names


def expert_shapes(model: ModelConfig) -> dict[str, tuple[int, int]]:
    """(in, out) of one expert's linear per served parameter."""
    H, Im = model.hidden_size, model.moe_intermediate_size
    return {"gate_up": (H, 2 * Im), "down": (Im, H)}


def expert_targets(
    folder: Path, cfg: dict[str, Any], model: ModelConfig
) -> dict[tuple[int, str], tuple[int, float]]:
    """(layer, "gate_up"|"down"|ROUTER_MODULE) -> (rank, scale) of every expert or router parameter
    `target_parameters` names; any other parameter it matches (a dense layer's or attention's 2-D weight, a
    norm, ...) is refused by name."""
    wanted = cfg.get("target_parameters")
    if not wanted:
        return {}
    if not isinstance(wanted, list) or not all(isinstance(t, str) and t for t in wanted):
        raise refuse(folder, f"target_parameters={wanted!r} must be a list of parameter names")
    for key in ("layers_to_transform", "exclude_modules"):
        if cfg.get(key) not in (None, [], ""):
            raise refuse(folder, f"{key} together with target_parameters is not supported; train without it")
    if cfg.get("use_dora"):
        raise refuse(folder, "use_dora=true with target_parameters: PEFT has no DoRA on raw parameters")
    names = _param_names(model)
    out: dict[tuple[int, str], tuple[int, float]] = {}
    for t in wanted:
        hits = [n for n in names if n == t or n.endswith("." + t)]
        if not hits:
            raise refuse(folder, f"target_parameters entry {t!r} matches no parameter of the base model")
        for n in hits:
            layer, _, rest = n.removeprefix("model.layers.").partition(".")
            param = rest.removeprefix("mlp.experts.")
            if rest == "mlp.gate.weight":
                group = ROUTER_MODULE
            elif rest.startswith("mlp.experts.") and param in EXPERT_PARAMS:
                group = EXPERT_PARAMS[param]
            else:
                raise refuse(
                    folder,
                    f"target_parameters entry {t!r} matches {n}: LoRA on raw parameters is served only on a "
                    f"mixture-of-experts model's experts ({', '.join('mlp.experts.' + p for p in EXPERT_PARAMS)}) "
                    "and router (mlp.gate.weight); target linears through target_modules instead",
                )
            r = int(_pattern_value(folder, cfg.get("rank_pattern") or {}, n, cfg["r"]))
            alpha = float(_pattern_value(folder, cfg.get("alpha_pattern") or {}, n, cfg["lora_alpha"]))
            out[(int(layer), group)] = (
                r,
                alpha / (math.sqrt(r) if cfg.get("use_rslora") else r),
            )
    return out


def read_expert_tensors(
    folder: Path,
    f: Any,
    model: ModelConfig,
    targets: dict[tuple[int, str], tuple[int, float]],
    read: Callable[[str], torch.Tensor],
) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    """(layer, group) -> (A [E, in, r], scale * B [E, r, out]) fp32, the pool's layout, from the file's expert
    keys; refused unless they are exactly the targets' lora_A/lora_B with PEFT's shapes. `read(key)`: the
    tensor as fp32, refused unless finite (peft_format's reader)."""
    order = list(EXPERT_PARAMS.values())
    found: dict[tuple[int, str, str], str] = {}
    for key in f.keys():
        if not is_expert_key(key):
            continue
        m = _EXPERT_KEY.match(key)
        layer = int(m["layer"]) if m else -1
        mine = sorted((g for lay, g in targets if lay == layer), key=order.index)
        depth = m["nest"].count("base_layer.") if m else 0
        if m is None or depth >= len(mine):
            raise refuse(
                folder,
                f"tensor {key} is not the lora_A/lora_B of an expert parameter that target_parameters names "
                "(mlp.experts.[base_layer.]lora_A|B.weight)",
            )
        found[(layer, mine[len(mine) - 1 - depth], m["ab"])] = key
    shapes, E = expert_shapes(model), model.num_experts
    out = {}
    for (layer, g), (r, scale) in sorted(targets.items()):
        n_in, n_out = shapes[g]
        ts = []
        for ab, want in (("A", [r * E, n_in]), ("B", [n_out, r * E])):
            key = found.get((layer, g, ab))
            if key is None:
                raise refuse(folder, f"no lora_{ab} for layer {layer}'s experts {g}: the file is incomplete")
            got = list(f.get_slice(key).get_shape())
            if got != want:
                raise refuse(
                    folder,
                    f"tensor {key} has shape {got}, expected {want} (r={r}, {E} experts, {g} is {n_in}->{n_out}): "
                    "the adapter does not fit this base model",
                )
            ts.append(read(key))
        a = ts[0].reshape(E, r, n_in).transpose(1, 2).contiguous()
        b = (ts[1].reshape(n_out, r, E).permute(2, 1, 0) * scale).contiguous()
        out[(layer, g)] = (a, b)
    if len(found) != 2 * len(targets):
        raise refuse(folder, "the file holds expert tensors target_parameters does not name")
    return out


class ExpertWeights:
    """One pool's expert LoRA for one (layer, parameter), expert-major: virtual slot e * cap + s holds adapter
    slot s's expert e. The MoE hands its pairs sorted by expert, then token, and a pool's tokens run in slot
    order, so its pairs come out in virtual-slot order without a sort."""

    def __init__(self, cap: int, experts: int, d_in: int, r: int, d_out: int, dtype, device):
        import torch

        self.E, self.cap = experts, cap
        self.A = torch.empty(experts * cap, d_in, r, dtype=dtype, device=device)
        self.B = torch.empty(experts * cap, r, d_out, dtype=dtype, device=device)

    def _by_expert(self, t: torch.Tensor) -> torch.Tensor:
        return t.view(self.E, self.cap, *t.shape[1:])

    def install(self, slot: int, a: torch.Tensor, b: torch.Tensor) -> None:
        """a [E, in, r], b [E, r, out] (scale folded in) into adapter slot `slot`."""
        self._by_expert(self.A)[:, slot].copy_(a)
        self._by_expert(self.B)[:, slot].copy_(b)

    def grow(self, cap: int) -> None:
        import torch

        for name in ("A", "B"):
            t = getattr(self, name)
            n = torch.empty(self.E * cap, *t.shape[1:], dtype=t.dtype, device=t.device)
            n.view(self.E, cap, *t.shape[1:])[:, : self.cap] = self._by_expert(t)
            setattr(self, name, n)
        self.cap = cap

    def nbytes_per_slot(self) -> int:
        return self.E * (self.A[0].numel() + self.B[0].numel()) * self.A.element_size()


def apply_experts(
    plans: list,
    cache: dict,
    layer: int,
    which: str,
    x_pairs: torch.Tensor,
    pair_expert: torch.Tensor,
    pair_token: torch.Tensor,
    out_pairs: torch.Tensor,
) -> None:
    """out_pairs[i] += scale * (x_pairs[i] A_{a,e}^T) B_{a,e}^T for pair i = (token pair_token[i], expert
    pair_expert[i]) whose token runs adapter a with LoRA on this layer's experts `which`. The pairs must come
    sorted by expert, then token (the MoE's LoRA order): each plan's pairs are then in virtual-slot order.

    Per plan, over its pairs: few pairs (a decode step) run the fused segment op over each (adapter, expert) run
    (the factors read once where they lie), or without the fused ops gather each pair's A and B and run two
    batched matmuls; many (a prefill) run the grouped kernels' shrink and expand over the virtual-slot segments.
    When the plan holds every pair (one pool, no base tokens: the common case) the delta is added in place, else
    the pairs are gathered and added back with one index_add_. cache[(layer, plan)] = (pair_token, sel, virtual
    slots, segments once built, spans once built): built by gate_up's call, reused by down's."""
    import torch
    from loraland_kernels import fused
    from loraland_kernels import lora as K

    for i, (pool, s, e, seg) in enumerate(plans):
        g = pool.expert_groups.get((layer, which))
        if g is None:
            continue
        hit = cache.get((layer, i))
        if hit is None or hit[0] is not pair_token:
            lo = s + seg.num_base
            sel = ((pair_token >= lo) & (pair_token < e)).nonzero().squeeze(1)
            if sel.numel() == pair_token.numel():
                sel = None  # every pair: no gather, no scatter
            tok, ex = (
                (pair_token, pair_expert)
                if sel is None
                else (t.index_select(0, sel) for t in (pair_token, pair_expert))
            )
            hit = cache[(layer, i)] = [
                pair_token,
                sel,
                ex * g.cap + seg.token_slot.index_select(0, tok - lo),
                None,
                None,
            ]
        _, sel, v, sub, spans = hit
        n = v.numel()
        if not n:
            continue
        x = x_pairs if sel is None else x_pairs.index_select(0, sel)
        few = n * (g.A[0].numel() + g.B[0].numel()) * g.A.element_size() <= GATHER_BYTES
        if few and K.fused_runs(x, g.A):
            # each (adapter, expert) run of pairs times its factors, read once in place (no per-pair copies)
            if spans is None:
                spans = hit[4] = K.run_spans(v)
            xa = x.to(g.A.dtype)
            d = fused.segment_matmul(xa if xa.stride(1) == 1 else xa.contiguous(), g.A, spans)
            d = fused.segment_matmul(d, g.B, spans).to(out_pairs.dtype)
            if sel is None:
                out_pairs.add_(d)
            else:
                out_pairs.index_add_(0, sel, d)
            continue
        if few:
            z = torch.bmm(x.to(g.A.dtype).unsqueeze(1), g.A.index_select(0, v))  # in the pool's dtype
            if sel is None and out_pairs.dtype == g.B.dtype and out_pairs.is_contiguous():
                out_pairs.unsqueeze(1).baddbmm_(z, g.B.index_select(0, v))
                continue
            d = torch.bmm(z, g.B.index_select(0, v)).squeeze(1).to(out_pairs.dtype)
            if sel is None:
                out_pairs.add_(d)
            else:
                out_pairs.index_add_(0, sel, d)
            continue
        if sub is None:
            sub = hit[3] = K.build_segments(v, g.E * g.cap)
        m = _method(sub, x.device)
        if sel is None:
            K.expand(out_pairs, K.shrink(x, g.A, sub, method=m), g.B, sub, method=m)
            continue
        d = torch.zeros(n, out_pairs.shape[1], dtype=out_pairs.dtype, device=out_pairs.device)
        K.expand(d, K.shrink(x, g.A, sub, method=m), g.B, sub, method=m)
        out_pairs.index_add_(0, sel, d)


# Up to this many bytes of A and B factors for the pairs of one call, the factors are gathered per pair and
# applied by two batched matmuls: ~6 ops, where building segments for the kernels costs ~20 small ones (decode,
# 128 pairs of the bench shape, both projections, cold: 1.6 vs 2.4 ms per layer). Past it (a prefill's thousands
# of pairs) the copies would cost more than the grouped kernels, which read each segment's factors once.
GATHER_BYTES = 16 << 20

# Virtual-slot segments (adapter x expert) are short and sparse in their span: a prefill chunk of 8192 pairs from 25
# adapters over 16 of 32 experts is 400 segments of ~20 pairs in a span of 784 slots. There the gather beats
# torch._grouped_mm (shrink + expand, gate_up of the bench shape: 40 vs 51 ms; on a captured engine chunk 17 vs 66
# ms for the shrink); one GEMM per segment wins only past ~128 pairs per segment (8192 pairs of one adapter: 42
# vs 32 ms).
GROUPED_MIN_MEAN = 128


def _method(seg, device) -> str | None:
    """The kernels' path for one pool's virtual-slot segments: their own choice on CUDA and for long segments,
    else the fused segment op (the gather where it is not built). The fused op against the gather on a prefill
    chunk of the bench shape (2,048 tokens, top-4, 50 r8 adapters, one layer's gate_up and down): bf16 70 -> 26 ms,
    fp32 53 -> 37 ms (2-core Zen 4)."""
    if device.type != "cpu" or seg.num_adapter_tokens >= GROUPED_MIN_MEAN * len(seg.slots):
        return None
    return "fused"


def check_expert_tensors(folder: Path, f: Any, cfg: dict[str, Any], max_rank: int) -> None:
    """What no base model is needed for (app/replica/lora/checks.py): expert (and router) keys in PEFT's
    ParamWrapper form, lora_A and lora_B at each nesting depth with matching r*E (router: r), finite values,
    ranks within max_rank."""
    import torch

    ranks = [cfg["r"], *(cfg.get("rank_pattern") or {}).values()]
    if max(ranks) > max_rank:
        raise refuse(folder, f"r={max(ranks)} (r/rank_pattern) exceeds the maximum rank {max_rank}")
    wanted = cfg.get("target_parameters") or []
    pairs: dict[tuple[int, int], dict[str, str]] = {}
    for key in f.keys():
        router = _ROUTER_KEY.match(key)
        if router is not None and wanted:
            pairs.setdefault((int(router["layer"]), -1), {})[router["ab"]] = key
            continue
        if not is_expert_key(key):
            continue
        m = _EXPERT_KEY.match(key)
        if m is None or not wanted or m["nest"].count("base_layer.") >= len(wanted):
            raise refuse(
                folder,
                f"tensor {key} is not the lora_A/lora_B of an expert parameter that target_parameters names "
                "(mlp.experts.[base_layer.]lora_A|B.weight)",
            )
        pairs.setdefault((int(m["layer"]), len(m["nest"])), {})[m["ab"]] = key
    for ab in pairs.values():
        if set(ab) != {"A", "B"}:
            raise refuse(
                folder, f"{next(iter(ab.values()))} has no matching lora_A/lora_B: the file is incomplete"
            )
        a, b = (list(f.get_slice(ab[x]).get_shape()) for x in "AB")
        if len(a) != 2 or len(b) != 2 or a[0] != b[1]:
            raise refuse(
                folder,
                f"tensors {ab['A']} {a} and {ab['B']} {b} do not pair (lora_A [r*E, in], lora_B [out, r*E])",
            )
        for x in "AB":
            if not torch.isfinite(f.get_tensor(ab[x]).to(torch.float64)).all():
                raise refuse(folder, f"tensor {ab[x]} holds NaN or inf values: the adapter is corrupt")
