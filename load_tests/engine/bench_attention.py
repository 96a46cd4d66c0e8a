"""Decode attention on CPU: SDPA with enable_gqa vs the grouped form the model uses, at workload W's shapes.
Run: ./run bench attention [--help]. Method and results: load_tests/engine/RESULTS.md."""

from __future__ import annotations

import argparse
import time
from functools import partial

import torch
import torch.nn.functional as F


def gqa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)


def grouped(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    B, H, _, d = q.shape
    Hkv = k.shape[1]
    return F.scaled_dot_product_attention(q.view(B, Hkv, H // Hkv, d), k, v, attn_mask=mask).view(B, H, 1, d)


def timed(f, iters: int) -> float:
    f()
    f()
    t = time.perf_counter()
    for _ in range(iters):
        f()
    return (time.perf_counter() - t) / iters * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--ctx", type=int, default=192)
    ap.add_argument("--iters", type=int, default=20)
    a = ap.parse_args()
    B, H, Hkv, d, L = a.batch, 32, 4, 64, a.ctx
    g = torch.Generator().manual_seed(0)
    print(
        f"decode attention, {B} rows x {H} heads ({Hkv} KV) x d {d}, context up to {L}, {torch.get_num_threads()} threads"
    )
    print("| dtype | SDPA enable_gqa ms | grouped ms | speed-up | err gqa | err grouped |")
    print("| --- | --- | --- | --- | --- | --- |")
    for dtype in (torch.float32, torch.bfloat16):
        q = torch.randn(B, H, 1, d, generator=g).to(dtype)
        k, v = (torch.randn(B, Hkv, L, d, generator=g).to(dtype) for _ in range(2))
        lens = torch.randint(L * 2 // 3, L + 1, (B, 1), generator=g)
        mask = (torch.arange(L)[None, :] < lens)[:, None, None, :]
        ref = F.scaled_dot_product_attention(
            q.double(), k.double(), v.double(), attn_mask=mask, enable_gqa=True
        )

        args = (q, k, v, mask)
        t_gqa, t_grouped = timed(partial(gqa, *args), a.iters), timed(partial(grouped, *args), a.iters)
        e_gqa = (gqa(*args).double() - ref).abs().max().item()
        e_grouped = (grouped(*args).double() - ref).abs().max().item()
        name = str(dtype).removeprefix("torch.")
        print(
            f"| {name} | {t_gqa:.2f} | {t_grouped:.2f} | {t_gqa / t_grouped:.1f}x | {e_gqa:.1e} | {e_grouped:.1e} |"
        )


if __name__ == "__main__":
    main()
