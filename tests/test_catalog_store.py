"""The Redis catalog against a real redis-server: versions, races, tenants, placement expiry, events, faults."""

from __future__ import annotations

import multiprocessing as mp
import re
import threading
import time
import uuid

import pytest
import redis

from app.catalog.redis_server import free_port, start_redis
from app.catalog.store import Catalog, hash_api_key
from app.errors import CatalogUnavailable, InvalidRequest, UnknownAdapter
from app.files import safe_relpath
from app.names import check_name, parse_ref
from app.protocol import ReplicaStats
from tests.fixtures.services import redis_server  # noqa: F401  (until conftest registers the plugin)

SHA = "ab" * 32


def _reg(cat: Catalog, name: str, uri: str = "s3://bucket/a", **kw):
    args = dict(
        files={"adapter_config.json": SHA, "adapter_model.safetensors": "cd" * 32},
        size=1234,
        rank=4,
        alpha=8.0,
        target_modules=["v_proj", "q_proj"],
        base_model={"architecture": "LlamaForCausalLM", "hidden_size": 64, "num_layers": 2},
    )
    args.update(kw)
    return cat.register(name, uri, **args)


@pytest.fixture
def catalog(redis_server):  # noqa: F811
    cat = Catalog(redis_server, namespace=f"test-{uuid.uuid4().hex[:8]}")
    yield cat
    cat.close()


def test_versions_refs_and_newest(catalog):
    r1 = _reg(catalog, "acme/sql", "s3://bucket/sql/v1")
    r2 = _reg(catalog, "acme/sql", "s3://bucket/sql/v2", rank=8)
    assert (r1.version, r2.version) == (1, 2)
    assert catalog.get("acme/sql").uri == "s3://bucket/sql/v2"
    assert catalog.get("acme/sql@1").uri == "s3://bucket/sql/v1"
    assert catalog.get("acme/sql@2").rank == 8
    assert catalog.get("acme/sql@3") is None and catalog.get("nope") is None
    [listed] = catalog.list()
    assert listed.ref == "acme/sql@2" and listed.target_modules == ["q_proj", "v_proj"]
    assert [r.version for r in catalog.versions("acme/sql")] == [1, 2]
    d = listed.to_dict()
    assert {"name", "version", "uri", "rank", "sha256", "tenant", "files", "base_model"} <= d.keys()
    assert (
        len(d["sha256"]) == 64 and d["sha256"] == catalog.get("acme/sql@1").sha256
    )  # same files, same digest
    with pytest.raises(UnknownAdapter, match="acme/nope"):
        catalog.require("acme/nope")


def test_remove_version_then_all_and_versions_never_reused(catalog):
    for i in range(3):
        _reg(catalog, "a", f"s3://bucket/a/v{i + 1}")
    assert catalog.remove("a@3") == 1
    assert catalog.get("a").version == 2  # the plain name falls back to the newest left
    assert catalog.remove("a@3") == 0
    assert catalog.remove("a@1") == 1 and catalog.get("a").version == 2
    assert catalog.remove("a") == 1
    assert catalog.get("a") is None and catalog.list() == []
    # A replica may still cache a@1..3: a re-created name must not reuse those versions.
    assert _reg(catalog, "a").version == 4
    _reg(catalog, "a")
    assert catalog.remove("a") == 2


def _register_many(url: str, ns: str, name: str, n: int) -> list[int]:
    cat = Catalog(url, namespace=ns)
    try:
        return [_reg(cat, name, f"s3://bucket/{uuid.uuid4().hex}").version for _ in range(n)]
    finally:
        cat.close()


def test_concurrent_registrations_get_distinct_versions(catalog, redis_server):  # noqa: F811
    seen: list[list[int]] = []
    reads: list[int] = []
    done = threading.Event()

    def reader() -> None:  # every read is a whole record, and the newest never goes backwards
        while not done.is_set():
            rec = catalog.get("race")
            if rec is not None:
                assert rec.files and rec.uri.startswith("s3://")
                assert not reads or rec.version >= reads[-1]
                reads.append(rec.version)

    reader_thread = threading.Thread(target=reader)
    reader_thread.start()
    threads = [
        threading.Thread(target=lambda: seen.append(_register_many(redis_server, catalog.ns, "race", 15)))
        for _ in range(6)
    ]
    for t in threads:
        t.start()
    # Separate processes too: different connections, no shared client state at all.
    with mp.get_context("spawn").Pool(2) as pool:
        from_procs = pool.starmap(_register_many, [(redis_server, catalog.ns, "race", 10)] * 2)
    for t in threads:
        t.join()
    done.set()
    reader_thread.join()
    versions = sorted(v for vs in seen + from_procs for v in vs)
    assert versions == list(range(1, 6 * 15 + 2 * 10 + 1))
    assert catalog.get("race").version == versions[-1]
    assert len(catalog.versions("race")) == len(versions)
    assert reads, "the reader saw no registration"


@pytest.mark.parametrize(
    "bad", ["", "-x", ".hidden", "a/b/c", "a b", "x" * 129, "../x", "a/../b", "/abs", "org/", "é", "a\nb"]
)
def test_bad_names_are_refused(catalog, bad):
    with pytest.raises(InvalidRequest, match="invalid adapter name"):
        _reg(catalog, bad)
    with pytest.raises(InvalidRequest):
        parse_ref(bad)


def test_names_refs_and_relative_paths():
    for good in ("a", "A9", "org/name", "my.org/sql_expert-v2", "x" * 128, "o" * 128 + "/" + "n" * 128):
        assert check_name(good) == good
    assert parse_ref("org/a@12") == ("org/a", 12) and parse_ref("a") == ("a", None)
    for bad in ("a@0", "a@", "a@x", "a@-1", "a@01", "a@1@2"):
        with pytest.raises(InvalidRequest):
            parse_ref(bad)
    assert safe_relpath("sub/adapter_model.safetensors") == "sub/adapter_model.safetensors"
    for bad in ("../x", "a/../../x", "/etc/passwd", "a//b", "./a", "a\\b", "C:/x", ""):
        with pytest.raises(InvalidRequest, match="unsafe file path"):
            safe_relpath(bad)


def test_register_validates_fields(catalog):
    with pytest.raises(InvalidRequest, match="sha256"):
        _reg(catalog, "a", files={"adapter_model.safetensors": "xyz"})
    with pytest.raises(InvalidRequest, match="unsafe"):
        _reg(catalog, "a", files={"../adapter_model.safetensors": SHA})
    with pytest.raises(InvalidRequest, match="rank"):
        _reg(catalog, "a", rank=0)
    with pytest.raises(InvalidRequest, match="unknown tenant 'ghost'"):
        _reg(catalog, "a", tenant="ghost")
    assert catalog.list() == []  # nothing half-registered


def test_tenants_keys_are_hashed_and_rotate(catalog, redis_server):  # noqa: F811
    key = catalog.create_tenant("acme")
    assert key.startswith("ll-") and len(key) > 40
    assert catalog.tenant_for_key(key) == "acme"
    assert catalog.tenant_for_key("ll-wrong") is None and catalog.tenant_for_key("") is None
    with pytest.raises(InvalidRequest, match="already exists"):
        catalog.create_tenant("acme")
    new = catalog.rotate_key("acme")
    assert new != key and catalog.tenant_for_key(new) == "acme" and catalog.tenant_for_key(key) is None
    with pytest.raises(InvalidRequest, match="unknown tenant"):
        catalog.rotate_key("ghost")
    [t] = catalog.list_tenants()
    assert t["name"] == "acme" and "key_hash" not in t and t["rotated"] >= t["created"]

    # Nothing in Redis holds a raw key: dump every value under the namespace.
    r = redis.Redis.from_url(redis_server, decode_responses=True)
    dump = []
    for k in r.scan_iter(f"{catalog.ns}:*"):
        kind = r.type(k)
        if kind == "hash":
            dump += [f"{f}={v}" for f, v in r.hgetall(k).items()]
        elif kind == "string":
            dump.append(r.get(k))
    blob = "\n".join([*dump, *r.scan_iter(f"{catalog.ns}:*")])
    assert hash_api_key(new) in blob
    assert key not in blob and new not in blob and new[3:20] not in blob
    r.close()


def test_tenant_visibility(catalog):
    catalog.create_tenant("a")
    catalog.create_tenant("b")
    _reg(catalog, "a-private", tenant="a")
    _reg(catalog, "b-public", tenant="b", public=True)
    _reg(catalog, "admin-only")
    assert [r.name for r in catalog.list("a")] == ["a-private", "b-public"]
    assert [r.name for r in catalog.list("b")] == ["b-public"]
    assert len(catalog.list()) == 3
    admin = catalog.get("admin-only")
    assert catalog.can_use(None, admin) and not catalog.can_use("a", admin)
    assert catalog.can_use("b", catalog.get("a-private")) is False


def test_pin(catalog):
    _reg(catalog, "p")
    catalog.set_pinned("p", True)
    assert catalog.get("p").pinned and catalog.list()[0].pinned
    _reg(catalog, "p")  # pinning belongs to the name: a new version stays pinned
    assert catalog.get("p").pinned and catalog.get("p@1").pinned
    catalog.set_pinned("p", False)
    assert not catalog.get("p").pinned
    with pytest.raises(UnknownAdapter):
        catalog.set_pinned("ghost", True)


def test_heartbeat_expiry_removes_dead_replica_from_placement(catalog, redis_server):  # noqa: F811
    def beat(rid: str, resident: list[str], ttl_s: float) -> None:
        stats = ReplicaStats(rid, resident=tuple(resident), free_slots=2, queue_len=1, kv_usage=0.25)
        catalog.heartbeat(stats, load=0.5, ttl_s=ttl_s)

    beat("dying", ["x@1", "only-dying@1"], 0.4)
    beat("alive", ["x@1"], 30)
    assert catalog.placement("x@1") == {"x@1": ["alive", "dying"]}
    assert catalog.placement() == {"x@1": ["alive", "dying"], "only-dying@1": ["dying"]}
    info = catalog.replicas()["dying"]
    assert (
        info.resident == ["only-dying@1", "x@1"]
        and info.queue_len == 1
        and abs(info.heartbeat - time.time()) < 5
    )
    time.sleep(0.6)  # "dying" stops beating
    assert catalog.placement("x@1") == {"x@1": ["alive"]}
    assert catalog.placement("only-dying@1") == {}
    assert set(catalog.replicas()) == {"alive"}
    r = redis.Redis.from_url(redis_server, decode_responses=True)
    assert not r.exists(f"{catalog.ns}:placement:only-dying@1", f"{catalog.ns}:resident:dying")  # reaped
    # A beat that no longer lists an adapter removes the replica from its placement.
    beat("alive", ["y@1"], 30)
    assert catalog.placement("x@1") == {} and catalog.placement("y@1") == {"y@1": ["alive"]}
    catalog.drop_replica("alive")
    assert catalog.replicas() == {} and catalog.placement() == {}
    assert r.keys(f"{catalog.ns}:*") == []
    r.close()


def test_events(catalog):
    events: list[dict] = []
    stop = catalog.subscribe(events.append)
    _reg(catalog, "e")
    _reg(catalog, "e")
    catalog.set_pinned("e", True)
    catalog.remove("e@2")
    catalog.remove("e")
    catalog.create_tenant("t")
    catalog.rotate_key("t")
    deadline = time.time() + 5
    while len(events) < 6 and time.time() < deadline:
        time.sleep(0.02)
    stop()
    assert [(e["type"], e.get("name"), e["version"]) for e in events] == [
        ("registered", "e", 1),
        ("registered", "e", 2),
        ("pinned", "e", 2),
        ("removed", "e", 2),
        ("removed", "e", None),
        ("key_rotated", None, None),
    ]
    assert events[4]["versions"] == [1] and events[5]["tenant"] == "t"
    _reg(catalog, "after-stop")
    time.sleep(0.3)
    assert len(events) == 6


def test_unreachable_redis_names_the_url():
    url = f"redis://:s3cret@127.0.0.1:{free_port()}/0"
    with pytest.raises(CatalogUnavailable) as e:
        Catalog(url)
    assert f"127.0.0.1:{url.rsplit(':', 1)[1]}" in str(e.value) and "s3cret" not in str(e.value)
    # A Redis that dies under a live client.
    url, stop = start_redis()
    cat = Catalog(url)
    _reg(cat, "a")
    stop()
    with pytest.raises(CatalogUnavailable, match=re.escape(url)):
        cat.get("a")
    with pytest.raises(CatalogUnavailable):
        cat.heartbeat(ReplicaStats("r", free_slots=1), load=0)
    cat.close()


def test_register_many_pipelined(catalog):
    entries = [
        dict(
            name=f"bulk-{i % 50}",
            uri=f"s3://bucket/{i}",
            files={"adapter_model.safetensors": SHA},
            size=1,
            rank=4,
            alpha=8.0,
            target_modules=["q_proj"],
            base_model={},
        )
        for i in range(120)
    ]
    versions = catalog.register_many(entries, batch=32)
    assert versions == [i // 50 + 1 for i in range(120)]
    assert len(catalog.list()) == 50 and catalog.get("bulk-7").version == 3
    with pytest.raises(InvalidRequest, match="unknown tenant"):
        catalog.register_many([{**entries[0], "tenant": "ghost"}])
