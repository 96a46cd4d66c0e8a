"""The benchmark model: TinyLlama width, 2 layers, random weights, and a 32000-word tokenizer (workload W)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch

# Where the benchmarks cache what they build (models, adapters), across runs.
CACHE = Path.home() / ".cache" / "loraland"
BENCH_MODEL = CACHE / "bench-tinyllama-2l"

TINYLLAMA_2L = dict(
    hidden_size=2048,
    intermediate_size=5632,
    num_hidden_layers=2,
    num_attention_heads=32,
    num_key_value_heads=4,
    vocab_size=32000,
    max_position_embeddings=2048,
)


# A random model of Llama-3.2-1B's shape (tied embeddings, llama3 rope scaling left out: same cost), the 1B row of
# load_tests/engine/bench_speed.py; stored in bf16 (2.5 GB), served in the dtype a run asks for.
LLAMA_1B = dict(
    hidden_size=2048,
    intermediate_size=8192,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
    vocab_size=128256,
    max_position_embeddings=4096,
    tie_word_embeddings=True,
    rope_theta=500000.0,
)


def build_bench_model(
    out_dir: Path, seed: int = 0, shape: dict | None = None, dtype: torch.dtype = torch.float32
) -> Path:
    """Random Llama model of `shape` (TinyLlama-width 2 layers by default) + word-level tokenizer, cached in
    out_dir."""
    shape = shape or TINYLLAMA_2L
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    out_dir = Path(out_dir)
    if (out_dir / "config.json").is_file() and (out_dir / "tokenizer.json").is_file():
        return out_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    vocab = {"<s>": 0, "</s>": 1, "<unk>": 2} | {f"w{i}": i for i in range(3, shape["vocab_size"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    ).save_pretrained(out_dir)
    cfg = transformers.LlamaConfig(bos_token_id=0, eos_token_id=1, **shape)
    cfg.architectures = ["LlamaForCausalLM"]
    torch.manual_seed(seed)
    with torch.device("cpu"):
        model = transformers.LlamaForCausalLM(cfg).to(dtype)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.02)
    model.save_pretrained(out_dir, safe_serialization=True)
    (out_dir / "loraland_bench.json").write_text(json.dumps({"seed": seed}))
    return out_dir


def bench_model() -> Path:
    """The bench model in its usual cache folder (built on first use)."""
    return build_bench_model(BENCH_MODEL)


def llama_1b_model() -> Path:
    """The random Llama-3.2-1B-shaped model (built on first use, ~1 min)."""
    return build_bench_model(CACHE / "bench-llama-1b", shape=LLAMA_1B, dtype=torch.bfloat16)


def workload_w(n: int = 64, prompt_len: int = 128, seed: int = 0, vocab: int = 32000) -> list[list[int]]:
    """n prompts of prompt_len random token ids (the peers were measured on the same shapes)."""
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(prompt_len)] for _ in range(n)]
