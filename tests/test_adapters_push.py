"""`loraland adapters push NAME DIR --to s3://bucket/root`: the root holds every version, each under NAME/vN/, so
version 2 needs no new prefix; progress bars on the upload and on `register`'s download. Real console-script
processes against a real redis-server and moto's S3 server."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from app.catalog.redis_server import start_redis
from app.catalog.sources import AdapterHub, hash_folder
from app.config.settings import Settings
from tests.fixtures.services import aws_env, make_bucket, s3_server  # noqa: F401
from tests.fixtures.tiny_adapter import write_model_config, write_tiny_adapter

ROOT = Path(__file__).resolve().parents[1]


def loraland(env: dict, *args: str) -> subprocess.CompletedProcess:
    """The console script as a real process (its progress bars on a real stderr)."""
    proc = subprocess.run(
        [sys.executable, "-m", "app.cli", *args],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, f"{args}\n{proc.stdout}\n{proc.stderr}"
    return proc


def inproc(capsys, *args: str) -> tuple[str, str]:
    """app.cli.main in this process (the same code path, without interpreter start-up): (stdout, stderr)."""
    from app.cli import main

    capsys.readouterr()
    assert main(list(args)) == 0
    return capsys.readouterr()


@pytest.fixture
def redis_url():
    url, stop = start_redis()  # its own: the CLI's catalog namespace is fixed
    yield url
    stop()


def test_push_puts_each_version_under_the_root_with_progress(
    redis_url,
    s3_server,  # noqa: F811
    tmp_path,
    monkeypatch,
    capsys,
):
    bucket = f"push-{uuid.uuid4().hex[:10]}"
    make_bucket(s3_server, bucket)
    base = {k: v for k, v in os.environ.items() if not k.startswith(("LORALAND_", "AWS_", "HF_"))}
    env = {
        **base, **aws_env(s3_server), "PYTHONPATH": str(ROOT), "LORALAND_CACHE_DIR": str(tmp_path / "cache"),
        "LORALAND_REDIS_URL": redis_url, "HF_HUB_OFFLINE": "1",
    }  # fmt: skip
    model = write_model_config(tmp_path / "model")
    v1, v2 = write_tiny_adapter(tmp_path / "v1", seed=1), write_tiny_adapter(tmp_path / "v2", seed=2, rank=8)
    root = f"s3://{bucket}/adapters"
    name = f"acme/sql-{uuid.uuid4().hex[:6]}"

    first = loraland(env, "adapters", "push", name, str(v1), "--to", root, "--model", str(model))
    assert f"registered {name}@1: {root}/{name}/v1 " in first.stdout
    assert f"upload {root}/{name}/v1" in first.stderr  # the progress bar
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    out, err = inproc(capsys, "adapters", "push", name, str(v2), "--to", root, "--no-progress", "--json")
    rec = json.loads(out)
    assert (rec["version"], rec["uri"], rec["rank"]) == (2, f"{root}/{name}/v2", 8)
    assert "upload" not in err

    # A registration by URI downloads the adapter: with a progress bar.
    out, err = inproc(capsys, "adapters", "register", f"{name}-copy", f"{root}/{name}/v2")
    assert f"download {root}/{name}/v2" in err and "registered" in out

    # Both versions stay whole where they are; a removed version's number is never given again.
    hub = AdapterHub(settings=Settings(cache_dir=tmp_path / "fetch"))
    for version, folder in ((1, v1), (2, v2)):
        shown = json.loads(inproc(capsys, "adapters", "show", f"{name}@{version}", "--json")[0])
        got = hub.fetch(shown["uri"], files=shown["files"])
        assert hash_folder(got) == hash_folder(folder, sorted(shown["files"]))
    inproc(capsys, "adapters", "rm", f"{name}@2")
    third = json.loads(inproc(capsys, "adapters", "push", name, str(v2), "--to", root, "--json")[0])
    assert (third["version"], third["uri"]) == (3, f"{root}/{name}/v3")
    # hub.cached (the `source` label of load metrics): the same files are already in this cache, not in a new one
    assert hub.cached(third["uri"], third["files"]) is True
    fresh = AdapterHub(settings=Settings(cache_dir=tmp_path / "fresh"))
    assert fresh.cached(third["uri"], third["files"]) is False
    fresh.fetch(third["uri"], files=third["files"])
    assert fresh.cached(third["uri"], third["files"]) is True
