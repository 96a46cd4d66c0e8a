"""Adapters that can never load are refused at registration, by `loraland adapters push/register` without
--model and by POST /v1/adapters, and nothing is registered (issue 20.3-20.5); an adapter only the replica can
refuse (its shapes do not fit the base model) is marked unloadable at its first load and answered at once
afterwards (20.4); merges with weights in scientific notation run (20.6).

The CLI runs in-process (app.cli.main) against a real redis-server; the HTTP side is the in-process stack of
tests/test_ingress_http.py (build_api over LocalBackend(ReplicaCore) on the tiny LLMKernel, a real Catalog)."""

from __future__ import annotations

import asyncio
import json
import os
import time

import httpx
import pytest

from app.catalog.redis_server import start_redis
from app.catalog.store import Catalog
from app.config.app_config import AppConfig
from app.errors import InvalidAdapter
from app.replica.deployment import LocalBackend, ReplicaCore
from app.router.http.auth import Authenticator
from app.router.http.ingress import build_api
from app.router.service import CatalogProxy, IngressService
from tests.fixtures.malformed import MALFORMED, write_malformed
from tests.fixtures.tiny_adapter import write_tiny_adapter

ADMIN = "admin-token-for-validation"
PROMPT = "the quick brown fox"


@pytest.fixture(scope="module")
def redis_url():
    url, stop = start_redis()  # its own server: the CLI's key namespace is fixed
    try:
        yield url.rsplit("/", 1)[0]
    finally:
        stop()


class Cli:
    """app.cli.main(argv) in this process, with the environment a shell would give it."""

    def __init__(self, env: dict[str, str], monkeypatch: pytest.MonkeyPatch, capsys) -> None:
        self.env, self.monkeypatch, self.capsys = env, monkeypatch, capsys

    def __call__(self, *args: str, rc: int = 0) -> tuple[str, str]:
        from app.cli import main

        self.capsys.readouterr()
        with self.monkeypatch.context() as m:
            for k, v in self.env.items():
                m.setenv(k, v)
            code = main(list(args))
        out, err = self.capsys.readouterr()
        assert code == rc, f"loraland {' '.join(args)} -> {code}\n{out}\n{err}"
        assert "Traceback" not in err, err
        return out, err

    def error(self, *args: str) -> str:
        lines = [ln for ln in self(*args, rc=1)[1].splitlines() if ln.startswith("loraland: error:")]
        assert len(lines) == 1, lines
        return lines[0]

    def json(self, *args: str):
        return json.loads(self(*args, "--json")[0])


def make_cli(redis_url: str, db: int, tmp_path, monkeypatch, capsys) -> Cli:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("LORALAND_", "AWS_", "HF_"))}
    env = {**base, "LORALAND_REDIS_URL": f"{redis_url}/{db}", "LORALAND_CACHE_DIR": str(tmp_path / "cache")}
    return Cli({**env, "HF_HUB_OFFLINE": "1"}, monkeypatch, capsys)


def test_cli_refuses_malformed_adapters_without_model(redis_url, tmp_path, monkeypatch, capsys):
    cli = make_cli(redis_url, 1, tmp_path, monkeypatch, capsys)
    for kind, (_, want) in sorted(MALFORMED.items()):
        folder = write_malformed(tmp_path / "corpus", kind)
        assert want in cli.error("adapters", "register", f"bad-{kind}", str(folder)), kind
        if kind in ("nan", "huge-weights", "catastrophic-regex", "pickled-bin"):
            # push refuses before it uploads anything (the bucket is never contacted)
            reason = cli.error(
                "adapters",
                "push",
                f"bad-{kind}",
                str(folder),
                "--to",
                "s3://never-contacted/x",
                "--no-progress",
            )
            assert want in reason, kind
    assert cli.json("adapters", "list") == []

    good = write_tiny_adapter(tmp_path / "good", seed=4)
    out, err = cli("adapters", "register", "good", str(good))
    assert "registered good@1" in out and "every check that needs no base model passed" in err
    table = cli("adapters", "list")[0].splitlines()
    assert table[0].split()[-2:] == ["STATE", "URI"] and table[1].split()[-2] == "ok"
    assert cli.json("adapters", "show", "good")["unloadable"] is None


# ---------------------------------------------------------------------------------------------- HTTP


class Stack:
    def __init__(self, url: str, llama_dir, root) -> None:
        from loraland import LLMKernel

        self.url, self.root = url, root
        self.catalog = Catalog(url)  # the CLI's namespace: adapters registered by `loraland` are seen here
        self.key = self.catalog.create_tenant("alpha")
        self.cfg = AppConfig(model=str(llama_dir), served_model_name="tiny-llama", redis_url=url)
        self.kernel = LLMKernel(llama_dir, max_adapters=4, max_batch_size=8, dtype="float32")
        self.core = ReplicaCore(self.cfg, "local-0", kernel=self.kernel, catalog=self.catalog)
        proxy = CatalogProxy(url, self.catalog)
        self.service = IngressService(self.cfg, LocalBackend(self.core), proxy)
        self.auth = Authenticator(proxy, ADMIN)
        self.api = build_api(self.service, self.auth)
        self.loads: list[str] = []
        load = self.kernel.load_adapter

        def counted(name, *a, **kw):  # every fetch + read a replica starts
            self.loads.append(name)
            return load(name, *a, **kw)

        self.kernel.load_adapter = counted

    def run(self, fn):
        async def go():
            transport = httpx.ASGITransport(app=self.api)
            async with httpx.AsyncClient(transport=transport, base_url="http://ll", timeout=120) as client:
                return await fn(client)

        return asyncio.run(go())

    def complete(self, model: str, **kw):
        body = {"model": model, "prompt": PROMPT, "max_tokens": 6, **kw}
        return self.run(lambda c: c.post("/v1/completions", json=body, headers=bearer(self.key)))


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture(scope="module")
def stack(redis_url, llama_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LORALAND_LOCAL_ROOTS", str(root))
        mp.setenv("LORALAND_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
        s = Stack(f"{redis_url}/2", llama_dir, root)
    s.complete("tiny-llama", max_tokens=1)  # first request imports what every path needs
    yield s
    s.auth.close()
    s.core.close()
    s.catalog.close()


def test_post_adapters_refuses_malformed_with_400(stack):
    admin = bearer(ADMIN)
    timings = {}

    async def go(client):
        out = {}
        for kind in sorted(MALFORMED):
            folder = write_malformed(stack.root / "corpus", kind)
            t0 = time.perf_counter()
            r = await client.post(
                "/v1/adapters", json={"name": f"bad-{kind}", "source": str(folder)}, headers=admin
            )
            timings[kind] = time.perf_counter() - t0
            out[kind] = r
        out["listed"] = await client.get("/v1/adapters", headers=admin)
        return out

    got = stack.run(go)
    for kind, (_, want) in MALFORMED.items():
        r = got[kind]
        assert r.status_code == 400, (kind, r.text)
        assert want in r.json()["error"]["message"], (kind, r.text)
    assert got["catastrophic-regex"].json()["error"]["param"] == "target_modules"
    # Before the guard, re.fullmatch('(.|.)*X', name) ran ~2**31 steps per module name: no answer at all.
    assert timings["catastrophic-regex"] < 5.0, timings
    assert not [a for a in got["listed"].json()["data"] if a["name"].startswith("bad-")]
    print("\nPOST /v1/adapters refusal times (s):", {k: round(v, 3) for k, v in sorted(timings.items())})


def test_adapter_only_the_replica_can_refuse_is_marked_unloadable(stack, tmp_path, monkeypatch, capsys):
    cli = make_cli(stack.url.rsplit("/", 1)[0], 2, tmp_path, monkeypatch, capsys)
    # hidden size 48 (qwen2-tied): consistent in itself, so it registers without --model, but not for this
    # llama base model (hidden 64), which only the replica knows.
    wide = write_tiny_adapter(tmp_path / "wide", "qwen2-tied", seed=6)
    assert "registered wide@1" in cli("adapters", "register", "wide", str(wide), "--public")[0]

    first = stack.complete("wide")
    assert first.status_code == 400 and "shape" in first.json()["error"]["message"], first.text
    assert stack.loads == ["wide"]
    shown = cli.json("adapters", "show", "wide")
    assert "shape" in shown["unloadable"] and str(tmp_path) not in shown["unloadable"]
    table = cli("adapters", "list")[0].splitlines()
    assert table[1].split()[-2] == "UNLOADABLE"
    assert "UNLOADABLE" in cli("adapters", "show", "wide")[0]

    t0 = time.perf_counter()
    second = stack.complete("wide")
    took = time.perf_counter() - t0
    message = second.json()["error"]["message"]
    assert second.status_code == 400 and "marked unloadable" in message and "shape" in message, second.text
    assert second.json()["error"]["param"] == "model"
    assert stack.loads == ["wide"], "the second request must not fetch or read the adapter again"

    # Another replica (empty memory) learns it from the catalog record and does not try either.
    other = ReplicaCore(stack.cfg, "local-1", kernel=stack.kernel, catalog=stack.catalog)
    with pytest.raises(InvalidAdapter, match="marked unloadable"):
        asyncio.run(other.fetcher.ensure(stack.catalog.get("wide")))
    assert stack.loads == ["wide"]

    # A new version that fits clears it.
    good = write_tiny_adapter(tmp_path / "wide-v2", seed=7)
    assert "registered wide@2" in cli("adapters", "register", "wide", str(good), "--public")[0]
    ok = stack.complete("wide@2")
    assert ok.status_code == 200, ok.text
    assert stack.catalog.get("wide").unloadable is None and stack.catalog.get("wide@1").unloadable
    print(f"\nsecond request for an unloadable adapter answered in {took * 1e3:.1f} ms")


def test_merge_weights_in_scientific_notation_over_http(stack, tmp_path):
    for name, seed in (("sci-a", 21), ("sci-b", 22)):
        folder = write_tiny_adapter(stack.root / name, seed=seed)
        r = stack.run(
            lambda c, n=name, f=folder: c.post(
                "/v1/adapters", json={"name": n, "source": str(f), "public": True}, headers=bearer(ADMIN)
            )
        )
        assert r.status_code == 201, r.text
    got = {m: stack.complete(m) for m in ("sci-a*1e-05+sci-b*2E+0", "sci-a*5e-1+sci-b*1E+0")}
    for model, r in got.items():
        assert r.status_code == 200, (model, r.text)
    want = stack.kernel.complete([PROMPT], ["sci-a@1*0.5+sci-b@1*1"], max_tokens=6)[0].text
    assert got["sci-a*5e-1+sci-b*1E+0"].json()["choices"][0]["text"] == want
