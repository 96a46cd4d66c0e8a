"""Measuring the weather_tool adapter (app/demo/tool_task.py) as app/demo/evaluate.py measures the others: the
held-out weather questions (cities training never saw) through LLMKernel, base vs adapter, each answer judged
exactly (one Hermes block whose JSON is the call), and ours == transformers + PEFT (greedy tokens, fp32); then
the held-out questions the tool cannot answer, where a right answer makes no call. The prompts are the chats
with the tool as the server renders them (app/replica/chat.py)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from app.demo import tool_task as W
from app.demo.evaluate import TaskResult, end_ids, hf_greedy, kernel_greedy, strip_end

MAX_NEW_TOKENS = 48  # the longest call (Rio de Janeiro, fahrenheit) is 38 tokens, then <|im_end|>


@dataclass
class ToolResult:
    calls: TaskResult  # the weather questions
    other_n: int
    base_plain: int  # unrelated questions answered without a call, by the base
    adapter_plain: int  # ... and with the adapter

    def line(self) -> str:
        return (
            f"{W.TOOL_TASK} on {self.other_n} held-out questions the tool cannot answer (sums): no call from "
            f"the base on {self.base_plain}, from the adapter on {self.adapter_plain}"
        )


def prompt_ids(tok, q: W.Question) -> list[int]:
    """The question as a chat with the get_weather tool, rendered as the server renders it."""
    from app.replica.chat import render_chat

    text = render_chat(W.messages(q), tok, tools=[W.WEATHER_TOOL])
    return tok.encode(text, add_special_tokens=False)


def evaluate_tool(
    kernel, base_dir: Path, folder: Path, n: int, with_hf: bool = True, say=print
) -> ToolResult:
    """`n` held-out weather questions and n // 2 unrelated ones through the base and the adapter (loaded in
    `kernel` as W.TOOL_TASK)."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    tok = AutoTokenizer.from_pretrained(base_dir)
    decode = lambda ids: tok.decode(ids, skip_special_tokens=True)  # noqa: E731
    qs, others = W.eval_questions(n), W.other_questions(max(1, n // 2))
    prompts = [prompt_ids(tok, q) for q in qs]
    base = kernel_greedy(kernel, prompts, None, MAX_NEW_TOKENS)
    ours = kernel_greedy(kernel, prompts, W.TOOL_TASK, MAX_NEW_TOKENS)
    agree = 0
    if with_hf:
        eos = end_ids(GenerationConfig.from_pretrained(base_dir))
        hf = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()
        peft = PeftModel.from_pretrained(hf, folder, adapter_name=W.TOOL_TASK).eval()
        theirs = hf_greedy(peft, tok, prompts, MAX_NEW_TOKENS)
        agree = sum(strip_end(a, eos) == strip_end(b, eos) for a, b in zip(ours, theirs, strict=True))
    ok = [W.correct(decode(o), q) for o, q in zip(ours, qs, strict=True)]
    misses = [(q.text, decode(o)) for o, q, good in zip(ours, qs, ok, strict=True) if not good][:3]
    base_ok = sum(W.correct(decode(o), q) for o, q in zip(base, qs, strict=True))
    calls = TaskResult(W.TOOL_TASK, n, base_ok, sum(ok), agree, misses)
    say(calls.row())
    other_prompts = [prompt_ids(tok, q) for q in others]
    plain = [
        sum(W.correct(decode(o), q) for o, q in zip(kernel_greedy(kernel, other_prompts, a, 32), others))
        for a in (None, W.TOOL_TASK)
    ]
    result = ToolResult(calls, len(others), plain[0], plain[1])
    say(result.line())
    return result
