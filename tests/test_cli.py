"""The `loraland` admin CLI driven as a subprocess against a real redis-server and moto's S3 over HTTP."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from app.catalog.redis_server import free_port
from app.catalog.sources import AdapterHub, hash_folder
from app.catalog.store import Catalog
from app.config.settings import Settings
from app.protocol import ReplicaStats
from tests.fixtures.services import (  # noqa: F401  (fixtures, until conftest registers the plugin)
    aws_env,
    make_bucket,
    redis_server,
    s3_denied_reader,
    s3_server,
)
from tests.fixtures.tiny_adapter import write_model_config, write_tiny_adapter

ROOT = Path(__file__).resolve().parents[1]
_dbs = itertools.count(1)  # each test gets its own Redis database: the CLI's namespace is fixed


class Cli:
    def __init__(self, env: dict[str, str]) -> None:
        self.env = env

    def __call__(
        self, *args: str, rc: int = 0, env: dict[str, str] | None = None
    ) -> subprocess.CompletedProcess:
        proc = subprocess.run(
            [sys.executable, "-m", "app.cli", *args],
            env={**self.env, **(env or {})},
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert proc.returncode == rc, (
            f"loraland {' '.join(args)} -> {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
        )
        assert "Traceback" not in proc.stderr, proc.stderr
        return proc

    def json(self, *args: str) -> object:
        return json.loads(self(*args, "--json").stdout)

    def error(self, *args: str, env: dict[str, str] | None = None) -> str:
        """Run a command that must fail; return its one-line reason."""
        lines = [
            ln for ln in self(*args, rc=1, env=env).stderr.splitlines() if ln.startswith("loraland: error:")
        ]
        assert len(lines) == 1
        return lines[0]


@pytest.fixture
def env(redis_server, s3_server, tmp_path):  # noqa: F811
    db = next(_dbs)
    assert db < 16, "redis-server has 16 databases by default"
    url = redis_server.rsplit("/", 1)[0] + f"/{db}"
    base = {k: v for k, v in os.environ.items() if not k.startswith(("LORALAND_", "AWS_", "HF_"))}
    return {
        **base,
        **aws_env(s3_server),
        "LORALAND_REDIS_URL": url,
        "LORALAND_CACHE_DIR": str(tmp_path / "cache"),
        "HF_HUB_OFFLINE": "1",
        "HF_HUB_CACHE": str(tmp_path / "hub"),
        "PYTHONPATH": str(ROOT),
    }


class InProcessCli(Cli):
    """app.cli.main(argv) in this process with the same environment: the same code paths as the console
    script without paying interpreter start-up and imports (~1-3 s) per call; the error-path checks use it,
    the end-to-end flow and a few failures run as real subprocesses."""

    def __init__(
        self, env: dict[str, str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
    ) -> None:
        super().__init__(env)
        self.monkeypatch, self.capsys = monkeypatch, capsys

    def __call__(
        self, *args: str, rc: int = 0, env: dict[str, str] | None = None
    ) -> subprocess.CompletedProcess:
        from app.cli import main

        self.capsys.readouterr()
        with self.monkeypatch.context() as m:
            for k, v in {**self.env, **(env or {})}.items():
                m.setenv(k, v)
            try:
                code = main(list(args))
            except SystemExit as e:  # argparse usage errors
                code = e.code
        out, err = self.capsys.readouterr()
        assert code == rc, f"loraland {' '.join(args)} -> {code}\n{out}\n{err}"
        return subprocess.CompletedProcess(args, code, out, err)


@pytest.fixture
def cli(env):
    return Cli(env)


@pytest.fixture
def cli_inproc(env, monkeypatch, capsys):
    return InProcessCli(env, monkeypatch, capsys)


@pytest.fixture
def bucket(s3_server):  # noqa: F811
    name = f"cli-{uuid.uuid4().hex[:12]}"
    make_bucket(s3_server, name)
    return name


def test_push_list_show_version_pin_rm_and_tenants(cli, env, bucket, tmp_path, monkeypatch):
    model = write_model_config(tmp_path / "model")
    v1 = write_tiny_adapter(tmp_path / "v1", seed=1)
    v2 = write_tiny_adapter(tmp_path / "v2", seed=2, rank=8)

    created = cli.json("tenants", "create", "acme")
    key = created["api_key"]
    assert created["name"] == "acme" and key.startswith("ll-")
    out = cli("tenants", "create", "globex").stdout
    assert "shown only now" in out and "ll-" in out

    push = cli("adapters", "push", "acme/sql", str(v1), "--to", f"s3://{bucket}/root", "--tenant", "acme",
               "--model", str(model))  # fmt: skip
    assert "registered acme/sql@1" in push.stdout and "upload" in push.stderr  # the progress bar
    listed = cli.json("adapters", "list")
    assert len(listed) == 1
    rec = listed[0]
    assert {k: rec[k] for k in ("name", "version", "uri", "rank", "tenant")} == {
        "name": "acme/sql", "version": 1, "uri": f"s3://{bucket}/root/acme/sql/v1", "rank": 4, "tenant": "acme",
    }  # fmt: skip
    assert len(rec["sha256"]) == 64 and rec["files"] == hash_folder(v1, sorted(rec["files"]))
    assert rec["base_model"] == {"architecture": "LlamaForCausalLM", "hidden_size": 64, "num_layers": 2}
    table = cli("adapters", "list").stdout.splitlines()
    assert table[0].split()[:3] == ["NAME", "VERSION", "RANK"] and table[1].split()[:3] == [
        "acme/sql",
        "1",
        "4",
    ]

    # A new version: the plain name follows it, @1 still addresses the old one.
    assert cli.json("adapters", "push", "acme/sql", str(v2), "--to", f"s3://{bucket}/root", "--tenant",
                    "acme", "--model", str(model), "--no-progress")["version"] == 2  # fmt: skip
    shown = cli.json("adapters", "show", "acme/sql")
    assert (shown["version"], shown["rank"], shown["versions"]) == (2, 8, [1, 2])
    human = cli("adapters", "show", "acme/sql@1").stdout
    assert human.split("uri:")[1].split()[0] == f"s3://{bucket}/root/acme/sql/v1"
    assert "version:" in human and "file adapter_model.safetensors:" in human
    # The registered files really are what a replica fetches.
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    hub = AdapterHub(settings=Settings(cache_dir=tmp_path / "fetch"))
    assert hash_folder(hub.fetch(shown["uri"], files=shown["files"])) == hash_folder(
        v2, sorted(shown["files"])
    )

    assert "pinned acme/sql" in cli("adapters", "pin", "acme/sql").stdout
    assert cli.json("adapters", "show", "acme/sql")["pinned"] is True
    cli("adapters", "unpin", "acme/sql")

    # Tenants: list (table and JSON), rotate; the old key stops working.
    tenants = cli.json("tenants", "list")
    assert [(t["name"], t["adapters"]) for t in tenants] == [("acme", 1), ("globex", 0)]
    assert all("key_hash" not in t for t in tenants)
    assert cli("tenants", "list").stdout.splitlines()[1].split()[:2] == ["acme", "1"]
    # Fair-share weights: set, listed, reset; bad ones refused before the catalog is touched.
    assert cli.json("tenants", "set-weight", "acme", "2.5") == {"name": "acme", "weight": 2.5}
    assert {t["name"]: t.get("weight") for t in cli.json("tenants", "list")} == {"acme": 2.5, "globex": None}
    assert cli("tenants", "list").stdout.splitlines()[1].split()[:3] == ["acme", "1", "2.5"]
    assert "unknown tenant 'nobody'" in cli.error("tenants", "set-weight", "nobody", "2")
    cli("tenants", "set-weight", "acme", "0", rc=2)  # argparse: outside [0.01, 100]
    cli("tenants", "set-weight", "globex", "none")
    assert "weight" not in cli.json("tenants", "list")[1]
    new_key = cli.json("tenants", "rotate-key", "acme")["api_key"]
    with Catalog(env["LORALAND_REDIS_URL"]) as cat:
        assert cat.tenant_for_key(new_key) == "acme" and cat.tenant_for_key(key) is None
        cat.heartbeat(
            ReplicaStats("replica-0", resident=("acme/sql@2",), free_slots=3, kv_usage=0.5), load=0.25
        )
    placement = cli.json("placement")
    assert placement["adapters"] == {"acme/sql@2": ["replica-0"]}
    assert placement["replicas"]["replica-0"]["free_slots"] == 3
    assert "replica-0" in cli("placement").stdout

    assert cli("adapters", "rm", "acme/sql@1").stdout.strip() == "removed acme/sql@1"
    shown = cli.json("adapters", "show", "acme/sql")
    assert shown["versions"] == [2] and shown["pinned"] is False
    assert "1 version" in cli("adapters", "rm", "acme/sql").stdout
    assert "no adapter 'acme/sql'" in cli.error("adapters", "show", "acme/sql")

    # Deleting a tenant: its key stops working, the listing drops it, a second delete names the problem.
    assert "deleted tenant globex" in cli("tenants", "delete", "globex").stdout
    assert [t["name"] for t in cli.json("tenants", "list")] == ["acme"]
    assert "unknown tenant 'globex'" in cli.error("tenants", "delete", "globex")


def test_register_existing_uris_and_validate(cli_inproc, bucket, tmp_path):
    cli = cli_inproc
    model = write_model_config(tmp_path / "model")
    local = write_tiny_adapter(tmp_path / "local", seed=3)
    rec = cli.json("adapters", "register", "local-one", str(local), "--public", "--model", str(model))
    assert rec["uri"] == str(local.resolve()) and rec["public"] is True and rec["tenant"] is None
    cli("adapters", "push", "pushed", str(local), "--to", f"s3://{bucket}/p", "--no-progress")
    rec = cli.json("adapters", "register", "again", f"s3://{bucket}/p/pushed/v1")
    assert rec["files"] == cli.json("adapters", "show", "pushed")["files"] and rec["base_model"] == {}

    ok = cli.json("adapters", "validate", str(local), "--model", str(model))
    assert ok["valid"] is True and ok["rank"] == 4 and ok["target_modules"] == ["q_proj", "v_proj"]
    qwen = write_tiny_adapter(tmp_path / "qwen", "qwen2-tied")  # hidden 48: does not fit the llama model
    assert "shape" in cli.error("adapters", "validate", str(qwen), "--model", str(model))
    assert "exceeds --max-rank 2" in cli.error("adapters", "validate", str(local), "--model", str(model),
                                               "--max-rank", "2")  # fmt: skip


def test_failures_are_one_line_and_register_nothing(cli, cli_inproc, s3_server, bucket, tmp_path):  # noqa: F811
    # As real processes: exit codes, one line on stderr, no traceback.
    assert "invalid adapter name '../x'" in cli.error(
        "adapters", "push", "../x", str(tmp_path), "--to", "s3://b/y"
    )
    dead = f"redis://127.0.0.1:{free_port()}/0"
    reason = cli.error("--redis", dead, "adapters", "list")
    assert dead in reason and "unreachable" in reason
    assert cli("adapters", "bogus", rc=2).stderr.startswith("usage:")
    assert "not in the Hugging Face cache" in cli.error("adapters", "register", "y", "hf://acme/not-cached")

    cli = cli_inproc
    model = write_model_config(tmp_path / "model")
    src = write_tiny_adapter(tmp_path / "a")
    push = ["adapters", "push", "x", str(src), "--model", str(model), "--no-progress", "--to"]
    assert "no such bucket 'ghost-bucket'" in cli.error(*push, "s3://ghost-bucket/x")
    with s3_denied_reader(s3_server) as denied:
        assert "access denied" in cli.error(*push, f"s3://{bucket}/x", env=denied)
    assert "unknown tenant 'ghost'" in cli.error(*push, f"s3://{bucket}/z", "--tenant", "ghost")
    assert "bucket and a prefix" in cli.error(*push, f"s3://{bucket}")
    assert "no such key" in cli.error("adapters", "register", "y", f"s3://{bucket}/never-pushed")
    assert "no such folder" in cli.error("adapters", "register", "y", str(tmp_path / "missing"))
    assert "no adapter 'nope'" in cli.error("adapters", "rm", "nope")
    assert "invalid version" in cli.error("adapters", "show", "a@zero")
    cli("tenants", "create", "t")
    assert "already exists" in cli.error("tenants", "create", "t")
    assert dead in cli.error("adapters", "list", env={"LORALAND_REDIS_URL": dead})
    assert "no catalog" in cli.error("tenants", "list", env={"LORALAND_REDIS_URL": ""})
    assert cli.json("adapters", "list") == []
