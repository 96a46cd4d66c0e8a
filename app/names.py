"""The one grammar of names: adapter names and refs (`name`, `org/name`, `name@3`), tenant names, and the OpenAI
`model` field built from them (the base model, an adapter, a chain `a|b`, a merge `a*0.7+b*0.3`).

Merges. `a*0.7+b*0.3` is the exact sum of the terms' deltas (PEFT's combination_type "cat": the LoRAs side by
side along the rank axis). Any of PEFT's `add_weighted_adapter` combination types is asked for by name around
the terms, options after `;`:
    KIND(a*0.7+b*0.3[;option=value]...)        e.g. ties(a*0.7+b*0.3;density=0.5)
KIND is one of app/merge_methods.py's MERGE_OPTIONS: cat, linear, svd, ties, ties_svd, dare_linear, dare_ties, dare_linear_svd,
dare_ties_svd, magnitude_prune, magnitude_prune_svd. Options, each only where PEFT uses it: density (0 < d <= 1,
required by the pruning kinds), majority_sign_method (total | frequency; default total), svd_rank (default:
the largest term rank, as PEFT), svd_clamp (a quantile in (0, 1]; default none), seed (DARE's random masks;
default 0, so a merge named twice is the same merge). A KIND(...) stage may hold one term (PEFT then merges
linearly) and may be a chain stage (`ties(a*0.5+b*0.5;density=0.3)|c`). From Python, `merge_id` writes the
same text. Note that PEFT's "linear" mixes A's and B's separately (an approximation); "cat" is exact.

Parsing is pure (no catalog): the ingress parses first, then resolves every term through the catalog, so a
typo is a 400 naming the field and a missing or foreign adapter is a 404 naming the term."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from app.errors import InvalidRequest
from app.merge_methods import MergeMethod, parse_method

_SEGMENT = r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}"
ADAPTER_NAME_RE = re.compile(rf"^{_SEGMENT}(?:/{_SEGMENT})?$")
TENANT_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
_NAME_RULE = (
    "adapter names are 1-128 characters from [A-Za-z0-9._-], starting with a letter or digit, "
    "optionally prefixed once by 'org/' (same rule), e.g. 'acme/sql-expert'"
)


def check_name(name: str) -> str:
    """Return `name` if it is a valid adapter name; raise InvalidRequest naming the rule otherwise."""
    if not isinstance(name, str) or not ADAPTER_NAME_RE.match(name):
        raise InvalidRequest(f"invalid adapter name {name!r}: {_NAME_RULE}")
    return name


def check_tenant(name: str) -> str:
    if not isinstance(name, str) or not TENANT_NAME_RE.match(name):
        raise InvalidRequest(
            f"invalid tenant name {name!r}: 1-64 characters from [A-Za-z0-9._-], starting with a letter or digit"
        )
    return name


def parse_ref(ref: str) -> tuple[str, int | None]:
    """'name' -> (name, None) meaning the newest version; 'name@3' -> (name, 3)."""
    if not isinstance(ref, str):
        raise InvalidRequest(f"adapter reference must be a string, got {type(ref).__name__}")
    name, sep, version = ref.partition("@")
    check_name(name)
    if not sep:
        return name, None
    if not version.isdigit() or int(version) < 1 or version != str(int(version)):
        raise InvalidRequest(
            f"invalid version in {ref!r}: use name@N with N a positive integer, e.g. {name}@1"
        )
    return name, int(version)


_NAME = rf"{_SEGMENT}(?:/{_SEGMENT})?"
_REF_RE = re.compile(rf"^(?P<name>{_NAME})(?:@(?P<version>[0-9]{{1,9}}))?$")
_WEIGHT_RE = re.compile(r"^[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?$")

MAX_STAGES = 8
MAX_TERMS = 8


@dataclass(frozen=True)
class Term:
    """One adapter inside a stage; `version` None means "the newest", `weight` only matters in a merge."""

    name: str
    version: int | None = None
    weight: float = 1.0

    @property
    def ref(self) -> str:
        return self.name if self.version is None else f"{self.name}@{self.version}"


@dataclass(frozen=True)
class ModelSpec:
    """A parsed `model` field. No stages = the base model; one stage of one term = a plain adapter.
    `methods[i]` is stage i's MergeMethod (None, or missing, for a plain adapter or a cat merge)."""

    stages: tuple[tuple[Term, ...], ...] = ()
    methods: tuple[MergeMethod | None, ...] = ()

    @property
    def kind(self) -> str:
        if not self.stages:
            return "base"
        if len(self.stages) > 1:
            return "chain"
        return "merge" if len(self.stages[0]) > 1 or self.method(0) is not None else "adapter"

    def method(self, i: int) -> MergeMethod | None:
        return self.methods[i] if i < len(self.methods) else None

    def terms(self) -> list[Term]:
        return [t for stage in self.stages for t in stage]

    def canonical(self) -> str:
        """The kernel's adapter_id syntax; empty for the base model."""
        return "|".join(_stage_text(stage, self.method(i)) for i, stage in enumerate(self.stages))


def _stage_text(stage: tuple[Term, ...], method: MergeMethod | None = None) -> str:
    if len(stage) == 1 and method is None:
        return stage[0].ref
    terms = "+".join(f"{t.ref}*{t.weight:g}" for t in stage)
    return terms if method is None or (method.kind == "cat" and len(stage) > 1) else method.text(terms)


def merge_id(terms: list[tuple[str, float]], kind: str = "cat", **options: object) -> str:
    """The adapter id of a merge from Python: merge_id([("a", 0.7), ("b", 0.3)], "ties", density=0.5) ->
    'ties(a*0.7+b*0.3;density=0.5)'. Raises InvalidRequest as the `model` field would."""
    inner = ";".join(
        ["+".join(f"{ref}*{w!r}" for ref, w in terms), *(f"{k}={v}" for k, v in options.items())]
    )
    return parse_model(f"{kind}({inner})").canonical()


def _bad(model: str, why: str) -> InvalidRequest:
    shown = model if len(model) <= 100 else model[:100] + "…"  # never echo a huge field back in full
    err = InvalidRequest(
        f"model: {why} in {shown!r}. Use the base model's id, an adapter name, 'name@version', "
        "a chain 'a|b' or a merge 'a*0.7+b*0.3' (or 'ties(a*0.7+b*0.3;density=0.5)')."
    )
    err.param = "model"
    return err


# What a term's text ends with when the '+' that follows is part of its weight, not a separator: a sign right
# after '*' (`a*+0.5`), or an exponent's sign (`a*1e+05`, `b*2E+2`, as Python and JSON print floats).
_SIGNED = re.compile(r"\*\s*(?:[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)[eE])?$")


def _split_terms(stage: str) -> list[str]:
    """`a*1e-05+b*2E+2` -> ['a*1e-05', 'b*2E+2']: split a merge at the '+'s that separate terms."""
    parts, start = [], 0
    for i, ch in enumerate(stage):
        if ch == "+" and not _SIGNED.search(stage, start, i):
            parts.append(stage[start:i])
            start = i + 1
    return [*parts, stage[start:]]


def _parse_term(model: str, text: str, in_merge: bool) -> Term:
    text = text.strip()
    weight = 1.0
    if "*" in text:
        if not in_merge:
            raise _bad(model, f"a weight ({text!r}) is only allowed in a merge of two or more adapters")
        ref, _, w = text.rpartition("*")
        ref, w = ref.strip(), w.strip()
        if not _WEIGHT_RE.match(w):
            raise _bad(model, f"the weight {w!r} is not a number")
        weight = float(w)
        if not math.isfinite(weight) or weight == 0.0:
            raise _bad(model, f"the weight {w!r} must be a finite, non-zero number")
        text = ref
    m = _REF_RE.match(text)
    if not m:
        raise _bad(
            model, f"{text!r} is not an adapter name (letters, digits, '.', '_', '-', optionally 'org/')"
        )
    version = m.group("version")
    if version is not None and (int(version) < 1 or version != str(int(version))):
        raise _bad(model, f"invalid version in {text!r}: use name@N with N a positive integer, e.g. name@1")
    return Term(m.group("name"), int(version) if version is not None else None, weight)


def parse_model(model: object, base_ids: tuple[str, ...] | frozenset[str] = ()) -> ModelSpec:
    """Parse the `model` field; `base_ids` are the names the base model answers to."""
    if not isinstance(model, str) or not model.strip():
        err = InvalidRequest("model: required, a non-empty string (the base model's id or an adapter name)")
        err.param = "model"
        raise err
    text = model.strip()
    if text in base_ids:
        return ModelSpec()
    stages_text = text.split("|")
    if len(stages_text) > MAX_STAGES:
        raise _bad(model, f"a chain has at most {MAX_STAGES} stages")
    stages, methods = [], []
    for st in stages_text:
        if not st.strip():
            raise _bad(model, "an empty chain stage")
        try:
            st, method = parse_method(st)
        except ValueError as e:
            raise _bad(model, str(e)) from None
        parts = _split_terms(st)
        if len(parts) > MAX_TERMS:
            raise _bad(model, f"a merge has at most {MAX_TERMS} terms")
        if any(not p.strip() for p in parts):
            raise _bad(model, "an empty merge term")
        terms = tuple(_parse_term(model, p, in_merge=len(parts) > 1 or method is not None) for p in parts)
        names = [t.name for t in terms]
        if len(set(names)) != len(names):
            raise _bad(model, "the same adapter appears twice in one merge")
        stages.append(terms)
        methods.append(method if method is not None and (method.kind != "cat" or len(terms) == 1) else None)
    return ModelSpec(tuple(stages), tuple(methods) if any(methods) else ())


def resolved(spec: ModelSpec, versions: dict[str, int]) -> ModelSpec:
    """The same spec with every term pinned to a concrete version (`versions`: term ref -> version)."""
    return ModelSpec(
        tuple(tuple(Term(t.name, versions[t.ref], t.weight) for t in stage) for stage in spec.stages),
        spec.methods,
    )
