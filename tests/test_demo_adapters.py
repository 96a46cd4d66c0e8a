"""The demo's adapters do what they claim: exact on held-out inputs, measured through LLMKernel.

The assets come from `loraland demo-assets` (app/demo/assets.py): a build committed under app/demo/assets
if there is one, else built once into the cache (LORALAND_CACHE_DIR or ~/.cache/loraland; about three
minutes on two cores) and reused after."""

from __future__ import annotations

import json
import shutil

import pytest

from app.demo.assets import ADAPTER_TASKS, DemoSpec, build_tokenizer, check_assets, locate_assets
from app.demo.train import TASKS, TrainSpec, _batches, compose, heldout_inputs

SPEC = DemoSpec()
HELDOUT = heldout_inputs(SPEC.seed, 200, SPEC.data)
MIN_ACCURACY = 0.99


@pytest.fixture(scope="module")
def assets():
    return locate_assets()


@pytest.fixture(scope="module")
def kernel(assets):
    from loraland import LLMKernel

    # fp32: the exact path; the demo serves in whatever dtype the machine prefers.
    k = LLMKernel(str(assets / "base"), dtype="float32", max_batch_size=128, max_adapters=4)
    for task in ADAPTER_TASKS:
        k.load_adapter(task, assets / "adapters" / task)
    yield k
    k.close()


def _exact(kernel, model: str, fn) -> tuple[float, list[tuple[str, str, str]]]:
    outputs = kernel.infer(HELDOUT, [model] * len(HELDOUT), max_tokens=40)
    misses = [(x, fn(x), o) for x, o in zip(HELDOUT, outputs, strict=True) if o.strip() != fn(x)]
    return 1 - len(misses) / len(HELDOUT), misses


def test_tokenizer_frames_the_text_and_round_trips():
    tok = build_tokenizer()
    ids = tok.encode("hello world", add_special_tokens=False)
    assert tok.convert_ids_to_tokens(ids) == ["^", *"hello world", "="]  # one token per character
    assert ids[0] == tok.bos_token_id and ids[-1] == tok.sep_token_id
    assert tok.decode(ids, skip_special_tokens=True) == "hello world"
    # Whitespace around a prompt (curl's trailing newline) is not part of the input.
    assert tok.encode("  hello world\n", add_special_tokens=False) == ids
    assert tok.apply_chat_template([{"role": "user", "content": "ab cd"}], tokenize=False) == "ab cd"


def test_heldout_is_seeded_distinct_and_never_trained_on():
    assert HELDOUT == heldout_inputs(SPEC.seed, 200, SPEC.data)
    assert len(set(HELDOUT)) == 200
    assert all(1 <= len(x.split()) <= 4 and x.islower() for x in HELDOUT)
    tok = build_tokenizer()
    excluded = set(HELDOUT[:100])
    seen = set()
    stream = _batches(
        tok, TASKS["copy"], TrainSpec(steps=1, lr=1e-3, batch_size=64, seed=7), SPEC.data, excluded
    )
    for _ in range(40):
        ids, labels, _positions, _mask = next(stream)
        assert (labels != -100).any()
        for row in ids.tolist():  # a packed row holds several "^text=answer</s>" examples
            for example in tok.decode(row, skip_special_tokens=False).split("^")[1:]:
                seen.add(example.split("=")[0])
    assert len(seen) > 2000  # distinct inputs (short single words repeat)
    assert not (seen & excluded)


def test_assets_are_peft_folders_and_tamper_evident(assets, tmp_path):
    assert check_assets(assets) is None
    manifest = json.loads((assets / "manifest.json").read_text())
    assert set(manifest["adapters"]) == set(ADAPTER_TASKS)
    for task in ADAPTER_TASKS:
        cfg = json.loads((assets / "adapters" / task / "adapter_config.json").read_text())
        assert cfg["peft_type"] == "LORA" and cfg["r"] == SPEC.lora_rank
        assert cfg["target_modules"] == sorted(SPEC.lora_targets)
        assert (assets / "adapters" / task / "adapter_model.safetensors").is_file()
    copy = tmp_path / "demo"
    shutil.copytree(assets, copy)
    weights = copy / "adapters" / "upper" / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1] + b"\0")
    assert "changed" in check_assets(copy)
    assert "another spec" in check_assets(copy, DemoSpec(seed=SPEC.seed + 1))


@pytest.mark.parametrize("task", ADAPTER_TASKS)
def test_adapter_is_exact_on_heldout_through_kernel(kernel, task):
    acc, misses = _exact(kernel, task, TASKS[task])
    assert acc >= MIN_ACCURACY, f"{task}: {acc:.1%} exact; misses (input, want, got): {misses[:5]}"


def test_chain_equals_composition_of_functions(kernel):
    acc, misses = _exact(kernel, "reverse|upper", compose("reverse", "upper"))
    assert acc >= MIN_ACCURACY, f"reverse|upper: {acc:.1%} exact; misses (input, want, got): {misses[:5]}"


def test_merge_of_merge_ready_pair_equals_the_chain(kernel):
    """`upper` was trained beside `reverse` (DemoSpec.merge_ready): one forward with both deltas composes."""
    acc, misses = _exact(kernel, "reverse+upper", compose("reverse", "upper"))
    assert acc >= 0.97, f"reverse+upper: {acc:.1%} exact; misses (input, want, got): {misses[:5]}"


def test_base_copies_and_mixed_batches_match_single_adapter_batches(kernel):
    sample = HELDOUT[:24]
    ids = [None, *ADAPTER_TASKS] * 6
    mixed = kernel.infer(sample, ids, max_tokens=40)
    for adapter in set(ids):
        rows = [i for i, a in enumerate(ids) if a == adapter]
        alone = kernel.infer([sample[i] for i in rows], [adapter] * len(rows), max_tokens=40)
        assert [mixed[i] for i in rows] == alone
        fn = TASKS[adapter or "copy"]
        assert sum(mixed[i] == fn(sample[i]) for i in rows) >= len(rows) - 1


def test_hf_peft_oracle_agrees_with_kernel(assets, kernel):
    """transformers + PEFT load the same folders and decode the same greedy text."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(assets / "base")
    base = AutoModelForCausalLM.from_pretrained(assets / "base", dtype=torch.float32)
    model = PeftModel.from_pretrained(base, assets / "adapters" / "rot13").eval()
    texts = HELDOUT[:8]
    want = kernel.infer(texts, ["rot13"] * len(texts), max_tokens=40)
    with torch.no_grad():
        for text, w in zip(texts, want, strict=True):
            ids = torch.tensor([tok.encode(text, add_special_tokens=False)])
            out = model.generate(
                ids,
                max_new_tokens=40,
                do_sample=False,
                eos_token_id=tok.eos_token_id,
                pad_token_id=tok.pad_token_id,
            )
            assert tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True) == w


@pytest.mark.ray
@pytest.mark.timeout(400)
def test_loraland_demo_serves_live_results_and_stops_everything_on_ctrl_c(assets, tmp_path):
    """`loraland demo` as a user runs it (inside /work/shared/tools/offline: it starts Ray)."""
    import os
    import re
    import signal
    import subprocess
    import sys
    import time

    import openai
    import redis

    from app.catalog.redis_server import free_port

    port = free_port()
    log = tmp_path / "demo.log"
    env = {k: v for k, v in os.environ.items() if k != "LORALAND_REDIS_URL"}
    argv = [sys.executable, "-m", "app.cli", "demo", "--assets", str(assets), "--port", str(port)]
    with open(log, "w") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while "serving at" not in log.read_text():
            assert proc.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, "loraland demo did not come up:\n" + log.read_text()[-3000:]
            time.sleep(1)
        text = log.read_text()
        results = re.findall(r"^  (\S+) +-> '(.*)'(.*)$", text, re.M)
        assert [r[0] for r in results] == [
            "upper",
            "reverse",
            "rot13",
            "reverse|upper",
            "rot13|rot13",
            "reverse*1.0+upper*1.0",
        ]
        assert all(r[2].strip() == "ok" for r in results), text
        assert f"curl -s http://127.0.0.1:{port}/v1/completions" in text
        # The printed openai line's client, against the live server.
        client = openai.OpenAI(
            base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=60
        )
        got = client.completions.create(model="reverse|upper", prompt="make me loud", max_tokens=48)
        assert got.choices[0].text == "LOUD ME MAKE"
        chat = client.chat.completions.create(model="rot13", messages=[{"role": "user", "content": "hello"}])
        assert chat.choices[0].message.content == "uryyb"
    finally:
        os.kill(proc.pid, signal.SIGINT)
        try:
            rc = proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            raise
    text = log.read_text()
    assert rc == 0, text[-3000:]
    assert "stopped: Serve, Ray and the private Redis are down" in text
    url = re.search(r"private Redis for the catalog: (redis://\S+)", text).group(1)
    with pytest.raises(redis.ConnectionError):
        redis.Redis.from_url(url, socket_connect_timeout=1).ping()
    # Nothing the demo started outlives it (Ray's processes run in its session).
    time.sleep(2)
    left = subprocess.run(
        ["ps", "-o", "pid=,args=", "-s", str(proc.pid)], capture_output=True, text=True
    ).stdout
    assert not left.strip(), left
