"""Triton SGMV shrink/expand (the CUDA path of kernels/loraland_kernels/lora.py). Imports triton: load it lazily.

Grid: (token tiles of the longest segment x output tiles, segments, split-K). A program owns one
[BLOCK_M, BLOCK_N] output tile of one segment, loops over the reduction dim in BLOCK_K steps and
accumulates in fp32; tiles past the end of a shorter segment exit at once. The slot of a segment is read
from seg_slot, so the pool size never matters (no empty-slot cost, no weight copies). Offsets into the
pools are int64 (S * in * r can pass 2**31). Any strides are accepted: z may be a column slice of a fused
shrink, y a column slice of a fused output.

Under TRITON_INTERPRET=1 these run on CPU tensors (fp32/fp16; the interpreter's bf16 tl.dot is wrong).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from loraland_kernels.segments import Segments


@triton.jit
def _shrink_kernel(
    x_ptr, a_ptr, z_ptr, seg_start_ptr, seg_len_ptr, seg_slot_ptr,
    N, K,
    stride_xm, stride_xk, stride_as, stride_ak, stride_an, stride_zm, stride_zn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    pid_mn, seg, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    n_tiles = tl.cdiv(N, BLOCK_N)
    pid_m, pid_n = pid_mn // n_tiles, pid_mn % n_tiles
    seg_len = tl.load(seg_len_ptr + seg)
    if pid_m * BLOCK_M >= seg_len:
        return
    start = tl.load(seg_start_ptr + seg).to(tl.int64)
    slot = tl.load(seg_slot_ptr + seg).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m, mask_n = offs_m < seg_len, offs_n < N
    rows = start + offs_m.to(tl.int64)
    x_base = x_ptr + rows[:, None] * stride_xm
    a_base = a_ptr + slot * stride_as + offs_n[None, :].to(tl.int64) * stride_an
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    # split-K: program pid_k takes every SPLIT_K-th K tile
    for k0 in range(pid_k * BLOCK_K, K, BLOCK_K * SPLIT_K):
        k = k0 + offs_k
        mask_k = k < K
        xt = tl.load(
            x_base + k[None, :].to(tl.int64) * stride_xk, mask=mask_m[:, None] & mask_k[None, :], other=0.0
        )
        at = tl.load(
            a_base + k[:, None].to(tl.int64) * stride_ak, mask=mask_k[:, None] & mask_n[None, :], other=0.0
        )
        xt = xt.to(at.dtype)
        if IEEE:
            acc += tl.dot(xt, at, input_precision="ieee")
        else:
            acc += tl.dot(xt, at)
    z_ptrs = z_ptr + rows[:, None] * stride_zm + offs_n[None, :].to(tl.int64) * stride_zn
    mask = mask_m[:, None] & mask_n[None, :]
    if SPLIT_K == 1:
        tl.store(z_ptrs, acc.to(z_ptr.dtype.element_ty), mask=mask)
    else:
        tl.atomic_add(z_ptrs, acc, mask=mask)  # z is an fp32 scratch buffer, zeroed by the caller


@triton.jit
def _expand_kernel(
    z_ptr, b_ptr, y_ptr, scale_ptr, bscale_ptr, bbias_ptr, seg_start_ptr, seg_len_ptr, seg_slot_ptr,
    N, K,
    stride_zm, stride_zk, stride_bs, stride_bk, stride_bn, stride_ym, stride_yn, stride_cs, stride_cn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    HAS_SCALE: tl.constexpr, HAS_BASE_SCALE: tl.constexpr, HAS_BASE_BIAS: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    pid_mn, seg = tl.program_id(0), tl.program_id(1)
    n_tiles = tl.cdiv(N, BLOCK_N)
    pid_m, pid_n = pid_mn // n_tiles, pid_mn % n_tiles
    seg_len = tl.load(seg_len_ptr + seg)
    if pid_m * BLOCK_M >= seg_len:
        return
    start = tl.load(seg_start_ptr + seg).to(tl.int64)
    slot = tl.load(seg_slot_ptr + seg).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m, mask_n = offs_m < seg_len, offs_n < N
    rows = start + offs_m.to(tl.int64)
    z_base = z_ptr + rows[:, None] * stride_zm
    b_base = b_ptr + slot * stride_bs + offs_n[None, :].to(tl.int64) * stride_bn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + offs_k
        mask_k = k < K
        zt = tl.load(
            z_base + k[None, :].to(tl.int64) * stride_zk, mask=mask_m[:, None] & mask_k[None, :], other=0.0
        )
        bt = tl.load(
            b_base + k[:, None].to(tl.int64) * stride_bk, mask=mask_k[:, None] & mask_n[None, :], other=0.0
        )
        zt = zt.to(bt.dtype)
        if IEEE:
            acc += tl.dot(zt, bt, input_precision="ieee")
        else:
            acc += tl.dot(zt, bt)
    if HAS_SCALE:
        acc *= tl.load(scale_ptr + slot).to(tl.float32)
    y_ptrs = y_ptr + rows[:, None] * stride_ym + offs_n[None, :].to(tl.int64) * stride_yn
    mask = mask_m[:, None] & mask_n[None, :]
    y = tl.load(y_ptrs, mask=mask, other=0.0).to(tl.float32)
    if HAS_BASE_SCALE:  # DoRA: the base output rescaled per column in the same pass (no extra read of y)
        cs = tl.load(bscale_ptr + slot * stride_cs + offs_n.to(tl.int64) * stride_cn, mask=mask_n, other=1.0)
        if HAS_BASE_BIAS:
            bb = tl.load(bbias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)
            y = (y - bb[None, :]) * cs.to(tl.float32)[None, :] + bb[None, :]
        else:
            y = y * cs.to(tl.float32)[None, :]
    tl.store(y_ptrs, (y + acc).to(y_ptr.dtype.element_ty), mask=mask)


def _check_grid(k_segs: int) -> None:
    if k_segs > 65535:  # CUDA's limit on grid axis 1
        raise ValueError(f"{k_segs} segments in one call: at most 65535; split the batch or the pool")


def _block(n: int, lo: int, hi: int) -> int:
    return max(lo, min(hi, triton.next_power_of_2(max(n, 1))))


def _block_m(seg: Segments) -> int:
    # decode segments hold ~1 token: the smallest tile tl.dot allows; prefill segments get bigger tiles
    return _block(seg.max_seg_len, 16, 64)


def shrink(x: torch.Tensor, A: torch.Tensor, seg: Segments, split_k: int | None = None) -> torch.Tensor:
    """Semantics: z[t] = x[t] @ A[s_t] for adapter tokens, z[t] = 0 where s_t = -1.

    x [T, in] (any strides), A [S, in, r] (any strides) -> z [T, r] in A's dtype, fp32 accumulation.
    split_k > 1 splits the in-dim across programs (fp32 atomics; for few short segments on a big GPU).
    """
    T, K = x.shape
    N = A.shape[2]
    k_segs = len(seg.slots)
    block_m, block_n, block_k = _block_m(seg), _block(N, 16, 64), _block(K, 16, 64)
    m_tiles, n_tiles = triton.cdiv(max(seg.max_seg_len, 1), block_m), triton.cdiv(N, block_n)
    if split_k is None:
        # enough programs to fill a GPU (~100+ SMs) when the batch is decode-only
        split_k = max(1, min(8, 128 // max(1, m_tiles * n_tiles * k_segs), triton.cdiv(K, block_k)))
    if split_k == 1:
        z = torch.zeros(T, N, dtype=A.dtype, device=x.device)
    else:
        z = torch.zeros(T, N, dtype=torch.float32, device=x.device)
    if k_segs:
        _check_grid(k_segs)
        grid = (m_tiles * n_tiles, k_segs, split_k)
        _shrink_kernel[grid](
            x, A, z, seg.seg_start, seg.seg_len, seg.seg_slot,
            N, K,
            x.stride(0), x.stride(1), A.stride(0), A.stride(1), A.stride(2), z.stride(0), z.stride(1),
            BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split_k, IEEE=A.dtype == torch.float32,
        )  # fmt: skip
    return z if z.dtype == A.dtype else z.to(A.dtype)


def expand(
    y: torch.Tensor,
    z: torch.Tensor,
    B: torch.Tensor,
    seg: Segments,
    scale: torch.Tensor | None = None,
    *,
    base_scale: torch.Tensor | None = None,
    base_bias: torch.Tensor | None = None,
) -> None:
    """Semantics: y[t] += scale[s_t] * (z[t] @ B[s_t]) in place for adapter tokens; rows with s_t = -1
    untouched; scale None means 1. With base_scale (DoRA), y[t] is first replaced by
    base_scale[s_t] * (y[t] - base_bias) + base_bias (base_bias None means 0), in the same pass.

    y [T, out], z [T, r], B [S, r, out], scale [S] or None, base_scale [S, out] (any strides) or None,
    base_bias [out] or None; any strides for y and z (column slices welcome).
    Computed in fp32 from B's dtype, stored in y's dtype.
    """
    K, N = B.shape[1], B.shape[2]
    k_segs = len(seg.slots)
    if not k_segs:
        return
    _check_grid(k_segs)
    if scale is not None:
        scale = scale.to(device=y.device, dtype=torch.float32).contiguous()
    if base_bias is not None:
        base_bias = base_bias.to(device=y.device, dtype=torch.float32).contiguous()
    cs = base_scale if base_scale is not None else B  # any tensor: the pointer is unused without the flag
    block_m, block_n, block_k = _block_m(seg), _block(N, 16, 128), _block(K, 16, 64)
    grid = (triton.cdiv(seg.max_seg_len, block_m) * triton.cdiv(N, block_n), k_segs)
    _expand_kernel[grid](
        z, B, y, scale if scale is not None else B, cs, base_bias if base_bias is not None else B,
        seg.seg_start, seg.seg_len, seg.seg_slot,
        N, K,
        z.stride(0), z.stride(1), B.stride(0), B.stride(1), B.stride(2), y.stride(0), y.stride(1),
        cs.stride(0), cs.stride(1) if cs.dim() > 1 else 0,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, HAS_SCALE=scale is not None,
        HAS_BASE_SCALE=base_scale is not None, HAS_BASE_BIAS=base_bias is not None,
        IEEE=B.dtype == torch.float32,
    )  # fmt: skip
