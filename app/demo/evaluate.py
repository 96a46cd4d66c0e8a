"""Measuring the real demo's adapters: task accuracy through LLMKernel, base vs adapter, and agreement with
transformers + PEFT (greedy tokens, fp32). Used by examples/eval_adapters.py and tests/test_demo_real.py."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from app.demo import tasks as T

MAX_NEW_TOKENS = 32  # the longest target (person_json) is 23 tokens, then the end token
# 512 x 16 tokens of KV (46 KB a token on SmolLM2: ~380 MB): enough for 50 prompts at once. The default sizes the
# cache to 90% of free host memory, which a machine shared with other jobs cannot spare.
KV_BLOCKS = 512


@dataclass
class TaskResult:
    task: str
    n: int
    base_correct: int
    adapter_correct: int
    agree: int  # examples whose greedy tokens through LLMKernel equal HF + PEFT's
    misses: list[tuple[str, str]]  # (sentence, adapter's answer) for wrong answers, a few

    def row(self) -> str:
        return (
            f"| {self.task} | {self.base_correct}/{self.n} ({self.base_correct / self.n:.0%}) "
            f"| {self.adapter_correct}/{self.n} ({self.adapter_correct / self.n:.0%}) "
            f"| {self.agree}/{self.n} |"
        )


TABLE_HEADER = "| task | base (LLMKernel) | adapter (LLMKernel) | ours == HF+PEFT (greedy tokens) |\n| --- | --- | --- | --- |"


def prompt_ids(tok, sentence: str) -> list[int]:
    """The sentence as a chat through the tokenizer's template, ready for generation."""
    text = tok.apply_chat_template(T.chat(sentence), tokenize=False, add_generation_prompt=True)
    return tok.encode(text, add_special_tokens=False)


def kernel_greedy(
    kernel, prompts: list[list[int]], adapter: str | None, max_new: int = MAX_NEW_TOKENS
) -> list[list[int]]:
    """Greedy token ids through LLMKernel, all prompts in one shared batch."""
    done = kernel.complete(prompts, [adapter] * len(prompts), max_tokens=max_new, temperature=0.0)
    return [c.token_ids for c in done]


def hf_greedy(model, tok, prompts: list[list[int]], max_new: int = MAX_NEW_TOKENS) -> list[list[int]]:
    """Greedy token ids through transformers' generate, one prompt at a time (no padding to perturb the sums),
    stopping at the model's end token as the kernel does."""
    import torch

    eos = end_ids(model.generation_config)
    out = []
    with torch.no_grad():
        for ids in prompts:
            x = torch.tensor([ids])
            y = model.generate(
                x, max_new_tokens=max_new, do_sample=False, eos_token_id=eos, pad_token_id=eos[0]
            )
            out.append(y[0, len(ids) :].tolist())
    return out


def end_ids(generation_config) -> list[int]:
    """The model's end tokens (generation_config's eos_token_id: one id or a list)."""
    eos = generation_config.eos_token_id
    return [int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])]


def strip_end(ids: list[int], eos: list[int]) -> list[int]:
    """The tokens before the first end token (the kernel may or may not report the end token itself)."""
    for i, t in enumerate(ids):
        if t in eos:
            return ids[:i]
    return ids


def evaluate(
    kernel,
    base_dir: Path,
    adapters: dict[str, Path],
    n: int,
    with_hf: bool = True,
    say=print,
    chat_template: str | None = None,
) -> list[TaskResult]:
    """Every task's held-out examples (tasks.eval_examples, the first n) through the base and its adapter;
    chat_template replaces the tokenizer's (Gemma 3's base GGUF has none: app/demo/gemma3.py)."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    tok = AutoTokenizer.from_pretrained(base_dir)
    if chat_template is not None:
        tok.chat_template = chat_template
    exs = T.eval_examples(n)
    prompts = [prompt_ids(tok, e.sentence) for e in exs]
    decode = lambda ids: tok.decode(ids, skip_special_tokens=True)  # noqa: E731
    base_out = kernel_greedy(kernel, prompts, None)
    hf = None
    eos = end_ids(GenerationConfig.from_pretrained(base_dir))
    if with_hf:
        hf = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()
        eos = end_ids(hf.generation_config)
    results = []
    for task, folder in adapters.items():
        ours = kernel_greedy(kernel, prompts, task)
        agree = 0
        if hf is not None:
            peft = PeftModel.from_pretrained(hf, folder, adapter_name=task).eval()
            theirs = hf_greedy(peft, tok, prompts)
            agree = sum(strip_end(a, eos) == strip_end(b, eos) for a, b in zip(ours, theirs, strict=True))
            hf = peft.unload()  # the bare transformers model again, for the next adapter
        base_ok = sum(T.correct(task, decode(o), e) for o, e in zip(base_out, exs, strict=True))
        ok = [T.correct(task, decode(o), e) for o, e in zip(ours, exs, strict=True)]
        misses = [(e.sentence, decode(o)) for o, e, good in zip(ours, exs, ok, strict=True) if not good][:3]
        results.append(TaskResult(task, n, base_ok, sum(ok), agree, misses))
        say(results[-1].row())
    return results
