"""Quota records and the shared token buckets (app/catalog/quotas.py) against a real redis-server, the ingress
limiter's bookkeeping (app/router/http/quotas.py) and `loraland tenants set-quota/get-quota/quotas`.

The HTTP side, with two ingress apps sharing one Redis, is tests/test_quota_http.py."""

from __future__ import annotations

import json
import time
import uuid
from types import SimpleNamespace

import pytest

from app.catalog.quotas import Quota
from app.catalog.store import Catalog
from app.cli import main as cli_main
from app.errors import InvalidRequest, UnknownAdapter
from app.protocol import ReplicaRequest
from app.router.http.quota_fallback import LocalBuckets
from app.router.http.quotas import reserve_tokens, scopes_of
from app.sampling_params import SamplingParams
from tests.fixtures.services import redis_server  # noqa: F401

T = "tenant:acme"
A = "adapter:acme/sql"


@pytest.fixture()
def catalog(redis_server):  # noqa: F811
    cat = Catalog(redis_server, namespace=f"q{uuid.uuid4().hex[:8]}")
    cat.create_tenant("acme")
    cat._r.sadd(cat._k("adapters"), "acme/sql")  # the name only: quotas need the adapter to exist
    yield cat
    cat.close()


def lease() -> str:
    return uuid.uuid4().hex


def test_quota_values_are_validated():
    assert Quota().unlimited and Quota().describe() == "unlimited"
    assert Quota(concurrent=2, tokens_per_minute=100).describe() == "2 concurrent requests, 100 tokens/minute"
    for bad in (
        {"concurrent": 0},
        {"requests_per_minute": -1},
        {"tokens_per_minute": 1.5},
        {"concurrent": True},
    ):
        with pytest.raises(InvalidRequest, match=next(iter(bad))):
            Quota.from_dict(bad)
    with pytest.raises(InvalidRequest, match="rpm: unknown quota limit"):
        Quota.from_dict({"rpm": 5})


def test_set_get_merge_replace_clear(catalog):
    assert catalog.get_quota("tenant", "acme") is None  # no quota: unlimited
    q = catalog.set_quota("tenant", "acme", Quota(requests_per_minute=60, tokens_per_minute=1000))
    assert q == Quota(requests_per_minute=60, tokens_per_minute=1000)
    merged = catalog.set_quota("tenant", "acme", {"concurrent": 2, "tokens_per_minute": None}, merge=True)
    assert merged == Quota(concurrent=2, requests_per_minute=60)
    replaced = catalog.set_quota("tenant", "acme", {"concurrent": 3})
    assert replaced == Quota(concurrent=3) == catalog.get_quota("tenant", "acme")
    catalog.set_quota("adapter", "acme/sql", Quota(requests_per_minute=5))
    assert catalog.quotas() == {T: Quota(concurrent=3), A: Quota(requests_per_minute=5)}
    assert catalog.set_quota("tenant", "acme", {}) is None  # no limit left: the quota is gone
    assert catalog.quotas() == {A: Quota(requests_per_minute=5)}
    with pytest.raises(InvalidRequest, match="unknown tenant 'ghost'"):
        catalog.set_quota("tenant", "ghost", Quota(concurrent=1))
    with pytest.raises(InvalidRequest, match="unknown tenant 'ghost'"):
        catalog.get_quota("tenant", "ghost")
    with pytest.raises(UnknownAdapter, match="no adapter 'nope'"):
        catalog.set_quota("adapter", "nope", Quota(concurrent=1))


def test_admission_is_all_or_nothing_across_scopes(catalog):
    catalog.set_quota("tenant", "acme", Quota(requests_per_minute=10, tokens_per_minute=1000))
    catalog.set_quota("adapter", "acme/sql", Quota(requests_per_minute=2))
    for _ in range(2):
        assert catalog.admit_quota([T, A], 100, lease(), 30).admitted
    refused = catalog.admit_quota([T, A], 100, lease(), 30)
    assert not refused.admitted and (refused.scope, refused.limit, refused.value) == (
        A,
        "requests_per_minute",
        2,
    )
    assert 29 < refused.wait_s <= 30  # one request of 2/minute refills in 30 s
    # The refusal charged nothing to the tenant: 8 requests and 800 tokens are left there, and no more.
    for _ in range(8):
        assert catalog.admit_quota([T], 100, lease(), 30).admitted
    over = catalog.admit_quota([T], 1, lease(), 30)
    assert not over.admitted and over.limit == "requests_per_minute"
    assert over.quotas == {T: Quota(requests_per_minute=10, tokens_per_minute=1000)}


def test_retry_after_is_when_the_bucket_refills(catalog):
    catalog.set_quota("tenant", "acme", Quota(requests_per_minute=120))
    while catalog.admit_quota([T], 1, lease(), 30).admitted:
        pass
    refused = catalog.admit_quota([T], 1, lease(), 30)
    assert 0 < refused.wait_s <= 0.5  # 2 requests a second
    time.sleep(refused.wait_s + 0.05)
    assert catalog.admit_quota([T], 1, lease(), 30).admitted


def test_tokens_settle_against_actual_usage(catalog):
    catalog.set_quota("tenant", "acme", Quota(tokens_per_minute=600))  # 10 tokens a second
    held = lease()
    assert catalog.admit_quota([T], 500, held, 30).admitted
    assert not catalog.admit_quota([T], 200, lease(), 30).admitted  # 100 + refill left
    catalog.settle_quota([T], held, 500 - 40)  # it used 40 of its 500
    assert catalog.admit_quota([T], 500, lease(), 30).admitted
    # Usage beyond the reservation is charged too: the bucket goes into debt and waits get longer.
    held = lease()
    assert catalog.admit_quota([T], 50, held, 30).admitted
    catalog.settle_quota([T], held, -600)
    refused = catalog.admit_quota([T], 10, lease(), 30)
    assert not refused.admitted and refused.wait_s > 50  # 600 tokens of debt at 10/s


def test_a_reservation_beyond_a_whole_minute_is_impossible(catalog):
    catalog.set_quota("tenant", "acme", Quota(tokens_per_minute=100))
    out = catalog.admit_quota([T], 101, lease(), 30)
    assert not out.admitted and out.impossible and out.value == 100


def test_concurrency_leases_release_renew_and_expire(catalog):
    catalog.set_quota("tenant", "acme", Quota(concurrent=2))
    a, b = lease(), lease()
    assert catalog.admit_quota([T], 1, a, 5).admitted
    assert catalog.admit_quota([T], 1, b, 5).admitted
    full = catalog.admit_quota([T], 1, lease(), 5)
    assert not full.admitted and full.limit == "concurrent" and full.wait_s == 1.0
    catalog.settle_quota([T], a, 0)
    assert catalog.admit_quota([T], 1, lease(), 0.3).admitted  # a's slot is free
    # A crashed ingress never releases its lease (this one, 0.3 s): it runs out. Renewed ones (b) are kept.
    time.sleep(0.5)
    assert catalog.renew_leases([(T, b)], 5) == 1
    assert catalog.admit_quota([T], 1, lease(), 5).admitted
    assert not catalog.admit_quota([T], 1, lease(), 5).admitted  # b and the last one hold both slots


def test_reservation_estimates_and_scopes():
    text = ReplicaRequest(request_id="r", prompts=("x" * 40,), sampling=SamplingParams(max_tokens=7), n=2)
    assert reserve_tokens(text) == 11 + 2 * 7
    ids = ReplicaRequest(request_id="r", prompts=((1, 2, 3), (4,)))
    assert reserve_tokens(ids) == 4 + 2 * 16  # the default max_tokens
    chat = ReplicaRequest(request_id="r", messages=({"role": "user", "content": "abcd"},))
    assert reserve_tokens(chat) == (2 + 4) + 16
    recs = tuple(SimpleNamespace(name=n) for n in ("a", "b", "a"))
    assert scopes_of(ReplicaRequest(request_id="r", records=recs, tenant="t")) == [
        "tenant:t",
        "adapter:a",
        "adapter:b",
    ]
    assert scopes_of(ReplicaRequest(request_id="r")) == []


def test_local_fallback_divides_each_limit_by_the_ingress_replicas():
    from collections import Counter

    local = LocalBuckets(replicas=2)
    quotas = {T: Quota(concurrent=4, requests_per_minute=6, tokens_per_minute=1000)}
    inflight = Counter()
    assert [local.admit([T], quotas, 1, inflight).admitted for _ in range(4)] == [True] * 3 + [False]
    refused = local.admit([T], quotas, 1, inflight)
    assert refused.limit == "requests_per_minute" and 0 < refused.wait_s <= 20  # 3/minute here
    inflight[T] = 2
    local = LocalBuckets(replicas=2)
    assert local.admit([T], quotas, 1, inflight).limit == "concurrent"  # 2 of the 4 slots are this ingress's
    # A full share admits any request the whole quota could (here 800 > 500 tokens), then waits.
    inflight[T] = 0
    assert local.admit([T], {T: Quota(tokens_per_minute=1000)}, 800, inflight).admitted
    assert not local.admit([T], {T: Quota(tokens_per_minute=1000)}, 1, inflight).admitted


def test_cli_set_get_and_list_quotas(catalog, monkeypatch, capsys):
    def cli(*args, rc=0):
        code = cli_main(["--redis", catalog.url, *args])
        out = capsys.readouterr()
        assert code == rc, out
        return out

    monkeypatch.setattr(Catalog, "__init__", _namespaced(catalog.ns))
    assert "tenant acme: unlimited" in cli("tenants", "get-quota", "acme").out
    assert "tenant acme: 60 requests/minute" in cli("tenants", "set-quota", "acme", "--rpm", "60").out
    out = cli("tenants", "set-quota", "acme", "--tpm", "5000", "--concurrent", "4", "--json").out
    assert json.loads(out) == {
        "scope": "tenant", "name": "acme", "concurrent": 4, "requests_per_minute": 60, "tokens_per_minute": 5000,
    }  # fmt: skip
    cli("tenants", "set-quota", "acme", "--rpm", "none")
    assert catalog.get_quota("tenant", "acme") == Quota(concurrent=4, tokens_per_minute=5000)
    cli("tenants", "set-quota", "acme/sql", "--adapter", "--rpm", "10")
    rows = cli("tenants", "quotas").out.splitlines()
    assert rows[0].split() == ["SCOPE", "NAME", "CONCURRENT", "REQUESTS/MIN", "TOKENS/MIN"]
    assert rows[1].split() == ["adapter", "acme/sql", "-", "10", "-"]
    assert rows[2].split() == ["tenant", "acme", "4", "-", "5000"]
    cli("tenants", "set-quota", "acme", "--clear")
    assert json.loads(cli("tenants", "quotas", "--json").out) == [
        {"scope": "adapter", "name": "acme/sql", "concurrent": None, "requests_per_minute": 10,
         "tokens_per_minute": None},
    ]  # fmt: skip
    assert "nothing to change" in cli("tenants", "set-quota", "acme", rc=1).err
    assert "unknown tenant 'ghost'" in cli("tenants", "set-quota", "ghost", "--rpm", "1", rc=1).err
    with pytest.raises(SystemExit):  # argparse: not a positive integer
        cli_main(["--redis", catalog.url, "tenants", "set-quota", "acme", "--rpm", "0"])
    assert "not a positive integer" in capsys.readouterr().err


def _namespaced(ns):
    """Catalog.__init__ with the test's namespace (the CLI uses the default one)."""
    original = Catalog.__init__

    def init(self, url, namespace="loraland"):
        original(self, url, ns)

    return init
