"""Fuzz the PEFT adapter reader (atheris): adapter_config.json and the safetensors header and bytes.
Run: ./run bench fuzz_adapter [--help]. Method and results: load_tests/chaos/RESULTS.md."""

from __future__ import annotations

import atexit
import json
import os
import shutil
import struct
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from load_tests.chaos import fuzz_runner

SEP = b"\n--adapter_model.safetensors--\n"
MAX_RANK = 8
TINY = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 32,
    "hidden_size": 8,
    "intermediate_size": 16,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "max_position_embeddings": 64,
    "_name_or_path": "tiny-fuzz-llama",
}
MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
DTYPE = {"F64": "<f8", "F32": "<f4", "F16": "<f2", "I64": "<i8", "I32": "<i4", "I16": "<i2", "I8": "i1",
         "U8": "u1", "BOOL": "u1", "BF16": None, "F8_E4M3": None, "F8_E5M2": None, "U16": "<u2"}  # fmt: skip


class PropertyViolation(AssertionError):
    """The reader accepted an adapter but another view of it disagrees (a crash for the fuzzer)."""


# ---------------------------------------------------------------------------------------------- bytes


class Draw:
    """Choices read from the fuzzer's bytes (zeros once they run out): atheris-free, so regression tests and
    the suite replay inputs without it."""

    def __init__(self, data: bytes):
        self.data, self.i = data, 0

    def byte(self) -> int:
        if self.i >= len(self.data):
            return 0
        self.i += 1
        return self.data[self.i - 1]

    def pick(self, seq: Any) -> Any:
        return seq[self.byte() % len(seq)]

    def int(self, lo: int, hi: int) -> int:
        return lo + (self.byte() | self.byte() << 8) % (hi - lo + 1)

    def chance(self, one_in: int) -> bool:
        return self.byte() % one_in == 0


def tensor_bytes(values: np.ndarray, dtype: str) -> bytes:
    if dtype == "BF16":
        return (values.astype("<f4").view("<u4") >> 16).astype("<u2").tobytes()
    if DTYPE.get(dtype) is None:  # fp8 and unknown names: one byte per value
        return values.astype("<f4").view("u1")[::4].tobytes()
    if dtype == "BOOL":
        return (values != 0).astype("u1").tobytes()
    return values.astype(DTYPE[dtype]).tobytes()


def safetensors(tensors: dict[str, tuple[str, list[int], bytes]], metadata: dict | None = None) -> bytes:
    """The safetensors layout by hand: u64 header length, JSON header, then the data in key order."""
    header: dict[str, Any] = {"__metadata__": metadata} if metadata is not None else {}
    blobs, offset = [], 0
    for key, (dtype, shape, blob) in tensors.items():
        header[key] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + len(blob)]}
        blobs.append(blob)
        offset += len(blob)
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)  # the writer pads to 8 bytes
    return struct.pack("<Q", len(head)) + head + b"".join(blobs)


def shapes() -> dict[str, tuple[int, int]]:
    from app.config.model_config import ModelConfig

    return ModelConfig.from_dict(TINY).linear_shapes()


def good_config(rank: int = 2, targets: tuple[str, ...] = ("q_proj", "v_proj"), **extra: Any) -> dict:
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": "tiny-fuzz-llama",
            "r": rank, "lora_alpha": 2 * rank, "target_modules": list(targets), "bias": "none",
            "fan_in_fan_out": False, "use_rslora": False, "inference_mode": True, **extra}  # fmt: skip


def good_weights(
    rank: int = 2, targets: tuple[str, ...] = ("q_proj", "v_proj"), layers=(0, 1), dtype="F32", dora=False
) -> bytes:
    rng, sh, tensors = np.random.default_rng(rank), shapes(), {}
    for layer in layers:
        for m in targets:
            n_in, n_out = sh[m]
            p = f"base_model.model.model.layers.{layer}.{'self_attn' if m in MODULES[:4] else 'mlp'}.{m}"
            for ab, shape in (("A", [rank, n_in]), ("B", [n_out, rank])):
                tensors[f"{p}.lora_{ab}.weight"] = (
                    dtype,
                    shape,
                    tensor_bytes(rng.normal(0, 0.1, shape), dtype),
                )
            if dora:
                tensors[f"{p}.lora_magnitude_vector"] = (dtype, [n_out], tensor_bytes(np.ones(n_out), dtype))
    return safetensors(tensors, {"format": "pt"})


# ---------------------------------------------------------------------------------------------- structured draws

_CONFIG_KEYS = ("r", "lora_alpha", "target_modules", "rank_pattern", "alpha_pattern", "layers_to_transform",
                "layers_pattern", "use_rslora", "use_dora", "bias", "peft_type", "task_type", "modules_to_save",
                "fan_in_fan_out", "auto_mapping", "base_model_name_or_path", "exclude_modules", "lora_bias",
                "init_lora_weights", "target_parameters", "layer_replication", "megatron_config")  # fmt: skip
_VALUES = (None, True, False, 0, -1, 1, 2, 3, 8, 9, 17, 2**31, 2**64, 0.5, 1.5, 1e308, -1e308, 1e-320,
           float("nan"), float("inf"), "", "q_proj", "v_proj", ".*", ".*q_proj", "(a|aa)+$", "all-linear",
           "model.layers.0.self_attn.q_proj", "layers", "h", "x" * 300, "LORA", "LOHA", "CAUSAL_LM",
           "SEQ_CLS", "none", "all", ["q_proj", "v_proj"], ["q_proj", 5], [], ["c_attn"], ["lm_head"],
           ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], [0], [1], [0, 1],
           [5000], [-1], [True], {"q_proj": 4}, {"q_proj": 99}, {"(a|aa)+$": 2}, {"v_proj": 0}, {"q": "x"},
           {"model.layers.1.self_attn.q_proj": 4}, {"layers.0.self_attn.v_proj": 1.5}, {"": 2},
           {"base_model_class": "MistralForCausalLM"}, {"base_model_class": "GPT2LMHeadModel"},
           {"base_model_class": 5}, [["q_proj"]], {"a": {"b": [1, {"c": None}]}})  # fmt: skip
_KEY_SUFFIXES = (".lora_A.weight", ".lora_B.weight", ".lora_A.default.weight", ".lora_B.default.weight",
                 ".lora_magnitude_vector", ".lora_magnitude_vector.weight", ".lora_A.other.weight",
                 ".lora_embedding_A", ".weight", ".lora_A.weight.weight")  # fmt: skip
_PREFIXES = ("base_model.model.model.layers.{l}.{b}.{m}", "model.layers.{l}.{b}.{m}", "layers.{l}.{b}.{m}",
             "base_model.model.model.layers.{l}.{m}", "base_model.model.lm_head",
             "base_model.model.model.embed_tokens", "base_model.model.model.layers.{l}.mlp.{m}.x",
             "x.layers.{l}.{b}.{m}")  # fmt: skip
_LAYERS = (0, 1, 2, 31, 1023, 1024, 5000, 10**20)


def drawn_config(d: Draw) -> bytes:
    cfg = good_config(
        rank=d.pick((1, 2, 4, 8, 9)), targets=d.pick((("q_proj", "v_proj"), MODULES, ("q_proj",)))
    )
    for _ in range(d.int(0, 4)):
        cfg[d.pick(_CONFIG_KEYS)] = d.pick(_VALUES)
    if d.chance(8):
        cfg.pop(d.pick(("r", "lora_alpha", "target_modules")), None)
    if d.chance(16):
        return json.dumps(d.pick(_VALUES)).encode()  # not an object
    return json.dumps(cfg).encode()


def drawn_weights(d: Draw) -> bytes:
    sh, tensors = shapes(), {}
    rank = d.pick((1, 2, 2, 2, 4, 8, 9, 0))
    for _ in range(d.int(0, 10)):
        m = d.pick((*MODULES, "c_attn", "q_proj"))
        block = "self_attn" if m in MODULES[:4] else d.pick(("mlp", "mlp", "self_attn"))
        key = d.pick(_PREFIXES).format(l=d.pick(_LAYERS), b=block, m=m) + d.pick(_KEY_SUFFIXES)
        n_in, n_out = sh.get(m, (8, 24))
        shape = d.pick(([rank, n_in], [n_out, rank], [n_out], [rank, n_in + 1], [n_in, rank], [rank, n_in, 1],
                        [], [0, n_in], [2**33, 0], [rank, -1]))  # fmt: skip
        dtype = d.pick(("F32", "F32", "F32", "F16", "BF16", "F64", "I64", "BOOL", "U8", "F8_E4M3", "Q4", ""))
        count = int(np.prod([max(0, s) for s in shape])) if shape and all(s >= 0 for s in shape) else 1
        count = min(count, 4096)
        fill = d.pick(("normal", "normal", "zeros", "nan", "inf", "huge", "tiny"))
        values = {"zeros": np.zeros(count), "nan": np.full(count, np.nan), "inf": np.full(count, np.inf),
                  "huge": np.full(count, 3e38), "tiny": np.full(count, 1e-45)}.get(fill)  # fmt: skip
        if values is None:
            values = np.random.default_rng(d.byte()).normal(0, 0.1, count)
        blob = tensor_bytes(values, dtype)
        if d.chance(8):
            blob = blob[: d.int(0, len(blob))]  # data shorter than the shape says
        tensors[key] = (dtype, shape, blob)
    raw = safetensors(tensors, d.pick(({"format": "pt"}, None, {"format": 5}, {"x": "y" * 100})))
    how = d.byte() % 16
    if how == 0:  # the header length lies
        raw = struct.pack("<Q", d.pick((0, 1, 7, 2**63, len(raw), len(raw) - 8 + 1, 100_000_000))) + raw[8:]
    elif how == 1:  # cut anywhere
        raw = raw[: d.int(0, len(raw))]
    elif how == 2:  # a byte of the header changed
        i = d.int(8, max(8, len(raw) - 1))
        raw = raw[:i] + bytes([d.byte()]) + raw[i + 1 :]
    elif how == 3:  # offsets swapped or overlapping
        raw = raw.replace(b'"data_offsets":[0,', b'"data_offsets":[4,', 1)
    return raw


# ---------------------------------------------------------------------------------------------- the target


def decode(data: bytes) -> tuple[bytes | None, bytes | None, bool]:
    """(adapter_config.json, adapter_model.safetensors, write a pickle too) from one fuzz input."""
    if not data:
        return good_config_bytes(), GOOD_WEIGHTS, False
    head, rest = data[0], data[1:]
    mode = head & 3
    if mode == 0:
        config, sep, weights = rest.partition(SEP)
        config_b, weights_b = config, (weights if sep else GOOD_WEIGHTS)
    elif mode == 1:
        config_b, weights_b = good_config_bytes(), rest
    elif mode == 2:
        config_b, weights_b = rest, GOOD_WEIGHTS
    else:
        d = Draw(rest)
        config_b, weights_b = drawn_config(d), drawn_weights(d)
    flags = head >> 2 if head & 0x80 else 0  # rare: a missing file, a pickle next to the weights
    return (None if flags & 1 else config_b), (None if flags & 2 else weights_b), bool(flags & 4)


def good_config_bytes() -> bytes:
    return json.dumps(good_config()).encode()


GOOD_WEIGHTS = b""  # set by load(); a module constant so decode() needs no numpy work per input
_FOLDER: Path | None = None
_T: dict[str, Any] = {}


def load() -> None:
    """Import the code under test (the worker does it inside atheris.instrument_imports)."""
    global GOOD_WEIGHTS, _FOLDER
    from app.config.model_config import ModelConfig
    from app.errors import LoraLandError
    from app.replica.lora import peft_format

    try:
        from app.replica.lora.checks import check_adapter
    except ImportError:  # older trees: the reader alone
        check_adapter = None
    _T.update(model=ModelConfig.from_dict(TINY), read=peft_format.read_adapter, error=LoraLandError,
              summary=peft_format.adapter_summary, check=check_adapter)  # fmt: skip
    GOOD_WEIGHTS = GOOD_WEIGHTS or good_weights()
    scratch = os.environ.get(fuzz_runner.SCRATCH_ENV)  # the runner's (in memory, removed when it ends)
    if scratch:
        _FOLDER = Path(scratch) / f"adapter-{os.getpid()}"
    else:  # a test replaying inputs in its own process
        top = tempfile.mkdtemp(prefix="loraland-fuzz-adapter-")
        atexit.register(shutil.rmtree, top, ignore_errors=True)
        _FOLDER = Path(top) / "adapter"
    _FOLDER.mkdir()
    # One good adapter through every reader first: torch and safetensors import lazily, and an import that
    # takes seconds on a busy machine must not count against the first input's timeout.
    write_folder(_FOLDER, b"")
    run(_FOLDER)


def write_folder(folder: Path, data: bytes) -> None:
    config, weights, pickle = decode(data)
    for name, blob in (("adapter_config.json", config), ("adapter_model.safetensors", weights)):
        path = folder / name
        if blob is None:
            path.unlink(missing_ok=True)
        else:
            path.write_bytes(blob)
    bin_path = folder / "adapter_model.bin"
    if pickle:
        bin_path.write_bytes(b"\x80\x04K\x01.")
    else:
        bin_path.unlink(missing_ok=True)


def test_one(data: bytes) -> None:
    """One input through every reader; LoraLandError is the only allowed failure (fuzz_runner swallows it)."""
    if not _T:
        load()
    write_folder(_FOLDER, data)
    run(_FOLDER)


def run(folder: Path) -> None:
    """The reader, the summary and the base-model-free checks on `folder`, with the properties between them."""
    allowed = _T["error"]
    try:
        weights = _T["read"](folder, _T["model"], max_rank=MAX_RANK)
    except allowed:
        weights = None
    try:
        summary = _T["summary"](folder)
    except allowed:
        if weights is not None:
            raise PropertyViolation("read_adapter accepted an adapter adapter_summary refuses") from None
        summary = None
    if weights is not None and summary is not None:
        if summary["target_modules"] != sorted(weights.target_modules) or summary["layers"] != list(
            weights.layers
        ):
            raise PropertyViolation(
                f"summary {summary['target_modules']}/{summary['layers']} != the weights'"
            )
    if _T["check"] is not None:
        try:
            _T["check"](folder, max_rank=MAX_RANK)
        except allowed as e:
            if weights is not None and "norm" not in str(e):
                raise PropertyViolation(
                    f"check_adapter refuses an adapter the base model loads: {e}"
                ) from None


# ---------------------------------------------------------------------------------------------- the run


def seeds() -> list[bytes]:
    global GOOD_WEIGHTS
    GOOD_WEIGHTS = GOOD_WEIGHTS or good_weights()  # numpy only: the parent process never imports torch
    out = []
    variants = [
        (good_config(), good_weights()),
        (good_config(rank=4, targets=MODULES), good_weights(rank=4, targets=MODULES)),
        (
            good_config(use_rslora=True, rank_pattern={"v_proj": 1}, alpha_pattern={"q_proj": 3}),
            None,
        ),  # fmt: skip
        (good_config(use_dora=True), good_weights(dora=True)),
        (good_config(layers_to_transform=[1]), good_weights(layers=(1,))),
        (good_config(target_modules=r".*\.(q_proj|v_proj)"), good_weights()),
        (good_config(), good_weights(dtype="BF16")),
        (good_config(), good_weights(dtype="F16")),
    ]
    for cfg, weights in variants:
        if weights is None:
            sh, rng, tensors = shapes(), np.random.default_rng(0), {}
            for layer in (0, 1):
                for m, r in (("q_proj", 2), ("v_proj", 1)):
                    n_in, n_out = sh[m]
                    p = f"base_model.model.model.layers.{layer}.self_attn.{m}"
                    tensors[f"{p}.lora_A.weight"] = (
                        "F32",
                        [r, n_in],
                        tensor_bytes(rng.normal(size=(r, n_in)), "F32"),
                    )
                    tensors[f"{p}.lora_B.weight"] = (
                        "F32",
                        [n_out, r],
                        tensor_bytes(rng.normal(size=(n_out, r)), "F32"),
                    )
            weights = safetensors(tensors, {"format": "pt"})
        out.append(bytes([0]) + json.dumps(cfg).encode() + SEP + weights)
    out.append(bytes([1]) + GOOD_WEIGHTS)
    out.append(bytes([2]) + good_config_bytes())
    out += [bytes([3]) + bytes([i] * 64) for i in range(0, 256, 17)]
    return out


def worker(args) -> None:
    fuzz_runner.run_instrumented(args, load, test_one, lambda: (_T["error"],))


def main(argv: list[str] | None = None) -> int:
    return fuzz_runner.main("load_tests.chaos.fuzz_adapter", __doc__, seeds, worker, argv)


if __name__ == "__main__":
    sys.exit(main())
