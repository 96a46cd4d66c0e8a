"""Seeded CPU training for the demo: a tiny Llama taught to copy its input, then one LoRA per task.

Every task is a Python function on short strings, so anyone can check an adapter's output by eye and by
calling the function. The base model learns `^text= -> text</s>` on mixed-case words (so every letter's
output embedding is trained); each adapter then learns its function on lowercase words. The tokenizer
adds `^` and `=` itself (see assets.build_tokenizer), so a prompt is just the text."""

from __future__ import annotations

import codecs
import math
import random
import string
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F


def _reverse_words(s: str) -> str:
    return " ".join(reversed(s.split()))


def _rot13(s: str) -> str:
    return codecs.encode(s, "rot13")


# name -> the function the adapter imitates; "copy" is what the base model itself does.
TASKS: dict[str, Callable[[str], str]] = {
    "copy": lambda s: s,
    "upper": str.upper,
    "reverse": _reverse_words,
    "rot13": _rot13,
}
ADAPTER_TASKS = ("upper", "reverse", "rot13")


def compose(*names: str) -> Callable[[str], str]:
    """The function a chain "a|b" imitates: b(a(x))."""

    def run(s: str) -> str:
        for n in names:
            s = TASKS[n](s)
        return s

    return run


@dataclass(frozen=True)
class DataSpec:
    min_words: int = 1
    max_words: int = 4
    min_letters: int = 2
    max_letters: int = 7


def random_text(rng: random.Random, spec: DataSpec, mixed_case: bool = False) -> str:
    """1-4 random words of 2-7 letters; with mixed_case some words are UPPER or Capitalised."""
    words = []
    for _ in range(rng.randint(spec.min_words, spec.max_words)):
        w = "".join(
            rng.choice(string.ascii_lowercase) for _ in range(rng.randint(spec.min_letters, spec.max_letters))
        )
        if mixed_case:
            r = rng.random()
            w = w.upper() if r < 0.25 else w.capitalize() if r < 0.5 else w
        words.append(w)
    return " ".join(words)


def heldout_inputs(seed: int, n: int = 200, spec: DataSpec = DataSpec()) -> list[str]:
    """n distinct lowercase inputs that training never sees (training rejects them by value)."""
    rng = random.Random(f"heldout-{seed}")
    out: dict[str, None] = {}
    while len(out) < n:
        out[random_text(rng, spec)] = None
    return list(out)


@dataclass(frozen=True)
class TrainSpec:
    steps: int
    lr: float
    batch_size: int = 64
    seed: int = 0
    mixed_case: bool = False
    warmup_frac: float = 0.05


@dataclass
class TrainResult:
    steps: int
    wall_s: float
    cpu_s: float  # process CPU time: what the run costs when other work shares the cores
    final_loss: float


def encode_pair(tok, text: str, target: str) -> tuple[list[int], list[int]]:
    """(prompt ids ending in the separator, target ids ending in eos)."""
    prompt = tok.encode(text, add_special_tokens=False)
    out = tok.encode(target, add_special_tokens=False)
    return prompt, out[:-1] + [tok.eos_token_id]  # the tokenizer appends the separator to every encoding


def _pack(examples: list[tuple[list[int], list[int]]], pad: int):
    """Pack (prompt, answer) pairs into rows, a long one beside short ones, with a block-diagonal causal
    mask and positions restarting per example: the same gradient as one example per row, at about half
    the padded compute, while every batch keeps its mix of lengths (sorting whole batches by length
    instead slows learning several-fold)."""
    seqs = sorted(examples, key=lambda pq: -(len(pq[0]) + len(pq[1])))
    width = len(seqs[0][0]) + len(seqs[0][1])
    rows: list[list[tuple[list[int], list[int]]]] = []
    lo, hi = 0, len(seqs) - 1
    while lo <= hi:
        row, used = [seqs[lo]], len(seqs[lo][0]) + len(seqs[lo][1])
        lo += 1
        while lo <= hi and used + len(seqs[hi][0]) + len(seqs[hi][1]) <= width:
            row.append(seqs[hi])
            used += len(seqs[hi][0]) + len(seqs[hi][1])
            hi -= 1
        rows.append(row)
    ids = torch.full((len(rows), width), pad)
    labels = torch.full((len(rows), width), -100)
    positions = torch.zeros((len(rows), width), dtype=torch.long)
    segment = torch.full((len(rows), width), -1)
    for r, row in enumerate(rows):
        at = 0
        for k, (p, q) in enumerate(row):
            n = len(p) + len(q)
            ids[r, at : at + n] = torch.tensor(p + q)
            # position t predicts token t+1: only the answer (after the separator) is learned
            labels[r, at + len(p) - 1 : at + n - 1] = torch.tensor(q)
            positions[r, at : at + n] = torch.arange(n)
            segment[r, at : at + n] = k
            at += n
    causal = torch.ones(width, width, dtype=torch.bool).tril()
    mask = (segment[:, :, None] == segment[:, None, :]) & causal & (segment[:, :, None] >= 0)
    # padding rows attend to themselves only, so no softmax row is empty
    mask |= torch.eye(width, dtype=torch.bool)
    return ids, labels, positions, mask[:, None]


def _batches(tok, fn, spec: TrainSpec, data: DataSpec, exclude: set[str], stream: int = 0):
    rng = random.Random(f"train-{spec.seed}-{stream}")
    while True:
        batch = []
        while len(batch) < spec.batch_size:
            text = random_text(rng, data, spec.mixed_case)
            if text not in exclude:
                batch.append(encode_pair(tok, text, fn(text)))
        yield _pack(batch, tok.pad_token_id)


@dataclass(frozen=True)
class Objective:
    """A function to imitate, and how to put the model in the state that learns it (e.g. which adapters
    are active); train() alternates between its objectives step by step."""

    fn: Callable[[str], str]
    activate: Callable[[], None] | None = None


def train(
    model,
    tok,
    objectives: list[Objective],
    spec: TrainSpec,
    exclude: set[str],
    data: DataSpec = DataSpec(),
    log: Callable[[str], None] | None = None,
) -> TrainResult:
    """AdamW with warmup + cosine decay on the trainable parameters of `model` (a causal LM)."""
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=spec.lr, betas=(0.9, 0.98), weight_decay=0.0)
    warm = max(1, int(spec.steps * spec.warmup_frac))

    def factor(step: int) -> float:
        return (
            min(1.0, (step + 1) / warm) * 0.5 * (1 + math.cos(math.pi * min(step, spec.steps) / spec.steps))
        )

    sched = torch.optim.lr_scheduler.LambdaLR(opt, factor)
    model.train()
    t0, c0 = time.perf_counter(), time.process_time()
    loss_v = float("nan")
    streams = [_batches(tok, o.fn, spec, data, exclude, i) for i, o in enumerate(objectives)]
    for step in range(spec.steps):
        k = step % len(objectives)
        if objectives[k].activate is not None:
            objectives[k].activate()
        ids, labels, positions, mask = next(streams[k])
        logits = model(input_ids=ids, position_ids=positions, attention_mask=mask).logits
        loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        loss_v = loss.item()
        if log and (step % 100 == 0 or step == spec.steps - 1):
            log(f"  step {step:4d}  loss {loss_v:.4f}  {time.perf_counter() - t0:6.1f}s")
    model.eval()
    return TrainResult(spec.steps, time.perf_counter() - t0, time.process_time() - c0, loss_v)


@torch.no_grad()
def greedy_accuracy(
    model, tok, fn: Callable[[str], str], inputs: list[str], max_new_tokens: int = 40, batch_size: int = 100
) -> tuple[float, list[tuple[str, str]]]:
    """Exact-match rate of greedy decoding with the training model (HF generate); also the misses."""
    misses: list[tuple[str, str]] = []
    for i in range(0, len(inputs), batch_size):
        chunk = inputs[i : i + batch_size]
        enc = [tok.encode(t, add_special_tokens=False) for t in chunk]
        width = max(map(len, enc))
        # Left padding so every prompt ends where generation starts.
        ids = torch.tensor([[tok.pad_token_id] * (width - len(e)) + e for e in enc])
        mask = (torch.arange(width)[None, :] >= torch.tensor([width - len(e) for e in enc])[:, None]).long()
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
        )
        for text, row in zip(chunk, out[:, width:], strict=True):
            got = tok.decode(row, skip_special_tokens=True).strip()
            if got != fn(text):
                misses.append((text, got))
    return 1 - len(misses) / len(inputs), misses
