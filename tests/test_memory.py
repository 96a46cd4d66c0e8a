"""The C heap policy for a CPU engine (app/replica/memory.py): freed step temporaries are reused, not faulted in
again; an explicit trim still hands free pages back. Each case runs in a fresh interpreter (the policy is
process-wide and the engines in this process have already set it)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")

# Page faults of 20 rounds (after 10 of warm-up) of allocating, touching and freeing a 64 MiB tensor: 16,384
# pages a round.
FAULTS = textwrap.dedent(
    """
    import resource, sys, torch
    from app.replica.memory import keep_freed_memory
    if sys.argv[1] == "keep":
        assert keep_freed_memory()
    for _ in range(10):  # warm-up: the first rounds grow the heap (an aligned block needs a little more than a
        x = torch.ones(16 << 20); del x  # freed one of the same size until neighbouring free blocks merge)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(20):
        x = torch.ones(16 << 20); del x
    print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    """
)


def faults(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", FAULTS, mode], capture_output=True, text=True, check=True)
    return int(out.stdout.split()[-1])


def test_freed_blocks_are_reused_instead_of_faulted_in_again():
    default, kept = faults("default"), faults("keep")
    # glibc's default: the 64 MiB block is unmapped when freed and faulted in again each round
    assert default > 20 * 16_384 * 0.9
    assert kept < 2_000, f"{kept} page faults with the keep policy ({default} without)"


def test_explicit_trim_still_returns_free_pages():
    code = textwrap.dedent(
        """
        import torch
        from app.replica.memory import keep_freed_memory, release_free_memory
        def rss(): return int(open("/proc/self/statm").read().split()[1]) * 4096
        keep_freed_memory()
        x = torch.ones(64 << 20); del x  # 256 MiB freed, kept in the heap
        kept = rss()
        release_free_memory()
        print(kept - rss())
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert int(out.stdout.split()[-1]) > 200 << 20
