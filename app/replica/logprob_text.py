"""Sampled log probabilities (token ids, app/replica/sampling.py) -> what the OpenAI shapes print (protocol's
TokenLogprob): each token's text alone and its exact bytes, cached per token id (a vocabulary's worth at most).

A token's text is `tokenizer.decode([id])` (special tokens kept), as vLLM prints it; its bytes are exact for
byte-level BPE vocabularies (GPT-2's byte-to-character map undone) and SentencePiece byte tokens (<0xAB>),
where a token may hold part of a UTF-8 character, and the UTF-8 of its text otherwise.
"""

from __future__ import annotations

import re
from collections.abc import Sequence as Seq
from typing import Any

from app.protocol import TokenLogprob
from app.replica.logprobs import SampleLogprobs

_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet, character -> byte (the inverse of its bytes_to_unicode)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


_BYTE_DECODER = _byte_decoder()


class LogprobText:
    """Names tokens for log probability output; one per tokenizer (the cache grows to the vocabulary at most)."""

    def __init__(self, tokenizer: Any):
        self.tok = tokenizer
        self._cache: dict[int, tuple[str, bytes]] = {}

    def name(self, token_id: int) -> tuple[str, bytes]:
        hit = self._cache.get(token_id)
        if hit is None:
            text = self.tok.decode([token_id], skip_special_tokens=False)
            piece = self.tok.convert_ids_to_tokens(token_id)
            if isinstance(piece, str) and (m := _BYTE_TOKEN.fullmatch(piece)):
                raw = bytes([int(m.group(1), 16)])
            elif isinstance(piece, str) and piece and all(c in _BYTE_DECODER for c in piece):
                raw = bytes(_BYTE_DECODER[c] for c in piece)
                if raw.decode("utf-8", errors="replace") != text and "\ufffd" not in text:
                    raw = text.encode("utf-8")  # not a byte-level vocabulary after all: trust the text
            else:
                raw = text.encode("utf-8")
            hit = self._cache[token_id] = (text, raw)
        return hit

    def convert(self, logprobs: Seq[SampleLogprobs]) -> list[TokenLogprob]:
        return [
            self._entry(s.token_id, s.logprob, tuple(map(self._entry, s.top_ids, s.top_logprobs)))
            for s in logprobs
        ]

    def _entry(self, token_id: int, logprob: float, top: tuple[TokenLogprob, ...] = ()) -> TokenLogprob:
        text, raw = self.name(token_id)
        return TokenLogprob(token_id, text, logprob, raw, top)
