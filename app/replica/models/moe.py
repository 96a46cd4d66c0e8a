"""A mixture-of-experts MLP (Qwen3-MoE's, OLMoE's and Mixtral's sparse blocks) run grouped: one GEMM pair per
expert over its tokens.

Semantics (transformers' sparse blocks, in their order of operations so fp32 tokens agree):
  x [T, H] -> router logits x W_r^T (+ each token's adapter's router LoRA) [T, E] -> softmax in fp32
  -> top-k (values, experts) [T, k] -> (norm_topk_prob) values / their sum -> weights w [T, k]
  out[t] = sum_j w[t, j] * down_e(act(gate_e(x[t])) * up_e(x[t])),  e = experts[t, j]
summed into zeros in ascending expert order (HF's eager loop over experts; index_add_ per expert there, one
index_add_ per chunk of expert-sorted rows here: the same adds in the same order). The routing variants
(`Routing`): Qwen3-MoE and OLMoE renormalise the top-k as the config says and cast w to x's dtype; Mixtral always
renormalises and keeps w in fp32, so each expert's output is weighted in fp32 and rounded once (its
`current_hidden_states * top_k_weights` promotes, then `.to(dtype)`).

The (token, expert) pairs are sorted by expert once per layer (a stable argsort; bincount gives each expert's
run, read to the host once per layer). Per chunk of consecutive experts (all of them in a decode step; a prefill's
pairs cut so no temporary reaches 64 MiB, see CHUNK_BYTES) the tokens are gathered into that order with one
index_select, each expert's contiguous rows go through its gate_up and down projections, and the weighted rows are
scattered back with one index_add_ (a decode step's with the fused ops: fused.expert_combine_, the weighting and the
adds in one pass, the same roundings). The Python loop runs over the experts that got rows, never tokens.

The expert projections are plain F.linear on the 3-D weights' slices (transformers' arithmetic, bit for bit).
Given `linear` (the model's GEMM factory, app/replica/linear.py) and the fused CPU ops built, a decode step's
chunk (few rows per expert, every expert's weights read once) goes through fused.expert_matmul: one op per
projection over all the chunk's experts, streaming the dense weights with software prefetch into L2 (~30 GB/s of
the ~35 a 2-core Zen 4 reads); prefill stays per expert on aten (compute-bound, where that is as fast as
anything). Given `linear` without the fused ops, one PackedLinear per expert and projection, prepacked at load
(see _expert_linears).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from loraland_kernels import fused

from app.replica.linear import PackedLinear, Plan
from app.replica.models.norms import act_mul_

if TYPE_CHECKING:
    from app.replica.models.batch import LoraHook

# Called with each layer's top-k expert ids [T, k] when set (tests: which experts a batch reaches).
RouteHook = Callable[[torch.Tensor], None]
# (weight [out, in], bias) -> the prepacked linear (the model's factory; app/replica/models/layer.MakeLinear)
ExpertLinear = Callable[[torch.Tensor, torch.Tensor | None], PackedLinear]


@dataclass(frozen=True)
class Routing:
    """How a family turns the top-k router probabilities into weights: renormalised to sum to 1 or not, and
    kept in fp32 (Mixtral) or cast to the activations' dtype (Qwen3-MoE, OLMoE). Equal in fp32."""

    norm_topk_prob: bool
    fp32_weights: bool = False


MIXTRAL = Routing(norm_topk_prob=True, fp32_weights=True)


class MoE:
    """gate_up [E, 2*I, H] (gate rows first), down [E, H, I], router [E, H]. `routing`: a Routing, or a bool
    (norm_topk_prob with Qwen3-MoE's casts). `linear`: prepack each expert's two projections with it (None:
    F.linear on the weights' slices, transformers' arithmetic exactly)."""

    def __init__(
        self,
        router: torch.Tensor,
        gate_up: torch.Tensor,
        down: torch.Tensor,
        top_k: int,
        routing: Routing | bool,
        act: str,
        linear: ExpertLinear | None = None,
    ):
        E, two_i, H = gate_up.shape
        if router.shape != (E, H) or down.shape != (E, H, two_i // 2):
            raise ValueError(
                f"MoE weights disagree: router {tuple(router.shape)}, gate_up {tuple(gate_up.shape)}, "
                f"down {tuple(down.shape)} (want [E, H], [E, 2I, H], [E, H, I])"
            )
        gate_up, down = gate_up.contiguous(), down.contiguous()
        self.router, self.intermediate = router, two_i // 2
        self.routing = routing if isinstance(routing, Routing) else Routing(bool(routing))
        self.num_experts, self.top_k, self.act = E, top_k, act
        self.on_route: RouteHook | None = None
        self.packed: list[PackedLinear] = []
        # the engine's path on CPU with the fused ops built: dense experts, a decode step's expert GEMMs in one
        # op per projection (fused.expert_matmul), prefill's per expert by aten (as fast there as a packing)
        self.fused = (
            linear is not None
            and gate_up.dtype in (torch.float32, torch.bfloat16)
            and fused.enabled(gate_up.device)
        )
        if linear is None or self.fused:
            self.gate_up_runs = [_plain(gate_up[e]) for e in range(E)]
            self.down_runs = [_plain(down[e]) for e in range(E)]
            self.dense = [gate_up, down]
            return
        gu, dn = _expert_linears(linear, gate_up), _expert_linears(linear, down)
        self.gate_up_runs, self.down_runs, self.packed = gu, dn, gu + dn
        # experts run by aten read the dense weights (views of these tensors)
        self.dense = [w for w, lins in ((gate_up, gu), (down, dn)) if "aten" in lins[0].packed]

    def tensors(self) -> list[torch.Tensor]:
        """What the layer keeps resident: the router, the dense experts where a kernel reads them, the packings."""
        packs = [t for lin in self.packed for name, t in lin.packed.items() if name != "aten"]
        return [self.router, *self.dense, *packs]

    def route(
        self, x: torch.Tensor, lora: LoraHook | None = None, layer: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k], expert ids [T, k]) as transformers' TopKRouter of the family picks them. Router LoRA
        (PEFT's ParamWrapper on `mlp.gate.weight`: x (W + s B A)^T) is added to the logits, before the softmax."""
        logits = F.linear(x, self.router)
        if lora is not None:
            lora.apply(layer, "router", x, logits)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        top, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.routing.norm_topk_prob:
            top /= top.sum(dim=-1, keepdim=True)
        return (top if self.routing.fp32_weights else top.to(logits.dtype)), experts

    def __call__(self, x: torch.Tensor, lora: LoraHook | None = None, layer: int = 0) -> torch.Tensor:
        """x [T, H] -> [T, H], a fresh tensor (the caller adds it to the residual). With `lora`, each token's
        adapter's router LoRA is added to its logits, and each pair's adapter's expert deltas are added to the gate_up output (before the activation) and to the down output
        (before the routing weight) of every expert of a chunk at once, between per-expert GEMMs."""
        weights, experts = self.route(x, lora, layer)
        if self.on_route is not None:
            self.on_route(experts)
        T = x.shape[0]
        if lora is None:
            # pairs by expert; within one by top-k rank, then token: transformers' row order, so each GEMM sees
            # the rows where HF's does (a GEMM's rounding may depend on a row's place in its blocking)
            flat, ws = experts.t().flatten(), weights.t().flatten()
            order = torch.argsort(flat, stable=True)
            rows = order % T  # the token of each sorted pair
            pair_expert = None
        else:
            # by expert, then token: each pool's pairs in its virtual-slot order (app/replica/lora/experts.py)
            flat, ws = experts.flatten(), weights.flatten()
            order = torch.argsort(flat, stable=True)
            rows = order // self.top_k
            pair_expert = flat.index_select(0, order)
        ws = ws.index_select(0, order).unsqueeze(1)
        # one read to the host per layer: the per-expert row counts slice the sorted pairs (on CPU a plain
        # copy of E ints; the GEMM calls need them as Python ints whatever the device)
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        out = torch.zeros_like(x)
        width = max(x.shape[1], 2 * self.intermediate) * x.element_size()
        for chunk in _chunks(counts, max(1, CHUNK_BYTES // width)):
            lo, hi = chunk[0][1], chunk[-1][2]
            r = rows[lo:hi]
            xs = x.index_select(0, r)
            # the chunks in pair order: each row's adds in ascending expert order
            if lora is None and hi - lo > FEW_PAIRS:
                out.index_add_(0, r, self._experts(xs, chunk, lo, ws))
                continue
            ys = self._experts_at_once(xs, chunk, lo, lora, layer, pair_expert, r)
            if self.fused and hi - lo <= FEW_PAIRS:  # weighted and added in one pass, the same roundings
                fused.expert_combine_(out, ys, ws[lo:hi, 0], r)
            else:
                out.index_add_(0, r, ys.mul_(ws[lo:hi]))
        return out

    def _experts(self, xs: torch.Tensor, chunk: list[Span], lo: int, ws: torch.Tensor) -> torch.Tensor:
        """Expert by expert: each one's temporaries stay in cache (prefill)."""
        ys = torch.empty_like(xs)
        gate_up, down, act = self.gate_up_runs, self.down_runs, self.act
        for e, s, t in chunk:
            torch.mul(
                down[e](act_mul_(gate_up[e](xs[s - lo : t - lo]), act)), ws[s:t], out=ys[s - lo : t - lo]
            )
        return ys

    def _experts_at_once(
        self,
        xs: torch.Tensor,
        chunk: list[Span],
        lo: int,
        lora: LoraHook | None,
        layer: int,
        pair_expert: torch.Tensor | None,
        pair_token: torch.Tensor,
    ) -> torch.Tensor:
        """The gate_up GEMMs of every expert, then one activation over all the chunk's pairs, the down GEMMs
        (decode steps, where per-op costs add up): with the fused ops one op per projection for all the chunk's
        experts, else two per expert; the LoRA deltas of every expert's pairs together between the passes. The
        expert outputs come back unweighted (the caller weights them as it adds them up)."""
        spans = self._spans(chunk, lo) if self.fused and xs.shape[0] <= FEW_PAIRS else None
        gu = self._project(0, xs, chunk, lo, spans)
        if lora is not None:
            lora.apply_experts(layer, "gate_up", xs, pair_expert[lo : lo + xs.shape[0]], pair_token, gu)
        ms = act_mul_(gu, self.act)
        ys = self._project(1, ms, chunk, lo, spans)
        if lora is not None:
            lora.apply_experts(layer, "down", ms, pair_expert[lo : lo + xs.shape[0]], pair_token, ys)
        return ys

    @staticmethod
    def _spans(chunk: list[Span], lo: int) -> torch.Tensor:
        return torch.tensor([(e, s - lo, t - lo) for e, s, t in chunk], dtype=torch.long)

    def _project(
        self, which: int, a: torch.Tensor, chunk: list[Span], lo: int, spans: torch.Tensor | None
    ) -> torch.Tensor:
        """Every chunk expert's gate_up (which 0) or down (1) projection of its rows of a: one fused op over all
        of them (spans given: the dense weights streamed once) or one call per expert."""
        if spans is not None:
            return fused.expert_matmul(a, self.dense[which], spans)
        runs = self.down_runs if which else self.gate_up_runs
        return _cat([runs[e](a[s - lo : t - lo]) for e, s, t in chunk])


def _cat(parts: list[torch.Tensor]) -> torch.Tensor:
    return parts[0] if len(parts) == 1 else torch.cat(parts)


# (expert, first pair, end pair) in the expert-sorted pairs
Span = tuple[int, int, int]
# The largest [pairs, width] temporary of one chunk. glibc serves a thread's allocations of 64 MiB and more from a
# fresh mmap each time (a thread arena's heaps are 64 MiB at most), page-faulting every page on first touch; the
# engine's step runs on its own thread. A prefill of 4096 tokens, top-4, hidden 1024 in fp32 is exactly 64 MiB.
CHUNK_BYTES = 32 << 20
# Up to this many pairs (a decode step's few rows per expert) the base path runs each pass over the whole chunk
FEW_PAIRS = 1024


def _chunks(counts: list[int], max_pairs: int) -> list[list[Span]]:
    """The experts with rows, as runs of consecutive experts of at most max_pairs pairs together (an expert with
    more runs alone). Decode steps are one run."""
    runs: list[list[Span]] = []
    s = 0
    for e, n in enumerate(counts):
        if not n:
            continue  # an expert without rows costs nothing
        if not runs or s + n - runs[-1][0][1] > max_pairs:
            runs.append([])
        runs[-1].append((e, s, s + n))
        s += n
    return runs


def _plain(w: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda x: F.linear(x, w)


# the rows per expert a decode step brings (tens of sequences x top-k spread over tens of experts)
DECODE_ROWS = 4


def _expert_linears(linear: ExpertLinear, w: torch.Tensor) -> list[PackedLinear]:
    """One PackedLinear per expert of w [E, out, in], holding one packing. The experts are most of an MoE
    model's bytes: a plan that switches kernels by row count would keep two copies of each. The kernels differ
    where a step reads every expert for a few rows (2x on an AVX2 EPYC: weights streamed from memory, which the
    tuner's in-cache timing does not see) and tie at prefill sizes (compute-bound), so the experts keep the
    plan's kernel at DECODE_ROWS."""
    first = linear(w[0], None)
    kernels = first.plan.kernels
    if len(set(kernels)) == 1:
        return [first] + [linear(w[e], None) for e in range(1, w.shape[0])]
    plan = Plan.fixed(first.plan.kernel_for(DECODE_ROWS))
    return [PackedLinear(w[e], None, plan) for e in range(w.shape[0])]
