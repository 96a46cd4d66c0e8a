"""moto's S3 server as a process of its own on 127.0.0.1, for a LocalCluster (deploy/local_cluster.py), and the
environment that points AWS clients at it (and at nothing else: no real config, credentials or metadata)."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from app.catalog.redis_server import free_port


def start_s3(log_path: Path, timeout_s: float = 60.0) -> tuple[str, Callable[[], None]]:
    """Start moto's server and return (endpoint, stop) once it answers; its output goes to `log_path`."""
    port = free_port()
    log = open(log_path, "wb")  # noqa: SIM115 - the child holds it
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    endpoint, stop = f"http://127.0.0.1:{port}", _stopper(proc)
    try:
        import httpx

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                httpx.get(endpoint, timeout=2)
                return endpoint, stop
            except httpx.HTTPError:
                if proc.poll() is not None:
                    break
                time.sleep(0.2)
        raise RuntimeError(f"moto S3 server did not start on {endpoint}; see {log_path}")
    except BaseException:
        stop()
        raise


def _stopper(proc: subprocess.Popen) -> Callable[[], None]:
    def stop() -> None:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()

    return stop


def s3_env(endpoint: str) -> dict[str, str]:
    """What an AWS client needs to use the server at `endpoint`."""
    return {
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_CONFIG_FILE": "/nonexistent/aws-config",
        "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent/aws-credentials",
        "AWS_EC2_METADATA_DISABLED": "true",
    }
