"""`loraland serve` as a user runs it: a subprocess that starts Ray and a private Redis, serves, and on
Ctrl-C stops both. (Run inside /work/shared/tools/offline: it starts Ray.)"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import httpx
import pytest
import redis

from app.catalog.redis_server import free_port
from tests.fixtures.tiny_adapter import write_tiny_adapter

pytestmark = [pytest.mark.ray, pytest.mark.timeout(400)]


def test_loraland_serve_starts_serves_and_cleans_up(llama_dir, tmp_path):
    store = tmp_path / "store"
    write_tiny_adapter(store / "demo" / "sql", seed=3)
    port = free_port()
    log = tmp_path / "serve.log"
    env = {
        **os.environ,
        "LORALAND_CACHE_DIR": str(tmp_path / "cache"),
        "OMP_NUM_THREADS": "1",
    }
    env.pop("LORALAND_REDIS_URL", None)
    argv = [sys.executable, "-m", "app.cli", "serve", "--model", str(llama_dir), "--port", str(port)]
    argv += ["--no-auth", "--replica-cpus", "0.5", "--adapter-store", str(store), "--replica-gpus", "0"]
    with open(log, "w") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            assert proc.poll() is None, log.read_text()[-3000:]
            if "LoRA-Land is serving" in log.read_text():  # serve.run returned: every replica is up
                break
            time.sleep(1)
        else:
            raise AssertionError("loraland serve did not come up:\n" + log.read_text()[-3000:])
        assert httpx.get(f"{base}/healthz", timeout=10).json()["status"] == "ok"
        # --adapter-store: the admin route finds `demo/sql` there by name (admin is open under --no-auth).
        r = httpx.post(f"{base}/v1/adapters", json={"name": "demo/sql", "public": True}, timeout=60)
        assert r.status_code == 201, r.text
        assert r.json()["uri"] == str(store / "demo" / "sql")
        r = httpx.post(
            f"{base}/v1/completions",
            json={"model": "demo/sql", "prompt": "hello", "max_tokens": 4},
            timeout=60,
        )
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 4
        models = {m["id"] for m in httpx.get(f"{base}/v1/models", timeout=10).json()["data"]}
        assert models == {llama_dir.name, "demo/sql"}
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            rc = proc.wait(timeout=90)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
    text = log.read_text()
    assert rc == 0, text[-3000:]
    assert "AUTHENTICATION IS OFF" in text
    url = re.search(r"private Redis for the catalog at (redis://\S+)", text).group(1)
    with pytest.raises(redis.ConnectionError):  # the private Redis went with it
        redis.Redis.from_url(url, socket_connect_timeout=1).ping()
