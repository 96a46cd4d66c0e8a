"""PEFT's merge kinds (add_weighted_adapter's combination types) as the `model` grammar names them:
`KIND(a*0.7+b*0.3[;option=value]...)`, the options each kind uses, their defaults, and their parsing
(app/names.py holds the rest of the grammar and its module docstring the user's view)."""

from __future__ import annotations

import re
from dataclasses import dataclass

_DENSITY, _SIGN, _SVD, _SEED = ("density",), ("majority_sign_method",), ("svd_rank", "svd_clamp"), ("seed",)
MERGE_OPTIONS: dict[str, tuple[str, ...]] = {  # PEFT's combination types and the options each one uses
    "cat": (),
    "linear": (),
    "svd": _SVD,
    "ties": _DENSITY + _SIGN,
    "ties_svd": _DENSITY + _SIGN + _SVD,
    "dare_linear": _DENSITY + _SEED,
    "dare_ties": _DENSITY + _SIGN + _SEED,
    "dare_linear_svd": _DENSITY + _SEED + _SVD,
    "dare_ties_svd": _DENSITY + _SIGN + _SEED + _SVD,
    "magnitude_prune": _DENSITY,
    "magnitude_prune_svd": _DENSITY + _SVD,
}
_OPTION_DEFAULTS = {"majority_sign_method": "total", "seed": 0, "svd_rank": None, "svd_clamp": None}


@dataclass(frozen=True)
class MergeMethod:
    """How a merge stage combines its terms (PEFT's add_weighted_adapter); the options are None where the kind
    does not use them, and hold their defaults where it does (see the module docstring)."""

    kind: str = "cat"
    density: float | None = None
    majority_sign_method: str | None = None
    svd_rank: int | None = None
    svd_clamp: float | None = None
    seed: int | None = None

    def text(self, terms: str) -> str:
        """`terms` ('a*0.7+b*0.3') wrapped in this method's syntax, options at their defaults left out."""
        opts = [f"{k}={getattr(self, k):g}" if isinstance(getattr(self, k), float) else f"{k}={getattr(self, k)}"
                for k in MERGE_OPTIONS[self.kind] if getattr(self, k) != _OPTION_DEFAULTS.get(k)]  # fmt: skip
        return f"{self.kind}({';'.join([terms, *opts])})"


_METHOD_RE = re.compile(r"^\s*(?P<kind>[a-z_]+)\s*\((?P<inner>[^()]*)\)\s*$")


def parse_method(st: str) -> tuple[str, MergeMethod | None]:
    """`KIND(terms;opt=v;...)` -> (terms, MergeMethod); anything else is a plain stage, returned as is.
    ValueError says what is wrong (app/names.py puts it in the `model` field's 400)."""
    m = _METHOD_RE.match(st)
    if m is None:
        if "(" in st or ")" in st:
            raise ValueError(
                f"{st.strip()!r} is not KIND(terms;option=value...), e.g. ties(a*0.7+b*0.3;density=0.5)"
            )
        return st, None
    kind, (terms, *opts) = m["kind"], m["inner"].split(";")
    if kind not in MERGE_OPTIONS:
        raise ValueError(f"unknown merge type {kind!r}: use one of {', '.join(MERGE_OPTIONS)}")
    values: dict[str, object] = {k: _OPTION_DEFAULTS.get(k) for k in MERGE_OPTIONS[kind]}
    seen = set()
    for opt in opts:
        key, eq, raw = (x.strip() for x in opt.partition("="))
        if not eq or key not in MERGE_OPTIONS[kind] or key in seen:
            allowed = ", ".join(MERGE_OPTIONS[kind]) or "none"
            raise ValueError(
                f"option {opt.strip()!r} of a {kind} merge: options are key=value, once each, from: {allowed}"
            )
        seen.add(key)
        values[key] = _option_value(kind, key, raw)
    if "density" in values and values["density"] is None:
        raise ValueError(f"a {kind} merge needs a density, e.g. {kind}(a*0.7+b*0.3;density=0.5)")
    return terms, MergeMethod(kind, **values)


def _option_value(kind: str, key: str, raw: str) -> object:
    try:
        if key == "majority_sign_method":
            if raw not in ("total", "frequency"):
                raise ValueError
            return raw
        if key in ("svd_rank", "seed"):
            v = int(raw)
            if v < (1 if key == "svd_rank" else 0) or v >= 2**63 or str(v) != raw:
                raise ValueError
            return v
        v = float(raw)
        if not 0.0 < v <= 1.0:  # density: a fraction kept; svd_clamp: a quantile
            raise ValueError
        return v
    except ValueError:
        rule = {"majority_sign_method": "total or frequency", "svd_rank": "a positive integer",
                "seed": "a non-negative integer"}.get(key, "a number in (0, 1]")  # fmt: skip
        raise ValueError(f"{kind} option {key}={raw!r} must be {rule}") from None
