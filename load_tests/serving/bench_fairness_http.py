"""Fair sharing under a flood over HTTP on a real local Ray cluster: bench_fairness's phases end to end.
Run: ./run bench fairness_http [--help]. Method and results: load_tests/serving/RESULTS.md."""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import random
import time
from pathlib import Path

from load_tests.harness.client import ClientConfig, make_client, send_one
from load_tests.harness.local_stack import LocalStack, StackConfig, require_offline
from load_tests.harness.models import bench_model
from load_tests.harness.stats import percentile_or_nan as p
from load_tests.harness.workload import RequestSpec, make_prompt
from load_tests.serving.bench_fairness import Phase, add_load_args, drive

MODEL = "tiny-llama"  # LocalStack's served model name, whatever model it serves


class HttpBench:
    def __init__(self, base_url: str, keys: dict[str, str], a: argparse.Namespace):
        self.a = a
        self.cfgs = {t: ClientConfig(base_url + "/v1", api_key=k, timeout=300.0) for t, k in keys.items()}
        self.rng = random.Random(0)
        self.ids = itertools.count()
        self.failed: dict[str, int] = {"a": 0, "b": 0}
        self.errors: set[str] = set()

    async def one(self, client, tenant: str, phase: Phase) -> None:
        a = self.a
        n = self.rng.randint(max(1, a.new // 2), 3 * a.new // 2)
        spec = RequestSpec(
            next(self.ids), MODEL, make_prompt(self.rng, a.prompt_len, "text"), a.prompt_len, n, None
        )
        t0 = time.perf_counter()
        timed = tenant == "b" and phase.in_window(t0)
        phase.pending_b += timed
        rec = await send_one(client, self.cfgs[tenant], spec, t0)
        phase.pending_b -= timed
        if not rec.ok:
            self.failed[tenant] += 1
            self.errors.add(f"{rec.error_kind}: {rec.error_detail}"[:160])
            await asyncio.sleep(0.1)  # a refused flood must not spin
            return
        per_chunk = rec.output_tokens / max(1, len(rec.chunk_times))
        phase.tokens[tenant] += round(per_chunk * sum(phase.in_window(t0 + c) for c in rec.chunk_times))
        if timed and rec.ttft is not None:
            phase.ttft_b.append(rec.ttft)

    async def run(self, client, flood: bool, b_rate: float) -> Phase:
        phase = Phase(self.a.seconds)
        a_streams = self.a.a_concurrency if flood else 0

        async def one(tenant: str, ph: Phase) -> None:
            await self.one(client, tenant, ph)

        await drive(phase, one, a_streams, b_rate, self.a.warmup, 300.0)
        await asyncio.sleep(2.0)  # the replica finishes aborting what was cut off
        return phase


async def measure(stack: LocalStack, keys: dict[str, str], a: argparse.Namespace) -> dict:
    bench = HttpBench(stack.base, keys, a)
    async with make_client(bench.cfgs["a"], a.a_concurrency + 64) as client:
        for t in ("a", "b"):  # warm both keys' auth caches and the replica
            await send_one(
                client, bench.cfgs[t], RequestSpec(0, MODEL, "w5 w6 w7", 3, 2, None), time.perf_counter()
            )
        sat = await bench.run(client, True, 0.0)
        b_rate = a.b_share * sat.tok_s() / a.new
        alone = await bench.run(client, False, b_rate)
        flood = await bench.run(client, True, b_rate)

    row = {
        "saturated_tok_s": sat.tok_s(),
        "b_rate_req_s": b_rate,
        "b_alone_ttft_p50": p(alone.ttft_b, 50),
        "b_alone_ttft_p99": p(alone.ttft_b, 99),
        "b_alone_n": len(alone.ttft_b),
        "flood_b_ttft_p50": p(flood.ttft_b, 50),
        "flood_b_ttft_p99": p(flood.ttft_b, 99),
        "flood_b_n": len(flood.ttft_b),
        "flood_tok_s": flood.tok_s(),
        "flood_a_tok_s": flood.tok_s("a"),
        "flood_b_tok_s": flood.tok_s("b"),
        "failed": dict(bench.failed),
        "errors": sorted(bench.errors)[:5],
    }
    row["ttft_p99_ratio"] = row["flood_b_ttft_p99"] / row["b_alone_ttft_p99"]
    row["throughput_ratio"] = row["flood_tok_s"] / row["saturated_tok_s"]
    return row


def stack_config(policy: str, model_dir: Path, max_batch: int) -> StackConfig:
    return StackConfig(
        replicas=1,
        adapters=0,
        cold=0,
        max_batch_size=max_batch,
        request_timeout_s=300.0,
        replica_num_cpus=1.0,
        num_cpus=4,
        scheduling_policy=policy.split("+")[0],
        vtc_preempt="+preempt" in policy,
        model_dir=model_dir,
        oracle=False,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--policies", default="vtc+preempt,fcfs")
    ap.add_argument("--passes", type=int, default=1, help="each pass runs every policy once, in turn")
    add_load_args(ap, max_batch=8, a_concurrency=32, b_share=0.25, prompt_len=32, new=16)
    ap.add_argument("--json", type=Path, default=None, help="also write the results here")
    a = ap.parse_args()
    require_offline()
    model_dir = bench_model()
    print(
        f"HTTP, one replica: A closed loop x{a.a_concurrency}; B {a.b_share:.0%} of saturated req/s; "
        f"{a.prompt_len} prompt + {a.new} new tokens; max_batch_size {a.max_batch}; {a.seconds:.0f}s per phase "
        f"after {a.warmup:.0f}s warm-up",
        flush=True,
    )
    rows = []
    for n in range(1, a.passes + 1):
        for policy in a.policies.split(","):
            with LocalStack(stack_config(policy, model_dir, a.max_batch)) as stack:
                keys = {"a": stack.add_tenant("tenant-a"), "b": stack.add_tenant("tenant-b")}
                r = asyncio.run(measure(stack, keys, a))
            rows.append({"pass": n, "policy": policy, **r})
            print(
                f"pass {n} {policy:11} saturated {r['saturated_tok_s']:6.1f} tok/s | B alone TTFT p50 "
                f"{r['b_alone_ttft_p50']:.3f}s p99 {r['b_alone_ttft_p99']:.3f}s (n={r['b_alone_n']}) | flood: B TTFT "
                f"p50 {r['flood_b_ttft_p50']:.3f}s p99 {r['flood_b_ttft_p99']:.3f}s (n={r['flood_b_n']}), "
                f"{r['flood_tok_s']:.1f} tok/s (A {r['flood_a_tok_s']:.1f}, B {r['flood_b_tok_s']:.1f}) | failed "
                f"{r['failed']} | p99 ratio {r['ttft_p99_ratio']:.2f} (goal <= 1.2), throughput ratio "
                f"{r['throughput_ratio']:.2f} (goal >= 0.9)",
                flush=True,
            )
            for e in r["errors"]:
                print("   error:", e, flush=True)
            if a.json:  # after every run: a long benchmark keeps what it measured
                a.json.write_text(json.dumps({"args": vars(a), "rows": rows}, indent=1, default=str))


if __name__ == "__main__":
    main()
