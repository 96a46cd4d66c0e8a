"""The real demo's shipped adapters: SmolLM2-135M-Instruct LoRAs trained by examples/train_adapters.py.

app/demo/adapters/<task>/    PEFT LoRA (adapter_config.json, adapter_model.safetensors), one per task in
                             app/demo/tasks.py; rank 8 on q_proj + v_proj, 1.8 MB each in fp32
app/demo/adapters/train_report.json   steps, seconds and final loss of the build that wrote them"""

from __future__ import annotations

from pathlib import Path

from app.demo.tasks import TASK_NAMES

ADAPTERS_DIR = Path(__file__).resolve().parent / "adapters"
BASE_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"  # recorded in adapter_config.json instead of a local path
LORA = {
    "r": 8,
    "lora_alpha": 16,
    "target_modules": ["q_proj", "v_proj"],
    "lora_dropout": 0.0,
    "bias": "none",
}


def shipped_adapters(folder: Path = ADAPTERS_DIR) -> dict[str, Path]:
    """task -> its adapter folder, for every task whose folder is complete; FileNotFoundError if none is."""
    found = {
        t: folder / t
        for t in TASK_NAMES
        if (folder / t / "adapter_config.json").is_file()
        and (folder / t / "adapter_model.safetensors").is_file()
    }
    if not found:
        raise FileNotFoundError(
            f"no trained adapters under {folder}; train them with `python examples/train_adapters.py`"
        )
    return found


CHAIN = "person_json|shout"  # the JSON's city, in shout's format
MERGE = (
    "person_json*0.5+iso_date*0.5"  # one forward with both deltas at half strength: a blend, not a pipeline
)


def showcase(names=TASK_NAMES) -> list[tuple[str, str | None]]:
    """(model field, its expected answer to tasks.DEMO_SENTENCE or None where nothing exact is claimed): the base,
    each adapter of `names`, and the chain and the merge whose adapters are all there, for `loraland demo`."""
    from app.demo import tasks as T

    demo = T.Example(T.DEMO_SENTENCE, "Anna Berg", "Oslo", 29, "2021-03-05")
    have = set(names)
    return [
        (None, None),
        *((t, T.target(t, demo)) for t in TASK_NAMES if t in have),
        *([(CHAIN, T.target("shout", demo))] if {"person_json", "shout"} <= have else []),
        *([(MERGE, None)] if {"person_json", "iso_date"} <= have else []),
    ]
