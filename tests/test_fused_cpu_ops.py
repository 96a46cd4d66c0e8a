"""The fused CPU ops (kernels/loraland_kernels/cpu/fused_ops.cpp) against the torch ops they replace: the same
results (fp32 to rounding of long sums, bf16 within one rounding), on odd shapes, GQA, windows, partial rotary,
and stale NaN slots that decode attention must never read; and the torch fallback when the library is off."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from loraland_kernels import cpu_build, fused

from app.replica.models.norms import RMSNorm, act_mul_
from app.replica.models.rope import rotate_

pytestmark = pytest.mark.skipif(not cpu_build.load(), reason=f"fused CPU ops not built: {cpu_build.reason()}")
DTYPES = [torch.float32, torch.bfloat16]


def _close(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype, ulps: float = 2e-6) -> None:
    tol = dict(rtol=ulps, atol=ulps) if dtype == torch.float32 else dict(rtol=1.6e-2, atol=1e-2)
    torch.testing.assert_close(a.float(), b.float(), **tol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("style", ["llama", "gemma"])
def test_rms_norm_and_the_residual_add(dtype, style):
    torch.manual_seed(0)
    x, delta = torch.randn(37, 200, dtype=dtype), torch.randn(37, 200, dtype=dtype)
    w = torch.randn(200, dtype=dtype)
    norm = RMSNorm(w, 1e-6, style)
    assert norm.fused
    ref = norm._torch(x)
    _close(norm(x), ref, dtype)
    h_ref, h = x.clone(), x.clone()
    h_ref.add_(delta)
    out = norm.add_norm(h, delta)
    assert torch.equal(h, h_ref)  # the residual stream is updated exactly as torch's add_ would
    _close(out, norm._torch(h_ref), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("act", ["silu", "gelu_pytorch_tanh"])  # GeLU runs torch's ops: checks the dispatch
def test_act_mul(dtype, act):
    torch.manual_seed(1)
    gu = torch.randn(19, 2 * 333, dtype=dtype) * 4
    g, u = gu.chunk(2, dim=-1)
    ref = (F.silu(g) if act == "silu" else F.gelu(g, approximate="tanh")) * u
    assert torch.equal(act_mul_(gu, act), ref)  # bit for bit: the same Sleef and libm calls, the same split


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rot_half", [32, 16])  # full rotary of head_dim 64, and a partial one (Phi-style)
def test_rope_and_cache_write(dtype, rot_half):
    torch.manual_seed(2)
    T, H, Hkv, d, bs = 11, 6, 2, 64, 4
    qkv = torch.randn(T, (H + 2 * Hkv) * d + 8, dtype=dtype)[:, : (H + 2 * Hkv) * d]  # strided rows
    pos = torch.arange(T).float()[:, None] * torch.rand(rot_half)
    cos, sin = pos.cos().to(dtype)[:, None, :], pos.sin().to(dtype)[:, None, :]
    slots = torch.randperm(12 * bs)[:T]
    kc, vc = torch.zeros(12, bs, Hkv, d, dtype=dtype), torch.zeros(12, bs, Hkv, d, dtype=dtype)
    ref = qkv.clone()
    rotate_(ref[:, : (H + Hkv) * d].unflatten(1, (H + Hkv, d)), cos, sin)
    fused.rope_cache_(qkv, H, Hkv, d, cos, sin, slots, kc, vc)
    assert torch.equal(qkv, ref)  # the same products and sums, each rounded as HF rounds them
    assert torch.equal(kc.view(-1, Hkv * d)[slots], ref[:, H * d : (H + Hkv) * d])
    assert torch.equal(vc.view(-1, Hkv * d)[slots], ref[:, (H + Hkv) * d :])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", [None, 5])
# d: AVX512's 64-column blocks (AVX2's where AVX512 is not built); 16-column rest (AVX2's 8-column one there);
# AVX2's path on an AVX512 machine; the generic loops
@pytest.mark.parametrize("d", [64, 80, 72, 36])
# query heads per KV head: 4 (one AVX512 tile), 3, 6 (tiles of 4 and 2), 1
@pytest.mark.parametrize("heads", [(8, 2), (9, 3), (12, 2), (4, 4)])
def test_decode_attention_reads_only_live_slots(dtype, window, d, heads):
    torch.manual_seed(3)
    (H, Hkv), bs, nblocks = heads, 4, 40
    kc = torch.randn(nblocks, bs, Hkv, d, dtype=dtype)
    vc = torch.randn(nblocks, bs, Hkv, d, dtype=dtype)
    lens = torch.tensor([1, 7, 16, 13])
    tables = torch.randperm(nblocks)[: 4 * len(lens)].view(len(lens), 4)  # each row its own blocks
    for b, n in enumerate(lens.tolist()):  # every slot past a row's length is poison
        for t in range(n, 4 * bs):
            kc[tables[b, t // bs], t % bs] = float("nan")
            vc[tables[b, t // bs], t % bs] = float("nan")
    T = 6
    decode_idx = torch.tensor([5, 0, 3, 2])  # rows of the flat batch, in any order
    q = torch.randn(T, H, d, dtype=dtype)
    out = torch.zeros(T, H * d, dtype=dtype)
    fused.decode_attention_(q, kc, vc, decode_idx, tables, lens, window, d**-0.5, out)
    for b, n in enumerate(lens.tolist()):
        start = 0 if window is None else max(0, n - window)
        slots = torch.tensor([int(tables[b, t // bs]) * bs + t % bs for t in range(start, n)])
        keys = kc.view(-1, Hkv, d)[slots].transpose(0, 1)[None]
        vals = vc.view(-1, Hkv, d)[slots].transpose(0, 1)[None]
        qr = q[decode_idx[b]][None, :, None, :]
        ref = F.scaled_dot_product_attention(qr.float(), keys.float(), vals.float(), enable_gqa=True)
        _close(out[decode_idx[b]], ref.reshape(-1), dtype)
    assert torch.equal(out[[1, 4]], torch.zeros(2, H * d, dtype=dtype))  # rows that do not decode: untouched


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", [None, 5])
def test_paged_attention_runs_prefills_as_rows_like_sdpa(dtype, window, monkeypatch):
    """paged_attention with the fused ops (one op call: decode rows, then every prefill token as a row whose
    context ends at its own position) against its SDPA path: a whole-prompt prefill, a chunk after a cached
    prefix (chunked prefill / prefix cache), a decode row, GQA, with and without a sliding window."""
    from app.replica.models import attention
    from app.replica.models.batch import ForwardBatch, PrefillAttn

    torch.manual_seed(6)
    H, Hkv, d, bs, nblocks = 6, 2, 32, 4, 24
    kc = torch.randn(nblocks, bs, Hkv, d, dtype=dtype)
    vc = torch.randn(nblocks, bs, Hkv, d, dtype=dtype)
    T = 1 + 9 + 6  # a decode row, a 9-token prompt, the last 6 tokens of a 14-token sequence
    q = torch.randn(T, H, d, dtype=dtype)
    blocks_a, blocks_b, blocks_c = torch.tensor([7, 2, 19]), torch.tensor([4, 11, 0]), torch.tensor([9, 13, 21, 5])

    def cached(blocks: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:  # a sequence's first n k, v
        slots = torch.tensor([int(blocks[t // bs]) * bs + t % bs for t in range(n)])
        return kc.view(-1, Hkv, d)[slots], vc.view(-1, Hkv, d)[slots]

    k = torch.empty(T, Hkv, d, dtype=dtype)
    v = torch.empty(T, Hkv, d, dtype=dtype)
    k[1:10], v[1:10] = cached(blocks_b, 9)
    k[10:], v[10:] = (t[8:] for t in cached(blocks_c, 14))
    b = ForwardBatch(
        input_ids=torch.zeros(T, dtype=torch.long), positions=torch.zeros(T, dtype=torch.long),
        slot_mapping=torch.zeros(T, dtype=torch.long), decode_idx=torch.tensor([0]),
        decode_block_tables=blocks_a[None], decode_ctx_lens=torch.tensor([11]),
        prefills=[PrefillAttn(torch.arange(1, 10), 9, blocks_b), PrefillAttn(torch.arange(10, 16), 14, blocks_c)],
        logits_idx=torch.tensor([0, 9, 15]),
    )  # fmt: skip
    got = attention.paged_attention(q, k, v, b, kc, vc, window, None)
    assert b.attention_rows is not None and b.attention_rows.rows.tolist() == list(range(T))
    monkeypatch.setattr(attention.fused, "enabled", lambda device: False)
    b.attention_rows = None
    want = attention.paged_attention(q, k, v, b, kc, vc, window, None)
    _close(got, want, dtype, ulps=1e-5)


def test_the_library_can_be_turned_off():
    """LORALAND_FUSED_CPU=0: nothing is built or loaded and the model's torch ops run."""
    code = (
        "from loraland_kernels import cpu_build, fused; import torch; "
        "from app.replica.models.norms import RMSNorm; "
        "assert not fused.enabled(torch.device('cpu')); assert not RMSNorm(torch.ones(4), 1e-6).fused; "
        "print(cpu_build.reason())"
    )
    env = {**os.environ, "LORALAND_FUSED_CPU": "0"}
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "LORALAND_FUSED_CPU=0" in r.stdout


@pytest.mark.parametrize("V", [49152, 37, 16, 1])
def test_greedy_rows_is_torch_argmax_and_flags_exactly_the_non_finite_rows(V):
    torch.manual_seed(4)
    x = torch.randn(12, V)
    x[1, 5 % V] = x[1, 3 % V] = float("nan")  # NaN is the maximum for torch.argmax: its first one
    x[2, 7 % V] = float("inf")
    x[3, :] = -float("inf")
    x[4, 11 % V] = -float("inf")
    x[5] = 0.0  # all tied: index 0
    x[6, V // 2] = x[6].max() + 1
    x[6, V - 1] = x[6, V // 2]  # a tie: the first wins
    x[7, V - 1] = float("nan")
    x[8] = torch.full((V,), 3e38)  # finite, though the row's sum is not
    out = fused.greedy_rows(x)
    assert torch.equal(out[:, 0], x.argmax(-1))
    assert torch.equal(out[:, 1].bool(), ~torch.isfinite(x).all(-1))


@pytest.mark.parametrize("dtype", DTYPES)
# a fused q,v shrink, an expand, rank-8 shrinks (the two-rows-per-vector path), odd sizes
@pytest.mark.parametrize("n, m", [(576, 48), (16, 576), (1024, 8), (33, 8), (7, 45), (33, 16), (1, 3)])
def test_segment_matmul_is_each_slots_matmul(dtype, n, m):
    """fused.segment_matmul: each span's rows times its slot's factors (fp32 sums), over spans of 1..9 rows (tiles
    of four and their rest), a strided a (a column slice of a fused shrink's z), slots in any order."""
    torch.manual_seed(5)
    S = 12
    w = torch.randn(S, n, m, dtype=dtype) / n**0.5
    lens, slots = [1, 9, 4, 2, 5, 3, 1], [3, 0, 11, 3, 7, 5, 10]
    P = sum(lens)
    a = torch.randn(P, n + 5, dtype=dtype)[:, 2 : 2 + n]
    ends = torch.tensor(lens).cumsum(0)
    spans = torch.stack([torch.tensor(slots), ends - torch.tensor(lens), ends], 1)
    out = fused.segment_matmul(a, w, spans)
    ref = torch.cat([a[s:e].float() @ w[slot].float() for slot, s, e in spans.tolist()])
    _close(out, ref.to(dtype), dtype, ulps=1e-5)
    # a row's answer does not depend on the rows around it (the same sums in the same order)
    alone = torch.cat([fused.segment_matmul(a[t : t + 1], w, torch.tensor([[slot, 0, 1]])) for slot, s, e in
                       spans.tolist() for t in range(s, e)])  # fmt: skip
    assert torch.equal(out, alone)
    # added into a column slice of a wider output, rounded as out.add_(product)
    y = torch.randn(P, m + 7, dtype=dtype)
    want = y.clone()
    want[:, 3 : 3 + m].add_(out)
    assert fused.segment_matmul(a, w, spans, y[:, 3 : 3 + m]) is not None
    assert torch.equal(y, want)


def test_segment_matmul_refuses_spans_that_do_not_tile_the_rows():
    w, a = torch.randn(4, 8, 16), torch.randn(5, 8)
    for bad in ([[0, 0, 2], [1, 3, 5]], [[0, 0, 2], [1, 2, 4]], [[4, 0, 5]], [[0, 1, 5]]):
        with pytest.raises(RuntimeError, match="segment_matmul"):
            fused.segment_matmul(a, w, torch.tensor(bad))
