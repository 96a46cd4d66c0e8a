"""BOS and the other special tokens of a prompt (issue 31): a raw text prompt (/v1/completions, LLMKernel's string
prompts, a chain's later stage) gets exactly the ids the model's HF tokenizer gives it with its default special
tokens (Gemma 3's adds <bos>, SmolLM2's nothing); a chat rendered through a template that writes the BOS gets no
second one, whether the replica renders it (prepare_prompts) or the caller does (kernel.render_chat's text).

Tiny tokenizers built here (the fixture model's vocabulary, with and without a BOS post-processor), then Gemma 3
270M's real one where its package is installed: ids equal to transformers', and a raw prompt's greedy tokens
equal to transformers' on the converted model (fp32)."""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path

import pytest

from loraland import LLMKernel
from tests.hf_oracle import hf_greedy, load_hf

TEXTS = ["hello world", "the quick brown fox", " 0123456789 + - * / =", ""]
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
CHAT = [{"role": "user", "content": "hello world"}]


def _model_with_tokenizer(src: Path, dst: Path, add_bos: bool) -> Path:
    """The fixture model under `dst` with its tokenizer made to add <s> in front (or not), and TEMPLATE."""
    from tokenizers import Tokenizer, processors
    from transformers import PreTrainedTokenizerFast

    shutil.copytree(src, dst)
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (dst / f).unlink(missing_ok=True)
    raw = Tokenizer.from_file(str(src / "tokenizer.json"))
    if add_bos:
        bos = raw.token_to_id("<s>")
        raw.post_processor = processors.TemplateProcessing(
            single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)]
        )
    fast = PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="<s>", eos_token="</s>")
    fast.chat_template = TEMPLATE
    fast.save_pretrained(dst)
    return dst


@pytest.fixture(scope="module", params=[True, False], ids=["adds-bos", "no-bos"])
def tiny(request, llama_dir, tmp_path_factory):
    from transformers import AutoTokenizer

    folder = _model_with_tokenizer(llama_dir, tmp_path_factory.mktemp("bos") / "m", request.param)
    with LLMKernel(folder, dtype="float32", max_batch_size=4, num_kv_blocks=64) as k:
        yield request.param, k, AutoTokenizer.from_pretrained(folder), folder


def test_raw_prompt_ids_are_the_hf_tokenizers(tiny):
    add_bos, k, hf_tok, _ = tiny
    bos = hf_tok.bos_token_id
    for text in TEXTS:
        want = hf_tok(text).input_ids
        assert k.tokenize(text) == want, text
        assert (want[:1] == [bos]) is add_bos  # the built tokenizer does what it says
    long = "hello world " * 360  # over LONG_PROMPT_CHARS: tokenized on a thread
    assert asyncio.run(k.tokenize_async(long)) == hf_tok(long).input_ids


def test_a_rendered_chat_has_one_bos(tiny):
    from app.protocol import ReplicaRequest
    from app.replica.prompts import prepare_prompts

    _, k, hf_tok, _ = tiny
    bos = hf_tok.bos_token_id
    text = k.render_chat(CHAT)
    assert text.startswith("<s>user: hello world")
    want = hf_tok(text, add_special_tokens=False).input_ids
    assert want.count(bos) == 1 and want[0] == bos
    # the caller rendered it (a raw prompt that starts with the BOS text), or the replica did (a chat request)
    assert k.tokenize(text) == want
    (served,) = asyncio.run(prepare_prompts(k, ReplicaRequest("r", messages=tuple(CHAT))))
    assert served.ids == want


def test_raw_prompt_greedy_equals_transformers(tiny):
    add_bos, k, hf_tok, folder = tiny
    hf = load_hf(folder)
    for text in TEXTS[:2]:
        got = k.complete([text], max_tokens=8, ignore_eos=True)[0].token_ids
        assert got == hf_greedy(hf, hf_tok(text).input_ids, 8), (add_bos, text)


# ---- Gemma 3 270M, whose tokenizer adds <bos> ---------------------------------------------------------------
@pytest.fixture(scope="module")
def gemma():
    from app.demo import gemma3

    why = gemma3.available()
    if why is not None:
        pytest.skip(why)
    return gemma3.model_dir()


def test_gemma_raw_prompts_match_transformers(gemma):
    from transformers import AutoTokenizer

    hf_tok = AutoTokenizer.from_pretrained(gemma)
    assert hf_tok("hello").input_ids[0] == hf_tok.bos_token_id  # Gemma's tokenizer adds <bos>
    texts = ["The capital of France is", "def fibonacci(n):", "Once upon a time, こんにちは"]
    with LLMKernel(gemma, dtype="float32", max_batch_size=4, num_kv_blocks=64) as k:
        for text in texts:
            assert k.tokenize(text) == hf_tok(text).input_ids, text
        chat = k.render_chat(CHAT) if k.tokenizer.chat_template else None
        got = [c.token_ids for c in k.complete(texts[:2], max_tokens=8, ignore_eos=True)]
    if chat is not None and chat.startswith(hf_tok.bos_token):
        assert hf_tok(chat, add_special_tokens=False).input_ids.count(hf_tok.bos_token_id) == 1
    hf = load_hf(gemma)
    for text, ours in zip(texts[:2], got):
        assert ours == hf_greedy(hf, hf_tok(text).input_ids, 8), text
    assert json.loads((gemma / "config.json").read_text())["architectures"][0].startswith("Gemma3")
