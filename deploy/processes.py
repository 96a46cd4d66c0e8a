"""Processes of a cluster on one machine: found by a path only that cluster uses (its temp dir) and ended by
PID, never by name (`ray stop` ends every Ray process on the machine); the CPU priority of a starting node;
Ray's cached auth settings in a driver process. Used by deploy/local_cluster.py and
load_tests/chaos/ray_up_local.py."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path


def refresh_ray_auth() -> None:
    if "ray" not in sys.modules:  # nothing cached yet: Ray reads the environment when it loads
        return
    from ray._raylet import AuthenticationTokenLoader, Config

    Config.initialize("")
    AuthenticationTokenLoader.instance().reset_cache()


def set_autogroup_nice(pid: int | str, nice: int) -> None:
    """Linux schedules each session (autogroup) as one unit, so a process's own nice value cannot lift a node
    that runs in its own session: the session's weight is set through /proc instead (needs root for < 0)."""
    try:
        Path(f"/proc/{pid}/autogroup").write_text(str(nice))
    except OSError:  # no autogroups here, or not root: start at normal priority
        pass


def boost_priority() -> None:
    """Startup only (undone once the node is up): the raylet aborts the node when its dashboard agent has not
    written its port file within a fixed 15 s (Ray 2.60 ignores agent_register_timeout_ms there), and on a
    machine shared by busy processes the agent's imports alone can take longer."""
    set_autogroup_nice("self", -10)


def pids_with_marker(marker: str) -> set[int]:
    """PIDs whose command line holds `marker`, a path only one cluster uses (its temp dir), never this one."""
    import psutil

    pids = set()
    for p in psutil.process_iter(["pid", "cmdline"]):
        try:
            if any(marker in arg for arg in (p.info["cmdline"] or ())):
                pids.add(p.info["pid"])
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    pids.discard(os.getpid())
    return pids


def send_signal(pids: set[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def end_pids(pids: set[int], grace_s: float = 10.0, again=None) -> None:
    """SIGTERM, up to grace_s for them to exit, then SIGKILL to what is left (and to `again()`'s PIDs)."""
    import psutil

    send_signal(pids, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(psutil.pid_exists(p) for p in pids):
        time.sleep(0.2)
    left = {p for p in pids if psutil.pid_exists(p)} | (again() if again else set())
    send_signal(left, signal.SIGKILL)
