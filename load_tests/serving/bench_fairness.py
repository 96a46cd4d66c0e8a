"""Fair sharing between tenants under a flood, in-process (one LLMKernel, no Ray, no HTTP; issue 15).
Run: ./run bench fairness [--help]. Method and results: load_tests/serving/RESULTS.md."""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from load_tests.harness.models import bench_model
from load_tests.harness.stats import percentile_or_nan


@dataclass
class Phase:
    """What one phase measured in its window [start, end): tokens delivered in it, and the TTFT of every B
    request sent in it (the phase runs on, flood and all, until each of those has its first token)."""

    seconds: float
    start: float = float("inf")
    end: float = float("inf")
    tokens: dict[str, int] = field(default_factory=lambda: {"a": 0, "b": 0})
    ttft_b: list[float] = field(default_factory=list)
    queued_b: list[float] = field(
        default_factory=list
    )  # engine arrival -> admission, seconds (no client side)
    pending_b: int = 0  # B requests sent in the window still waiting for their first token
    steps: list[float] = field(default_factory=list)  # engine step durations in the window, seconds
    # B's engine-side TTFT split, per B request of the window: arrival -> start of the step that carries its first
    # chunk (the rest of the step in flight, and any step it waited through), and that step's duration
    wait_b: list[float] = field(default_factory=list)
    own_b: list[float] = field(default_factory=list)
    engine_ttft_b: list[float] = field(
        default_factory=list
    )  # arrival -> end of the step sampling its 1st token

    def in_window(self, t: float) -> bool:
        return self.start <= t < self.end

    def tok_s(self, tenant: str | None = None) -> float:
        n = sum(self.tokens.values()) if tenant is None else self.tokens[tenant]
        return n / self.seconds


async def drive(
    phase: Phase,
    one: Callable[[str, Phase], Awaitable[None]],
    a_concurrency: int,
    b_rate: float,
    warmup: float,
    pending_timeout_s: float,
) -> None:
    """One phase: tenant A's closed loops (`a_concurrency` of them, 0: none) and tenant B's requests at `b_rate`
    per second (0: none) run `warmup` seconds, then the measured window, then on until every B request sent in
    the window has its first token (at most `pending_timeout_s` more); then every request is cancelled."""
    stop = asyncio.Event()
    tasks = []

    async def closed_loop() -> None:
        while not stop.is_set():
            await one("a", phase)

    async def steady() -> None:
        interval, nxt = 1.0 / b_rate, time.perf_counter()
        while not stop.is_set():
            tasks.append(asyncio.ensure_future(one("b", phase)))
            nxt += interval
            await asyncio.sleep(max(0.0, nxt - time.perf_counter()))

    tasks += [asyncio.ensure_future(closed_loop()) for _ in range(a_concurrency)]
    if b_rate > 0:
        tasks.append(asyncio.ensure_future(steady()))
    await asyncio.sleep(warmup)
    phase.start = time.perf_counter()
    phase.end = phase.start + phase.seconds
    await asyncio.sleep(phase.seconds)
    deadline = time.perf_counter() + pending_timeout_s
    while phase.pending_b and time.perf_counter() < deadline:
        await asyncio.sleep(0.02)
    stop.set()
    for t in tasks:  # cancelling a stream aborts its request in the engine
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


class Bench:
    def __init__(self, kernel, a: argparse.Namespace):
        self.k, self.a = kernel, a
        self.rng = random.Random(0)
        self.vocab = kernel.model_config.vocab_size
        self.phase: Phase | None = None
        admitted = kernel.fairness.admitted

        def timed_admission(seq) -> None:  # B's queueing delay as the scheduler sees it, free of client noise
            if seq.tenant == "b" and self.phase is not None and self.phase.in_window(time.perf_counter()):
                self.phase.queued_b.append(time.monotonic() - seq.arrival)
            admitted(seq)

        kernel.fairness.admitted = timed_admission
        step, schedule = kernel.engine.step, kernel.engine.scheduler.schedule
        started: dict[int, float] = {}  # B sequence -> when the step carrying its first chunk started
        t_step = [0.0]

        def traced_schedule():
            batch = schedule()
            for it in batch.items:
                if it.seq.tenant == "b" and id(it.seq) not in started and it.start == 0:
                    started[id(it.seq)] = t_step[0]
            return batch

        kernel.engine.scheduler.schedule = traced_schedule

        def timed_step() -> bool:  # the engine thread's steps: how long a request arriving mid-step waits
            t0 = t_step[0] = time.perf_counter()
            ran = step()
            t1 = time.perf_counter()
            ph = self.phase
            if ran and ph is not None and ph.in_window(t0):
                ph.steps.append(t1 - t0)
            for seq in list(kernel.engine.scheduler.running) if ran else ():
                if seq.tenant == "b" and len(seq.output_ids) == 1 and id(seq) in started:
                    begun = started.pop(id(seq))  # monotonic and perf_counter: the same clock on Linux
                    if ph is not None and ph.in_window(seq.arrival):
                        ph.wait_b.append(begun - seq.arrival)
                        ph.own_b.append(t1 - begun)
                        ph.engine_ttft_b.append(t1 - seq.arrival)
            return ran

        kernel.engine.step = timed_step

    def prompt(self) -> list[int]:
        return [self.rng.randrange(3, self.vocab) for _ in range(self.a.prompt_len)]

    async def one(self, tenant: str, phase: Phase) -> None:
        t0 = time.perf_counter()
        timed = tenant == "b" and phase.in_window(t0)
        phase.pending_b += timed
        n = self.a.new if self.a.fixed_len else self.rng.randint(max(1, self.a.new // 2), 3 * self.a.new // 2)
        stream = self.k.generate(self.prompt(), None, tenant=tenant, max_tokens=n, ignore_eos=True)
        async for d in stream:
            now = time.perf_counter()
            if phase.in_window(now):
                phase.tokens[tenant] += len(d.token_ids)
            if timed and d.token_ids:
                timed = False
                phase.ttft_b.append(now - t0)
                phase.pending_b -= 1

    async def run(self, flood: bool, b_rate: float, seconds: float, warmup: float) -> Phase:
        phase = self.phase = Phase(seconds)
        await drive(phase, self.one, self.a.a_concurrency if flood else 0, b_rate, warmup, 120.0)
        await self.drain()
        return phase

    async def drain(self) -> None:
        e = self.k.engine
        while e.num_waiting() or e.scheduler.running:
            await asyncio.sleep(0.05)


async def measure(kernel, a: argparse.Namespace) -> dict:
    bench = Bench(kernel, a)
    sat = await bench.run(True, 0.0, a.seconds, a.warmup)
    sat_req_s = sat.tok_s() / a.new
    b_rate = a.b_share * sat_req_s
    alone = await bench.run(False, b_rate, a.seconds, a.warmup)
    flood = await bench.run(True, b_rate, a.seconds, a.warmup)
    row = {
        "saturated_tok_s": sat.tok_s(),
        "b_rate_req_s": b_rate,
        "b_alone_ttft_p50": percentile_or_nan(alone.ttft_b, 50),
        "b_alone_ttft_p99": percentile_or_nan(alone.ttft_b, 99),
        "b_alone_n": len(alone.ttft_b),
        "flood_b_ttft_p50": percentile_or_nan(flood.ttft_b, 50),
        "flood_b_ttft_p99": percentile_or_nan(flood.ttft_b, 99),
        "flood_b_n": len(flood.ttft_b),
        "b_alone_queue_p99": percentile_or_nan(alone.queued_b, 99),
        "flood_b_queue_p50": percentile_or_nan(flood.queued_b, 50),
        "flood_b_queue_p99": percentile_or_nan(flood.queued_b, 99),
        "flood_tok_s": flood.tok_s(),
        "flood_a_tok_s": flood.tok_s("a"),
        "flood_b_tok_s": flood.tok_s("b"),
        "b_alone_step_p99": percentile_or_nan(alone.steps, 99),
        "flood_step_p50": percentile_or_nan(flood.steps, 50),
        "flood_step_p99": percentile_or_nan(flood.steps, 99),
    }
    for name, ph in (("alone", alone), ("flood", flood)):  # B's engine-side TTFT, split
        for part in ("wait", "own", "engine_ttft"):
            xs = getattr(ph, part + "_b")
            row[f"{name}_b_{part}_p50"], row[f"{name}_b_{part}_p99"] = (
                percentile_or_nan(xs, 50),
                percentile_or_nan(xs, 99),
            )
    row["ttft_p99_ratio"] = row["flood_b_ttft_p99"] / row["b_alone_ttft_p99"]
    row["throughput_ratio"] = row["flood_tok_s"] / row["saturated_tok_s"]
    return row


def add_load_args(
    ap: argparse.ArgumentParser, max_batch: int, a_concurrency: int, b_share: float, prompt_len: int, new: int
) -> None:
    """The phases' and the load's options (this bench's and bench_fairness_http's), with their defaults."""
    ap.add_argument("--seconds", type=float, default=60.0, help="measured seconds per phase")
    ap.add_argument("--warmup", type=float, default=5.0, help="seconds per phase before measuring")
    ap.add_argument("--max-batch", type=int, default=max_batch)
    ap.add_argument(
        "--a-concurrency", type=int, default=a_concurrency, help="tenant A's outstanding requests"
    )
    ap.add_argument("--b-share", type=float, default=b_share, help="B's rate, as a share of saturated req/s")
    ap.add_argument("--prompt-len", type=int, default=prompt_len)
    ap.add_argument("--new", type=int, default=new)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--quick", action="store_true", help="30 s phases, 32+16-token requests, batch 8, A x32, B 25%%"
    )
    ap.add_argument("--policies", default="vtc,vtc+preempt,fcfs")
    ap.add_argument("--fixed-len", action="store_true", help="every request exactly --new output tokens")
    add_load_args(ap, max_batch=16, a_concurrency=64, b_share=0.1, prompt_len=64, new=32)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--model", type=Path, default=None, help="a model folder (default: the bench model)")
    ap.add_argument("--json", type=Path, default=None, help="also write the results here")
    a = ap.parse_args()
    if a.quick:  # smaller requests and batch so a loaded 2-core machine still sees a dozen B requests
        a.seconds, a.warmup, a.max_batch, a.a_concurrency = 30.0, 4.0, 8, 32
        a.prompt_len, a.new, a.b_share = 32, 16, 0.25
    from loraland import LLMKernel

    model_dir = a.model or bench_model()
    print(
        f"A: closed loop x{a.a_concurrency}; B: {a.b_share:.0%} of saturated req/s; {a.prompt_len} prompt + "
        f"{a.new} new tokens; max_batch_size {a.max_batch}; {a.seconds:.0f}s per phase after {a.warmup:.0f}s "
        f"warm-up; torch threads {torch.get_num_threads()}",
        flush=True,
    )
    rows = {}
    for policy in a.policies.split(","):
        with LLMKernel(
            model_dir,
            dtype=a.dtype,
            max_batch_size=a.max_batch,
            enable_prefix_caching=False,
            scheduling_policy=policy.split("+")[0],
            vtc_preempt="+preempt" in policy,
        ) as k:
            if "+isolate" in policy:
                k.fairness.isolate = True
            k.complete([[5, 6, 7]], max_tokens=2, ignore_eos=True)  # warm-up
            rows[policy] = r = asyncio.run(measure(k, a))
            r["preemptions"] = k.engine.scheduler.num_preemptions
        print(
            f"{policy:11} saturated {r['saturated_tok_s']:7.1f} tok/s | B alone TTFT p50 {r['b_alone_ttft_p50']:.3f}s "
            f"p99 {r['b_alone_ttft_p99']:.3f}s (n={r['b_alone_n']}) | flood: B TTFT p50 {r['flood_b_ttft_p50']:.3f}s "
            f"p99 {r['flood_b_ttft_p99']:.3f}s (n={r['flood_b_n']}), {r['flood_tok_s']:.1f} tok/s "
            f"(A {r['flood_a_tok_s']:.1f}, B {r['flood_b_tok_s']:.1f}), B queued p50 {r['flood_b_queue_p50']:.3f}s "
            f"p99 {r['flood_b_queue_p99']:.3f}s (alone p99 {r['b_alone_queue_p99']:.3f}s), steps p50 "
            f"{r['flood_step_p50']:.3f}s p99 {r['flood_step_p99']:.3f}s (alone p99 {r['b_alone_step_p99']:.3f}s), "
            f"preemptions {r['preemptions']} | p99 ratio {r['ttft_p99_ratio']:.2f} "
            f"(goal <= 1.2), throughput ratio {r['throughput_ratio']:.2f} (goal >= 0.9)",
            flush=True,
        )
        print(
            "   B's engine-side TTFT p50/p99 (s), alone | flood: "
            + " | ".join(
                f"{part} "
                + ", ".join(
                    f"{r[f'{n}_b_{part}_p50']:.3f}/{r[f'{n}_b_{part}_p99']:.3f}" for n in ("alone", "flood")
                )
                for part in ("wait", "own", "engine_ttft")
            ),
            flush=True,
        )
    if a.json:
        a.json.write_text(json.dumps({"args": vars(a), "rows": rows}, indent=1, default=str))


if __name__ == "__main__":
    main()
