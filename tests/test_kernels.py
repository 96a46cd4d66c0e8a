"""Grouped multi-LoRA kernels against kernels/loraland_kernels/reference.py: the CPU paths (gather, grouped, auto) and the
Triton SGMV kernels (TRITON_INTERPRET=1 on CPU tensors here; real CUDA when a GPU is present)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    # must be set before loraland_kernels.triton_sgmv decorates its kernels; lora.py imports it lazily
    os.environ["TRITON_INTERPRET"] = "1"

from loraland_kernels import lora as K  # noqa: E402
from loraland_kernels import reference as R  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TOL = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 3e-2}
POPULARITY = ["distinct", "uniform", "zipf", "identical"]
CPU_METHODS = ["fused", "gather", "grouped", "compact", None]


def slot_ids(popularity: str, T: int, S: int, n_base: int, gen: torch.Generator) -> torch.Tensor:
    """Sorted per-token slots for T tokens (the first n_base with no adapter) under a popularity law."""
    n = T - n_base
    if popularity == "distinct":  # every token its own adapter (decode with all-different adapters)
        assert n <= S
        ids = torch.randperm(S, generator=gen)[:n]
    elif popularity == "uniform":
        ids = torch.randint(0, S, (n,), generator=gen)
    elif popularity == "zipf":
        w = 1.0 / torch.arange(1, S + 1, dtype=torch.float64) ** 1.1
        ids = torch.randperm(S, generator=gen)[torch.multinomial(w, n, replacement=True, generator=gen)]
    elif popularity == "identical":
        ids = torch.full((n,), int(torch.randint(0, S, (1,), generator=gen)))
    else:
        raise ValueError(popularity)
    return torch.cat([torch.full((n_base,), -1), ids.sort().values])


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-6))


def pool(S: int, d_in: int, r: int, d_out: int, dtype, gen, device="cpu"):
    A = (torch.randn(S, d_in, r, generator=gen) / d_in**0.5).to(device, dtype)
    B = torch.randn(S, r, d_out, generator=gen).to(device, dtype)
    return A, B


def check_lora(method, dtype, ids, S, d_in, r, d_out, use_scale, gen, device="cpu"):
    """One shrink + expand against the reference, for z and y."""
    T = ids.numel()
    A, B = pool(S, d_in, r, d_out, dtype, gen, device)
    x = torch.randn(T, d_in, generator=gen).to(device, dtype)
    y = torch.randn(T, d_out, generator=gen).to(device, dtype)
    scale = (torch.rand(S, generator=gen) + 0.5).to(device) if use_scale else None
    seg = K.build_segments(ids.to(device), S)
    z_ref = R.shrink_ref(x.cpu(), A.cpu(), ids)
    y_ref = R.expand_ref(y.cpu(), z_ref, B.cpu(), ids, None if scale is None else scale.cpu())
    z = K.shrink(x, A, seg, method=method)
    assert z.shape == (T, r) and z.dtype == dtype
    assert rel_err(z.cpu(), z_ref) <= TOL[dtype]
    assert not z[ids < 0].any(), "tokens without an adapter must shrink to 0"
    y0 = y.clone()
    K.expand(y, z, B, seg, scale, method=method)
    assert rel_err(y.cpu(), y_ref) <= TOL[dtype]
    assert torch.equal(y[ids < 0], y0[ids < 0]), "tokens without an adapter must be left untouched"


def check_dora(method, dtype, ids, S, d_in, r, d_out, use_bias, gen, device="cpu"):
    """shrink + expand with a DoRA base rescale (base_scale per slot and column, a shared base_bias) against
    the reference; tokens without an adapter stay untouched."""
    T = ids.numel()
    A, B = pool(S, d_in, r, d_out, dtype, gen, device)
    x = torch.randn(T, d_in, generator=gen).to(device, dtype)
    y = torch.randn(T, d_out, generator=gen).to(device, dtype)
    base_scale = (torch.rand(S, d_out, generator=gen) + 0.5).to(device, dtype)
    bias = torch.randn(d_out, generator=gen).to(device, dtype) if use_bias else None
    seg = K.build_segments(ids.to(device), S)
    z_ref = R.shrink_ref(x.cpu(), A.cpu(), ids)
    y_ref = R.expand_ref(
        y.cpu(), z_ref, B.cpu(), ids, None, base_scale.cpu(), None if bias is None else bias.cpu()
    )
    y0 = y.clone()
    K.lora_linear_delta(y, x, A, B, seg, base_scale=base_scale, base_bias=bias, method=method)
    assert rel_err(y.cpu(), y_ref) <= TOL[dtype]
    assert torch.equal(y[ids < 0], y0[ids < 0]), "tokens without an adapter must be left untouched"


# ---------------------------------------------------------------------------------------------- CPU paths
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("method", CPU_METHODS, ids=str)
@pytest.mark.parametrize("popularity", POPULARITY)
@pytest.mark.parametrize("d_in,r,d_out", [(133, 7, 45), (64, 16, 96)])  # awkward / 16-byte aligned
def test_cpu_matches_reference(popularity, method, dtype, d_in, r, d_out):
    gen = torch.Generator().manual_seed(hash((popularity, d_in)) % 2**31)
    for T, n_base, use_scale in [(40, 0, False), (37, 5, True)]:
        check_lora(
            method, dtype, slot_ids(popularity, T, 48, n_base, gen), 48, d_in, r, d_out, use_scale, gen
        )


@pytest.mark.parametrize("method", CPU_METHODS + ["loop"], ids=str)
@pytest.mark.parametrize(
    "ids",
    [[3], [-1], [-1, -1, -1], [0, 1, 2, 3, 4, 5], [-1, 2, 2, 2, 2, 2, 2, 2, 2, 2, 5], []],
    ids=["one-token", "one-base-token", "all-base", "1-token-segments", "base-then-long", "empty"],
)
def test_cpu_edge_sizes(ids, method):
    gen = torch.Generator().manual_seed(1)
    ids = torch.tensor(ids, dtype=torch.int64)
    if ids.numel() == 0 or (ids < 0).all():  # nothing to compare against but zeros / an untouched y
        A, B = pool(8, 133, 4, 45, torch.float32, gen)
        x, y = torch.randn(ids.numel(), 133), torch.randn(ids.numel(), 45)
        seg = K.build_segments(ids, 8)
        z = K.shrink(x, A, seg, method=method)
        y0 = y.clone()
        K.expand(y, z, B, seg, method=method)
        assert z.shape == (ids.numel(), 4) and not z.any() and torch.equal(y, y0)
        return
    check_lora(method, torch.float32, ids, 8, 133, 4, 45, True, gen)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("method", CPU_METHODS + ["loop"], ids=str)
@pytest.mark.parametrize("popularity", POPULARITY)
def test_cpu_dora_rescale_matches_reference(popularity, method, dtype):
    gen = torch.Generator().manual_seed(hash((popularity, "dora")) % 2**31)
    for T, n_base, use_bias in [(30, 0, False), (37, 5, True)]:
        check_dora(method, dtype, slot_ids(popularity, T, 40, n_base, gen), 40, 64, 8, 48, use_bias, gen)


@pytest.mark.parametrize("method", CPU_METHODS, ids=str)
def test_cpu_dora_fp32_factors_on_bf16_outputs(method):
    """The pools keep f and the bias in fp32 whatever their dtype: bf16 outputs and pools, fp32 factors."""
    gen = torch.Generator().manual_seed(25)
    ids = slot_ids("zipf", 30, 12, 4, gen)
    A, B = pool(12, 64, 8, 40, torch.bfloat16, gen)
    x, y = torch.randn(30, 64, generator=gen).bfloat16(), torch.randn(30, 40, generator=gen).bfloat16()
    f, bias = torch.rand(12, 40, generator=gen) + 0.5, torch.randn(40, generator=gen)
    y_ref = R.expand_ref(y, R.shrink_ref(x, A, ids), B, ids, None, f, bias)
    K.lora_linear_delta(y, x, A, B, K.build_segments(ids, 12), base_scale=f, base_bias=bias, method=method)
    assert y.dtype == torch.bfloat16 and rel_err(y, y_ref) <= TOL[torch.bfloat16]


def test_dora_reference_is_peft_dora_linear():
    """The kernels' DoRA semantics (scale folded into B, base rescaled) equal PEFT's DoRA layer at eval."""
    from peft.tuners.lora.dora import DoraLinearLayer

    gen = torch.Generator().manual_seed(21)
    d_in, d_out, r, s = 24, 20, 4, 1.7
    base = torch.nn.Linear(d_in, d_out)
    with torch.no_grad():
        base.weight.copy_(torch.randn(d_out, d_in, generator=gen))
        base.bias.copy_(torch.randn(d_out, generator=gen))
    lora_A, lora_B = torch.nn.Linear(d_in, r, bias=False), torch.nn.Linear(r, d_out, bias=False)
    with torch.no_grad():
        lora_A.weight.copy_(torch.randn(r, d_in, generator=gen))
        lora_B.weight.copy_(torch.randn(d_out, r, generator=gen) * 0.3)
    dora = DoraLinearLayer(fan_in_fan_out=False)
    dora.update_layer(base_layer=base, lora_A=lora_A.weight, lora_B=lora_B.weight, scaling=s)
    with torch.no_grad():
        dora.weight.mul_(1 + 0.3 * torch.randn(d_out, generator=gen))  # a trained magnitude
        x = torch.randn(7, d_in, generator=gen)
        base_out = base(x)
        want = base_out + dora(
            x, lora_A=lora_A, lora_B=lora_B, scaling=s, base_layer=base, base_result=base_out
        )
        m, W, b = dora.weight, base.weight, base.bias
        torch.testing.assert_close(R.dora_linear_ref(x, W, b, lora_A.weight, lora_B.weight, s, m), want)
        # the pool's layout: one slot, B^T * scale * f, base_scale f, base_bias b
        f = m / torch.linalg.norm(W + s * lora_B.weight @ lora_A.weight, dim=1)
        ids = torch.zeros(7, dtype=torch.int64)
        y = base_out.clone()
        K.lora_linear_delta(
            y, x, lora_A.weight.t()[None], (lora_B.weight * s * f[:, None]).t()[None],
            K.build_segments(ids, 1), base_scale=f[None], base_bias=b,
        )  # fmt: skip
    torch.testing.assert_close(y, want)


def test_cpu_auto_rule():
    """Long (prefill) segments in fp32 take the grouped GEMM, over a compacted copy when the pool is sparse;
    decode-like batches and bf16 pools the gather. Each choice still matches the reference."""
    gen = torch.Generator().manual_seed(2)
    cases = [
        (torch.arange(4).repeat_interleave(64), 4, torch.float32, "grouped"),
        (
            torch.tensor([500] * 64 + [900] * 64),
            1000,
            torch.float32,
            "compact",
        ),  # 399 empty slots in the span
        (torch.arange(32), 64, torch.float32, "gather"),
        (
            torch.arange(4).repeat_interleave(64),
            4,
            torch.bfloat16,
            "gather",
        ),  # bf16 small GEMMs are slow on CPU
        (torch.tensor([7]), 8, torch.float32, "grouped"),  # one token, one adapter: a single GEMM
    ]
    for ids, S, dtype, want in cases:
        assert K.build_segments(ids, S).cpu_method(dtype) == want, (ids, S, dtype)
        check_lora(None, dtype, ids, S, 64, 16, 32, True, gen)


@pytest.mark.parametrize("method", ["fused", "gather", "grouped"])
def test_cpu_chunked_batches(monkeypatch, method):
    """Batches past the gather index cap / the expand chunk size are cut into token chunks: same result."""
    monkeypatch.setattr(K, "GATHER_MAX_INDEX", 64 * 5)  # 5 tokens per shrink chunk at in=64
    monkeypatch.setattr(K, "EXPAND_CHUNK_BYTES", 64 * 32 * 4)  # 64-row expand chunks at out=32, fp32
    gen = torch.Generator().manual_seed(13)
    for pop in ("uniform", "identical"):
        check_lora(method, torch.float32, slot_ids(pop, 150, 12, 7, gen), 12, 64, 8, 32, True, gen)


def test_cpu_mixed_dtypes_bf16_activations_fp32_pool():
    """bf16 activations with fp32 pools: computed in fp32, added into the bf16 output."""
    gen = torch.Generator().manual_seed(3)
    ids = slot_ids("zipf", 50, 16, 3, gen)
    A, B = pool(16, 64, 8, 40, torch.float32, gen)
    x = torch.randn(50, 64, generator=gen).bfloat16()
    y = torch.randn(50, 40, generator=gen).bfloat16()
    seg = K.build_segments(ids, 16)
    z = K.shrink(x, A, seg)
    assert z.dtype == torch.float32
    y_ref = R.expand_ref(y, R.shrink_ref(x, A, ids), B, ids)
    K.expand(y, z, B, seg)
    assert y.dtype == torch.bfloat16 and rel_err(y, y_ref) <= TOL[torch.bfloat16]


@pytest.mark.parametrize("dora", [False, True])
@pytest.mark.parametrize("method", ["fused", "gather", "grouped", "compact"])
def test_cpu_op_count_independent_of_adapter_count(method, dora):
    """The CPU paths issue the same ops for 2 adapters as for 60 (no per-adapter Python loop)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.n += 1
            return func(*args, **(kwargs or {}))

    gen = torch.Generator().manual_seed(4)
    A, B = pool(64, 64, 16, 32, torch.float32, gen)
    x, scale = torch.randn(120, 64), torch.rand(64)
    counts = []
    for ids in (
        torch.tensor([-1] * 4 + [3] * 60 + [9] * 56),
        torch.tensor([-1] * 4 + list(range(58)) * 2).sort().values,
    ):
        seg = K.build_segments(ids, 64)
        kw = {"base_scale": torch.rand(64, 32), "base_bias": torch.rand(32)} if dora else {}
        with Count() as c:
            z = K.shrink(x, A, seg, method=method)
            K.expand(torch.zeros(120, 32), z, B, seg, scale, method=method, **kw)
        counts.append(c.n)
    assert counts[0] == counts[1], counts


# ------------------------------------------------------------------------------- mixed ranks, fused q/k/v
def run_mixed_ranks(method, dtype, device, ranks, d_in, d_out, gen):
    """One batch split over several pools (one per rank), each on its own contiguous token range."""
    ranges, t = [], 0
    for i, r in enumerate(ranks):
        n = 3 + i % 4
        ids = slot_ids(["uniform", "zipf", "identical", "distinct"][i % 4], n, 6, 1 if i == 0 else 0, gen)
        ranges.append((t, t + n, ids, pool(6, d_in, r, d_out, dtype, gen, device)))
        t += n
    x = torch.randn(t, d_in, generator=gen).to(device, dtype)
    y = torch.zeros(t, d_out, dtype=dtype, device=device)
    y_ref = torch.zeros(t, d_out)
    for s, e, ids, (A, B) in ranges:
        seg = K.build_segments(ids.to(device), 6)
        K.lora_linear_delta(y[s:e], x[s:e], A, B, seg, method=method)
        y_ref[s:e] = R.lora_delta_ref(x[s:e].cpu(), A.cpu(), B.cpu(), ids)
    assert rel_err(y.cpu(), y_ref) <= TOL[dtype]


@pytest.mark.parametrize("method", CPU_METHODS, ids=str)
def test_cpu_mixed_ranks_one_batch(method):
    run_mixed_ranks(
        method,
        torch.float32,
        "cpu",
        [1, 2, 3, 4, 8, 13, 16, 32, 48, 64],
        133,
        45,
        torch.Generator().manual_seed(5),
    )


def run_fused_qkv(method, dtype, device, gen, use_scale):
    """One shrink over A_qkv [S, in, rq+rk+rv]; expand each projection from its z slice into its column
    slice of the fused q/k/v output, against three separate reference LoRAs."""
    S, d_in, ranks, outs = 10, 133, (5, 3, 8), (48, 16, 16)
    ids = slot_ids("zipf", 24, S, 4, gen)
    pools = [pool(S, d_in, r, o, dtype, gen, device) for r, o in zip(ranks, outs, strict=True)]
    scales = [(torch.rand(S, generator=gen) + 0.5).to(device) if use_scale else None for _ in ranks]
    A_qkv = torch.cat([A for A, _ in pools], dim=2)
    x = torch.randn(24, d_in, generator=gen).to(device, dtype)
    out = torch.randn(24, sum(outs), generator=gen).to(device, dtype)
    ref = out.cpu().float().clone()
    seg = K.build_segments(ids.to(device), S)
    z = K.shrink(x, A_qkv, seg, method=method)
    cols = [0, outs[0], outs[0] + outs[1], sum(outs)]
    ys = [out[:, cols[j] : cols[j + 1]] for j in range(3)]
    K.expand_sliced(ys, z, [B for _, B in pools], seg, scales, method=method)
    for j, (A, B) in enumerate(pools):
        sc = None if scales[j] is None else scales[j].cpu()
        ref[:, cols[j] : cols[j + 1]] += R.lora_delta_ref(x.cpu(), A.cpu(), B.cpu(), ids, sc)
    assert rel_err(out.cpu(), ref) <= TOL[dtype]


def run_fused_qkv_dora(method, dtype, device, gen):
    """The fused q/k/v expand with DoRA rescales: each projection's column slice gets its own base_scale
    and base_bias (a [S, out_j] and [out_j] slice), against separate references."""
    S, d_in, ranks, outs = 10, 133, (5, 3, 8), (48, 16, 16)
    ids = slot_ids("zipf", 24, S, 4, gen)
    pools = [pool(S, d_in, r, o, dtype, gen, device) for r, o in zip(ranks, outs, strict=True)]
    fs = [(torch.rand(S, o, generator=gen) + 0.5).to(device, dtype) for o in outs]
    bs = [torch.randn(o, generator=gen).to(device, dtype) for o in outs[:2]] + [None]
    A_qkv = torch.cat([A for A, _ in pools], dim=2)
    x = torch.randn(24, d_in, generator=gen).to(device, dtype)
    out = torch.randn(24, sum(outs), generator=gen).to(device, dtype)
    ref = out.cpu().float().clone()
    seg = K.build_segments(ids.to(device), S)
    z = K.shrink(x, A_qkv, seg, method=method)
    cols = [0, outs[0], outs[0] + outs[1], sum(outs)]
    ys = [out[:, cols[j] : cols[j + 1]] for j in range(3)]
    K.expand_sliced(ys, z, [B for _, B in pools], seg, base_scales=fs, base_biases=bs, method=method)
    for j, (A, B) in enumerate(pools):
        c = slice(cols[j], cols[j + 1])
        zj = R.shrink_ref(x.cpu(), A.cpu(), ids)
        b = None if bs[j] is None else bs[j].cpu()
        ref[:, c] = R.expand_ref(ref[:, c], zj, B.cpu(), ids, None, fs[j].cpu(), b)
    assert rel_err(out.cpu(), ref) <= TOL[dtype]


@pytest.mark.parametrize("method", CPU_METHODS, ids=str)
def test_cpu_fused_qkv_dora(method):
    run_fused_qkv_dora(method, torch.float32, "cpu", torch.Generator().manual_seed(22))


@pytest.mark.parametrize("method", CPU_METHODS, ids=str)
@pytest.mark.parametrize("use_scale", [False, True])
def test_cpu_fused_qkv_slices(method, use_scale):
    run_fused_qkv(method, torch.float32, "cpu", torch.Generator().manual_seed(6), use_scale)


# ------------------------------------------------------------------------------------------ validation
def test_build_segments_rejects_bad_slot_ids():
    with pytest.raises(ValueError, match="sorted"):
        K.build_segments(torch.tensor([2, 1]), 4)
    with pytest.raises(ValueError, match="sorted"):
        K.build_segments(torch.tensor([0, -1]), 4)  # -1 only at the start
    with pytest.raises(ValueError, match="num_slots"):
        K.build_segments(torch.tensor([0, 4]), 4)
    seg = K.build_segments(torch.tensor([-1, 1, 1, 3]), 4)
    assert (seg.num_base, seg.slots, seg.lens, seg.max_seg_len) == (1, [1, 3], [2, 1], 2)
    assert seg.seg_start.tolist() == [1, 3] and seg.offs.tolist() == [2, 2, 3]
    with pytest.raises(ValueError, match="tokens"):
        K.shrink(torch.randn(5, 8), torch.randn(4, 8, 2), seg)


def test_lora_module_does_not_import_triton():
    code = "import sys, loraland_kernels.lora; assert 'triton' not in sys.modules, 'triton imported eagerly'"
    subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, check=True, env={**os.environ, "PYTHONPATH": str(ROOT)}
    )


# --------------------------------------------------------------------- Triton (interpreter here; CUDA on GPU)
DEVICE = "cuda" if HAS_CUDA else "cpu"
TRITON_DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if HAS_CUDA else [])


@pytest.fixture(scope="module", autouse=False)
def triton_mod():
    from loraland_kernels import triton_sgmv

    if not HAS_CUDA:
        assert type(triton_sgmv._shrink_kernel).__name__ == "InterpretedFunction", (
            "triton was set up without TRITON_INTERPRET=1 before this module: run tests/test_kernels.py alone"
        )
    return triton_sgmv


@pytest.mark.parametrize("dtype", TRITON_DTYPES, ids=str)
@pytest.mark.parametrize("popularity", POPULARITY)
def test_triton_matches_reference(triton_mod, popularity, dtype):
    gen = torch.Generator().manual_seed(7)
    # awkward sizes: in 133, rank 7, out 45; tokens without adapter in the second case
    for T, n_base, r, use_scale in [(9, 0, 7, False), (12, 3, 16, True)]:
        check_lora(
            "triton", dtype, slot_ids(popularity, T, 10, n_base, gen), 10, 133, r, 45, use_scale, gen, DEVICE
        )


@pytest.mark.parametrize(
    "ids", [[4], [-1, -1, 0, 1, 2], [-1] + [3] * 40], ids=["one-token", "1-token-segs", "long"]
)
def test_triton_edge_sizes(triton_mod, ids):
    check_lora(
        "triton",
        torch.float32,
        torch.tensor(ids),
        6,
        133,
        1,
        45,
        True,
        torch.Generator().manual_seed(8),
        DEVICE,
    )


@pytest.mark.parametrize("split_k", [1, 3])
def test_triton_split_k(triton_mod, split_k):
    gen = torch.Generator().manual_seed(9)
    ids = slot_ids("uniform", 10, 6, 2, gen).to(DEVICE)
    A, _ = pool(6, 200, 5, 1, torch.float32, gen, DEVICE)
    x = torch.randn(10, 200, generator=gen).to(DEVICE)
    z = triton_mod.shrink(x, A, K.build_segments(ids, 6), split_k=split_k)
    assert rel_err(z.cpu(), R.shrink_ref(x.cpu(), A.cpu(), ids.cpu())) <= 1e-5


def test_triton_all_base_tokens(triton_mod):
    seg = K.build_segments(torch.tensor([-1, -1]).to(DEVICE), 4)
    A, B = pool(4, 16, 4, 8, torch.float32, torch.Generator().manual_seed(10), DEVICE)
    y = torch.ones(2, 8, device=DEVICE)
    z = K.shrink(torch.randn(2, 16, device=DEVICE), A, seg, method="triton")
    K.expand(y, z, B, seg, method="triton")
    assert not z.any() and bool((y == 1).all())


@pytest.mark.parametrize("dtype", TRITON_DTYPES, ids=str)
def test_triton_mixed_ranks_one_batch(triton_mod, dtype):
    run_mixed_ranks("triton", dtype, DEVICE, [1, 2, 8, 16, 33, 64], 40, 24, torch.Generator().manual_seed(11))


@pytest.mark.parametrize("dtype", TRITON_DTYPES, ids=str)
@pytest.mark.parametrize("use_scale", [False, True])
def test_triton_fused_qkv_slices(triton_mod, dtype, use_scale):
    run_fused_qkv("triton", dtype, DEVICE, torch.Generator().manual_seed(12), use_scale)


@pytest.mark.parametrize("dtype", TRITON_DTYPES, ids=str)
@pytest.mark.parametrize("popularity", ["distinct", "zipf"])
def test_triton_dora_rescale(triton_mod, popularity, dtype):
    gen = torch.Generator().manual_seed(23)
    for T, n_base, use_bias in [(9, 0, False), (12, 3, True)]:
        check_dora(
            "triton", dtype, slot_ids(popularity, T, 10, n_base, gen), 10, 40, 7, 45, use_bias, gen, DEVICE
        )


def test_triton_fused_qkv_dora(triton_mod):
    run_fused_qkv_dora("triton", torch.float32, DEVICE, torch.Generator().manual_seed(24))
