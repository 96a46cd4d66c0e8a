"""The seed's example runs as written, with hub names resolved from LORALAND_ADAPTER_PATH."""

import os
import subprocess
import sys
from pathlib import Path

from tests.fixtures.adapters import ADAPTER_SPECS, make_peft_adapter

ROOT = Path(__file__).resolve().parents[1]


def test_seed_example_runs_as_written(llama_dir, tmp_path):
    for name, spec in (("translate", ADAPTER_SPECS[0]), ("polish", ADAPTER_SPECS[2])):
        make_peft_adapter(llama_dir, tmp_path / "org" / name, **spec.kwargs())
    env = {
        **os.environ,
        "LORALAND_ADAPTER_PATH": str(tmp_path),
        "LORALAND_CACHE_DIR": str(tmp_path / "cache"),
        "PYTHONPATH": str(ROOT),
    }
    env.pop("LORALAND_REDIS_URL", None)
    out = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "seed.py"), str(llama_dir)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    lines = [line for line in out.stdout.splitlines() if line.startswith(("chain:", "mixed:"))]
    assert len(lines) == 2
    chain, mixed = (eval(line.split(":", 1)[1]) for line in lines)
    assert len(chain) == 3 and len(mixed) == 3 and all(isinstance(t, str) for t in chain + mixed)
