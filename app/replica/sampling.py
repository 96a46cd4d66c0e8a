"""Sampling parameters and the sampler (greedy, temperature, top-k, top-p, per-request seeds).

Every value a request may carry is checked once, in `SamplingParams.__post_init__`, before the request enters
the shared batch: what is accepted here the sampler can honour for any logits. What can only go wrong inside
the batched step (one row's logits are inf/NaN, e.g. an adapter with absurd weights; an exception while
drawing one row's token) comes back from `sample` as that row's exception, never as the step's.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, fields

import torch

from app.errors import InvalidRequest

# Temperatures below this are greedy (argmax): vLLM's _SAMPLING_EPS. Scaling by 1/t that small only sharpens a
# distribution that is already one-hot to float32 precision, and 1e-300 would overflow logits / t.
SAMPLING_EPS = 1e-5
# Seeds are signed 64-bit integers, the range vLLM's OpenAI server accepts (torch.iinfo(torch.long)).
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1
_F32_MAX = torch.finfo(torch.float32).max


def _invalid(param: str, message: str) -> InvalidRequest:
    err = InvalidRequest(f"{param}: {message}")  # "field: what was wrong", the project's convention
    err.param = param
    return err


def _show(value: object) -> str:
    """A value for an error message, cut short (a 10 kB integer is not echoed back whole)."""
    if isinstance(value, int) and value.bit_length() > 128:
        return f"an integer of {value.bit_length()} bits"
    text = repr(value)
    return text if len(text) <= 64 else text[:61] + "..."


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_real(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


@dataclass(frozen=True)
class SamplingParams:
    """One request's sampling; the checks below name the field and its accepted range.

    temperature: a finite number >= 0; below SAMPLING_EPS (1e-5) the request is greedy. top_p: in (0, 1].
    top_k: -1 or 0 = off, else a positive integer (>= the vocabulary size = off). seed: an integer in
    [-2**63, 2**63 - 1] (SEED_MIN..SEED_MAX), as vLLM accepts; it seeds this request's own generator.
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0  # 0 or -1 = off
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise _invalid("max_tokens", f"must be an integer >= 1, got {_show(self.max_tokens)}")
        t = self.temperature
        if not _is_real(t) or not math.isfinite(t) or t < 0:
            raise _invalid(
                "temperature",
                f"must be a finite number >= 0 (below {SAMPLING_EPS} means greedy), got {_show(t)}",
            )
        p = self.top_p
        if not _is_real(p) or not math.isfinite(p) or not 0 < p <= 1:
            raise _invalid("top_p", f"must be a number in (0, 1], got {_show(p)}")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise _invalid("top_k", f"must be -1, 0 (off) or a positive integer, got {_show(self.top_k)}")
        s = self.seed
        if s is not None and (not _is_int(s) or not SEED_MIN <= s <= SEED_MAX):
            raise _invalid(
                "seed", f"must be an integer in [{SEED_MIN}, {SEED_MAX}] (signed 64-bit), got {_show(s)}"
            )
        if any(not isinstance(x, str) or not x for x in self.stop):
            raise _invalid("stop", "stop strings must be non-empty strings")
        if not all(_is_int(x) for x in self.stop_token_ids):
            raise _invalid("stop_token_ids", "must be a list of integer token ids")

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS

    @classmethod
    def from_kwargs(cls, **kw) -> SamplingParams:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kw) - known)
        if unknown:
            raise InvalidRequest(f"unknown sampling parameter(s) {unknown}; supported: {sorted(known)}")
        if isinstance(kw.get("stop"), str):
            kw["stop"] = (kw["stop"],)
        for key in ("stop", "stop_token_ids"):
            if kw.get(key) is None:
                kw.pop(key, None)
            else:
                kw[key] = tuple(kw[key])
        kw = {k: v for k, v in kw.items() if v is not None or k == "seed"}
        return cls(**kw)


@dataclass
class SamplerState:
    """Per-sequence random state: a seeded sequence draws only from its own generator."""

    generator: torch.Generator | None = field(default=None)


class NonFiniteLogits(Exception):
    """A row's logits hold inf or NaN: no token drawn from them would mean anything."""


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    states: list[SamplerState],
    check: Callable[[int], None] | None = None,
) -> list[int | Exception]:
    """logits [n, V] (any float dtype) -> per row, its token id, or the exception that failed that row alone
    (NonFiniteLogits, or whatever drawing its token raised). `check(i)`, a test hook, runs per row first and
    fails that row if it raises. Rows never affect each other: a failed row leaves the others' tokens, and
    their generators, exactly as they would have been without it."""
    logits = logits.float()
    # A row sum is inf/NaN if any of its logits is (argmax of a NaN row is garbage, so greedy rows count too):
    # one cheap pass over the whole tensor, one transfer with the argmax. Only the rows it flags are checked
    # element by element (a finite row's sum can overflow).
    flag = ~torch.isfinite(logits.sum(dim=-1))
    head = torch.stack((logits.argmax(dim=-1), flag.long())).tolist()
    out: list[int | Exception] = list(head[0])
    if flagged := [i for i, f in enumerate(head[1]) if f]:
        exact = (~torch.isfinite(logits[flagged]).all(dim=-1)).tolist()
        for i in (i for i, b in zip(flagged, exact) if b):
            out[i] = NonFiniteLogits("non-finite logits (inf/NaN)")
    if check is not None:
        for i in (i for i, t in enumerate(out) if not isinstance(t, Exception)):
            try:
                check(i)
            except Exception as e:
                out[i] = e
    rows = [i for i, p in enumerate(params) if not p.greedy and not isinstance(out[i], Exception)]
    if not rows:
        return out
    try:
        probs = _probs(logits, rows, params)
    except Exception:  # find the row at fault: each row alone (nothing random was drawn yet)
        probs = None
    for j, i in enumerate(rows):
        try:
            row = probs[j] if probs is not None else _probs(logits, [i], params)[0]
            out[i] = int(torch.multinomial(row, 1, generator=_generator(states[i], params[i], row.device)))
        except Exception as e:
            out[i] = e
    return out


def _probs(logits: torch.Tensor, rows: list[int], params: list[SamplingParams]) -> torch.Tensor:
    """Unnormalized next-token probabilities of `rows` (all finite): temperature, then top-k, then top-p."""
    dev = logits.device
    x = logits if len(rows) == logits.shape[0] else logits.index_select(0, torch.tensor(rows, device=dev))
    ps = [params[i] for i in rows]
    # Numerically safe scaling: shift each row so its max is 0, then divide by t (kept finite in float32).
    # (x - max) / t is in [-inf, 0] for every accepted t (>= SAMPLING_EPS) with an exact 0 at the max:
    # softmax never sees inf - inf, nor -inf / inf, and at least one token keeps probability 1.
    x = x - x.amax(dim=-1, keepdim=True)  # a new tensor: in place from here on
    x.div_(torch.tensor([min(p.temperature, _F32_MAX) for p in ps], device=dev)[:, None])
    vocab = x.shape[1]
    ks = [p.top_k if 0 < p.top_k < vocab else vocab for p in ps]
    if sel := [j for j, k in enumerate(ks) if k < vocab]:  # top-k rows only
        idx, kk = torch.tensor(sel, device=dev), torch.tensor([ks[j] for j in sel], device=dev)[:, None]
        sub = x.index_select(0, idx)
        kth = sub.topk(max(ks[j] for j in sel), dim=-1).values.gather(1, kk - 1)
        x.index_copy_(0, idx, sub.masked_fill(sub < kth, float("-inf")))  # ties at the k-th value survive
    probs = torch.softmax(x, dim=-1)
    if sel := [j for j, p in enumerate(ps) if p.top_p < 1]:  # top-p rows only
        idx = torch.tensor(sel, device=dev)
        sorted_p, order = probs.index_select(0, idx).sort(dim=-1, descending=True)
        top_p = torch.tensor([ps[j].top_p for j in sel], device=dev)[:, None]
        keep = sorted_p.cumsum(-1) - sorted_p < top_p  # always keeps the top token
        probs.index_copy_(0, idx, torch.zeros_like(sorted_p).scatter_(1, order, sorted_p * keep))
    return probs


def _generator(st: SamplerState, p: SamplingParams, device: torch.device) -> torch.Generator:
    """The sequence's own generator, on the logits' device (a CPU generator cannot draw on a GPU)."""
    if st.generator is None or st.generator.device != device:
        st.generator = torch.Generator(device=device)
        if p.seed is not None:
            st.generator.manual_seed(p.seed)
        else:
            st.generator.seed()
    return st.generator
