"""What a load test sends: which model each request names, how long its prompt and output are, and when it goes.

Everything here is pure and seeded, so the same arguments give the same requests against every server.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

# The bench tokenizer (load_tests/harness/models.py) is word-level over "w3".."w31999": N such words are N tokens.
FIRST_WORD_ID = 3
VOCAB = 32000

POPULARITIES = ("uniform", "zipf:A", "distinct", "identical", "base")

WORKLOAD_W_ARGS = ["--concurrency", "64", "--num-requests", "64", "--prompt-len", "128", "--output-len", "64"]
# bench_serving's arguments for workload W. One untimed pass of each run first: vLLM CPU compiles per batch shape, and adapters are then resident on both.
WORKLOAD_W_ARGS += ["--seed", "0", "--warmup-runs", "1", "--no-progress"]


@dataclass(frozen=True)
class LengthDist:
    """A token-length distribution: `N` (fixed), `N:uniform[:R]`, `N:normal:SD`, `N:exp`.

    uniform without R spans [N/2, 3N/2]; every draw is clipped to at least 1.
    """

    mean: int
    kind: str = "fixed"
    param: float | None = None

    def __post_init__(self) -> None:
        if self.mean < 1:
            raise ValueError(f"length {self.mean} must be at least 1")
        if self.kind not in ("fixed", "uniform", "normal", "exp"):
            raise ValueError(f"length distribution {self.kind!r} unknown: use fixed, uniform, normal or exp")
        if self.kind == "normal" and (self.param is None or self.param < 0):
            raise ValueError("normal needs a standard deviation: N:normal:SD, e.g. 128:normal:32")

    def sample(self, rng: random.Random) -> int:
        if self.kind == "fixed":
            return self.mean
        if self.kind == "uniform":
            r = int(self.param) if self.param is not None else self.mean // 2
            return max(1, rng.randint(self.mean - r, self.mean + r))
        if self.kind == "normal":
            return max(1, round(rng.gauss(self.mean, self.param)))
        return max(1, round(rng.expovariate(1.0 / self.mean)))


def parse_length(text: str) -> LengthDist:
    parts = text.split(":")
    try:
        mean = int(parts[0])
        param = float(parts[2]) if len(parts) > 2 else None
    except ValueError:
        raise ValueError(f"length {text!r}: expected N, N:uniform[:R], N:normal:SD or N:exp") from None
    if len(parts) > 3:
        raise ValueError(f"length {text!r}: expected N, N:uniform[:R], N:normal:SD or N:exp")
    return LengthDist(mean, parts[1] if len(parts) > 1 else "fixed", param)


@dataclass(frozen=True)
class Popularity:
    """How requests pick adapters: uniform, zipf:alpha (rank k has weight 1/k^alpha), distinct (request i gets
    adapter i, cycling when there are more requests than adapters), identical (all on the first adapter), or
    base (all on the base model, no adapter)."""

    kind: str
    alpha: float = 0.0

    def __post_init__(self) -> None:
        if self.kind not in ("uniform", "zipf", "distinct", "identical", "base"):
            raise ValueError(f"popularity {self.kind!r} unknown: use one of {', '.join(POPULARITIES)}")
        if self.kind == "zipf" and self.alpha <= 0:
            raise ValueError("zipf needs a positive exponent, e.g. zipf:1.1")

    def __str__(self) -> str:
        return f"zipf:{self.alpha:g}" if self.kind == "zipf" else self.kind


def parse_popularity(text: str) -> Popularity:
    kind, _, arg = text.partition(":")
    if kind == "zipf":
        try:
            return Popularity("zipf", float(arg))
        except ValueError:
            raise ValueError(f"popularity {text!r}: write zipf:ALPHA, e.g. zipf:1.1") from None
    if arg:
        raise ValueError(f"popularity {text!r}: only zipf takes an argument")
    return Popularity(kind)


def assign_models(pop: Popularity, base: str, adapters: list[str], n: int, rng: random.Random) -> list[str]:
    """The `model` field of each of n requests."""
    if pop.kind == "base":
        return [base] * n
    if not adapters:
        raise ValueError(
            f"popularity {pop} needs adapters: give --adapters or --adapter-prefix/--num-adapters"
        )
    if pop.kind == "identical":
        return [adapters[0]] * n
    if pop.kind == "distinct":
        return [adapters[i % len(adapters)] for i in range(n)]
    if pop.kind == "uniform":
        return [rng.choice(adapters) for _ in range(n)]
    weights = [1.0 / (k**pop.alpha) for k in range(1, len(adapters) + 1)]
    return rng.choices(adapters, weights=weights, k=n)


@dataclass(frozen=True)
class RequestSpec:
    index: int
    model: str
    prompt: str | list[int]
    prompt_len: int
    max_tokens: int
    send_at: float | None  # seconds after the start (rate mode); None = as soon as a slot is free


def make_prompt(rng: random.Random, n_tokens: int, fmt: str) -> str | list[int]:
    ids = [rng.randrange(FIRST_WORD_ID, VOCAB) for _ in range(n_tokens)]
    return ids if fmt == "ids" else " ".join(f"w{i}" for i in ids)


def poisson_arrivals(rate: float, n: int, rng: random.Random) -> list[float]:
    """n arrival times (s) of a Poisson process with `rate` requests/s; the first request goes at 0."""
    t, out = 0.0, []
    for i in range(n):
        if i:
            t += rng.expovariate(rate)
        out.append(t)
    return out


def build_workload(
    *,
    base: str,
    adapters: list[str],
    popularity: Popularity,
    num_requests: int,
    prompt_len: LengthDist,
    output_len: LengthDist,
    prompt_format: str = "text",
    rate: float | None = None,
    seed: int = 0,
    prompt_salt: str = "",
) -> list[RequestSpec]:
    """The requests of one run. Separate RNG streams per aspect, so changing the popularity does not change the
    prompts, and the base-model run sends exactly the prompts the adapter run sends."""
    if prompt_format not in ("text", "ids"):
        raise ValueError(f"prompt format {prompt_format!r}: use text or ids")
    models = assign_models(popularity, base, adapters, num_requests, random.Random(f"{seed}-models"))
    lens_rng, prompt_rng = random.Random(f"{seed}-lengths"), random.Random(f"{seed}-prompts{prompt_salt}")
    arrivals = poisson_arrivals(rate, num_requests, random.Random(f"{seed}-arrivals")) if rate else None
    out = []
    for i in range(num_requests):
        p, o = prompt_len.sample(lens_rng), output_len.sample(lens_rng)
        out.append(
            RequestSpec(
                i,
                models[i],
                make_prompt(prompt_rng, p, prompt_format),
                p,
                o,
                arrivals[i] if arrivals else None,
            )
        )
    return out
