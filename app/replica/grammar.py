"""Structured output (`response_format`): JSON grammars through xgrammar, as per-row token bitmasks.

Semantics: a request's `SamplingParams.response_format` is None (free text), "json_object" (any JSON object), or
a JSON schema as canonical JSON text (sorted keys, so equal schemas share one compiled grammar: the ingress's
app/router/http/openai_sampling.format_key makes it from OpenAI's field). `Grammars`
compiles it once per key against the model's tokenizer (at admission, on a worker thread: never on the step
loop) and caches it. Each sequence holds a `GrammarState` (a matcher over that grammar) in its SamplerState;
`mask_rows` sets the logits of every token the grammar forbids next to -inf, for the grammar rows only, after
catching each matcher up with the row's accepted output tokens (so preemption by recompute, which keeps the
output, needs nothing special). EOS is allowed only where the grammar may end.

Whitespace between JSON tokens is compact (xgrammar's any_whitespace=False): a model free to emit whitespace
forever can loop without ever closing the object; compact JSON is still JSON.

Strings hold no raw control characters: xgrammar 0.2's rule for a string with minLength/maxLength is a class of
every character but quote, backslash, CR and LF, which lets the other U+0000-U+001F (tab, U+0001...) through,
and strict json.loads refuses them.
`json_grammar` rewrites every negated character class of the converted grammar to exclude them too (in a JSON
grammar such a class only ever matches a string's characters), so a response_format and a constrained tool
call (app/router/http/tool_calls.py compiles through here) are always strict JSON.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import Any

import torch

from app.errors import InvalidRequest

JSON_OBJECT = "json_object"
CACHE_LIMIT = 256  # compiled grammars kept (by key); xgrammar's compiler keeps its own bounded cache too
CONTROL = "\\0-\\x1f"  # U+0000-U+001F as an EBNF class range
# an EBNF string literal or character class (group 1: "^" when negated, group 2: its body); literals are
# matched only to be skipped (one may spell "[^")
_LITERAL_OR_CLASS = re.compile(r'"(?:\\.|[^"\\])*"|\[(\^?)((?:\\.|[^\]\\])*)\]')


def _invalid(message: str) -> InvalidRequest:
    err = InvalidRequest(f"response_format: {message}")
    err.param = "response_format"
    return err


class Grammars:
    """Compiles and caches grammars for one tokenizer (thread-safe; compile off the step loop)."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_ids: Seq[int]):
        self.tokenizer, self.vocab_size, self.stop_ids = tokenizer, vocab_size, sorted(stop_ids)
        self._compiler: Any = None
        self._cache: dict[str, Any] = {}
        self._lock = threading.Lock()

    def _xgrammar(self) -> Any:
        import xgrammar as xg

        with self._lock:
            if self._compiler is None:
                info = xg.TokenizerInfo.from_huggingface(
                    self.tokenizer, vocab_size=self.vocab_size, stop_token_ids=self.stop_ids
                )
                self._compiler = xg.GrammarCompiler(info, max_threads=1)
        return self._compiler

    def compile(self, key: str) -> Any:
        """The compiled grammar for `key` (format_key's), or a 400 naming response_format."""
        hit = self._cache.get(key)
        if hit is not None:
            return hit
        compiler = self._xgrammar()
        try:
            compiled = compiler.compile_grammar(json_grammar(key))
        except Exception as e:  # xgrammar raises RuntimeError/ValueError/its own errors for bad schemas
            raise _invalid(f"the schema cannot be compiled: {str(e).splitlines()[0][:300]}") from None
        with self._lock:
            if len(self._cache) >= CACHE_LIMIT:
                self._cache.pop(next(iter(self._cache)))
            self._cache[key] = compiled
        return compiled


def json_grammar(key: str) -> Any:
    """xgrammar's grammar for format_key's `key` whose strings admit no raw control character."""
    import xgrammar as xg

    if key == JSON_OBJECT:
        grammar = xg.Grammar.from_json_schema('{"type":"object"}', any_whitespace=False)
    else:
        grammar = xg.Grammar.from_json_schema(key, any_whitespace=False, strict_mode=True)
    ebnf = str(grammar)
    strict = strict_strings(ebnf)
    return grammar if strict == ebnf else xg.Grammar.from_ebnf(strict)


def strict_strings(ebnf: str) -> str:
    """`ebnf` with every negated character class `[^...]` outside string literals made to exclude U+0000-U+001F
    (a class that already starts by excluding them is kept)."""

    def fix(m: re.Match) -> str:
        negated, body = m.group(1), m.group(2)
        if not negated or body.startswith(CONTROL):
            return m.group(0)
        return f"[^{CONTROL}{body}]"

    return _LITERAL_OR_CLASS.sub(fix, ebnf)


@dataclass
class GrammarState:
    """One sequence's matcher and how many of its output tokens it has accepted."""

    matcher: Any
    accepted: int = 0

    @classmethod
    def of(cls, compiled: Any) -> GrammarState:
        import xgrammar as xg

        return cls(xg.GrammarMatcher(compiled))

    def catch_up(self, output_ids: Seq[int]) -> None:
        for tok in output_ids[self.accepted :]:
            if not self.matcher.accept_token(tok):
                raise InvalidRequest(f"token {tok} does not fit the response_format grammar")
            self.accepted += 1


def mask_rows(x: torch.Tensor, rows: Seq[int], grammars: Seq[GrammarState], outputs: Seq[Seq[int]]) -> None:
    """x [m, V] float32, in place: row rows[j] keeps only the tokens grammars[j] allows next (its matcher first
    accepts outputs[j]'s tokens it has not seen); the other rows are untouched. One bitmask, one apply."""
    import xgrammar as xg

    m, vocab = x.shape
    bitmask = xg.allocate_token_bitmask(m, vocab)
    for j, g, out in zip(rows, grammars, outputs):
        g.catch_up(out)
        g.matcher.fill_next_token_bitmask(bitmask, j)
    xg.apply_token_bitmask_inplace(x, bitmask.to(x.device), indices=list(rows))
