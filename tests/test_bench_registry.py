"""The benchmark suite's one entry point (load_tests/__main__.py, `./run bench`): every benchmark listed under a
unique name, each script's docstring short (method and results live in the groups' markdown files)."""

from __future__ import annotations

import ast
import importlib.util
import subprocess
import sys
from pathlib import Path

from load_tests.registry import GROUPS, benchmarks, find

ROOT = Path(__file__).resolve().parents[1]


def test_every_benchmark_listed_once_with_a_short_docstring():
    rows = benchmarks()
    names = [b.name for b in rows]
    assert len(names) == len(set(names)), f"two benchmarks share a name: {sorted(names)}"
    assert {"serving", "kernels", "sim", "chaos", "headline"} <= set(names)
    for b in rows:
        spec = importlib.util.find_spec(b.module)
        assert spec is not None and spec.origin, b.module
        doc = ast.get_docstring(ast.parse(Path(spec.origin).read_text())) or ""
        assert b.summary and len(doc.splitlines()) <= 3, (
            f"{b.module}: 1-3 docstring lines, the rest in RESULTS.md"
        )
        assert b.group in (*GROUPS, "")
    for group in GROUPS:
        assert (ROOT / "load_tests" / group / "RESULTS.md").is_file()
    assert find("load_tests.engine.bench_kernels").name == "kernels"


def test_list_and_unknown_name():
    run = [sys.executable, "-m", "load_tests"]
    listed = subprocess.run([*run, "--list"], capture_output=True, text=True, cwd=ROOT, check=True).stdout
    assert "kernels" in listed and "placement/" in listed
    bad = subprocess.run([*run, "no-such-bench"], capture_output=True, text=True, cwd=ROOT)
    assert bad.returncode == 2 and "--list" in bad.stderr
