"""The output side of the engine: sampled tokens -> Deltas (incremental text, stop strings, stop tokens).

Text is decoded incrementally, vLLM-style: only a window of output tokens from `prefix_offset` is decoded per
token, and the text that window adds past `read_offset` is committed once it no longer ends in U+FFFD (a
multi-byte character split across tokens). The cost per token is bounded by the window, not the output length.

What a request receives is exactly what decoding all its output ids (skip_special_tokens=True) at every step
would give: text that may still become a stop string (the longest stop string's length - 1 characters) and
trailing U+FFFD characters are held back until the next token or the end; a stop string cuts the text before
it; a stop token (or EOS) ends the request and is left out of the text. To keep that exact, the state holds a
short `tail` of the text: the last held-back characters plus up to `hold` already-sent ones, where a stop string
that ends in new text may begin.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from app.replica.logprobs import SampleLogprobs
from app.replica.output_state import Delta, OutputState
from app.replica.sequence import Sequence
from app.sampling_params import SamplingParams


class OutputProcessor:
    """Turns each sampled token of a sequence into its Delta (the engine applies the finish and sends it)."""

    def __init__(self, tokenizer, eos_ids: Iterable[int], max_model_len: int):
        self.tok = tokenizer
        self.eos_ids = set(eos_ids)
        self.max_model_len = max_model_len

    def state(self, params: SamplingParams, on_delta: Callable[[Delta], None]) -> OutputState:
        return OutputState(on_delta, params.stop, max((len(s) for s in params.stop), default=1) - 1)

    def append(self, seq: Sequence, tok: int, logprobs: SampleLogprobs | None = None) -> Delta:
        """Add the sampled token to the sequence; the Delta's finish_reason says whether it ended. Stop strings
        are looked for only once the output has more than min_tokens tokens (vLLM's rule)."""
        p, st = seq.params, seq.output
        seq.output_ids.append(tok)
        reason = None
        if tok in p.stop_token_ids or (not p.ignore_eos and tok in self.eos_ids):
            reason = "stop"  # the stop token is not part of the text: decode nothing new
        else:
            if len(seq.output_ids) >= p.max_tokens or seq.num_tokens >= self.max_model_len:
                reason = "length"
            self._decode(st, seq.output_ids)
        text = st.tail + st.pending
        if st.stops and len(seq.output_ids) > p.min_tokens:
            start = max(0, st.tail_sent - st.hold)
            hits = [(i, s) for s in st.stops if (i := text.find(s, start)) >= 0]
            if hits:
                text = text[: min(hits)[0]]
                reason = "stop"
        if reason is None:
            cut = len(text) - st.hold
            while cut > st.tail_sent and text[cut - 1] == "\ufffd":  # an unfinished multi-byte character
                cut -= 1
            new_text = text[st.tail_sent : cut] if cut > st.tail_sent else ""
        else:
            new_text = text[st.tail_sent :]
        st.tail_sent += len(new_text)
        # keep only what a later stop string may still start in: the last `hold` sent characters on
        drop = min(len(st.tail), max(0, st.tail_sent - st.hold))
        st.tail, st.tail_sent = st.tail[drop:], st.tail_sent - drop
        new_ids = seq.output_ids[st.sent_tokens :]
        st.sent_tokens = len(seq.output_ids)
        lps = None if logprobs is None else [logprobs]  # one delta per sampled token
        prompt = seq.prompt_logprobs if len(seq.output_ids) == 1 else None
        return Delta(
            new_text,
            new_ids,
            reason,
            len(seq.prompt_ids),
            len(seq.output_ids),
            logprobs=lps,
            prompt_logprobs=prompt,
            alora_activated=seq.alora_activated,
        )

    def _decode(self, st: OutputState, ids: list[int]) -> None:
        text = self.tok.decode(ids[st.prefix_offset :], skip_special_tokens=True)
        if len(text) > len(st.prefix_text) and not text.endswith("\ufffd"):
            st.tail += text[len(st.prefix_text) :]
            st.pending = ""
            st.prefix_offset, st.read_offset = st.read_offset, len(ids)
            st.prefix_text = self.tok.decode(ids[st.prefix_offset : st.read_offset], skip_special_tokens=True)
        else:
            st.pending = text[len(st.prefix_text) :]
