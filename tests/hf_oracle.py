"""HF transformers (+ PEFT) greedy references, the numeric oracle of every test."""

from __future__ import annotations

import torch


def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int, **kw) -> list[int]:
    ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
            **kw,
        )
    return out[0, len(prompt_ids) :].tolist()


def load_hf(model_dir):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
