"""Builds kernels/loraland_kernels/cpu/fused_ops.cpp with the machine's C++ compiler and loads it into torch.

The library is compiled once per (source, torch version, compiler, CPU flags), since `-march=native` code is
only valid on the CPU kind it was built for, and cached under ~/.cache/loraland/kernels (LORALAND_KERNEL_CACHE
overrides). `./run` builds it at install (`python -m loraland_kernels.cpu_build`); a process that finds no
build builds it on first use. No compiler, or a failed build: `load()` returns False with the reason, and the
callers (fused.py) run the plain torch ops instead. LORALAND_FUSED_CPU=0 turns the library off.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import torch

log = logging.getLogger(__name__)
SOURCE = Path(__file__).parent / "cpu" / "fused_ops.cpp"
_lock = threading.Lock()
_state: dict[str, object] = {}


def cache_dir() -> Path:
    root = os.environ.get("LORALAND_KERNEL_CACHE")
    return Path(root) if root else Path.home() / ".cache" / "loraland" / "kernels"


def _compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return ""


def library_path(cxx: str) -> Path:
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout.splitlines()[:1]
    key = hashlib.sha256()
    for part in (
        SOURCE.read_bytes(),
        torch.__version__.encode(),
        str(version).encode(),
        _cpu_flags().encode(),
    ):
        key.update(part)
    return cache_dir() / f"loraland_fused_{key.hexdigest()[:16]}.so"


def build(cxx: str, out: Path) -> None:
    """Compile SOURCE into out (atomically: a temporary file renamed, so concurrent builders never see half)."""
    from torch.utils.cpp_extension import include_paths, library_paths

    out.parent.mkdir(parents=True, exist_ok=True)
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    torch_lib = library_paths()[0]
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    cmd = [
        cxx, "-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-fno-trapping-math", "-fopenmp", "-std=c++17", "-shared", "-fPIC",
        f"-D_GLIBCXX_USE_CXX11_ABI={abi}", *[f"-I{p}" for p in include_paths()], str(SOURCE),
        f"-L{torch_lib}", "-lc10", "-ltorch_cpu", "-lgomp", f"-Wl,-rpath,{torch_lib}", "-o", tmp,
    ]  # fmt: skip
    try:
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError(f"{cxx} failed (rc {r.returncode}): {r.stderr.strip()[-2000:]}")
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def load() -> bool:
    """True when torch.ops.loraland's fused ops are usable in this process (built now if needed)."""
    if "ok" in _state:
        return bool(_state["ok"])
    with _lock:
        if "ok" in _state:
            return bool(_state["ok"])
        ok, why = False, ""
        if os.environ.get("LORALAND_FUSED_CPU", "1") == "0":
            why = "LORALAND_FUSED_CPU=0"
        elif (cxx := _compiler()) is None:
            why = "no C++ compiler (g++ or $CXX) on PATH"
        else:
            try:
                lib = library_path(cxx)
                if not lib.is_file():
                    log.info("building the fused CPU ops (%s) once for this CPU: %s", cxx, lib)
                    build(cxx, lib)
                torch.ops.load_library(str(lib))
                ok = True
            except Exception as e:  # a broken toolchain must not stop serving: the torch ops still work
                why = f"{type(e).__name__}: {e}"
        if not ok:
            log.warning("fused CPU ops unavailable (%s); using plain torch ops", why)
        _state.update(ok=ok, why=why)
        return ok


def reason() -> str:
    """Why load() returned False ("" when it did not)."""
    return str(_state.get("why", ""))


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    ok = load()
    print("fused CPU ops:", "ready" if ok else f"unavailable ({reason()})")
    sys.exit(0)
