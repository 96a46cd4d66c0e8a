"""The training child process of assets.build_assets: `python -m app.demo.build TMP SPEC_JSON`.

Trains the base model to copy, then each adapter on its task, and writes the HF and PEFT folders plus the
build report into TMP; the parent hashes them into the manifest and moves TMP into place."""

from __future__ import annotations

import dataclasses
import json
import sys
import warnings
from pathlib import Path

from app.demo.assets import BASE_NAME, DESCRIPTIONS, REPORT, DemoSpec, build_tokenizer
from app.demo.train import ADAPTER_TASKS, TASKS, compose


def _train_all(tmp: Path, spec: DemoSpec, say=print) -> dict:
    """Train the base and every adapter into `tmp` (run in a child process, see build_assets)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    from app.demo.train import Objective, greedy_accuracy, heldout_inputs, train

    warnings.filterwarnings("ignore", category=FutureWarning)  # PEFT calling transformers' deprecated names
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    torch.set_num_threads(spec.threads)
    tok = build_tokenizer(tmp / "base")
    heldout = heldout_inputs(spec.seed, spec=spec.data)
    exclude = set(heldout)
    cfg = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_heads,
        max_position_embeddings=spec.max_position_embeddings,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        tie_word_embeddings=False,
    )
    cfg.architectures = ["LlamaForCausalLM"]
    report: dict = {"train": {}, "heldout_accuracy_hf": {}}
    torch.manual_seed(spec.seed)
    model = LlamaForCausalLM(cfg)
    say(f"base model: {sum(p.numel() for p in model.parameters()):,} parameters, trained to copy its input")
    report["train"]["base"] = dataclasses.asdict(
        train(model, tok, [Objective(TASKS["copy"])], spec.base, exclude, spec.data, say)
    )
    model.save_pretrained(tmp / "base", safe_serialization=True)
    lora = LoraConfig(
        r=spec.lora_rank,
        lora_alpha=spec.lora_alpha,
        target_modules=list(spec.lora_targets),
        lora_dropout=0.0,
        bias="none",
        task_type="CAUSAL_LM",
    )
    # An adapter trained beside another comes after it.
    order = sorted(ADAPTER_TASKS, key=lambda t: t in spec.merge_ready)
    for task in order:
        torch.manual_seed(spec.seed + 1 + ADAPTER_TASKS.index(task))
        peft_model = get_peft_model(LlamaForCausalLM.from_pretrained(tmp / "base"), lora)
        say(
            f"adapter {task!r} ({DESCRIPTIONS[task]}): LoRA r={spec.lora_rank} on {len(spec.lora_targets)} modules"
        )
        objectives = [Objective(TASKS[task], lambda m=peft_model: _activate(m, ["default"]))]
        if (partner := spec.merge_ready.get(task)) is not None:
            say(
                f"  also trained beside {partner!r} so that the merge '{partner}+{task}' = '{partner}|{task}'"
            )
            peft_model.load_adapter(tmp / "adapters" / partner, adapter_name=partner, is_trainable=False)
            objectives.append(
                Objective(compose(partner, task), lambda m=peft_model: _activate(m, ["default", partner]))
            )
        report["train"][task] = dataclasses.asdict(
            train(peft_model, tok, objectives, spec.adapters[task], exclude, spec.data, say)
        )
        _activate(peft_model, ["default"])
        acc, misses = greedy_accuracy(peft_model, tok, TASKS[task], heldout)
        report["heldout_accuracy_hf"][task] = acc
        say(
            f"  exact on {acc:.1%} of {len(heldout)} held-out inputs"
            + (f"; e.g. {misses[0]}" if misses else "")
        )
        if partner is not None:
            _activate(peft_model, ["default", partner])
            acc, _ = greedy_accuracy(peft_model, tok, compose(partner, task), heldout)
            report["heldout_accuracy_hf"][f"{partner}+{task}"] = acc
            say(f"  merge {partner}+{task} exact on {acc:.1%} (vs {task}({partner}(x)))")
        peft_model.save_pretrained(
            tmp / "adapters" / task, safe_serialization=True, selected_adapters=["default"]
        )
        _normalise_adapter_folder(tmp / "adapters" / task)
    return report


def _activate(peft_model, names: list[str]) -> None:
    """Make `names` the active adapters, only the first ("default", the one being trained) trainable."""
    peft_model.base_model.set_adapter(names)
    for name, p in peft_model.named_parameters():
        p.requires_grad_(".default." in name)


def _normalise_adapter_folder(folder: Path) -> None:
    """PEFT records the base model's temporary path; name it instead so rebuilt assets are byte-identical."""
    path = folder / "adapter_config.json"
    cfg = json.loads(path.read_text())
    cfg["base_model_name_or_path"] = BASE_NAME
    cfg["target_modules"] = sorted(cfg["target_modules"])  # PEFT keeps a set: its order varies per process
    path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    (folder / "README.md").unlink(missing_ok=True)  # PEFT's model-card boilerplate, with that path in it


if __name__ == "__main__":  # python -m app.demo.build TMP SPEC_JSON
    _tmp = Path(sys.argv[1])
    _report = _train_all(
        _tmp, DemoSpec.from_dict(json.loads(sys.argv[2])), say=lambda s: print(s, flush=True)
    )
    (_tmp / REPORT).write_text(json.dumps(_report, indent=2) + "\n")
