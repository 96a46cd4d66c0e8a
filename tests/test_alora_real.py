"""Activated LoRA on the real model (SmolLM2-135M-Instruct, converted from its packaged GGUF): fp32 greedy tokens
identical to PEFT's aLoRA with the invocation at the start, in the middle, at the end, twice, cut short and absent,
in one batch with plain LoRA and base rows; and a checker asked about a conversation the base model answered
reuses that answer's KV blocks and still matches PEFT."""

from __future__ import annotations

import pytest
import torch

from loraland import LLMKernel
from tests.fixtures.adapters import make_peft_adapter, peft_model_with
from tests.fixtures.real_model import smollm2_folder
from tests.hf_oracle import hf_greedy
from tests.test_alora import make_alora

MAX_NEW = 8
INVOCATION = "<|im_start|>check\n"  # a checker's turn, as an aLoRA would be trained to see it
TEXTS = [
    "The capital of France is Paris, and it is known for the Eiffel Tower.",
    "Write a haiku about the sea.",
    "Water boils at 100 degrees Celsius at sea level.",
]


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """A 135M model's matmuls on a short prompt gain little from intra-op threads, and on a busy 2-core machine
    their spinning made each of PEFT's generate calls ~5x slower (restored after)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    folder = smollm2_folder()
    root = tmp_path_factory.mktemp("alora-real")
    k = LLMKernel(folder, dtype="float32", num_kv_blocks=256, max_model_len=1024)
    inv = k.tokenize(INVOCATION)
    adapters = {
        "chk": make_alora(folder, root / "chk", inv, seed=31, r=8, targets=("q_proj", "v_proj")),
        "plain": make_peft_adapter(folder, root / "plain", r=8, alpha=16, target_modules=["q_proj", "v_proj"],
                                   seed=32),
    }  # fmt: skip
    for name, path in adapters.items():
        k.load_adapter(name, path)
    yield k, inv, peft_model_with(folder, adapters)
    k.close()


def _prompts(k: LLMKernel, inv: list[int]) -> list[list[int]]:
    a, b, c = (k.tokenize(t) for t in TEXTS)
    return [
        inv + a,  # at the start
        a + inv + b,  # in the middle
        b + inv,  # at the end
        a + inv + c + inv + b,  # twice: the last occurrence activates
        c,  # absent: the base model's answer
        a + inv[:-1],  # cut short: absent too
    ]


def test_mixed_batch_matches_peft(case):
    k, inv, peft = case
    prompts = _prompts(k, inv)
    rows = (
        [(p, "chk") for p in prompts] + [(p, "plain") for p in prompts[:3]] + [(p, None) for p in prompts[:3]]
    )
    refs = [hf_greedy(peft, p, MAX_NEW, adapter_names=[a or "__base__"]) for p, a in rows]
    outs = k.complete([p for p, _ in rows], [a for _, a in rows], max_tokens=MAX_NEW, ignore_eos=True)
    assert [o.token_ids for o in outs] == refs
    assert [o.alora_activated for o in outs[: len(prompts)]] == [True] * 4 + [False] * 2
    # the adapter does change the answer once invoked, and is the base model without its invocation
    base = {tuple(p): r for (p, a), r in zip(rows, refs) if a is None}
    assert any(refs[i] != base[tuple(prompts[i])] for i in range(3))
    assert refs[4] == hf_greedy(peft, prompts[4], MAX_NEW, adapter_names=["__base__"])


def test_checker_reuses_the_base_answer_kv(case):
    k, inv, peft = case
    conv = k.tokenize(k.render_chat([{"role": "user", "content": TEXTS[0] + " " + TEXTS[2]}]))
    answer = k.complete([conv], [None], max_tokens=MAX_NEW, ignore_eos=True)[0].token_ids
    assert answer == hf_greedy(peft, conv, MAX_NEW, adapter_names=["__base__"])
    question = conv + answer + inv + k.tokenize("Is that answer correct?")
    before = k.stats().alora_kv.get("chk@1", (0, 0))
    out = k.complete([question], ["chk"], max_tokens=MAX_NEW, ignore_eos=True)[0]
    assert out.token_ids == hf_greedy(peft, question, MAX_NEW, adapter_names=["chk"])
    reused, prefilled = (x - y for x, y in zip(k.stats().alora_kv["chk@1"], before))
    bs = k.engine.cfg.block_size
    assert reused == (len(conv) + len(answer) - 1) // bs * bs  # the answer's last token was never fed
    assert prefilled == len(question) - reused
