"""Logits processors of the batched sampler: logit_bias, min_tokens, then the penalties (vLLM's order).

Semantics, per row (x: its logits [V], float32, changed in place):
- logit_bias: x[t] += b for each (t, b) the request gave (ids beyond V are ignored: the engine refuses them).
- min_tokens: while the row has fewer than min_tokens output tokens, x[t] = -inf for its stop_token_ids and,
  unless it ignores EOS, the model's EOS ids.
- repetition_penalty r (HF's RepetitionPenaltyLogitsProcessor, vLLM's): for every token t in the prompt or the
  output, x[t] = x[t] / r if x[t] > 0 else x[t] * r.
- frequency_penalty f, presence_penalty p (OpenAI's, over output tokens only): x[t] -= f * c[t] + p * (c[t] > 0),
  c[t] = how often t appears in the output.

Every step builds one tensor per stage for the rows that use it (no Python loop over the vocabulary): the bias
and min_tokens entries as (row, token) index lists, and the penalties from each row's counts, kept in its
SamplerState and updated with the tokens sampled since the last step (one small scatter per row).
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

import torch

from app.replica.sampler_state import SamplerState
from app.sampling_params import SamplingParams


def apply_processors(
    x: torch.Tensor,
    params: Seq[SamplingParams],
    states: Seq[SamplerState],
    histories: Seq[tuple[list[int], list[int]]],
    stop_ids: frozenset[int],
) -> None:
    """Process x [m, V] in place, row j with params[j], states[j] and histories[j] = (prompt ids, output ids)."""
    m, vocab = x.shape
    dev = x.device
    rows, toks, vals, mask_rows, mask_toks = [], [], [], [], []
    for j, p in enumerate(params):
        for t, b in p.logit_bias:
            if t < vocab:
                rows.append(j)
                toks.append(t)
                vals.append(b)
        if p.min_tokens and len(histories[j][1]) < p.min_tokens:
            stops = set(p.stop_token_ids) if p.ignore_eos else set(p.stop_token_ids) | stop_ids
            for t in stops:
                if 0 <= t < vocab:
                    mask_rows.append(j)
                    mask_toks.append(t)
    if rows:
        index = (torch.tensor(rows, device=dev), torch.tensor(toks, device=dev))
        x.index_put_(index, torch.tensor(vals, dtype=x.dtype, device=dev), accumulate=True)
    if mask_rows:
        index = (torch.tensor(mask_rows, device=dev), torch.tensor(mask_toks, device=dev))
        x.index_put_(index, torch.tensor(float("-inf"), dtype=x.dtype, device=dev))
    pen = [j for j, p in enumerate(params) if p.penalized]
    if not pen:
        return
    counts, seen = zip(*(_counts(states[j], histories[j], vocab, dev) for j in pen))
    ps = [params[j] for j in pen]
    idx = torch.tensor(pen, device=dev) if len(pen) < m else None
    sub = x if idx is None else x.index_select(0, idx)
    if any(p.repetition_penalty != 1 for p in ps):
        r = torch.tensor([p.repetition_penalty for p in ps], dtype=x.dtype, device=dev)[:, None]
        sub = torch.where(torch.stack(seen), torch.where(sub > 0, sub / r, sub * r), sub)
    if any(p.frequency_penalty or p.presence_penalty for p in ps):
        c = torch.stack(counts)
        f = torch.tensor([p.frequency_penalty for p in ps], dtype=x.dtype, device=dev)[:, None]
        pr = torch.tensor([p.presence_penalty for p in ps], dtype=x.dtype, device=dev)[:, None]
        sub = sub - (f * c + pr * (c > 0))
    if idx is None:
        x.copy_(sub)
    else:
        x.index_copy_(0, idx, sub)


def _counts(
    st: SamplerState, history: tuple[list[int], list[int]], vocab: int, dev: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """The row's output-token counts and prompt-or-output mask, brought up to date with its output so far."""
    prompt, output = history
    if st.counts is None or st.counts.device != dev or st.counts.shape[0] != vocab:
        st.counts = torch.zeros(vocab, dtype=torch.float32, device=dev)
        st.seen = torch.zeros(vocab, dtype=torch.bool, device=dev)
        st.seen[torch.tensor(prompt, dtype=torch.long, device=dev)] = True
        st.counted = 0
    if len(output) > st.counted:
        new = torch.tensor(output[st.counted :], dtype=torch.long, device=dev)
        st.counts.index_put_((new,), torch.ones(len(new), device=dev), accumulate=True)
        st.seen[new] = True
        st.counted = len(output)
    return st.counts, st.seen
