"""Malformed and hostile adapters through the admin API and the CLI (issue 16): each is a 4xx (the CLI: exit 1
and one `loraland: error:` line) whose message names what to fix, nothing is registered, and serving goes on
undisturbed.

This corpus holds what tests/fixtures/malformed.py (17 kinds, run by tests/test_adapter_checks.py and
tests/test_cli_validation.py) does not: broken files (truncated, garbage, a lying header, a config that is not
a JSON object), oversize and over-rank adapters, modules_to_save, an incomplete DoRA, bad names, and sources that
leave the local roots or name other hosts. The fuzz-found config fields of the wrong JSON type (tests/
test_fuzz.py) are here too, through HTTP: they were a 500 (TypeError/AttributeError out of app/replica/lora/)."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import pytest

from tests.fixtures.inproc_stack import module_stack, openai_error
from tests.fixtures.services import redis_server  # noqa: F401
from tests.fixtures.tiny_adapter import write_tiny_adapter

MAX_BYTES = 150_000  # LORALAND_MAX_ADAPTER_BYTES for this module: the tiny adapters are ~9 KB
WEIGHTS, CONFIG = "adapter_model.safetensors", "adapter_config.json"


def _config(folder: Path, **changes) -> None:
    path = folder / CONFIG
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def _bytes(folder: Path, fn) -> None:
    path = folder / WEIGHTS
    path.write_bytes(fn(path.read_bytes()))


def _tensors(folder: Path, fn) -> None:
    """Rewrite every tensor of the weights file through fn(key, tensor) (a valid safetensors file again)."""
    from safetensors.torch import load_file, save_file

    path = folder / WEIGHTS
    save_file({k: fn(k, v).contiguous() for k, v in load_file(str(path)).items()}, str(path))


# kind -> (how to break a good adapter folder, text the refusal must contain)
FILE_KINDS = {
    "truncated-weights": (lambda f: _bytes(f, lambda b: b[: len(b) // 2]), "safetensors"),
    "garbage-weights": (lambda f: _bytes(f, lambda b: os.urandom(len(b))), "safetensors"),
    "header-length-lies": (lambda f: _bytes(f, lambda b: struct.pack("<Q", 2**40) + b[8:]), "safetensors"),
    "config-not-json": (lambda f: (f / CONFIG).write_text("{not json"), "adapter_config.json"),
    "config-is-a-list": (lambda f: (f / CONFIG).write_text("[1, 2]"), "JSON object"),
    "modules-to-save": (lambda f: _config(f, modules_to_save=["lm_head"]), "modules_to_save"),
    "rank-over-limit": (lambda f: _config(f, r=128, lora_alpha=256), "128"),
    "dora-without-magnitudes": (lambda f: _config(f, use_dora=True), "magnitude"),
    "nan-weights": (lambda f: _tensors(f, lambda k, t: t.fill_(float("nan")) if "lora_A" in k else t), "NaN"),
    "inf-weights": (lambda f: _tensors(f, lambda k, t: t.fill_(float("inf")) if "lora_B" in k else t), "inf"),
    "absurd-delta": (lambda f: _tensors(f, lambda k, t: t * 1e18 if "lora_B" in k else t), "Frobenius norm"),
    "wrong-shape": (lambda f: _tensors(f, lambda k, t: t[:-1] if "lora_A" in k else t), "shape"),
    "unknown-target": (lambda f: _config(f, target_modules=["q_proj", "frobnicate_proj"]), "frobnicate_proj"),
    "not-lora": (lambda f: _config(f, peft_type="IA3"), "peft_type"),
    "pickled-weights": (lambda f: (f / WEIGHTS).rename(f / "adapter_model.bin"), "pickle"),
    "no-weights": (lambda f: (f / WEIGHTS).unlink(), WEIGHTS),
    "no-config": (lambda f: (f / CONFIG).unlink(), CONFIG),
}
TYPE_KINDS = {
    "target_modules-int": {"target_modules": 5},
    "exclude_modules-int-list": {"exclude_modules": [5]},
    "base_model_name-dict": {"base_model_name_or_path": {"a": 1}},
}


@pytest.fixture(scope="module")
def stack(redis_server, llama_dir, tmp_path_factory):  # noqa: F811
    env = {"LORALAND_MAX_ADAPTER_BYTES": str(MAX_BYTES)}
    for s in module_stack(redis_server, llama_dir, tmp_path_factory, "corpus", **env):
        s.reference = _complete(s, "pub")
        assert s.reference.status_code == 200, s.reference.text
        yield s


def _complete(stack, model: str):
    body = {"model": model, "prompt": "the quick brown fox", "max_tokens": 4}
    return stack.run(lambda c: c.post("/v1/completions", json=body, headers=stack.headers("alpha")))


def _register(stack, name: str, source: str):
    before = {r.ref for r in stack.catalog.list(None)}
    body = {"name": name, "source": source, "public": True}
    r = stack.run(lambda c: c.post("/v1/adapters", json=body, headers=stack.headers("admin")))
    assert {r.ref for r in stack.catalog.list(None)} == before, f"{name}: something was registered"
    return r


def _refused(r, want: str) -> None:
    assert 400 <= r.status_code < 500, r.text
    assert openai_error(r.json()) is None, r.text
    assert want.lower() in r.json()["error"]["message"].lower(), r.text


def _broken(stack, kind: str, how) -> Path:
    folder = write_tiny_adapter(stack.root / "corpus" / kind, seed=41)
    if isinstance(how, dict):
        _config(folder, **how)
    else:
        how(folder)
    return folder


@pytest.mark.parametrize("kind", sorted(FILE_KINDS))
def test_broken_files_are_refused_over_http(stack, kind):
    how, want = FILE_KINDS[kind]
    _refused(_register(stack, f"bad-{kind}", str(_broken(stack, kind, how))), want)


@pytest.mark.parametrize("kind", sorted(TYPE_KINDS))
def test_config_fields_of_the_wrong_type_are_400_over_http(stack, kind):
    field = next(iter(TYPE_KINDS[kind]))
    _refused(_register(stack, f"bad-{kind}", str(_broken(stack, kind, TYPE_KINDS[kind]))), field)


def test_oversize_adapter_is_refused(stack):
    all_seven = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    big = write_tiny_adapter(stack.root / "corpus" / "oversize", rank=32, targets=all_seven, seed=5)
    assert sum(p.stat().st_size for p in big.iterdir()) > MAX_BYTES
    _refused(_register(stack, "bad-oversize", str(big)), "LORALAND_MAX_ADAPTER_BYTES")


def test_sources_outside_the_roots_or_on_other_hosts_are_refused(stack, tmp_path):
    root = stack.root
    outside = write_tiny_adapter(tmp_path / "outside", seed=2)
    (root / "link-out").symlink_to(outside)
    mixed = write_tiny_adapter(root / "mixed", seed=3)
    (mixed / WEIGHTS).unlink()
    (mixed / WEIGHTS).symlink_to(outside / WEIGHTS)
    loop = write_tiny_adapter(root / "loop", seed=4)
    (loop / "a").symlink_to(loop / "b")
    (loop / "b").symlink_to(loop / "a")
    cases = {
        str(outside): "outside the allowed roots",
        f"{root}/../{outside.relative_to(root.parent)}": "outside the allowed roots",
        f"file://{outside}": "outside the allowed roots",
        str(root / "link-out"): "outside the allowed roots",
        str(mixed): "links outside",
        str(loop): "refused",
        "/etc": "outside the allowed roots",
        "s3://arn:aws:s3:us-east-1:123456789012:accesspoint:ap/x": "bucket",
        "s3://169.254.169.254/latest/meta-data": "bucket",
        "s3://other-bucket.evil.example:80/x": "bucket",
        "http://169.254.169.254/latest/meta-data": "unsupported adapter source",
        "ftp://example.org/x": "unsupported adapter source",
        "hf://../../x": "invalid adapter name",
        str(root / "empty-folder"): "",
    }
    (root / "empty-folder").mkdir()
    for source, want in cases.items():
        _refused(_register(stack, "bad-source", source), want)


def test_bad_names_are_refused(stack):
    good = write_tiny_adapter(stack.root / "corpus" / "named", seed=8)
    for name in ["../evil", "a/b/c", "..", ".hidden", "a b", "x" * 200, "a@1", "a|b", "a*0.5", "", "/abs"]:
        _refused(_register(stack, name, str(good)), "name")


def test_serving_is_undisturbed(stack):
    """After every refusal above (the module's other tests), the same request answers the same text."""
    r = _complete(stack, "pub")
    assert (
        r.status_code == 200
        and r.json()["choices"][0]["text"] == stack.reference.json()["choices"][0]["text"]
    )


# ---------------------------------------------------------------------------------------------- the CLI


def test_cli_refuses_the_same_files_with_one_line_and_registers_nothing(stack, tmp_path, monkeypatch, capsys):
    from app.cli import main

    env = {k: v for k, v in os.environ.items() if not k.startswith(("LORALAND_", "AWS_", "HF_"))}
    url = stack.catalog.url.rsplit("/", 1)[0] + "/7"  # its own database: the CLI's namespace is fixed
    env.update(LORALAND_REDIS_URL=url, LORALAND_CACHE_DIR=str(tmp_path / "cache"), HF_HUB_OFFLINE="1")
    env["LORALAND_MAX_ADAPTER_BYTES"] = str(MAX_BYTES)
    for k in list(os.environ):
        if k.startswith(("LORALAND_", "AWS_", "HF_")):
            monkeypatch.delenv(k)
    for k, v in env.items():
        monkeypatch.setenv(k, v)

    def run(*argv: str) -> tuple[int, str]:
        capsys.readouterr()
        code = main(list(argv))
        return code, capsys.readouterr().err

    all_seven = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    folders = {k: _broken(stack, f"cli-{k}", how) for k, (how, _) in FILE_KINDS.items()}
    wants = {k: want for k, (_, want) in FILE_KINDS.items()}
    folders["oversize"] = write_tiny_adapter(tmp_path / "big", rank=32, targets=all_seven, seed=5)
    wants["oversize"] = "LORALAND_MAX_ADAPTER_BYTES"
    for kind, folder in sorted(folders.items()):
        code, err = run("adapters", "register", f"bad-{kind}", str(folder))
        lines = [ln for ln in err.splitlines() if ln.startswith("loraland: error:")]
        assert code == 1 and len(lines) == 1 and "Traceback" not in err, (kind, err)
        assert wants[kind].lower() in lines[0].lower(), (kind, lines[0])
    code, err = run("adapters", "register", "../evil", str(folders["no-weights"]))
    assert code == 1 and "invalid adapter name" in err
    code, err = run("adapters", "register", "ok", "s3://arn:aws:s3:us-east-1:123456789012:accesspoint:ap/x")
    assert code == 1 and "bucket" in err, err
    capsys.readouterr()
    assert main(["adapters", "list", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == []
