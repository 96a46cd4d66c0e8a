"""Processes the benchmarks start and stop: `loraland serve`, moto's S3 server, and their wait-until-ready.

Everything binds 127.0.0.1; run the benchmarks inside `../shared/tools/offline` (Ray probes the network).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(url: str, proc: subprocess.Popen, log: Path, timeout_s: float = 600) -> None:
    """Poll url until it answers 200; fail early (with the log's name) when proc exits first."""
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args[:4]} exited ({proc.returncode}); see {log}")
        time.sleep(0.5)
    raise RuntimeError(f"{url} not ready after {timeout_s:.0f} s; see {log}")


def _stop(proc: subprocess.Popen, sig: int = 2) -> None:
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextmanager
def loraland_serve(
    model_dir: Path, log: Path, *args: str, port: int | None = None, env: dict | None = None
) -> Iterator[str]:
    """`loraland serve --model model_dir --served-model-name base --no-auth ARGS`; yields its base URL."""
    port = port or free_port()
    cmd = [sys.executable, "-m", "app.cli", "serve", "--model", str(model_dir), "--served-model-name", "base"]
    cmd += ["--port", str(port), "--no-auth", *args]
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, env={**os.environ, **(env or {})}, stdout=f, stderr=subprocess.STDOUT)
    try:
        base_url = f"http://127.0.0.1:{port}"
        wait_http(f"{base_url}/healthz", proc, log)
        yield base_url
    finally:
        _stop(proc)


@contextmanager
def moto_s3(log: Path) -> Iterator[dict[str, str]]:
    """moto's S3 server in its own process (so it shares no GIL with the client); yields the AWS_* env."""
    port = free_port()
    exe = Path(sys.executable).with_name("moto_server")
    with open(log, "w") as f:
        proc = subprocess.Popen(
            [str(exe), "-H", "127.0.0.1", "-p", str(port)], stdout=f, stderr=subprocess.STDOUT
        )
    try:
        endpoint = f"http://127.0.0.1:{port}"
        wait_http(f"{endpoint}/moto-api/", proc, log, timeout_s=60)
        yield {
            "AWS_ENDPOINT_URL": endpoint,
            "AWS_ACCESS_KEY_ID": "bench",
            "AWS_SECRET_ACCESS_KEY": "bench",
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_CONFIG_FILE": "/nonexistent/aws-config",
            "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent/aws-credentials",
            "AWS_EC2_METADATA_DISABLED": "true",
        }
    finally:
        _stop(proc, 15)


def vllm_env(cpus: str) -> dict[str, str]:
    """The environment of a vLLM CPU process: its OpenMP team bound to `cpus`, offline, no usage reports."""
    return {
        **os.environ,
        "VLLM_CPU_KVCACHE_SPACE": "2",  # GiB; 64 x 192 tokens need far less
        "VLLM_CPU_OMP_THREADS_BIND": cpus,
        "HF_HUB_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
    }


@contextmanager
def vllm_serve(
    venv: Path,
    model_dir: Path,
    log: Path,
    *,
    adapters: dict[str, Path] | None = None,
    max_loras: int = 64,
    dtype: str = "float32",
    cpus: str = "0-1",
    port: int | None = None,
    max_cpu_loras: int | None = None,
    max_model_len: int = 1024,
    extra: Sequence[str] = (),
    env: dict | None = None,
) -> Iterator[str]:
    """vLLM's CPU build (its own venv) serving model_dir as `base`, with `adapters` as LoRA modules; yields its
    base URL. cpus: the cores its OpenMP team is bound to (VLLM_CPU_OMP_THREADS_BIND), i.e. its thread count.
    max_cpu_loras: vLLM's host LRU of adapters (default: all of them); extra: more server arguments; env: more
    environment (e.g. its cache folders)."""
    port = port or free_port()
    cmd = [str(Path(venv) / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server"]
    cmd += [
        "--model",
        str(model_dir),
        "--served-model-name",
        "base",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
    ]
    cmd += ["--dtype", dtype, "--max-model-len", str(max_model_len), *extra]
    if adapters:
        rank = max(json.loads((p / "adapter_config.json").read_text())["r"] for p in adapters.values())
        cmd += [
            "--enable-lora",
            "--max-loras",
            str(max_loras),
            "--max-cpu-loras",
            str(max_cpu_loras or len(adapters)),
        ]
        cmd += ["--max-lora-rank", str(rank), "--lora-modules", *(f"{n}={p}" for n, p in adapters.items())]
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, env=vllm_env(cpus) | (env or {}), stdout=f, stderr=subprocess.STDOUT)
    try:
        base_url = f"http://127.0.0.1:{port}"
        wait_http(f"{base_url}/v1/models", proc, log, timeout_s=1800)  # first start compiles (minutes)
        yield base_url
    finally:
        _stop(proc, 15)
