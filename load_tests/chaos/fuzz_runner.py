"""Running an atheris (libFuzzer) target for N executions and reporting what escaped it.

A fuzz module (fuzz_adapter.py, fuzz_model_field.py) supplies `test_one(data: bytes)`, which may raise only the
documented error classes (app.errors.LoraLandError); `seeds()`, a starting corpus; and the modules whose code
coverage guides the mutations. This module does the rest:

    python -m load_tests.chaos.fuzz_adapter --runs 1000000 [--seed 1] [--corpus DIR] [--artifacts DIR] [--max-len 8192]

The parent process starts a worker (the same module with --worker) that runs libFuzzer; libFuzzer never returns
to Python (it exit()s), so the parent counts executions from libFuzzer's final stats. An undocumented exception
is a crash: the worker saves the input under --artifacts with its signature (type + innermost app/ frame) and
carries on, so one long run reports every distinct crash, not only the first. A timeout or an out-of-memory
kills the worker; the parent records libFuzzer's artifact and restarts it for the executions left. The exit
status is 0 when nothing escaped, 1 otherwise.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

CRASH_LOG = "crashes.jsonl"
SCRATCH_ENV = (
    "LORALAND_FUZZ_SCRATCH"  # a folder the target may write inputs to (in /dev/shm when there is one)
)
_STATS = re.compile(r"stat::number_of_executed_units:\s*(\d+)")
_DONE = re.compile(r"^#(\d+)\s", re.M)
_ARTIFACT = re.compile(r"Test unit written to (\S+)")
_MAX_RESTARTS = 50


@dataclass
class Result:
    executions: int
    seconds: float
    crashes: list[dict]

    def line(self, name: str) -> str:
        rate = self.executions / self.seconds if self.seconds > 0 else 0.0
        return (
            f"{name}: {self.executions} executions in {self.seconds:.1f} s ({rate:.0f}/s), "
            f"{len(self.crashes)} distinct crashes"
        )


def signature(exc: BaseException) -> str:
    """Type and the innermost frame in our code: one crash found a thousand times is one crash."""
    tb = traceback.extract_tb(exc.__traceback__)
    frames = [f for f in tb if "/app/" in f.filename] or tb[-1:]  # a property check raises in the harness
    where = f"{Path(frames[-1].filename).name}:{frames[-1].lineno}" if frames else "?"
    return f"{type(exc).__name__} at {where}"


def guarded(
    test_one: Callable[[bytes], None],
    allowed: tuple[type[BaseException], ...],
    artifacts: Path,
    *,
    stop_on_crash: bool = False,
) -> Callable[[bytes], None]:
    """test_one with allowed exceptions swallowed and every other one recorded once per signature."""
    seen: set[str] = set()
    artifacts.mkdir(parents=True, exist_ok=True)

    def target(data: bytes) -> None:
        try:
            test_one(data)
        except allowed:
            pass
        except Exception as e:
            if stop_on_crash:
                raise
            sig = signature(e)
            if sig in seen:
                return
            seen.add(sig)
            path = artifacts / f"crash-{hashlib.sha1(data).hexdigest()}"
            path.write_bytes(data)
            record = {"signature": sig, "input": str(path), "error": f"{type(e).__name__}: {e}"[:500]}
            record["traceback"] = "".join(traceback.format_exception(e))[-4000:]
            with open(artifacts / CRASH_LOG, "a") as f:
                f.write(json.dumps(record) + "\n")
            print(f"CRASH {sig}: {record['error'][:200]} (input: {path})", file=sys.stderr, flush=True)

    return target


def parse_args(argv: list[str] | None, doc: str) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    p.add_argument("--runs", type=int, default=100_000, help="executions in all (default 100000)")
    p.add_argument("--seed", type=int, default=1, help="libFuzzer's random seed (0: random)")
    p.add_argument("--max-len", type=int, default=8192, help="largest input in bytes")
    p.add_argument("--timeout-s", type=int, default=10, help="an input running longer is a crash")
    p.add_argument("--corpus", type=Path, default=None, help="corpus folder kept between runs")
    p.add_argument("--artifacts", type=Path, default=None, help="where crashing inputs are saved")
    p.add_argument("--stop-on-crash", action="store_true", help="stop at the first crash (to minimise it)")
    p.add_argument("--no-instrument", action="store_true", help="no coverage feedback (faster, blind)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def run_instrumented(
    args: argparse.Namespace,
    load: Callable[[], None],
    test_one: Callable[[bytes], None],
    allowed: Callable[[], tuple[type[BaseException], ...]],
) -> None:
    """A worker: `load` imports the target (under atheris' coverage instrumentation of app/ unless
    --no-instrument), then run_worker with the error classes `allowed` names once the target is loaded."""
    if args.no_instrument:
        load()
    else:
        import atheris

        with atheris.instrument_imports(include=["app"]):
            load()
    run_worker(args, test_one, allowed())


def run_worker(
    args: argparse.Namespace,
    test_one: Callable[[bytes], None],
    allowed: tuple[type[BaseException], ...],
) -> None:
    import atheris

    target = guarded(test_one, allowed, args.artifacts, stop_on_crash=args.stop_on_crash)
    flags = [
        f"-runs={args.runs}",
        f"-seed={args.seed}",
        f"-max_len={args.max_len}",
        f"-timeout={args.timeout_s}",
        f"-artifact_prefix={args.artifacts}/",
        "-rss_limit_mb=4096",
        "-print_final_stats=1",
    ]
    atheris.Setup([sys.argv[0], str(args.corpus), *flags], target)
    atheris.Fuzz()


def _write_seeds(corpus: Path, seeds: Iterable[bytes]) -> None:
    corpus.mkdir(parents=True, exist_ok=True)
    if any(corpus.iterdir()):
        return
    for data in seeds:
        (corpus / hashlib.sha1(data).hexdigest()).write_bytes(data)


def main(
    module: str,
    doc: str,
    seeds: Callable[[], Iterable[bytes]],
    worker: Callable[[argparse.Namespace], None],
    argv: list[str] | None = None,
) -> int:
    args = parse_args(argv, doc)
    if args.worker:
        worker(args)
        return 0
    work = Path(tempfile.mkdtemp(prefix="loraland-fuzz-"))
    shm = Path("/dev/shm")
    scratch = tempfile.mkdtemp(prefix="loraland-fuzz-", dir=shm if os.access(shm, os.W_OK) else work)
    try:
        return _run(module, args, seeds, work, scratch)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _run(module: str, args: argparse.Namespace, seeds, work: Path, scratch: str) -> int:
    args.corpus = args.corpus or work / "corpus"
    args.artifacts = (args.artifacts or work / "artifacts").resolve()
    args.artifacts.mkdir(parents=True, exist_ok=True)
    _write_seeds(args.corpus, seeds())
    name = module.rsplit(".", 1)[-1]
    left, done, t0, extra_crashes = args.runs, 0, time.monotonic(), []
    for _ in range(_MAX_RESTARTS):
        cmd = [sys.executable, "-m", module, "--worker", "--runs", str(left), "--seed", str(args.seed + done)]
        cmd += ["--max-len", str(args.max_len), "--timeout-s", str(args.timeout_s)]
        cmd += ["--corpus", str(args.corpus), "--artifacts", str(args.artifacts)]
        cmd += ["--stop-on-crash"] * args.stop_on_crash + ["--no-instrument"] * args.no_instrument
        log = work / f"worker-{done}.log"
        with open(log, "w") as f:
            env = {**os.environ, SCRATCH_ENV: scratch}
            rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=os.getcwd(), env=env).returncode
        text = log.read_text(errors="replace")
        ran = _executions(text)
        done += ran
        left -= ran
        if rc == 0:
            break
        # A timeout, an out-of-memory, or (with --stop-on-crash) an exception killed the worker.
        artifact = _ARTIFACT.search(text)
        kind = next((k for k in ("timeout", "out-of-memory", "Uncaught Python exception") if k in text), "rc")
        extra_crashes.append(
            {"signature": f"{kind} (worker rc={rc})", "input": artifact[1] if artifact else None,
             "error": text[-1500:]}
        )  # fmt: skip
        print(f"worker stopped ({kind}, rc={rc}); see {log}", file=sys.stderr)
        if args.stop_on_crash or left <= 0 or ran == 0:
            break
    crashes = _read_crashes(args.artifacts) + extra_crashes
    result = Result(done, time.monotonic() - t0, crashes)
    print(result.line(name))
    for c in crashes:
        print(f"  {c['signature']}: {c['error'][:300]!r} (input: {c['input']})")
    print(f"  corpus: {args.corpus}  artifacts: {args.artifacts}")
    return 1 if crashes else 0


def _executions(text: str) -> int:
    m = _STATS.search(text)
    if m:
        return int(m[1])
    done = _DONE.findall(text)  # killed before the final stats: the last progress line
    return int(done[-1]) if done else 0


def _read_crashes(artifacts: Path) -> list[dict]:
    path = artifacts / CRASH_LOG
    if not path.is_file():
        return []
    out: dict[str, dict] = {}  # a restarted worker may find a crash its predecessor already recorded
    for line in path.read_text().splitlines():
        if line.strip():
            record = json.loads(line)
            out.setdefault(record["signature"], record)
    return list(out.values())
