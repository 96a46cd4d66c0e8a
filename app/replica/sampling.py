"""The sampler (greedy, temperature, min-p, top-k, top-p, per-request seeds), with
logits processors (logit_bias, min_tokens, repetition/frequency/presence penalties: app/replica/logits_processors.py)
and log probabilities.

Order per row, as vLLM's: logit_bias and min_tokens, then the penalties, then the response_format grammar mask
(app/replica/grammar.py: tokens the row's JSON grammar forbids next get -inf), then greedy argmax, or temperature ->
min-p -> top-k -> top-p -> draw. Log probabilities are vLLM's default ("raw_logprobs"): log_softmax of the model's
own logits, before any of the above, so they do not change with penalties, bias or temperature (the sampled
token's logprob is its raw logprob even when a processor made it likely). Rows that use none of the processors
or logprobs pay nothing for them: each stage runs only when some row of the batch needs it.

Every value a request may carry is checked once, in `SamplingParams.__post_init__` (app/sampling_params.py),
before the request enters the shared batch: what is accepted here the sampler can honour for any logits. What can only go wrong inside
the batched step (one row's logits are inf/NaN, e.g. an adapter with absurd weights; an exception while
drawing one row's token) comes back from `sample` as that row's exception, never as the step's.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from collections.abc import Sequence as Seq

import torch
from loraland_kernels import fused

from app.errors import InvalidRequest
from app.replica.grammar import mask_rows
from app.replica.logits_processors import apply_processors
from app.replica.logprobs import SampleLogprobs, sample_logprobs
from app.replica.sampler_state import SamplerState
from app.sampling_params import SamplingParams

_F32_MAX = torch.finfo(torch.float32).max


class NonFiniteLogits(Exception):
    """A row's logits hold inf or NaN: no token drawn from them would mean anything."""


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    states: list[SamplerState],
    check: Callable[[int], None] | None = None,
    **context,
) -> list[int | Exception]:
    """`sample_with_logprobs` without the log probabilities."""
    return sample_with_logprobs(logits, params, states, check, **context)[0]


def sample_with_logprobs(
    logits: torch.Tensor,
    params: list[SamplingParams],
    states: list[SamplerState],
    check: Callable[[int], None] | None = None,
    *,
    histories: Seq[tuple[list[int], list[int]]] | None = None,
    stop_ids: frozenset[int] = frozenset(),
) -> tuple[list[int | Exception], list[SampleLogprobs | None]]:
    """logits [n, V] (any float dtype) -> per row, its token id or the exception that failed that row alone
    (NonFiniteLogits, or whatever drawing its token raised), and its SampleLogprobs (None unless the row asked
    for logprobs and got a token). `histories[i]`: row i's (prompt ids, output ids), read by the penalties and
    min_tokens (needed when a row uses them); `stop_ids`: the model's EOS ids, which min_tokens masks (with
    each row's stop_token_ids) unless the row ignores EOS. `check(i)`, a test hook, runs per row first and
    fails that row if it raises. Rows never affect each other: a failed row leaves the others' tokens, and
    their generators, exactly as they would have been without it."""
    raw = logits.float()
    n = raw.shape[0]
    sub, bad = None, {}
    if proc := [i for i, p in enumerate(params) if p.processed]:  # the fast path skips all of this
        if histories is None:
            raise ValueError("penalties, logit_bias and min_tokens need each row's token history")
        sub, top, bad = _processed(raw, proc, params, states, histories, stop_ids)
    # A row with an inf/NaN logit fails alone (argmax of a NaN row is garbage, so greedy rows count too). The fused
    # op finds each row's argmax and flags those rows in one pass; the torch path flags rows whose sum is not
    # finite, in one more pass. Either way one transfer, and only the flagged rows are checked element by element
    # (a finite row's sum can overflow).
    if fused.enabled(raw.device) and raw.stride(-1) == 1:  # one pass over the logits for both
        head = fused.greedy_rows(raw).T.tolist()
    else:
        flag = ~torch.isfinite(raw.sum(dim=-1))
        head = torch.stack((raw.argmax(dim=-1), flag.long())).tolist()
    out: list[int | Exception] = list(head[0])
    if sub is not None:  # processed rows: their argmax is the processed logits'
        for i, t in zip(proc, top):
            out[i] = t
    if flagged := [i for i, f in enumerate(head[1]) if f]:
        exact = (~torch.isfinite(raw[flagged]).all(dim=-1)).tolist()
        for i in (i for i, b in zip(flagged, exact) if b):
            out[i] = NonFiniteLogits("non-finite logits (inf/NaN)")
    for i, e in bad.items():
        if not isinstance(out[i], Exception):
            out[i] = e
    if check is not None:
        for i in (i for i, t in enumerate(out) if not isinstance(t, Exception)):
            try:
                check(i)
            except Exception as e:
                out[i] = e
    rows = [i for i, p in enumerate(params) if not p.greedy and not isinstance(out[i], Exception)]
    x = raw
    if (
        rows and sub is not None and any(not params[i].greedy for i in proc)
    ):  # sampled rows read processed ones
        x = raw.index_copy(0, torch.tensor(proc, device=raw.device), sub)
    if rows:
        try:
            probs = _probs(x, rows, params)
        except Exception:  # find the row at fault: each row alone (nothing random was drawn yet)
            probs = None
        for j, i in enumerate(rows):
            try:
                row = probs[j] if probs is not None else _probs(x, [i], params)[0]
                out[i] = int(
                    torch.multinomial(row, 1, generator=_generator(states[i], params[i], row.device))
                )
            except Exception as e:
                out[i] = e
    logprobs: list[SampleLogprobs | None] = [None] * n
    if want := [
        i for i, p in enumerate(params) if p.logprobs is not None and not isinstance(out[i], Exception)
    ]:
        sample_logprobs(raw, want, [params[i].logprobs for i in want], out, logprobs)
    return out, logprobs


def _processed(
    raw: torch.Tensor,
    proc: list[int],
    params: list[SamplingParams],
    states: list[SamplerState],
    histories: Seq[tuple[list[int], list[int]]],
    stop_ids: frozenset[int],
) -> tuple[torch.Tensor, list[int], dict[int, Exception]]:
    """Rows `proc` of the logits, processed (a new tensor: `raw` stays the model's, for logprobs), their argmax,
    and the rows that failed: an exception while processing one (found by redoing each row alone), or
    processing that left no finite logit."""
    dev = raw.device
    bad: dict[int, Exception] = {}
    sub = raw.index_select(0, torch.tensor(proc, device=dev))
    try:
        apply_processors(
            sub, [params[i] for i in proc], [states[i] for i in proc], [histories[i] for i in proc], stop_ids
        )
    except Exception:
        sub = raw.index_select(0, torch.tensor(proc, device=dev))
        for j, i in enumerate(proc):
            try:
                apply_processors(sub[j : j + 1], [params[i]], [states[i]], [histories[i]], stop_ids)
            except Exception as e:
                bad[i] = e
    if gram := [j for j, i in enumerate(proc) if states[i].grammar is not None and i not in bad]:
        _mask(sub, gram, proc, states, histories, bad)
    # -inf is expected (min_tokens masks); a row whose best logit is not finite has nothing to sample.
    best, at = sub.max(dim=-1)
    top, broken = torch.stack((at, (~torch.isfinite(best)).long())).tolist()
    for j, i in enumerate(proc):
        if broken[j] and i not in bad:
            bad[i] = InvalidRequest(
                "the sampling options (penalties, logit_bias, min_tokens, response_format) left no token with a finite logit: "
                "relax them"
            )
    return sub, top, bad


def _mask(
    sub: torch.Tensor,
    gram: list[int],
    proc: list[int],
    states: list[SamplerState],
    histories: Seq[tuple[list[int], list[int]]],
    bad: dict[int, Exception],
) -> None:
    """response_format: rows `gram` of `sub` keep only what their grammar allows (each row alone on failure)."""

    def apply(js: list[int]) -> None:
        mask_rows(sub, js, [states[proc[j]].grammar for j in js], [histories[proc[j]][1] for j in js])

    try:
        apply(gram)
    except Exception:
        for j in gram:
            try:
                apply([j])
            except Exception as e:
                bad[proc[j]] = e


def _probs(logits: torch.Tensor, rows: list[int], params: list[SamplingParams]) -> torch.Tensor:
    """Unnormalized next-token probabilities of `rows` (each with a finite max): temperature, then min-p, then
    top-k, then top-p."""
    dev = logits.device
    x = logits if len(rows) == logits.shape[0] else logits.index_select(0, torch.tensor(rows, device=dev))
    ps = [params[i] for i in rows]
    # Numerically safe scaling: shift each row so its max is 0, then divide by t (kept finite in float32).
    # (x - max) / t is in [-inf, 0] for every accepted t (>= SAMPLING_EPS) with an exact 0 at the max:
    # softmax never sees inf - inf, nor -inf / inf, and at least one token keeps probability 1.
    x = x - x.amax(dim=-1, keepdim=True)  # a new tensor: in place from here on
    x.div_(torch.tensor([min(p.temperature, _F32_MAX) for p in ps], device=dev)[:, None])
    if sel := [j for j, p in enumerate(ps) if p.min_p > 0]:  # min-p rows only
        # Each row's max is 0 now, so "p < min_p * p_max" is "x < log(min_p)": no softmax needed.
        idx = torch.tensor(sel, device=dev)
        floor = torch.tensor([math.log(ps[j].min_p) for j in sel], device=dev)[:, None]
        sub = x.index_select(0, idx)
        x.index_copy_(0, idx, sub.masked_fill(sub < floor, float("-inf")))
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
