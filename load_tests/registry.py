"""Every benchmark of the suite by name: the modules of the group packages that run as scripts, found by
reading their source (nothing is imported until one runs), each described by its docstring's first line."""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent
GROUPS = {
    "serving": "serving over HTTP or in-process, against peers",
    "engine": "kernel, engine and component microbenchmarks",
    "chaos": "faults, soak, fuzzing, multi-node",
    "placement": "the placement simulator and its check against a real stack",
}


@dataclass(frozen=True)
class Bench:
    name: str  # what `./run bench NAME` takes: the module's name without its bench_ prefix
    group: str
    module: str  # what `python -m` runs
    summary: str


def _runs_as_script(tree: ast.Module) -> bool:
    return any(
        isinstance(n, ast.If) and "__main__" in ast.unparse(n.test) and "__name__" in ast.unparse(n.test)
        for n in tree.body
    )


def benchmarks() -> list[Bench]:
    """Every benchmark, group by group, in name order within a group."""
    out = []
    for group in GROUPS:
        for path in sorted((ROOT / group).glob("*.py")):
            tree = ast.parse(path.read_text())
            if not _runs_as_script(tree):
                continue
            doc = (ast.get_docstring(tree) or "").strip()
            out.append(
                Bench(
                    path.stem.removeprefix("bench_"),
                    group,
                    f"load_tests.{group}.{path.stem}",
                    doc.split("\n")[0],
                )
            )
    out.append(Bench("headline", "", "load_tests.headline", _doc_line(ROOT / "headline.py")))
    return out


def _doc_line(path: Path) -> str:
    return (ast.get_docstring(ast.parse(path.read_text())) or "").strip().split("\n")[0]


def find(name: str) -> Bench:
    """The benchmark called name; a KeyError that lists the names when there is none."""
    known = benchmarks()
    for b in known:
        if name in (b.name, b.module, b.module.rpartition(".")[2]):
            return b
    raise KeyError(
        f"no benchmark {name!r}; `./run bench --list` lists them: {', '.join(b.name for b in known)}"
    )
