"""The one grammar of names: adapter names and refs (`name`, `org/name`, `name@3`), tenant names, and the OpenAI
`model` field built from them (the base model, an adapter, a chain `a|b`, a merge `a*0.7+b*0.3`).

Parsing is pure (no catalog): the ingress parses first, then resolves every term through the catalog, so a
typo is a 400 naming the field and a missing or foreign adapter is a 404 naming the term."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from app.errors import InvalidRequest

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
    """A parsed `model` field. No stages = the base model; one stage of one term = a plain adapter."""

    stages: tuple[tuple[Term, ...], ...] = ()

    @property
    def kind(self) -> str:
        if not self.stages:
            return "base"
        if len(self.stages) > 1:
            return "chain"
        return "merge" if len(self.stages[0]) > 1 else "adapter"

    def terms(self) -> list[Term]:
        return [t for stage in self.stages for t in stage]

    def canonical(self) -> str:
        """The kernel's adapter_id syntax; empty for the base model."""
        return "|".join(_stage_text(stage) for stage in self.stages)


def _stage_text(stage: tuple[Term, ...]) -> str:
    if len(stage) == 1:
        return stage[0].ref
    return "+".join(f"{t.ref}*{t.weight:g}" for t in stage)


def _bad(model: str, why: str) -> InvalidRequest:
    err = InvalidRequest(
        f"model: {why} in {model!r}. Use the base model's id, an adapter name, 'name@version', "
        "a chain 'a|b' or a merge 'a*0.7+b*0.3'."
    )
    err.param = "model"
    return err


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
    stages = []
    for st in stages_text:
        if not st.strip():
            raise _bad(model, "an empty chain stage")
        parts = st.split("+")
        if len(parts) > MAX_TERMS:
            raise _bad(model, f"a merge has at most {MAX_TERMS} terms")
        if any(not p.strip() for p in parts):
            raise _bad(model, "an empty merge term")
        terms = tuple(_parse_term(model, p, in_merge=len(parts) > 1) for p in parts)
        names = [t.name for t in terms]
        if len(set(names)) != len(names):
            raise _bad(model, "the same adapter appears twice in one merge")
        stages.append(terms)
    return ModelSpec(tuple(stages))


def resolved(spec: ModelSpec, versions: dict[str, int]) -> ModelSpec:
    """The same spec with every term pinned to a concrete version (`versions`: term ref -> version)."""
    return ModelSpec(
        tuple(tuple(Term(t.name, versions[t.ref], t.weight) for t in stage) for stage in spec.stages)
    )
