"""xgrammar vs outlines-core for response_format: compile time, per-token mask cost, memory (issue 18).
Run: ./run bench grammar_engines [--help]. Method and results: load_tests/engine/RESULTS.md."""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from load_tests.harness.stats import percentile

CACHE = Path(os.environ.get("LORALAND_BENCH_CACHE", Path.home() / ".cache" / "loraland"))

SIMPLE = {
    "type": "object",
    "properties": {
        "n": {"type": "integer", "minimum": 0, "maximum": 999},
        "ok": {"type": "boolean"},
        "tag": {"enum": ["red", "green", "blue"]},
    },
    "required": ["n", "ok", "tag"],
    "additionalProperties": False,
}
NESTED = {
    "type": "object",
    "properties": {
        "id": {"type": "integer"},
        "name": {"type": "string", "maxLength": 24},
        "status": {"enum": ["active", "inactive", "banned"]},
        "tags": {"type": "array", "items": {"enum": ["alpha", "beta", "gamma", "delta"]}, "maxItems": 4},
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                "geo": {
                    "type": "object",
                    "properties": {"lat": {"type": "number"}, "lon": {"type": "number"}},
                    "required": ["lat", "lon"],
                    "additionalProperties": False,
                },
            },
            "required": ["city", "zip", "geo"],
            "additionalProperties": False,
        },
        "scores": {"type": "array", "items": {"type": "number"}},
        "verified": {"type": "boolean"},
    },
    "required": ["id", "name", "status", "tags", "address", "scores", "verified"],
    "additionalProperties": False,
}
# name -> (schema, or None for json_object; a document the grammar accepts, keys sorted as the ingress's
# canonical schema text sorts the properties)
GRAMMARS = {
    "simple": (SIMPLE, {"n": 417, "ok": True, "tag": "green"}),
    "nested": (
        NESTED,
        {
            "id": 90210,
            "name": "Ada Lovelace",
            "status": "active",
            "tags": ["beta", "delta"],
            "address": {"city": "London", "zip": "12345", "geo": {"lat": 51.5072, "lon": -0.1276}},
            "scores": [0.5, 17, 3.25, -2],
            "verified": False,
        },
    ),
    "json_object": (
        None,
        {"user": {"id": 7, "roles": ["admin", "ops"]}, "active": True, "quota": 12.5, "note": None},
    ),
}


def canonical(obj) -> str:
    """The ingress's canonical JSON (app/router/http/openai_sampling.format_key): sorted keys, compact."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"))


def document(obj) -> str:
    """A document as our server's grammar writes it: xgrammar's any_whitespace=False still puts one space after
    ':' and ',' (its default separators), keys in the schema's (sorted) order."""
    return json.dumps(obj, sort_keys=True, separators=(", ", ": "))


# ---------------------------------------------------------------------------------------------- vocabularies
def _corpus(max_bytes: int = 24 << 20):
    """Local text to train a BPE on: this venv's Python sources (code, docstrings, JSON-ish literals)."""
    import site

    roots = [Path(p) for p in site.getsitepackages()]
    total = 0
    for root in roots:
        for f in sorted(root.rglob("*.py")):
            try:
                text = f.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError):
                continue
            total += len(text)
            yield text
            if total >= max_bytes:
                return


def vocab_dir(name: str) -> Path:
    """A tokenizer folder: 'tiny' (tests/fixtures/models.build_tokenizer, 384 tokens) or 'bpe32k'."""
    out = CACHE / f"grammar-bench-{name}"
    if (out / "tokenizer.json").is_file():
        return out
    out.mkdir(parents=True, exist_ok=True)
    if name == "tiny":
        from tests.fixtures.models import build_tokenizer

        build_tokenizer(out)
        return out
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    size = {"bpe32k": 32000}[name]
    t = time.perf_counter()
    tok = ByteLevelBPETokenizer()
    tok.train_from_iterator(_corpus(), vocab_size=size, min_frequency=2, special_tokens=["<s>", "</s>"])
    PreTrainedTokenizerFast(
        tokenizer_object=tok._tokenizer, bos_token="<s>", eos_token="</s>"
    ).save_pretrained(out)
    print(
        f"trained {name} ({tok.get_vocab_size()} tokens) in {time.perf_counter() - t:.0f} s", file=sys.stderr
    )
    return out


# ---------------------------------------------------------------------------------------------- engines
def rss_mib() -> float:
    import psutil

    gc.collect()
    return psutil.Process().memory_info().rss / 2**20


class XGrammar:
    name = "xgrammar"

    def __init__(self, tok, vocab_size: int, eos: int):
        import xgrammar as xg

        self.xg = xg
        info = xg.TokenizerInfo.from_huggingface(tok, vocab_size=vocab_size, stop_token_ids=[eos])
        self.compiler = xg.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self.vocab_size = vocab_size
        from importlib.metadata import version

        self.version = version("xgrammar")

    def compile(self, schema: dict | None):
        if schema is None:
            return self.compiler.compile_json_schema('{"type":"object"}', any_whitespace=False)
        return self.compiler.compile_json_schema(canonical(schema), any_whitespace=False, strict_mode=True)

    @staticmethod
    def size(compiled) -> int:
        return int(compiled.memory_size_bytes)

    def matcher(self, compiled):
        return self.xg.GrammarMatcher(compiled)

    def new_mask(self):
        return self.xg.allocate_token_bitmask(1, self.vocab_size)

    @staticmethod
    def fill(m, mask) -> None:
        m.fill_next_token_bitmask(mask, 0)

    @staticmethod
    def advance(m, tok: int) -> None:
        if not m.accept_token(tok):
            raise AssertionError(f"xgrammar refused token {tok}")

    @staticmethod
    def ends(m, eos: int, mask) -> bool:
        m.fill_next_token_bitmask(mask, 0)
        return bool((int(mask[0, eos // 32]) >> (eos % 32)) & 1)


class OutlinesCore:
    name = "outlines-core"

    def __init__(self, tok, vocab_size: int, eos: int):
        import outlines_core as oc

        from app.replica.logprob_text import LogprobText

        self.oc = oc
        names = LogprobText(tok)
        special = set(tok.all_special_ids)
        by_bytes: dict[bytes, list[int]] = {}
        for i in range(len(tok)):
            if i in special:
                continue
            by_bytes.setdefault(names.name(i)[1], []).append(i)
        self.vocabulary = oc.Vocabulary(eos, by_bytes)
        self.vocab_size = vocab_size
        from importlib.metadata import version

        self.version = version("outlines-core")

    def compile(self, schema: dict | None):
        from outlines_core.json_schema import build_regex_from_schema

        text = '{"type":"object"}' if schema is None else canonical(schema)
        return self.oc.Index(build_regex_from_schema(text, whitespace_pattern=WS), self.vocabulary)

    @staticmethod
    def size(index) -> int:
        import pickle

        return len(pickle.dumps(index))

    def matcher(self, index):
        return self.oc.Guide(index)

    def new_mask(self):
        import torch

        return torch.zeros((1, (self.vocab_size + 31) // 32), dtype=torch.int32)

    @staticmethod
    def fill(g, mask) -> None:
        g.write_mask_into(mask.data_ptr(), mask.numel(), mask.element_size())

    @staticmethod
    def advance(g, tok: int) -> None:
        g.advance(tok, return_tokens=False)

    @staticmethod
    def ends(g, eos: int, mask) -> bool:
        g.write_mask_into(mask.data_ptr(), mask.numel(), mask.element_size())
        return bool((int(mask[0, eos // 32]) >> (eos % 32)) & 1)


WS = " ?"  # outlines-core's whitespace between JSON tokens: at most one space, as near as its regex gets to
# xgrammar's fixed ", " / ": " (it also allows no space, and a space around brackets)

ENGINES = {"xgrammar": XGrammar, "outlines-core": OutlinesCore}


def allowed(mask, tok: int) -> bool:
    return bool((int(mask[0, tok // 32]) >> (tok % 32)) & 1)


def worker(engine_name: str, vocab: str, grammars: list[str], repeats: int) -> None:
    """One engine on one vocabulary, in this fresh process; prints one JSON line per grammar."""
    import torch
    from transformers import AutoTokenizer

    torch.set_num_threads(1)
    tok = AutoTokenizer.from_pretrained(vocab_dir(vocab))
    vocab_size, eos = len(tok), tok.eos_token_id
    base = rss_mib()
    t = time.perf_counter()
    eng = ENGINES[engine_name](tok, vocab_size, eos)
    setup_s, setup_mib = time.perf_counter() - t, rss_mib() - base
    for gname in grammars:
        schema, doc = GRAMMARS[gname]
        ids = tok.encode(document(doc), add_special_tokens=False)
        before = rss_mib()
        t = time.perf_counter()
        try:
            compiled = eng.compile(schema)
        except Exception as e:  # an engine that cannot compile a grammar is a result, not a crash
            print(
                json.dumps({"engine": engine_name, "vocab": vocab, "grammar": gname, "error": str(e)[:200]})
            )
            continue
        compile_s = time.perf_counter() - t
        grew = rss_mib() - before
        mask = eng.new_mask()
        # Check: every token of the document is allowed where it comes, and EOS is allowed at its end.
        m = eng.matcher(compiled)
        for tid in ids:
            eng.fill(m, mask)
            if not allowed(mask, tid):
                raise AssertionError(
                    f"{engine_name}/{vocab}/{gname}: token {tid} {tok.decode([tid])!r} masked"
                )
            eng.advance(m, tid)
        if not eng.ends(m, eos, mask):
            raise AssertionError(f"{engine_name}/{vocab}/{gname}: EOS not allowed after the document")
        fills, advances = [], []
        for _ in range(repeats):
            m = eng.matcher(compiled)
            for tid in ids:
                t0 = time.perf_counter()
                eng.fill(m, mask)
                t1 = time.perf_counter()
                eng.advance(m, tid)
                t2 = time.perf_counter()
                fills.append(t1 - t0)
                advances.append(t2 - t1)
        print(
            json.dumps(
                {
                    "engine": engine_name,
                    "version": eng.version,
                    "vocab": vocab,
                    "vocab_size": vocab_size,
                    "grammar": gname,
                    "doc_tokens": len(ids),
                    "setup_s": setup_s,
                    "setup_mib": setup_mib,
                    "compile_s": compile_s,
                    "rss_mib": grew,
                    "size_kib": eng.size(compiled) / 1024,
                    "fill_us": statistics.median(fills) * 1e6,
                    "fill_p99_us": percentile(fills, 99) * 1e6,
                    "advance_us": statistics.median(advances) * 1e6,
                }
            ),
            flush=True,
        )
        del compiled, m


# ---------------------------------------------------------------------------------------------- driver
def run_worker(
    engine: str, vocab: str, grammar: str, repeats: int, outlines_path: str | None, timeout_s: float
) -> dict:
    """One (engine, vocabulary, grammar) in a fresh process; past timeout_s (outlines-core's json_object on a
    large vocabulary takes that long) the row says how long it ran without finishing."""
    env = dict(os.environ)
    if engine == "outlines-core" and outlines_path:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (outlines_path, env.get("PYTHONPATH")) if p)
    cmd = [
        sys.executable,
        "-m",
        "load_tests.engine.bench_grammar_engines",
        "--worker",
        engine,
        "--vocabs",
        vocab,
    ]
    cmd += ["--grammars", grammar, "--repeats", str(repeats)]
    try:
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {
            "engine": engine,
            "vocab": vocab,
            "grammar": grammar,
            "error": f"not done after {timeout_s:.0f} s",
        }
    if out.returncode != 0:
        raise RuntimeError(f"{engine}/{vocab}/{grammar} worker failed:\n{out.stderr[-3000:]}")
    return [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")][0]


def table(rows: list[dict]) -> str:
    by = {(r["vocab"], r["grammar"], r["engine"]): r for r in rows}
    lines = [
        "| vocab | grammar | engine | compile ms | mask fill µs (p50 / p99) | advance µs | RSS growth MiB | "
        "grammar size KiB |",
        "|---|---|---|---:|---:|---:|---:|---:|",
    ]
    ratios = []
    for (vocab, gname, engine), r in sorted(by.items(), key=lambda kv: (kv[0][0] != "tiny", kv[0])):
        if "error" in r:
            lines.append(f"| {vocab} | {gname} | {engine} | {r['error']} | | | | |")
            continue
        lines.append(
            f"| {vocab} ({r['vocab_size']}) | {gname} ({r['doc_tokens']} tok) | {engine} | "
            f"{r['compile_s'] * 1e3:.1f} | {r['fill_us']:.1f} / {r['fill_p99_us']:.1f} | {r['advance_us']:.1f} | "
            f"{r['rss_mib']:.1f} | {r['size_kib']:.1f} |"
        )
    lines += ["", "| vocab | grammar | outlines-core / xgrammar: compile | mask fill | fill+advance | grammar size |",
              "|---|---|---:|---:|---:|---:|"]  # fmt: skip
    for (vocab, gname, engine), x in sorted(by.items()):
        o = by.get((vocab, gname, "outlines-core"))
        if engine != "xgrammar" or o is None or "error" in x or "error" in o:
            continue
        ratios.append(
            f"| {vocab} | {gname} | {o['compile_s'] / x['compile_s']:.1f}x | {o['fill_us'] / x['fill_us']:.2f}x | "
            f"{(o['fill_us'] + o['advance_us']) / (x['fill_us'] + x['advance_us']):.2f}x | "
            f"{o['size_kib'] / x['size_kib']:.2f}x |"
        )
    setups = {(r["vocab"], r["engine"]): r for r in rows if "error" not in r}
    lines += ratios + ["", "| vocab | engine | per-tokenizer setup ms | its RSS MiB |", "|---|---|---:|---:|"]
    for (vocab, engine), r in sorted(setups.items()):
        lines.append(f"| {vocab} | {engine} | {r['setup_s'] * 1e3:.1f} | {r['setup_mib']:.1f} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vocabs", default="tiny,bpe32k")
    ap.add_argument("--grammars", default=",".join(GRAMMARS))
    ap.add_argument("--engines", default=",".join(ENGINES))
    ap.add_argument("--repeats", type=int, default=20, help="timed walks over each document")
    ap.add_argument("--outlines-path", default=None, help="a folder holding outlines_core (pip --target)")
    ap.add_argument("--timeout", type=float, default=300, help="seconds one engine/vocab/grammar may take")
    ap.add_argument("--json", type=Path, default=None, help="also write every row here")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    vocabs, grammars = a.vocabs.split(","), a.grammars.split(",")
    if a.worker:
        for v in vocabs:
            worker(a.worker, v, grammars, a.repeats)
        return
    rows = []
    for v in vocabs:
        vocab_dir(v)  # build (and cache) the vocabulary once, outside the workers' timings
        for g in grammars:
            for engine in a.engines.split(","):
                row = run_worker(engine, v, g, a.repeats, a.outlines_path, a.timeout)
                print(json.dumps(row), flush=True)
                rows.append(row)
    print()
    print(table(rows))
    if a.json:
        a.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
