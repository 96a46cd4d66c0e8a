"""Chaos: a bounded mixed load on a local stack while one fault at a time is injected; what was lost.
Run: ./run bench chaos [--help]. Method and results: load_tests/chaos/RESULTS.md."""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from load_tests.harness.local_stack import LocalStack, StackConfig, require_offline
from tests.fixtures.models import CORPUS

FAULTS = ("replica", "redis", "s3", "ingress")
INGRESS_REPLICAS = 2  # killing one leaves the other serving (deploy/serve_config.yaml runs 2 as well)
# A few prompts, so the single-request references (one oracle call per model, prompt and route) are few.
PROMPTS = [" ".join(line.split()[:n]) for line in CORPUS[:4] for n in (3, 7)]


@dataclass(frozen=True)
class ChaosConfig:
    concurrency: int = 8
    pre_s: float = 4.0  # load before the fault
    down_s: float = 5.0  # how long Redis or S3 stays down
    post_s: float = 15.0  # load after the fault ends
    request_timeout_s: float = 60.0  # a request without an answer by then is lost (a hang)
    recovery_timeout_s: float = 120.0
    stream_share: float = 0.4
    abandon_share: float = 0.1  # of the streamed requests
    chat_share: float = 0.3
    seed: int = 0


@dataclass(frozen=True)
class Req:
    model: str
    prompt: str | None
    messages: list | None
    stream: bool
    abandon: bool
    max_tokens: int


@dataclass
class Row:
    fault: str
    sent: int = 0
    ok: int = 0
    clean: int = 0
    lost: int = 0
    wrong: int = 0
    abandoned: int = 0
    down_s: float = 0.0
    recovery_s: float | None = None
    healthy_s: float | None = None  # until Serve runs every replica again and all heartbeat
    notes: Counter = field(default_factory=Counter)

    def add(self, outcome: str, note: str) -> None:
        self.sent += 1
        setattr(self, outcome, getattr(self, outcome) + 1)
        if note:
            self.notes[f"{outcome}:{note}"] += 1


def composite_models(stack: LocalStack) -> list[str]:
    w = stack.warm  # at least 8
    return [f"{w[0]}|{w[1]}", f"{w[2]}|{w[3]}|{w[4]}", f"{w[5]}*0.5+{w[6]}*0.5", f"{w[7]}*0.7+{w[0]}*0.3"]


def request_mix(stack: LocalStack, cfg: ChaosConfig, rng: random.Random, extra: list[str] = ()) -> Req:
    models = [*stack.warm, "tiny-llama", *composite_models(stack)]
    model = rng.choice(list(extra)) if extra and rng.random() < 0.3 else rng.choice(models)
    text = rng.choice(PROMPTS)
    stream = rng.random() < cfg.stream_share
    chat = rng.random() < cfg.chat_share
    return Req(
        model=model,
        prompt=None if chat else text,
        messages=[{"role": "user", "content": text}] if chat else None,
        stream=stream,
        abandon=stream and rng.random() < cfg.abandon_share,
        max_tokens=stack.cfg.max_tokens,
    )


def _error_outcome(status: int, content: bytes) -> tuple[str, str]:
    from tests.fixtures.inproc_stack import openai_error

    try:
        body = json.loads(content)
    except ValueError:
        body = None
    code = (
        body["error"].get("code") if isinstance(body, dict) and isinstance(body.get("error"), dict) else None
    )
    retryable = 400 <= status < 500 or status in (503, 504)
    if retryable and openai_error(body) is None:
        return "clean", f"{status}:{code}"
    return "lost", f"{status}:{code or content[:60]!r}"


async def send(client: httpx.AsyncClient, stack: LocalStack, req: Req, timeout_s: float) -> tuple[str, str]:
    """One request, classified: ok / wrong / clean / lost / abandoned, and a short note."""
    chat = req.messages is not None
    path = "/v1/chat/completions" if chat else "/v1/completions"
    body = {"model": req.model, "max_tokens": req.max_tokens, "stream": req.stream, "temperature": 0}
    body.update({"messages": req.messages} if chat else {"prompt": req.prompt})
    want = stack.reference(req.model, req.prompt, req.messages, req.max_tokens)
    headers = {"Authorization": f"Bearer {stack.api_key}"}
    try:
        async with asyncio.timeout(timeout_s):
            if not req.stream:
                r = await client.post(path, json=body, headers=headers)
                if r.status_code != 200:
                    return _error_outcome(r.status_code, r.content)
                choice = r.json()["choices"][0]
                text = choice["message"]["content"] if chat else choice["text"]
                return ("ok", _retried(r)) if text == want else ("wrong", _retried(r))
            async with client.stream("POST", path, json=body, headers=headers) as r:
                if r.status_code != 200:
                    return _error_outcome(r.status_code, await r.aread())
                text, done, error = "", False, None
                async for line in r.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    data = line[len("data: ") :]
                    if data == "[DONE]":
                        done = True
                        break
                    event = json.loads(data)
                    if "error" in event:
                        error = event
                        continue
                    if event.get("choices"):
                        choice = event["choices"][0]
                        piece = (choice.get("delta") or {}).get("content") if chat else choice.get("text")
                        text += piece or ""
                    if req.abandon and text:
                        return "abandoned", ""  # leaving the block closes the connection mid-stream
                if error is not None:
                    outcome, note = _error_outcome(int(error.get("status", 500)), json.dumps(error).encode())
                    return outcome, f"stream {note}"
                if not done:
                    return "lost", "stream cut without [DONE]"
                return ("ok", _retried(r)) if text == want else ("wrong", _retried(r))
    except TimeoutError:
        return "lost", "no answer (hang)"
    except httpx.HTTPError as e:
        return "lost", type(e).__name__


def _retried(r: httpx.Response) -> str:
    """'retried' when the proxy's IngressLossMiddleware sent the request a second time (its ingress died)."""
    from app.router.http.middleware import RETRIED_HEADER

    return "ingress retried it" if r.headers.get(RETRIED_HEADER.decode()) else ""


async def sweep(client: httpx.AsyncClient, stack: LocalStack, models: list[str]) -> list[str]:
    """Models that did not answer correctly in one round (an empty list: everything serves)."""
    sem = asyncio.Semaphore(4)

    async def one(model: str) -> str | None:
        req = Req(model, PROMPTS[0], None, False, False, stack.cfg.max_tokens)
        async with sem:
            outcome, note = await send(client, stack, req, 30.0)
        return None if outcome == "ok" else f"{model} ({outcome} {note})"

    return [m for m in await asyncio.gather(*(one(m) for m in models)) if m]


async def run_phase(stack: LocalStack, fault: str, cfg: ChaosConfig, rng: random.Random) -> Row:
    row = Row(fault)
    extra = list(stack.cold) if fault == "s3" else []
    probe_models = [*stack.warm, "tiny-llama", *composite_models(stack), *extra]
    state = {"stop_at": None}
    limits = httpx.Limits(max_connections=cfg.concurrency + 8)
    timeout = httpx.Timeout(cfg.request_timeout_s, connect=10.0)
    async with httpx.AsyncClient(base_url=stack.base, timeout=timeout, limits=limits) as client:

        async def worker() -> None:
            while state["stop_at"] is None or time.monotonic() < state["stop_at"]:
                outcome, note = await send(
                    client, stack, request_mix(stack, cfg, rng, extra), cfg.request_timeout_s
                )
                row.add(outcome, note)

        workers = [asyncio.create_task(worker()) for _ in range(cfg.concurrency)]
        await asyncio.sleep(cfg.pre_s)
        t0 = time.monotonic()
        await asyncio.to_thread(inject, stack, fault, cfg.down_s)
        t_end = time.monotonic()
        row.down_s = t_end - t0
        state["stop_at"] = t_end + cfg.post_s
        failing = ["not tried"]
        while failing and time.monotonic() - t_end < cfg.recovery_timeout_s:
            failing = await sweep(client, stack, probe_models)
            if not failing:
                row.recovery_s = time.monotonic() - t_end
            else:
                await asyncio.sleep(0.5)
        if failing:
            row.notes[f"still failing after {cfg.recovery_timeout_s:.0f} s: {failing[:3]}"] += 1
        await asyncio.gather(*workers)
    return row


def inject(stack: LocalStack, fault: str, down_s: float) -> None:
    """The fault, and its end for outages; returns when the fault is over (kills: at once)."""
    if fault == "replica":
        stack.kill("LoraReplica")
    elif fault == "ingress":
        stack.kill("Ingress")
    elif fault == "redis":
        stack.redis.kill()
        time.sleep(down_s)
        stack.redis.start()
    elif fault == "s3":
        stack.s3.stop()
        time.sleep(down_s)
        stack.s3.start()
    else:
        raise ValueError(f"unknown fault {fault!r}: one of {FAULTS}")


def chaos_stack(
    ingress_replicas: int = INGRESS_REPLICAS, proxy_middleware: bool = True, **stack
) -> StackConfig:
    """The stack the chaos run needs: `ingress_replicas` ingress replicas and Serve's proxy wrapped in
    IngressLossMiddleware (`proxy_middleware=False` measures Serve's proxy as it is)."""
    return StackConfig(ingress_replicas=ingress_replicas, proxy_middleware=proxy_middleware, **stack)


def run_chaos(stack: LocalStack, cfg: ChaosConfig, faults=FAULTS) -> list[Row]:
    rng = random.Random(cfg.seed)
    t0 = time.monotonic()
    warm_references(stack, faults)
    print(f"references computed in {time.monotonic() - t0:.0f} s", flush=True)
    rows = []
    for fault in faults:
        print(f"phase {fault}: load {cfg.pre_s:.0f} s, fault, load {cfg.post_s:.0f} s", flush=True)
        row = asyncio.run(run_phase(stack, fault, cfg, rng))
        rows.append(row)
        print(table([row]), flush=True)
        row.healthy_s = stack.wait_healthy(300)  # both replicas and the ingress back before the next fault
    return rows


def warm_references(stack: LocalStack, faults) -> None:
    """Every reference the load can ask for, computed before any clock runs (one oracle call each)."""
    models = [*stack.warm, "tiny-llama", *composite_models(stack), *(stack.cold if "s3" in faults else [])]
    for model in models:
        for text in PROMPTS:
            stack.reference(model, text, None, stack.cfg.max_tokens)
            stack.reference(model, None, [{"role": "user", "content": text}], stack.cfg.max_tokens)


def table(rows: list[Row]) -> str:
    head = (f"{'fault':8} {'sent':>5} {'ok':>5} {'clean':>5} {'lost':>5} {'wrong':>5} {'aband':>5} {'down_s':>6} "
            f"{'recov_s':>7} {'healthy_s':>9}")  # fmt: skip
    lines = [head]
    for r in rows:
        rec = f"{r.recovery_s:7.1f}" if r.recovery_s is not None else "  never"
        healthy = f"{r.healthy_s:9.1f}" if r.healthy_s is not None else f"{'-':>9}"
        lines.append(f"{r.fault:8} {r.sent:5} {r.ok:5} {r.clean:5} {r.lost:5} {r.wrong:5} {r.abandoned:5} "
                     f"{r.down_s:6.1f} {rec} {healthy}")  # fmt: skip
        for note, n in sorted(r.notes.items(), key=lambda kv: -kv[1]):
            lines.append(f"{'':8}   {n:4} x {note}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--faults", default=",".join(FAULTS))
    p.add_argument("--concurrency", type=int, default=ChaosConfig.concurrency)
    p.add_argument("--pre", type=float, default=ChaosConfig.pre_s)
    p.add_argument("--down", type=float, default=ChaosConfig.down_s)
    p.add_argument("--post", type=float, default=ChaosConfig.post_s)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ingress-replicas", type=int, default=INGRESS_REPLICAS)
    p.add_argument("--max-tokens", type=int, default=StackConfig.max_tokens, help="per request")
    p.add_argument("--no-proxy-middleware", action="store_true", help="Serve's proxy as it is (a baseline)")
    p.add_argument("--out", type=Path, default=None, help="write the rows as JSON here")
    args = p.parse_args(argv)
    require_offline()
    cfg = ChaosConfig(concurrency=args.concurrency, pre_s=args.pre, down_s=args.down, post_s=args.post,
                      seed=args.seed)  # fmt: skip
    stack_cfg = chaos_stack(args.ingress_replicas, not args.no_proxy_middleware, max_tokens=args.max_tokens)
    with LocalStack(stack_cfg) as stack:
        rows = run_chaos(stack, cfg, tuple(args.faults.split(",")))
    print("\n" + table(rows))
    if args.out:
        args.out.write_text(json.dumps([{**asdict(r), "notes": dict(r.notes)} for r in rows], indent=2))
    return 0 if all(r.lost == 0 and r.wrong == 0 and r.recovery_s is not None for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
