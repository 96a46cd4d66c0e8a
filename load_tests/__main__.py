"""`./run bench` (python -m load_tests): --list shows every benchmark; NAME [ARGS] runs one with its own
arguments (NAME --help for them); no name lists them too."""

from __future__ import annotations

import runpy
import sys

from load_tests.registry import GROUPS, benchmarks, find


def print_list() -> None:
    rows = benchmarks()
    width = max(len(b.name) for b in rows)
    for group, what in [*GROUPS.items(), ("", "")]:
        print(f"\n{group}/  ({what})" if group else "")
        for b in rows:
            if b.group == group:
                print(f"  {b.name:{width}}  {b.summary}")
    print("\n./run bench NAME [ARGS] runs one (NAME --help: its arguments); results: load_tests/README.md")


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("--list", "-l", "list", "--help", "-h"):
        print_list()
        return 0
    try:
        bench = find(argv[0])
    except KeyError as e:
        print(e.args[0], file=sys.stderr)
        return 2
    sys.argv = [f"python -m {bench.module}", *argv[1:]]
    runpy.run_module(bench.module, run_name="__main__", alter_sys=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
