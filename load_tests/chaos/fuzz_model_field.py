"""Fuzz the OpenAI `model` field parser (app/names.parse_model) with atheris.
Run: ./run bench fuzz_model_field [--help]. Method and results: load_tests/chaos/RESULTS.md."""

from __future__ import annotations

import sys

from load_tests.chaos import fuzz_runner

BASE_IDS = ("tiny-llama", "org/base")
TOKENS = ("a", "b", "c", "org/x", "ad00", "A.b-c_d", "@", "1", "2", "0", "999999999", "1234567890", "*",
          "0.5", "1e-3", "1E+2", "-0.25", "+0.5", ".5", "5.", "1e", "e5", "nan", "inf", "1e999", "0.0", "+",
          "|", "(", ")", ";", "=", " ", "\t", "ties", "cat", "linear", "svd", "dare_ties", "magnitude_prune",
          "density", "seed", "svd_rank", "svd_clamp", "majority_sign_method", "total", "frequency", "/", ".",
          "..", "-", "_", "tiny-llama", "\u00e9", "\x00", "\n", "a" * 130, "*" * 3, "+" * 3)  # fmt: skip


def decode(data: bytes) -> str:
    if not data:
        return ""
    if data[0] & 1:
        return data[1:].decode("utf-8", "replace")
    return "".join(TOKENS[b % len(TOKENS)] for b in data[1:])


_T: dict = {}


def load() -> None:
    from app import names
    from app.errors import InvalidRequest

    _T.update(names=names, error=InvalidRequest)


class PropertyViolation(AssertionError):
    """parse_model accepted a field whose parse does not hold together."""


def test_one(data: bytes) -> None:
    if not _T:
        load()
    check(decode(data))


def check(text: str) -> None:
    names, error = _T["names"], _T["error"]
    try:
        spec = names.parse_model(text, BASE_IDS)
    except error as e:
        if getattr(e, "param", None) != "model":
            raise PropertyViolation(f"InvalidRequest without param='model': {e}") from None
        raise
    if spec.kind == "base":
        if text.strip() not in BASE_IDS:
            raise PropertyViolation(f"{text!r} parsed as the base model")
        return
    if len(spec.stages) > names.MAX_STAGES or any(len(s) > names.MAX_TERMS for s in spec.stages):
        raise PropertyViolation(f"{text!r}: {len(spec.stages)} stages / terms over the limits")
    for stage in spec.stages:
        if len({t.name for t in stage}) != len(stage):
            raise PropertyViolation(f"{text!r}: an adapter twice in one merge")
        for t in stage:
            if not (t.weight == t.weight and abs(t.weight) != float("inf") and t.weight != 0):
                raise PropertyViolation(f"{text!r}: weight {t.weight}")
            try:  # the catalog looks every term up by its ref: it must be one parse_ref accepts
                back = names.parse_ref(t.ref)
            except error as e:
                raise PropertyViolation(
                    f"{text!r}: term ref {t.ref!r} is refused by parse_ref ({e})"
                ) from None
            if back != (t.name, t.version):
                raise PropertyViolation(f"{text!r}: term ref {t.ref!r} does not parse back")
    canonical = spec.canonical()
    try:
        again = names.parse_model(canonical, BASE_IDS)
    except error as e:
        raise PropertyViolation(f"{text!r}: canonical {canonical!r} does not parse ({e})") from None
    if again.canonical() != canonical or again.kind != spec.kind:
        raise PropertyViolation(f"{text!r}: canonical {canonical!r} reparses as {again.canonical()!r}")
    pinned = names.resolved(spec, {t.ref: 7 for t in spec.terms()})
    if any(t.version != 7 for t in pinned.terms()):
        raise PropertyViolation(f"{text!r}: resolved() left a term unpinned")


def seeds() -> list[bytes]:
    texts = ["a", "org/x@3", "a|b", "a*0.7+b*0.3", "ties(a*0.7+b*0.3;density=0.5)", "a*1e-05+b*2E+2",
             "dare_ties(a*1+b*1;density=0.3;seed=4)|c", "tiny-llama", "svd(a*0.5;svd_rank=2;svd_clamp=0.9)",
             "a@1*0.5+org/x@2*-0.5|b|c@9"]  # fmt: skip
    return [b"\x01" + t.encode() for t in texts] + [bytes([0, 0, 12, 14, 1, 15, 12, 16, 33])]


def worker(args) -> None:
    fuzz_runner.run_instrumented(args, load, test_one, lambda: (_T["error"],))


def main(argv: list[str] | None = None) -> int:
    return fuzz_runner.main("load_tests.chaos.fuzz_model_field", __doc__, seeds, worker, argv)


if __name__ == "__main__":
    sys.exit(main())
