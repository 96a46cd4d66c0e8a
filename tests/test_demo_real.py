"""The demo's shipped adapters (app/demo/adapters/, trained on SmolLM2-135M-Instruct by
examples/train_adapters.py) do what they were trained to do, served by LLMKernel exactly as transformers + PEFT
run them: on 5 held-out examples per task, greedy fp32 tokens equal HF + PEFT's, each adapter answers >= 4 of 5
right and the base fewer. The full table (50 per task) is examples/eval_adapters.py's, in docs/models.md.
Gemma 3 270M (skipped unless its packages are installed): its own adapters, 3 examples each, and SmolLM2's
adapters refused on it."""

from __future__ import annotations

import json

import pytest

from app.demo import tasks as T
from app.demo.evaluate import KV_BLOCKS, evaluate
from app.demo.real_assets import ADAPTERS_DIR, LORA, shipped_adapters
from app.demo.smollm2 import available

pytestmark = pytest.mark.timeout(600)
N = 5


@pytest.fixture(scope="module")
def smollm2():
    why = available()
    if why is not None:
        pytest.skip(why)
    from app.demo.smollm2 import model_dir

    return model_dir()


@pytest.fixture(scope="module")
def results(smollm2):
    import torch

    from loraland import LLMKernel

    torch.set_num_threads(2)
    adapters = shipped_adapters()
    kernel = LLMKernel(
        str(smollm2), dtype="float32", max_adapters=4, max_batch_size=16, num_kv_blocks=KV_BLOCKS
    )
    try:
        for name, folder in adapters.items():
            kernel.load_adapter(name, folder)
        yield {r.task: r for r in evaluate(kernel, smollm2, adapters, N, say=lambda _: None)}
    finally:
        kernel.close()


def test_every_task_ships_a_small_peft_adapter():
    assert set(shipped_adapters()) == set(T.TASK_NAMES)
    for task in T.TASK_NAMES:
        folder = ADAPTERS_DIR / task
        cfg = json.loads((folder / "adapter_config.json").read_text())
        assert cfg["peft_type"] == "LORA" and cfg["r"] == LORA["r"]
        assert cfg["target_modules"] == sorted(LORA["target_modules"])
        assert (folder / "adapter_model.safetensors").stat().st_size < 2 * 1024 * 1024


def test_heldout_examples_are_never_trained_on():
    seen = {e.sentence for e in T.examples(4000, T.TRAIN_SEED)}
    held = T.eval_examples(50)
    assert len({e.sentence for e in held}) == 50 and not seen & {e.sentence for e in held}


@pytest.mark.parametrize("task", T.TASK_NAMES)
def test_adapter_matches_hf_peft_and_beats_the_base(results, task):
    r = results[task]
    assert r.agree == N, f"{task}: LLMKernel's greedy tokens equal HF+PEFT's on {r.agree}/{N}"
    assert r.adapter_correct >= 4, f"{task}: {r.adapter_correct}/{N} right; misses: {r.misses}"
    assert r.base_correct < r.adapter_correct, f"{task}: the base got {r.base_correct}/{N}"


# Gemma 3 270M (`loraland demo --model gemma3-270m`): its own adapters for the same tasks, through the demo's
# Gemma template (the packaged GGUF is the base model, with no template of its own); SmolLM2's are refused.
GEMMA_N = 3


@pytest.fixture(scope="module")
def gemma_kernel():
    from app.demo import gemma3

    why = gemma3.available()
    if why is not None:
        pytest.skip(why)
    import torch

    from loraland import LLMKernel

    torch.set_num_threads(2)
    folder = gemma3.model_dir()
    kernel = LLMKernel(
        str(folder),
        dtype="float32",
        max_adapters=4,
        max_batch_size=16,
        num_kv_blocks=64,
        chat_template=gemma3.CHAT_TEMPLATE,
    )
    try:
        yield folder, kernel
    finally:
        kernel.close()


def test_gemma_refuses_the_smollm2_adapters(gemma_kernel):
    from app.errors import InvalidAdapter

    _, kernel = gemma_kernel
    with pytest.raises(InvalidAdapter, match="this adapter is for a different base model"):
        kernel.load_adapter("person_json", ADAPTERS_DIR / "person_json")


def test_gemma_adapters_match_hf_peft_and_beat_the_base(gemma_kernel):
    from app.demo import gemma3

    folder, kernel = gemma_kernel
    try:
        adapters = shipped_adapters(gemma3.ADAPTERS_DIR)
    except FileNotFoundError:
        pytest.skip(
            f"no Gemma adapters under {gemma3.ADAPTERS_DIR} (examples/train_adapters.py --model gemma3-270m)"
        )
    for name, path in adapters.items():
        kernel.load_adapter(name, path)
    rows = evaluate(kernel, folder, adapters, GEMMA_N, say=lambda _: None, chat_template=gemma3.CHAT_TEMPLATE)
    for r in rows:
        assert r.agree == GEMMA_N, (
            f"{r.task}: LLMKernel's greedy tokens equal HF+PEFT's on {r.agree}/{GEMMA_N}"
        )
        assert r.adapter_correct >= GEMMA_N - 1, (
            f"{r.task}: {r.adapter_correct}/{GEMMA_N}; misses: {r.misses}"
        )
        assert r.base_correct < r.adapter_correct, f"{r.task}: the base got {r.base_correct}/{GEMMA_N}"
