"""Adapters that change every few seconds (issue 34): RL-style weight sync through vLLM's runtime LoRA API under load.
Run: ./run bench churn [--quick] [--duration 600]; every answer checked against the version it names.
Method and results: load_tests/serving/RESULTS.md (churn)."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import time
from pathlib import Path

import httpx
import numpy as np
import psutil

PROMPTS = ["the quick brown fox", "hello world", "once upon a time", "to be or not"]
HDR, WARM, PUSH_S = "x-loraland-adapter-version", "x-loraland-warm-replicas", "x-loraland-push-seconds"


def rl_step(prev: Path, out: Path, rng: np.random.Generator, scale: float = 0.05) -> Path:
    """An RL step's new adapter: the previous weights plus noise (each version distinct)."""
    from safetensors.numpy import load_file, save_file

    out.mkdir(parents=True, exist_ok=True)
    tensors = load_file(str(prev / "adapter_model.safetensors"))
    new = {k: (v + rng.normal(0, scale, v.shape)).astype(np.float32) for k, v in tensors.items()}
    save_file(new, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text((prev / "adapter_config.json").read_text())
    return out


def stack_cpu() -> dict[int, tuple[str, float]]:
    """CPU seconds used so far by this process ("load") and every process it started: pid -> (title, seconds)."""
    out: dict[int, tuple[str, float]] = {}
    me = psutil.Process()
    for p in [me, *me.children(recursive=True)]:
        try:
            t, words = p.cpu_times(), p.cmdline()
            title = (
                "load"
                if p.pid == me.pid
                else (words[0].split(".")[0].rpartition("/")[2].strip() if words else "?")
            )
            out[p.pid] = (title, t.user + t.system)
        except psutil.Error:
            pass
    return out


def cpu_between(before: dict, after: dict) -> dict[str, float]:
    """CPU seconds each kind of process used between two stack_cpu() readings (the same titles summed)."""
    out: dict[str, float] = {}
    for pid, (title, s) in after.items():
        out[title] = out.get(title, 0.0) + s - before.get(pid, (title, 0.0))[1]
    return out


def cpu_name() -> str:
    """The CPU's model name (lscpu's), and how many cores this machine has."""
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return f"{line.partition(':')[2].strip()} ({os.cpu_count()} cores)"
    return f"unknown ({os.cpu_count()} cores)"


def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


class Churn:
    def __init__(self, stack, args) -> None:
        self.stack, self.args = stack, args
        self.headers = {"Authorization": f"Bearer {stack_admin()}"}
        self.root = Path(os.environ["LORALAND_LOCAL_ROOTS"])
        self.folders: dict[str, Path] = {}  # "rl0@3" -> folder
        self.names = [f"rl{i}" for i in range(args.churn)]
        self.latest: dict[str, int] = {}
        self.loaded_at: dict[str, float] = {}  # ref -> monotonic time its load returned
        self.returned_wall: dict[str, float] = {}  # ref -> wall time its load returned (vs replicas' answers)
        self.pushes: list[tuple[float, int, int]] = []  # (push seconds, warm holders, holders) per churn load
        self.warm_wall: dict[str, list[float]] = {}  # ref -> wall times replicas answered "warm" (SSE events)
        self.first_served: dict[str, float] = {}
        self.load_s: list[float] = []
        self.swap_s: list[float] = []
        self.probe = False  # set during the churn phase
        self.phases: dict[str, dict] = {}  # phase -> wall seconds, stack CPU seconds, load averages
        self.records: list[dict] = []
        self.rng = np.random.default_rng(0)
        self._refs: dict[tuple[str, str], str] = {}

    async def load(self, c: httpx.AsyncClient, name: str) -> None:
        from tests.fixtures.tiny_adapter import write_tiny_adapter

        v = self.latest.get(name, 0) + 1
        out = self.root / name / f"step-{v}"
        folder = (
            write_tiny_adapter(out, seed=900 + len(self.latest))
            if v == 1
            else rl_step(self.folders[f"{name}@{v - 1}"], out, self.rng)
        )
        body = {"lora_name": name, "lora_path": str(folder), "load_inplace": v > 1}
        t0 = time.monotonic()
        r = await c.post("/v1/load_lora_adapter", json=body, headers=self.headers)
        if r.status_code != 200:
            raise RuntimeError(f"load {name} v{v}: {r.status_code} {r.text}")
        ref = r.headers[HDR]
        self.loaded_at[ref], self.returned_wall[ref] = time.monotonic(), time.time()
        if self.probe:
            warm, holders = (int(x) for x in r.headers[WARM].split("/"))
            self.pushes.append((float(r.headers[PUSH_S]), warm, holders))
        self.load_s.append(self.loaded_at[ref] - t0)
        self.folders[ref] = folder
        self.latest[name] = int(ref.rpartition("@")[2])
        if self.probe:  # from the load returning to a 1-token answer on the new version (warm if pushed)
            pr = await self.probe_once(c, name)
            if pr.status_code == 200 and pr.headers.get(HDR) == ref:
                self.swap_s.append(time.monotonic() - self.loaded_at[ref])

    async def probe_once(self, c: httpx.AsyncClient, name: str) -> httpx.Response:
        body = {"model": name, "prompt": PROMPTS[0], "max_tokens": 1, "temperature": 0}
        return await c.post("/v1/completions", headers=self.headers, json=body)

    async def prober(self, c: httpx.AsyncClient, until: float) -> None:
        """Without churn, the churn phase's swap probes all the same (one per churning name every --swap-s):
        the phases then differ by the loads and pushes only."""
        while time.monotonic() < until:
            t0 = time.monotonic()
            await asyncio.gather(*(self.probe_once(c, n) for n in self.names))
            await asyncio.sleep(max(0.0, self.args.swap_s - (time.monotonic() - t0)))

    async def warm_events(self, c: httpx.AsyncClient, seconds: float) -> None:
        """The replicas' "warm" answers to pushed versions, from the residency event stream."""
        url = f"/v1/residency/events?poll_s=30&duration_s={seconds:.0f}"
        async with c.stream("GET", url, headers=self.headers) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    ev = json.loads(line[6:])
                    if ev.get("type") == "warm" and ev.get("ok"):
                        self.warm_wall.setdefault(f"{ev['adapter']}@{ev['version']}", []).append(ev["at"])

    async def swapper(self, c: httpx.AsyncClient, until: float) -> None:
        while time.monotonic() < until:
            t0 = time.monotonic()
            await asyncio.gather(*(self.load(c, n) for n in self.names))
            await asyncio.sleep(max(0.0, self.args.swap_s - (time.monotonic() - t0)))

    async def client(self, c: httpx.AsyncClient, until: float, phase: str, seed: int) -> None:
        rnd = random.Random(seed)
        others = self.stack.warm
        while time.monotonic() < until:
            model = rnd.choice(self.names) if rnd.random() < 0.5 else rnd.choice(others)
            prompt, stream = rnd.choice(PROMPTS), rnd.random() < 0.5
            body = {"model": model, "prompt": prompt, "max_tokens": self.args.max_tokens, "temperature": 0,
                    "stream": stream}  # fmt: skip
            rec = {"phase": phase, "model": model, "prompt": prompt, "stream": stream, "t0": time.monotonic()}
            try:
                if stream:
                    async with c.stream("POST", "/v1/completions", json=body, headers=self.headers) as r:
                        text = ""
                        async for line in r.aiter_lines():
                            if line.startswith("data: {"):
                                ev = json.loads(line[6:])
                                if "error" in ev:
                                    rec["error"] = ev["error"].get("message")
                                text += "".join(ch.get("text", "") for ch in ev.get("choices", []))
                else:
                    r = await c.post("/v1/completions", json=body, headers=self.headers)
                    text = r.json()["choices"][0]["text"] if r.status_code == 200 else ""
                rec.update(status=r.status_code, served=r.headers.get(HDR), text=text)
            except Exception as e:
                rec.update(status=None, error=repr(e))
            rec["t1"] = time.monotonic()
            served = rec.get("served")
            if served in self.loaded_at and rec["t0"] >= self.loaded_at[served]:
                self.first_served.setdefault(served, rec["t1"])
            self.records.append(rec)

    async def phase(self, name: str, duration: float, churn: bool) -> None:
        limits = httpx.Limits(max_connections=self.args.clients + 8)
        async with httpx.AsyncClient(base_url=self.stack.base, timeout=120, limits=limits) as c:
            if not self.latest:
                await asyncio.gather(*(self.load(c, n) for n in self.names))
            until = time.monotonic() + duration
            tasks = [self.client(c, until, name, i) for i in range(self.args.clients)]
            self.probe = churn
            if churn:
                tasks += [self.swapper(c, until), self.warm_events(c, duration + 5)]
            elif name != "warmup":
                tasks.append(self.prober(c, until))
            t0, cpu0, load0 = time.monotonic(), stack_cpu(), os.getloadavg()
            await asyncio.gather(*tasks)
            by = {
                k: round(v, 1)
                for k, v in sorted(cpu_between(cpu0, stack_cpu()).items(), key=lambda kv: -kv[1])
            }
            wall, cpu = time.monotonic() - t0, sum(by.values())
            self.phases[name] = {"wall_s": round(wall, 1), "stack_cpu_s": round(cpu, 1),
                                 "stack_cores": round(cpu / wall, 2), "loadavg_start": load0,
                                 "loadavg_end": os.getloadavg(),
                                 "cpu_s_by_process": {k: v for k, v in by.items() if v >= 0.5}}  # fmt: skip

    def reference(self, served: str, prompt: str) -> str:
        """The in-process kernel's greedy text for `served` (a churned version: its folder, under a name of
        its own so the oracle never holds two versions of one name)."""
        if served not in self.folders:
            return self.stack.reference(served.partition("@")[0], prompt, None, self.args.max_tokens)
        key = (served, prompt)
        if key not in self._refs:
            oracle, alias = self.stack.oracle, served.replace("@", "-v")
            oracle.load_adapter(alias, self.folders[served], version=1)
            for p in PROMPTS:
                self._refs[(served, p)] = oracle.complete([p], [alias], max_tokens=self.args.max_tokens)[
                    0
                ].text
            oracle.unload_adapter(alias)
        return self._refs[key]

    def summary(self, resources: dict) -> dict:
        out: dict = {
            "args": vars(self.args),
            "cpu": cpu_name(),
            "resources": resources,
            "phases": self.phases,
        }
        for phase in ("baseline", "churn", "baseline_after"):  # (the warm-up phase is not counted)
            recs = [r for r in self.records if r["phase"] == phase]
            ok = [r for r in recs if r.get("status") == 200 and r.get("served") and not r.get("error")]
            lost = [r for r in recs if r not in ok]
            wrong = [r for r in ok if r["text"] != self.reference(r["served"], r["prompt"])]
            churned = [r for r in ok if r["model"] in self.names]
            span = max(r["t1"] for r in recs) - min(r["t0"] for r in recs) if recs else 0
            out[phase] = {
                "requests": len(recs), "ok": len(ok), "lost": len(lost), "wrong_version": len(wrong),
                "on_churned_adapters": len(churned), "streamed": sum(r["stream"] for r in recs),
                "req_per_s": len(ok) / span if span else 0.0,
                "req_per_stack_cpu_s": len(ok) / self.phases[phase]["stack_cpu_s"] if phase in self.phases else None,
                "latency_p50_s": pct([r["t1"] - r["t0"] for r in ok], 0.5),
                "latency_p99_s": pct([r["t1"] - r["t0"] for r in ok], 0.99),
                "lost_examples": [{k: r.get(k) for k in ("model", "status", "error")} for r in lost[:5]],
                "wrong_examples": [{k: r.get(k) for k in ("model", "served", "prompt", "text")} for r in wrong[:5]],
            }  # fmt: skip
        swaps = [self.first_served[r] - self.loaded_at[r] for r in self.first_served]
        # Every holder warm, relative to the load returning (<= 0: warm before it returned, as pushes intend).
        lag = [max(ts) - self.returned_wall[r] for r, ts in self.warm_wall.items() if r in self.returned_wall]
        push_s = [p[0] for p in self.pushes]
        out["swaps"] = {
            "versions_loaded": len(self.load_s),
            "load_call_p50_s": pct(self.load_s, 0.5),
            "load_call_p99_s": pct(self.load_s, 0.99),
            "swap_probe_p50_s": pct(self.swap_s, 0.5),
            "swap_probe_p99_s": pct(self.swap_s, 0.99),
            "swap_probes": len(self.swap_s),
            "served_after_load_p50_s": pct(swaps, 0.5),
            "served_after_load_p99_s": pct(swaps, 0.99),
            "versions_served": len(self.first_served),
            "push_p50_s": pct(push_s, 0.5),
            "push_p99_s": pct(push_s, 0.99),
            "pushed_loads": sum(1 for p in self.pushes if p[2]),
            "pushed_all_holders_warm": sum(1 for p in self.pushes if p[2] and p[1] == p[2]),
            "holders_warm_after_return_p50_s": pct(lag, 0.5),
            "holders_warm_after_return_p99_s": pct(lag, 0.99),
            "holders_warm_after_return_max_s": max(lag) if lag else None,
        }
        # Is the wrong-version check able to see a wrong version? Distinct reference texts per churned adapter.
        texts: dict[tuple[str, str], set[str]] = {}
        for ref in self.folders:
            for p in PROMPTS[:2]:
                texts.setdefault((ref.partition("@")[0], p), set()).add(self.reference(ref, p))
        out["swaps"]["distinct_reference_texts_per_adapter_prompt"] = sorted(len(v) for v in texts.values())
        # Vs each baseline (before and after the churn: the machine is shared, its load drifts), and per CPU
        # second the stack used (what the churn costs, whatever share of the machine the stack got).
        for key in ("req_per_s", "req_per_stack_cpu_s"):
            churn = out["churn"][key]
            bases = [
                out[b][key] for b in ("baseline", "baseline_after") if out[b]["requests"] and out[b][key]
            ]
            ratio = f"{'throughput' if key == 'req_per_s' else 'per_cpu'}_churn_vs_baseline"
            out[ratio] = [round(churn / b, 3) for b in bases]
            out[ratio + "_mean"] = round(churn / (sum(bases) / len(bases)), 3) if bases else None
        return out


def stack_admin() -> str:
    from load_tests.harness.local_stack import ADMIN

    return ADMIN


def snapshot(stack) -> dict:
    r = httpx.get(
        f"{stack.base}/v1/residency", headers={"Authorization": f"Bearer {stack_admin()}"}, timeout=30
    )
    reps = r.json()["replicas"]
    rss = stack.replica_resources()
    return {
        "rss_mib": sorted(round(v["rss_mib"]) for v in rss.values()),
        "free_slots": [x["free_slots"] for x in reps],
        "device_slots_used": [x["device_slots_used"] for x in reps],
        "kv_usage": [x["kv_usage"] for x in reps],
        "adapters_held": [len(x["adapters"]) for x in reps],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--duration", type=float, default=600.0, help="seconds of churn (the baseline: a third)")
    ap.add_argument("--quick", action="store_true", help="30 s of churn, 12 other adapters")
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--churn", type=int, default=4, help="adapters getting a new version every --swap-s")
    ap.add_argument("--swap-s", type=float, default=2.0)
    ap.add_argument("--others", type=int, default=50, help="steady adapters beside the churning ones")
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--no-after", action="store_true", help="no second baseline after the churn")
    ap.add_argument("--out", type=Path, default=None, help="JSON results (default results/churn-<mode>.json)")
    args = ap.parse_args(argv)
    if args.quick:
        args.duration, args.others = 30.0, min(args.others, 12)

    from load_tests.harness.local_stack import LocalStack, StackConfig, require_offline

    require_offline()
    cfg = StackConfig(replicas=args.replicas, adapters=args.others, cold=0, max_adapters=8, max_tokens=args.max_tokens,
                      num_cpus=max(4, args.replicas + 2))  # fmt: skip
    stack = LocalStack(cfg)
    root = stack.workdir / "rl"
    root.mkdir(parents=True)
    os.environ["LORALAND_LOCAL_ROOTS"] = str(root)  # Ray's workers inherit it: the folders trainers write
    with stack:
        bench = Churn(stack, args)
        asyncio.run(bench.phase("warmup", 8.0, churn=False))  # every adapter's first load, not counted
        asyncio.run(bench.phase("baseline", max(20.0, args.duration / 3), churn=False))
        start = snapshot(stack)
        asyncio.run(bench.phase("churn", args.duration, churn=True))
        time.sleep(2 * cfg.heartbeat_s)
        end = snapshot(stack)
        if not args.no_after:
            asyncio.run(bench.phase("baseline_after", max(20.0, args.duration / 3), churn=False))
        result = bench.summary({"start": start, "end": end})
    out = (
        args.out
        or Path(__file__).parent / "results" / f"churn-{'quick' if args.quick else int(args.duration)}.json"
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2, default=str))
    print(json.dumps({k: v for k, v in result.items() if k != "args"}, indent=2, default=str))
    bad = result["churn"]["wrong_version"] + result["churn"]["lost"] + result["baseline"]["lost"]
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
