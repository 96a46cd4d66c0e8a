"""A real model end to end (issue 31): SmolLM2-135M-Instruct from its packaged GGUF, converted once and cached
in the HF cache dir. fp32 greedy tokens identical to transformers on chat prompts rendered by the model's own
template; streams equal to whole answers across multi-byte pieces; stops on generation_config's end tokens;
`--model` resolution and `--chat-template` on the tiny fixture model; clear errors for bad GGUF files."""

from __future__ import annotations

import asyncio
import json
import shutil
import struct
from pathlib import Path

import pytest

from app.replica.resources import generation_eos_ids, resolve_model_path
from loraland import LLMKernel
from tests.fixtures.real_model import smollm2_folder
from tests.hf_oracle import hf_greedy, load_hf

MAX_NEW = 16
QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three primary colors.",
    "What is 12 + 30?",
    "Translate 'good morning' into Spanish.",
    "Explain in one sentence what a CPU does.",
]
# answered greedily with Japanese text whose characters span several byte-level tokens
MULTIBYTE = ['Say "こんにちは" and nothing else.', "What does 日本 mean?"]


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    return smollm2_folder()


@pytest.fixture(scope="module")
def kernel(smollm2_dir):
    with LLMKernel(smollm2_dir, dtype="float32", max_batch_size=8, max_model_len=1024) as k:
        yield k


@pytest.fixture(scope="module")
def hf_model(smollm2_dir):
    return load_hf(smollm2_dir)


def chat(k: LLMKernel, question: str) -> str:
    return k.render_chat([{"role": "user", "content": question}])


def test_converted_folder_is_a_clean_checkpoint(smollm2_dir):
    cfg = json.loads((smollm2_dir / "config.json").read_text())
    assert "quantization_config" not in cfg and cfg["architectures"] == ["LlamaForCausalLM"]
    assert (smollm2_dir / "generation_config.json").is_file()
    assert list(smollm2_dir.glob("*.safetensors"))
    assert resolve_model_path("smollm2-135m") == smollm2_dir  # found again by the GGUF's hash, not converted


def test_chat_uses_the_models_template(kernel):
    text = chat(kernel, "hi")
    assert text.startswith("<|im_start|>system\n") and text.endswith(
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )


def test_greedy_tokens_identical_to_transformers(kernel, hf_model):
    prompts = [chat(kernel, q) for q in QUESTIONS]
    ours = kernel.complete(prompts, max_tokens=MAX_NEW, ignore_eos=True)
    for p, c in zip(prompts, ours):
        ids = kernel.tokenize(p)
        assert c.token_ids == hf_greedy(hf_model, ids, MAX_NEW), p


def test_stream_equals_whole_answer_across_multibyte_pieces(kernel):
    prompts = [chat(kernel, q) for q in MULTIBYTE]

    async def stream(prompt: str) -> list[str]:
        return [d.text async for d in kernel.generate(prompt, max_tokens=24)]

    wholes = kernel.complete(prompts, max_tokens=24)
    for prompt, whole in zip(prompts, wholes):
        pieces = asyncio.run(stream(prompt))
        assert "".join(pieces) == whole.text
        assert whole.text == kernel.tokenizer.decode(whole.token_ids, skip_special_tokens=True)
        assert "\ufffd" not in whole.text and not any("\ufffd" in p for p in pieces)
        partial = [t for t in whole.token_ids if "\ufffd" in kernel.tokenizer.decode([t])]
        assert partial, (
            f"no token of {whole.text!r} is a partial UTF-8 sequence: the stream was not exercised"
        )


def test_stops_on_the_generation_configs_end_token(kernel, hf_model, smollm2_dir):
    end = set(generation_eos_ids(smollm2_dir))
    assert kernel.tokenizer.convert_tokens_to_ids("<|im_end|>") in end <= kernel.engine.eos_ids
    prompt = chat(kernel, "Say hello.")
    c = kernel.complete([prompt], max_tokens=64)[0]
    ref = hf_greedy(hf_model, kernel.tokenize(prompt), 64)
    stop = next(i for i, t in enumerate(ref) if t in end)  # the model ends its turn well before 64 tokens
    # the end token is the answer's last id (as vLLM reports it), not part of its text
    assert c.finish_reason == "stop" and c.token_ids == ref[: stop + 1] and stop < 63
    assert c.text == kernel.tokenizer.decode(ref[:stop])


def test_generation_config_end_tokens_stop_a_tiny_model(llama_dir, tmp_path):
    """A generation_config.json listing several end tokens stops on each: the tiny model's first greedy token
    made an end token ends the answer at once."""
    with LLMKernel(llama_dir, dtype="float32", max_batch_size=2) as k:
        first = k.complete(["hello world"], max_tokens=4, ignore_eos=True)[0].token_ids[0]
    folder = tmp_path / "model"
    shutil.copytree(llama_dir, folder)
    eos = k.tokenizer.eos_token_id
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [eos, first]}))
    assert generation_eos_ids(folder) == (eos, first)
    with LLMKernel(folder, dtype="float32", max_batch_size=2) as k:
        assert first in k.engine.eos_ids
        c = k.complete(["hello world"], max_tokens=4)[0]
    assert (c.finish_reason, c.token_ids, c.text) == ("stop", [first], "")


def test_chat_template_override(llama_dir, tmp_path):
    tpl = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}<assistant>"
    path = tmp_path / "t.jinja"
    path.write_text(tpl)
    msgs = [{"role": "user", "content": "hi"}]
    for value in (tpl, str(path)):
        with LLMKernel(llama_dir, dtype="float32", max_batch_size=2, chat_template=value) as k:
            assert k.render_chat(msgs) == "<user>hi<assistant>"
    with pytest.raises(ValueError, match="neither a readable file"):
        LLMKernel(llama_dir, dtype="float32", chat_template=str(tmp_path / "missing.jinja"))


def test_serve_reads_the_chat_template_file(tmp_path):
    from app.cli.serve import _chat_template

    path = tmp_path / "t.jinja"
    path.write_text("{{ messages[-1]['content'] }}")
    assert _chat_template(str(path)) == "{{ messages[-1]['content'] }}"
    assert _chat_template("{{ x }}") == "{{ x }}" and _chat_template(None) is None
    with pytest.raises(SystemExit, match="--chat-template"):
        _chat_template(str(tmp_path / "missing.jinja"))


def _gguf(path: Path, kv: dict[str, str], version: int = 3) -> Path:
    def s(x: str) -> bytes:
        b = x.encode()
        return struct.pack("<Q", len(b)) + b

    body = b"".join(s(k) + struct.pack("<I", 8) + s(v) for k, v in kv.items())
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", version, 0, len(kv)) + body)
    return path


def test_bad_gguf_files_are_clear_errors(tmp_path):
    junk = tmp_path / "model.gguf"
    junk.write_bytes(b"<html>not found</html>")
    with pytest.raises(ValueError, match="is not a GGUF file"):
        resolve_model_path(junk)
    with pytest.raises(ValueError, match="no such file"):
        resolve_model_path(tmp_path / "missing.gguf")
    with pytest.raises(ValueError, match="architecture 'bert' is not served.*llama"):
        resolve_model_path(_gguf(tmp_path / "bert.gguf", {"general.architecture": "bert"}))
    cut = _gguf(tmp_path / "cut.gguf", {"general.architecture": "llama"})
    cut.write_bytes(cut.read_bytes()[:30])
    with pytest.raises(ValueError, match="truncated or damaged"):
        resolve_model_path(cut)
    with pytest.raises(ValueError, match="does not exist"):
        resolve_model_path(str(tmp_path / "nothing-here"))
