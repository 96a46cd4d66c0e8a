"""AdapterHub against moto's S3 server over HTTP, a pre-populated Hugging Face offline cache, and local
folders: verified fetches, the disk cache, and every refusal."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import uuid
from dataclasses import replace
from pathlib import Path

import boto3
import pytest

from app.catalog.sources import AdapterHub, hash_folder, s3_api
from app.catalog.sources.disk_cache import DiskCache
from app.catalog.store import Catalog
from app.config.settings import S3Settings, Settings
from app.errors import AdapterUnavailable, InvalidAdapter, InvalidRequest, UnknownAdapter
from tests.fixtures.services import (  # noqa: F401  (fixtures, until conftest registers the plugin)
    aws_env,
    make_bucket,
    redis_server,
    s3_denied_reader,
    s3_server,
)
from tests.fixtures.tiny_adapter import write_tiny_adapter

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def aws(s3_server, monkeypatch):  # noqa: F811
    for k, v in aws_env(s3_server).items():
        monkeypatch.setenv(k, v)
    return s3_server


@pytest.fixture
def bucket(aws):
    name = f"b-{uuid.uuid4().hex[:10]}"
    make_bucket(aws, name)
    return name


@pytest.fixture
def hub(tmp_path, aws):
    # S3 settings passed in, as a replica's come from Settings.from_env() (the env is set too, for boto3 here).
    return AdapterHub(settings=Settings(cache_dir=tmp_path / "cache", s3=S3Settings.from_env(aws_env(aws))))


def _s3(endpoint):
    return boto3.client("s3", endpoint_url=endpoint)


def _tree(folder: Path) -> set[str]:
    return {p.relative_to(folder).as_posix() for p in folder.rglob("*")}


def test_upload_then_fetch_verified_and_cached(hub, bucket, aws, tmp_path):
    src = write_tiny_adapter(tmp_path / "a")
    uri = f"s3://{bucket}/acme/a/v1"
    files = hub.upload(src, uri)
    assert files == hash_folder(src) and set(files) == {"adapter_config.json", "adapter_model.safetensors"}
    head = _s3(aws).head_object(Bucket=bucket, Key="acme/a/v1/adapter_model.safetensors")
    assert head["Metadata"]["sha256"] == files["adapter_model.safetensors"]
    got = hub.fetch(uri, files=files)
    assert hash_folder(got) == files and got.is_relative_to(tmp_path / "cache")
    # Content-addressed: a second fetch needs no S3 at all (it survives the store being down).
    _s3(aws).delete_objects(Bucket=bucket, Delete={"Objects": [{"Key": f"acme/a/v1/{f}"} for f in files]})
    assert hub.fetch(uri, files=files) == got
    assert [e["size"] for e in hub.cache.entries()] == [sum((src / f).stat().st_size for f in files)]


def test_fetch_without_manifest_takes_adapter_files_only_and_follows_changes(hub, bucket, aws, tmp_path):
    src = write_tiny_adapter(tmp_path / "a", seed=1)
    uri = f"s3://{bucket}/plain"
    files = hub.upload(src, uri)
    client = _s3(aws)
    client.put_object(Bucket=bucket, Key="plain/adapter_model.bin", Body=b"pickle!")
    client.put_object(Bucket=bucket, Key="plain/train.log", Body=b"log")
    client.put_object(Bucket=bucket, Key="plain/sub/", Body=b"")  # a "folder" marker
    got = hub.fetch(uri)
    assert _tree(got) == set(files) and hash_folder(got) == files
    # Re-pushed with other weights: the URI-keyed entry notices the new ETags.
    other = write_tiny_adapter(tmp_path / "b", seed=2)
    with pytest.raises(InvalidRequest, match="already exists with different content"):
        hub.upload(other, uri)
    new = hub.upload(other, uri, overwrite=True)
    assert new != files and hash_folder(hub.fetch(uri)) == new
    assert len(hub.cache.entries()) == 1


def test_checksum_mismatch_is_refused_and_nothing_kept(hub, bucket, aws, tmp_path):
    src = write_tiny_adapter(tmp_path / "a")
    uri = f"s3://{bucket}/x"
    files = hub.upload(src, uri)
    wrong = {**files, "adapter_model.safetensors": "0" * 64}
    with pytest.raises(InvalidAdapter, match="checksum mismatch for adapter_model.safetensors"):
        hub.fetch(uri, files=wrong)
    root = hub.cache.root
    assert hub.cache.entries() == [] and [p.name for p in root.iterdir()] in ([], [".lock"])


def test_s3_errors_are_clear_and_unavailable(hub, bucket, aws, tmp_path):
    with pytest.raises(AdapterUnavailable, match="no such bucket 'ghost-bucket'"):
        hub.fetch("s3://ghost-bucket/a")
    with pytest.raises(AdapterUnavailable, match="no adapter files under this prefix"):
        hub.fetch(f"s3://{bucket}/nothing-here")
    files = hub.upload(write_tiny_adapter(tmp_path / "a"), f"s3://{bucket}/a")
    with pytest.raises(AdapterUnavailable, match="no such key a/extra.json"):
        hub.fetch(f"s3://{bucket}/a", files={**files, "extra.json": "0" * 64})
    with pytest.raises(InvalidRequest, match="bucket and a prefix"):
        hub.fetch(f"s3://{bucket}")
    with pytest.raises(InvalidRequest, match="unsupported adapter source"):
        hub.fetch("ftp://host/a")


def test_s3_access_denied(hub, bucket, aws, tmp_path):
    files = hub.upload(write_tiny_adapter(tmp_path / "a"), f"s3://{bucket}/a")
    with s3_denied_reader(aws) as env:
        denied = AdapterHub(settings=replace(hub.settings, s3=S3Settings.from_env(env)))
        with pytest.raises(AdapterUnavailable, match=r"access denied \(AccessDenied\).*credentials"):
            denied.fetch(f"s3://{bucket}/a", files=files)
        with pytest.raises(AdapterUnavailable, match="access denied"):
            denied.upload(write_tiny_adapter(tmp_path / "b"), f"s3://{bucket}/b", overwrite=True)
    assert hub.cache.entries() == [] and denied.cache.root == hub.cache.root


@pytest.mark.parametrize("key", ["evil/../../escape.json", "evil//abs.json", "evil/./a.json"])
def test_unsafe_s3_keys_are_refused(hub, bucket, aws, tmp_path, key):
    _s3(aws).put_object(Bucket=bucket, Key="evil/adapter_config.json", Body=b"{}")
    _s3(aws).put_object(Bucket=bucket, Key=key, Body=b"{}")
    with pytest.raises(InvalidAdapter, match="unsafe file path"):
        hub.fetch(f"s3://{bucket}/evil")
    assert not (tmp_path / "escape.json").exists() and hub.cache.entries() == []


def test_size_limit(bucket, aws, tmp_path):
    src = write_tiny_adapter(tmp_path / "a")
    small = AdapterHub(settings=Settings(cache_dir=tmp_path / "cache", max_adapter_bytes=1000))
    with pytest.raises(InvalidAdapter, match="over the 1000-byte limit"):
        small.upload(src, f"s3://{bucket}/a")
    files = AdapterHub(settings=Settings(cache_dir=tmp_path / "c2")).upload(src, f"s3://{bucket}/a")
    with pytest.raises(InvalidAdapter, match="over the 1000-byte limit"):
        small.fetch(f"s3://{bucket}/a", files=files)
    with pytest.raises(InvalidAdapter, match="over the 1000-byte limit"):
        small.fetch(str(src))
    assert small.cache.entries() == []


def test_disk_cache_is_lru_by_bytes(bucket, aws, tmp_path):
    srcs = [write_tiny_adapter(tmp_path / f"s{i}", seed=i) for i in range(3)]
    size = sum(p.stat().st_size for p in srcs[0].iterdir())
    hub = AdapterHub(settings=Settings(cache_dir=tmp_path / "cache", max_cache_bytes=int(size * 2.5)))
    manifests = [hub.upload(s, f"s3://{bucket}/lru/{i}") for i, s in enumerate(srcs)]
    a = hub.fetch(f"s3://{bucket}/lru/0", files=manifests[0])
    b = hub.fetch(f"s3://{bucket}/lru/1", files=manifests[1])
    os.utime(hub.cache.root / f"{b.name}.json", (1, 1))  # make "b" clearly the least recently used...
    assert hub.fetch(f"s3://{bucket}/lru/0", files=manifests[0]) == a  # ...and "a" just used (a hit)
    c = hub.fetch(f"s3://{bucket}/lru/2", files=manifests[2])
    assert a.exists() and c.exists() and not b.exists()
    assert sum(e["size"] for e in hub.cache.entries()) <= int(size * 2.5)
    assert {e["key"] for e in hub.cache.entries()} == {a.name, c.name}


def test_disk_cache_ignores_entries_without_manifest(tmp_path):
    cache = DiskCache(tmp_path / "c", max_bytes=10_000)
    with cache.staging() as tmp:
        (tmp / "f.json").write_text("x")
        cache.commit("k", tmp, {"uri": "u", "size": 1}, replace=True)
    assert cache.lookup("k")[1]["uri"] == "u"
    (tmp_path / "c" / "k.json").unlink()  # a crash between the rename and the manifest
    assert cache.lookup("k") is None and cache.entries() == []
    with pytest.raises(RuntimeError), cache.staging() as tmp:
        (tmp / "partial").write_text("half")
        raise RuntimeError("download died")
    assert not list((tmp_path / "c").glob(".tmp-*"))


def test_multipart_upload(hub, bucket, aws, tmp_path, monkeypatch):
    monkeypatch.setattr(s3_api, "MULTIPART_THRESHOLD", 5 << 20)
    monkeypatch.setattr(s3_api, "MULTIPART_CHUNK", 5 << 20)
    src = write_tiny_adapter(tmp_path / "a")
    (src / "extra.safetensors").write_bytes(os.urandom((5 << 20) + 12345))
    files = hub.upload(src, f"s3://{bucket}/big")
    etag = _s3(aws).head_object(Bucket=bucket, Key="big/extra.safetensors")["ETag"]
    assert etag.strip('"').endswith("-2")  # two parts
    assert hash_folder(hub.fetch(f"s3://{bucket}/big", files=files)) == files


def test_local_folders_and_untrusted_roots(tmp_path):
    allowed = tmp_path / "allowed"
    inside = write_tiny_adapter(allowed / "org" / "a")
    outside = write_tiny_adapter(tmp_path / "elsewhere")
    hub = AdapterHub(settings=Settings(cache_dir=tmp_path / "cache", allowed_local_roots=(allowed,)))
    files = hash_folder(inside)
    assert hub.fetch(str(inside), files=files) == inside
    assert hub.fetch(f"file://{inside}", untrusted=True) == inside
    assert hub.fetch(str(outside)) == outside  # the admin may name any folder
    with pytest.raises(InvalidRequest, match="outside the allowed roots"):
        hub.fetch(str(outside), untrusted=True)
    with pytest.raises(InvalidRequest, match="outside the allowed roots"):
        hub.fetch(f"{allowed}/../elsewhere", untrusted=True)
    (allowed / "org" / "a" / "sneaky.json").symlink_to(outside / "adapter_config.json")
    with pytest.raises(InvalidRequest, match="links outside"):
        hub.fetch(str(inside), untrusted=True)
    with pytest.raises(InvalidAdapter, match="checksum mismatch for adapter_config.json"):
        hub.fetch(str(inside), files={**files, "adapter_config.json": "1" * 64})
    with pytest.raises(InvalidAdapter, match="unsafe file path"):
        hub.fetch(str(inside), files={"../x.json": "1" * 64})
    with pytest.raises(AdapterUnavailable, match="no such folder"):
        hub.fetch(str(tmp_path / "missing"))


def test_get_resolves_catalog_then_local_roots(redis_server, tmp_path, bucket):  # noqa: F811
    roots = tmp_path / "roots"
    local = write_tiny_adapter(roots / "acme" / "local-only", seed=3)
    shadow = write_tiny_adapter(roots / "acme" / "both", seed=4)
    cat = Catalog(redis_server, namespace=f"test-{uuid.uuid4().hex[:8]}")
    settings = Settings(cache_dir=tmp_path / "cache", adapter_path=(roots,))
    hub = AdapterHub(catalog=cat, settings=settings)
    src = write_tiny_adapter(tmp_path / "published", seed=5)
    files = hub.upload(src, f"s3://{bucket}/both/v1")
    meta = dict(size=1, rank=4, alpha=8.0, target_modules=["q_proj", "v_proj"], base_model={})
    cat.register("acme/both", f"s3://{bucket}/both/v1", files=files, **meta)
    cat.register("acme/both", str(shadow), files=hash_folder(shadow), **meta)
    path, record = hub.resolve("acme/both")
    assert record.version == 2 and path == shadow
    path, record = hub.resolve("acme/both@1")
    assert record.version == 1 and hash_folder(path) == files
    path, record = hub.resolve("acme/local-only")
    assert path == local and record is None
    with pytest.raises(UnknownAdapter, match="exist only in the catalog"):
        hub.get("acme/local-only@2")
    with pytest.raises(UnknownAdapter, match=r"looked in: the catalog at .*roots/nobody"):
        hub.get("nobody")
    cat.close()


def _hub_cache(root: Path, repo: str, folder: Path, commit: str) -> None:
    """Lay out huggingface_hub's cache: models--org--name/{blobs,snapshots/<commit>,refs/main}."""
    repo_dir = root / ("models--" + repo.replace("/", "--"))
    snap = repo_dir / "snapshots" / commit
    snap.mkdir(parents=True)
    (repo_dir / "blobs").mkdir(exist_ok=True)
    for f in folder.iterdir():
        data = f.read_bytes()
        blob = repo_dir / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snap / f.name).symlink_to(os.path.relpath(blob, snap))
    (repo_dir / "refs").mkdir(exist_ok=True)
    (repo_dir / "refs" / "main").write_text(commit)


_HF_SCRIPT = """
import json, sys
from app.catalog.sources import AdapterHub, hash_folder
from app.errors import AdapterUnavailable
from app.config.settings import Settings
hub = AdapterHub(settings=Settings.from_env())
out = {}
for label, call in [
    ("plain", lambda: hub.fetch("hf://acme/hub-lora")),
    ("rev", lambda: hub.fetch("hf://acme/hub-lora@" + sys.argv[1], files=json.loads(sys.argv[2]))),
    ("bad_sha", lambda: hub.fetch("hf://acme/hub-lora", files={"adapter_config.json": "0" * 64})),
    ("get", lambda: hub.get("acme/hub-lora")),
    ("missing", lambda: hub.get("acme/not-cached")),
    ("missing_uri", lambda: hub.fetch("hf://acme/not-cached")),
]:
    try:
        p = call()
        out[label] = {"path": str(p), "files": hash_folder(p)}
    except Exception as e:
        out[label] = {"error": type(e).__name__, "unavailable": isinstance(e, AdapterUnavailable), "message": str(e)}
print(json.dumps(out))
"""


def test_hf_offline_cache(tmp_path):
    src = write_tiny_adapter(tmp_path / "src", seed=7)
    (src / "adapter_model.bin").write_bytes(b"a pickle that must not be used")
    commit = "0123456789abcdef0123456789abcdef01234567"
    _hub_cache(tmp_path / "hub", "acme/hub-lora", src, commit)
    files = hash_folder(src)
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith(("HF_", "LORALAND_"))},
        "HF_HUB_OFFLINE": "1",
        "HF_HUB_CACHE": str(tmp_path / "hub"),
        "LORALAND_CACHE_DIR": str(tmp_path / "cache"),
        "PYTHONPATH": str(ROOT),
    }
    proc = subprocess.run(
        [sys.executable, "-c", _HF_SCRIPT, commit, json.dumps(files)],
        env=env, cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    snap = str(tmp_path / "hub" / "models--acme--hub-lora" / "snapshots" / commit)
    assert out["plain"] == {"path": snap, "files": files} == out["rev"] == out["get"]
    assert out["bad_sha"]["error"] == "InvalidAdapter" and "checksum mismatch" in out["bad_sha"]["message"]
    assert out["missing"]["error"] == "UnknownAdapter"
    assert "Hugging Face Hub" in out["missing"]["message"] and "HF_HUB_OFFLINE" in out["missing"]["message"]
    assert out["missing_uri"]["unavailable"]
    assert "not in the Hugging Face cache" in out["missing_uri"]["message"]
