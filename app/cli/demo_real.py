"""The real-model half of `loraland demo`: which model and adapters it serves (SmolLM2-135M-Instruct or Gemma 3
270M, each with the adapters trained on it), and one prompt answered by the base, each adapter, a chain and a
merge over HTTP."""

from __future__ import annotations

import argparse
import json
import shlex
import time
from dataclasses import dataclass
from pathlib import Path

SERVED_NAME = "demo"  # the base model's id in the demo (both demos)


@dataclass(frozen=True)
class RealModel:
    """What the real demo serves: the model folder, its label, chat template (None: the model's own), and the
    adapters folder with the adapter names in it (none: the base alone)."""

    folder: str
    label: str
    chat_template: str | None
    adapters: Path | None
    names: tuple[str, ...]


def real_model(args: argparse.Namespace) -> RealModel:
    """The real demo's model and adapters; errors say what to install. A packaged model gets the adapters trained
    on it; adapters trained on another base are refused when first used (the replica's base-model check)."""
    from app.demo import gemma3, smollm2
    from app.demo.real_assets import ADAPTERS_DIR, shipped_adapters

    packaged = {
        smollm2.SHORT_NAME: (smollm2, "SmolLM2-135M-Instruct", None, ADAPTERS_DIR),
        gemma3.SHORT_NAME: (gemma3, "Gemma 3 270M", gemma3.CHAT_TEMPLATE, gemma3.ADAPTERS_DIR),
    }
    name = args.model or smollm2.SHORT_NAME
    if name in packaged:
        module, label, template, default_adapters = packaged[name]
        why = module.available()
        if why is not None:
            raise RuntimeError(f"{why}; or run `loraland demo --toy` for the tiny character-level demo")
        t0 = time.perf_counter()
        folder = str(module.model_dir())
        print(f"model: {label} ({folder}, ready in {time.perf_counter() - t0:.1f}s)")
    else:
        folder, label, template, default_adapters = name, name, None, ADAPTERS_DIR
    adapters = Path(args.adapters or default_adapters)
    try:
        names = tuple(shipped_adapters(adapters))
    except FileNotFoundError:
        if args.adapters:
            raise
        print(
            f"no adapters trained on {label} under {adapters}: the demo shows the base model's answers only"
        )
        return RealModel(folder, label, template, None, ())
    print(f"adapters: {', '.join(names)} from {adapters}")
    return RealModel(folder, label, template, adapters, names)


def _chat(client, model: str | None, text: str) -> str:
    body = {"model": model or SERVED_NAME, "messages": [{"role": "user", "content": text}], "max_tokens": 48}
    r = client.post("/v1/chat/completions", json=body)
    if r.status_code != 200:
        raise RuntimeError(
            f"POST /v1/chat/completions model={body['model']!r} failed: HTTP {r.status_code} {r.text[:300]}"
        )
    return r.json()["choices"][0]["message"]["content"]


def show_real_results(
    client, label: str, names, t_start: float | None = None
) -> list[tuple[str, str, str | None]]:
    """The real demo: one chat prompt answered by the base, each adapter in `names`, a chain and a merge, side
    by side; print and return (model, output, expected or None). With t_start, say when the first answer came."""
    from app.demo.real_assets import showcase
    from app.demo.tasks import DEMO_SENTENCE

    rows = []
    print(f"\nprompt (one user message, through {label}'s chat template): {DEMO_SENTENCE!r}")
    for model, want in showcase(names):
        t0 = time.perf_counter()
        got = _chat(client, model, DEMO_SENTENCE).strip()
        mark = "" if want is None else "  ok" if got == want else f"  (trained to answer {want!r})"
        label = model or f"{SERVED_NAME} (base)"
        print(f"  {label:<30} -> {got!r}{mark}  [{time.perf_counter() - t0:.1f}s]")
        rows.append((model or SERVED_NAME, got, want))
        if t_start is not None and len(rows) == 1:
            print(f"  (first answer {time.perf_counter() - t_start:.1f}s after the demo started)")
    return rows


def real_usage_lines(base: str, names, label: str) -> str:
    from app.demo.real_assets import CHAIN, MERGE

    chat = json.dumps(
        {
            "model": "person_json",
            "messages": [{"role": "user", "content": "Leo Kim, 41, moved to Lima on June 2, 2019."}],
        }
    )
    return "\n".join(
        [
            "",
            "Try it (no API key needed: --no-auth on loopback):",
            f"  curl -s {base}/v1/models",
            f"  curl -s {base}/v1/chat/completions -H 'Content-Type: application/json' -d {shlex.quote(chat)}",
            "",
            f"Models: {SERVED_NAME} ({label}), adapters {', '.join(names) or '(none)'}, chains like "
            f"'{CHAIN}', merges like '{MERGE}'. Inputs: a sentence with a name, an age, a city and a date.",
            f"Status page (a browser on this machine): {base}/status",
            f"Prometheus metrics: {base}/metrics (deploy/prometheus.yml scrapes it)",
            "Ctrl-C stops the server, Ray and the private Redis.",
        ]
    )
