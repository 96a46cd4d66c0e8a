"""The import graph follows the request's path (docs/ARCHITECTURE.md, "Who may import whom").

Checked twice: statically over every module's source (so a lazy import inside a function counts too), and by
importing a layer in a fresh interpreter and listing what it pulled in.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# A module matching a prefix on the left may not import any module matching a prefix on the right.
FORBIDDEN: list[tuple[tuple[str, ...], tuple[str, ...]]] = [
    # The shared vocabulary sits below everything.
    (
        (
            "app.errors",
            "app.names",
            "app.files",
            "app.protocol",
            "app.adapter_record",
            "app.merge_methods",
            "app.sampling_params",
            "app.config",
        ),
        ("app.replica", "app.router", "app.catalog", "app.cli", "app.demo", "app.main", "loraland_kernels"),
    ),
    # The public package sits on top: nothing under app/ runs up the house through it.
    (("app",), ("loraland",)),
    # Kernels are plain torch/triton.
    (("loraland_kernels",), ("app",)),
    # The engine and everything under it know nothing of Redis, S3, HTTP or Ray Serve.
    (
        (
            "app.replica.engine",
            "app.replica.outputs",
            "app.replica.batch_builder",
            "app.replica.models",
            "app.replica.kv_cache",
            "app.replica.scheduler",
            "app.replica.sequence",
            "app.replica.sampling",
            "app.replica.lora",
            "app.replica.kernel",
            "app.replica.kernel_adapters",
            "app.replica.kernel_prompts",
            "app.replica.batch",
            "app.replica.row_failure",
            "app.replica.composition",
        ),
        ("app.catalog", "app.router", "app.cli", "app.demo", "app.main", "ray"),
    ),
    # The replica side never imports the router (the ingress alone maps errors to HTTP).
    (("app.replica",), ("app.router", "app.cli", "app.demo", "app.main")),
    # The router talks to replicas through app.protocol and Ray handles, not replica modules.
    (("app.router",), ("app.replica", "app.cli", "app.demo", "app.main", "loraland_kernels")),
    # The catalog is a service both sides use; it uses neither.
    (("app.catalog",), ("app.replica", "app.router", "app.cli", "app.demo", "app.main", "loraland_kernels")),
]


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT)
    parts = list((rel.relative_to("kernels") if rel.parts[0] == "kernels" else rel).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)
    return out


def _matches(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def _sources() -> list[Path]:
    return sorted(p for d in ("app", "kernels") for p in (ROOT / d).rglob("*.py"))


def test_static_import_graph_follows_the_layers():
    violations = []
    for path in _sources():
        mod = _module_name(path)
        for who, banned in FORBIDDEN:
            if not _matches(mod, who):
                continue
            for imp in sorted(_imports(path)):
                if _matches(imp, banned):
                    violations.append(f"{mod} imports {imp}")
    assert not violations, "layering violations:\n" + "\n".join(violations)


# The Ray edge: the only modules that build or read the wire `Failure` (app/protocol.py defines it). Everywhere
# else errors are exceptions.
RAY_EDGE = {"app.protocol", "app.replica.deployment", "app.router.routing.replica_client"}


def _names(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    found |= {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    found |= {a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names}
    return found


def test_failure_lives_only_at_the_ray_edge():
    users = sorted(_module_name(p) for p in _sources() if "Failure" in _names(p))
    assert set(users) <= RAY_EDGE, f"Failure used outside the Ray edge: {sorted(set(users) - RAY_EDGE)}"


def _graph() -> dict[str, set[str]]:
    """Module -> project modules it imports (lazy and TYPE_CHECKING imports included). `from pkg import sub`
    counts as importing the submodule, not the package."""
    paths = {_module_name(p): p for d in ("app", "kernels", "loraland") for p in (ROOT / d).rglob("*.py")}
    graph = {}
    for mod, path in paths.items():
        out = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                out.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                subs = {f"{node.module}.{a.name}" for a in node.names}
                out |= subs
                if not subs <= paths.keys():
                    out.add(node.module)
        graph[mod] = {m for m in out if m in paths and m != mod}
    return graph


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def test_no_import_circles():
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [
        ["a", "b", "c"]
    ]  # the checker works
    assert not _circles(_graph()), "import circles (lazy and TYPE_CHECKING imports count):\n" + "\n".join(
        " <-> ".join(c) for c in _circles(_graph())
    )


def test_the_checker_sees_lazy_imports(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("def f():\n    from app.router.http.errors import error_reply\n    import ray.serve\n")
    assert {"app.router.http.errors", "app.router.http.errors.error_reply", "ray.serve"} <= _imports(f)


@pytest.mark.parametrize(
    "module, banned",
    [
        ("app.replica.engine", ("app.catalog", "app.router", "ray")),
        ("app.replica.models", ("app.catalog", "app.router", "ray")),
        ("loraland_kernels.lora", ("app",)),
        ("app.replica.core", ("app.router", "loraland")),
        ("app.router.http.ingress", ("app.replica", "loraland")),
        ("app.replica.kernel", ("app.router",)),
        ("app.router.service", ("app.replica",)),
        ("app.catalog.store", ("app.replica", "app.router")),
    ],
)
def test_importing_a_layer_pulls_in_nothing_above_it(module, banned):
    code = f"import json, sys, {module}; print(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    loaded = json.loads(out.stdout.strip().splitlines()[-1])
    bad = [m for m in loaded if _matches(m, banned)]
    assert not bad, f"import {module} loaded {bad}"
