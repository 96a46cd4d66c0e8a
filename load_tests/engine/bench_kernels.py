"""Per-call cost of grouped multi-LoRA on CPU: each candidate strategy, and the chosen one against the base
linear of the same layer.
Run: ./run bench kernels [--help]. Method and results: load_tests/engine/RESULTS.md."""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from loraland_kernels import lora as K


def timed(fn, budget_s: float = 0.15, min_reps: int = 3, max_reps: int = 200) -> float:
    t0 = time.perf_counter()
    fn()  # warm-up
    if time.perf_counter() - t0 > 2.0:  # hopeless candidate: one more call is enough to show it
        min_reps = 1
    times: list[float] = []
    t_end = time.perf_counter() + budget_s
    while len(times) < min_reps or (len(times) < max_reps and time.perf_counter() < t_end):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times) * 1e6


def make_slots(T: int, L: int, S: int, gen: torch.Generator) -> torch.Tensor:
    n_req = max(1, T // L)
    per_req = torch.randint(0, S, (n_req,), generator=gen)
    ids = per_req.repeat_interleave(L)[:T]
    if ids.numel() < T:
        ids = torch.cat([ids, ids[-1:].expand(T - ids.numel())])
    return ids.sort().values


LORA_METHODS = ("loop", "gm-span", "gm-comp", "gather", "chosen")  # handle mixed dtypes themselves


def candidates(seg: K.Segments, S: int):
    """name -> (shrink(x, A), expand(y, z, B)) closures for this batch."""
    counts = torch.zeros(S, dtype=torch.int64)
    counts[torch.tensor(seg.slots, dtype=torch.int64)] = torch.tensor(seg.lens)
    offs_full = counts.cumsum(0).to(torch.int32)
    present = torch.tensor(seg.slots, dtype=torch.int64)
    lmax = seg.max_seg_len
    # padded token index for bmm: [k, lmax] positions into the flat batch (pad rows point at token 0)
    pos = torch.zeros(len(seg.slots), lmax, dtype=torch.int64)
    valid = torch.zeros(len(seg.slots), lmax, dtype=torch.bool)
    s = 0
    for i, n in enumerate(seg.lens):
        pos[i, :n] = torch.arange(s, s + n)
        valid[i, :n] = True
        s += n
    flat_pos, flat_valid = pos.reshape(-1), valid.reshape(-1)

    def bmm(a, w):
        xp = a.index_select(0, flat_pos).view(len(seg.slots), lmax, -1)
        out = torch.bmm(xp, w.index_select(0, present))
        return out.reshape(-1, w.shape[2])[flat_valid]

    def expand_with(f):
        def run(y, z, B):
            y.add_(f(z, B))

        return run

    def method(m):
        return (lambda x, A: K.shrink(x, A, seg, method=m), lambda y, z, B: K.expand(y, z, B, seg, method=m))

    return {
        "loop": method("loop"),
        "gm-full": (
            lambda x, A: torch._grouped_mm(x, A, offs=offs_full),
            expand_with(lambda z, B: torch._grouped_mm(z, B, offs=offs_full)),
        ),
        "gm-span": method("grouped"),
        "gm-comp": method("compact"),
        "bmm": (bmm, expand_with(bmm)),
        "gather": method("gather"),
        "chosen": method(None),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smaller grid (a smoke run)")
    ap.add_argument("--in-dim", type=int, default=2048)
    ap.add_argument("--out-dim", type=int, default=2048)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    pools = [8, 64] if args.quick else [8, 64, 256, 1024]
    work = [(1, 1), (64, 1), (512, 128)]
    if not args.quick:
        work = [(1, 1), (64, 1), (64, 8), (512, 1), (512, 128), (8192, 128)]
    # (activation dtype, pool dtype): bf16 activations with fp32 pools is the mixed option lora.py supports
    dtypes = [
        (torch.float32, torch.float32),
        (torch.bfloat16, torch.bfloat16),
        (torch.bfloat16, torch.float32),
    ]
    names = ["loop", "gm-full", "gm-span", "gm-comp", "bmm", "gather", "chosen"]
    d_in, d_out, r = args.in_dim, args.out_dim, args.rank
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, in={d_in} out={d_out} r={r}; "
        "us per call (shrink + expand); ratio = chosen / base linear x @ W^T [T,in]x[in,out]"
    )
    hdr = f"{'act/pool':10s} {'S':>5s} {'T':>5s} {'L':>4s} {'k':>4s} " + " ".join(f"{n:>8s}" for n in names)
    print(hdr + f" {'base':>8s} {'ratio':>6s} {'pick':>7s}")
    base_us: dict[tuple, float] = {}  # the base linear does not depend on the pool
    for act, pdt in dtypes:
        for S in pools:
            A = torch.randn(S, d_in, r, generator=gen).to(pdt) / d_in**0.5
            B = torch.randn(S, r, d_out, generator=gen).to(pdt)
            for T, L in work:
                x = torch.randn(T, d_in, generator=gen).to(act)
                W = torch.randn(d_out, d_in, generator=gen).to(act)
                y = torch.zeros(T, d_out, dtype=act)
                seg = K.build_segments(make_slots(T, L, S, gen), S)
                row = []
                for name, (sh, ex) in candidates(seg, S).items():
                    xin = x if name in LORA_METHODS or act == pdt else x.to(pdt)
                    z = sh(xin, A).to(pdt)
                    yy = y if name in LORA_METHODS or act == pdt else y.to(pdt)
                    row.append(
                        timed(lambda sh=sh, xin=xin, A=A: sh(xin, A))
                        + timed(lambda ex=ex, yy=yy, z=z, B=B: ex(yy, z, B))
                    )
                if (act, T) not in base_us:
                    base_us[(act, T)] = timed(lambda x=x, W=W: F.linear(x, W))
                base = base_us[(act, T)]
                tag = f"{str(act)[6:]}/{str(pdt)[6:]}"
                print(
                    f"{tag:10s} {S:5d} {T:5d} {L:4d} {len(seg.slots):4d} "
                    + " ".join(f"{v:8.0f}" for v in row)
                    + f" {base:8.0f} {row[-1] / base:6.3f} {seg.cpu_method(pdt):>7s}",
                    flush=True,
                )


if __name__ == "__main__":
    main()
