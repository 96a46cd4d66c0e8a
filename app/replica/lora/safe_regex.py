"""Regular expressions from adapter configs (target_modules, exclude_modules, rank_pattern/alpha_pattern keys):
refused unless they are provably cheap for Python's backtracking `re` to match against module names.

PEFT's semantics are `re.fullmatch(pattern, name)` (and `re.match(rf"(.*\\.)?({key})$", name)` for pattern
keys), and `re` has no timeout: a pattern like `(a|a)*b` or `(.*)*x` takes exponential time on a failing name,
so one config could hang the process that reads it. Rather than a different engine (other semantics) or a
timeout (re cannot be interrupted), we parse the pattern with re's own parser and bound the number of paths
its backtracking can explore, from the structure alone:

- a quantified part (`*`, `+`, `{m,n}` with more than one repetition) must be deterministic inside: no
  alternation, no other variable quantifier, no lookaround, and it must consume at least one character per
  repetition. This is the "no nested quantifiers" rule, which rules out every exponential blow-up;
- what is left is polynomial: with s variable quantifiers in sequence over a name of at most NAME_CHARS
  characters, the repetition counts are a tuple of s numbers summing to at most NAME_CHARS, so there are at
  most C(NAME_CHARS + s, s) of them; alternations and `?` multiply that by their number of choices (at most
  MAX_CHOICES: each choice is really tried when a name does not match), and a lookaround adds its own paths
  once per path that reaches it. The total must stay under MAX_PATHS;
- backreferences and conditional groups are refused outright (matching them is NP-hard in general);
- the pattern is at most MAX_PATTERN_CHARS long.

MAX_PATHS = 10,000 and MAX_CHOICES = 64 let the patterns published configs use through (`.*\\.(q_proj|v_proj)`:
98 paths, `^(?!.*vision).*\\.(q_proj|k_proj|v_proj)$`: 196, `.*layers\\.\\d+\\.(self_attn|mlp)\\.(q|v)_proj`:
2,450) and bound the worst allowed pattern we could build (a random search over ~1,500 allowed ones) to
~0.35 ms per module name here: well under a second for a 70-layer model's ~900 names.
"""

from __future__ import annotations

import math
import re

try:  # Python 3.11+
    import re._constants as _c
    import re._parser as _parser
except ImportError:  # pragma: no cover - Python 3.10
    import sre_constants as _c  # type: ignore[no-redef]
    import sre_parse as _parser  # type: ignore[no-redef]

MAX_PATTERN_CHARS = 256
NAME_CHARS = 48  # longest module name matched: 'model.layers.1023.post_attention_layernorm' is 42
MAX_PATHS = 10_000
MAX_CHOICES = 64

_REPEATS = {_c.MAX_REPEAT, _c.MIN_REPEAT, getattr(_c, "POSSESSIVE_REPEAT", _c.MAX_REPEAT)}
_LOOKS = {_c.ASSERT, _c.ASSERT_NOT}
_ATOMIC = getattr(_c, "ATOMIC_GROUP", None)


class UnsafePattern(ValueError):
    """Why a pattern is refused; the message says what to change."""


def _paths(choices: int, stars: int) -> int:
    return choices * math.comb(NAME_CHARS + stars, stars)


def _walk(items) -> tuple[int, int, int]:
    """(choices, stars, look) of a parsed (sub)pattern: the product of alternation/optional choices, the
    number of variable quantifiers in sequence, and the paths its lookarounds explore (each lookaround is
    tried once per path that reaches it)."""
    choices, stars, look = 1, 0, 0
    for op, av in items:
        if op in (_c.GROUPREF, _c.GROUPREF_EXISTS) or op == getattr(_c, "GROUPREF_IGNORE", None):
            raise UnsafePattern("backreferences and (?(group)...) conditionals are not allowed")
        if op == _c.SUBPATTERN:
            c, s, lk = _walk(av[-1])
        elif op == _ATOMIC:
            c, s, lk = _walk(av)
        elif op == _c.BRANCH:
            parts = [_walk(alt) for alt in av[1]]
            c, s, lk = sum(p[0] for p in parts), max(p[1] for p in parts), sum(p[2] for p in parts)
        elif op in _LOOKS:
            c0, s0, lk0 = _walk(av[1])
            c, s, lk = 1, 0, _paths(c0, s0) + lk0
        elif op in _REPEATS:
            lo, hi, body = av
            c0, s0, lk0 = _walk(body)
            if hi <= 1:  # `x?`: skip it, or take it
                c, s, lk = (c0 if lo == 1 else 1 + c0), s0, lk0
            elif c0 > 1 or s0 > 0 or lk0 > 0:
                raise UnsafePattern(
                    "a quantified group holds an alternation, another quantifier or a lookaround (e.g. (a|b)* "
                    "or (.*x)+): such nesting can take exponential time"
                )
            elif _parser.SubPattern(_parser.State(), body).getwidth()[0] == 0:
                raise UnsafePattern("a quantified part can match the empty string (e.g. (\\b)*)")
            else:
                c, s, lk = 1, (0 if lo == hi else 1), 0
        else:  # literals, classes, anchors: one way each
            continue
        look += _paths(choices, stars) * lk  # every path of the prefix reaches this item's lookarounds
        choices, stars = choices * c, stars + s
    return choices, stars, look


def cost(pattern: str) -> int:
    """Upper bound on the backtracking paths of one match of `pattern` against a module name; raises
    UnsafePattern (or re.error for an invalid pattern)."""
    if not isinstance(pattern, str):
        raise UnsafePattern(f"a pattern must be a string, not {type(pattern).__name__}")
    if len(pattern) > MAX_PATTERN_CHARS:
        raise UnsafePattern(f"it is {len(pattern)} characters long; the limit is {MAX_PATTERN_CHARS}")
    choices, stars, look = _walk(_parser.parse(pattern).data)
    if choices > MAX_CHOICES:
        raise UnsafePattern(
            f"its alternations and '?'s combine into {choices:,} choices (limit {MAX_CHOICES}): every one is "
            "tried on a name that does not match"
        )
    return _paths(choices, stars) + look


def check(pattern: str) -> None:
    """Raise UnsafePattern unless `pattern` is valid and cheap to match (see the module docstring)."""
    try:
        paths = cost(pattern)
    except re.error as e:
        raise UnsafePattern(f"it is not a valid regular expression ({e})") from None
    except RecursionError:
        raise UnsafePattern("it nests too deeply") from None
    if paths > MAX_PATHS:
        raise UnsafePattern(
            f"matching it may explore ~{paths:.2g} paths per module name (limit {MAX_PATHS:,}): use fewer "
            "'.*' / '?' / alternations in sequence, or a list of module names"
        )
