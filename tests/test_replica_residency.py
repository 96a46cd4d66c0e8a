"""What a replica tells the router it holds (`stats().resident`, also its catalog heartbeat): the
adapters in the kernel's memory, which shrinks when the host LRU drops one or the adapter is unloaded, not
every adapter ever registered (a real kernel on the tiny model, real PEFT adapters, no catalog)."""

import asyncio

from app.adapter_record import AdapterRecord
from app.config.app_config import AppConfig
from app.replica.core import ReplicaCore
from tests.fixtures.adapters import make_peft_adapter


def test_resident_shrinks_on_host_eviction_and_unload(llama_dir, tmp_path, monkeypatch):
    monkeypatch.delenv("LORALAND_REDIS_URL", raising=False)
    records = [
        AdapterRecord(
            name,
            1,
            str(make_peft_adapter(llama_dir, tmp_path / name, r=2, alpha=4, target_modules=["q_proj"])),
            files={},
            size=0,
            rank=2,
            alpha=4,
            target_modules=["q_proj"],
            base_model={},
            tenant=None,
            public=True,
            created=0.0,
        )
        for name in ("a", "b", "c")
    ]
    cfg = AppConfig(
        model=str(llama_dir),
        redis_url=None,
        cache_dir=str(tmp_path / "cache"),
        kernel={"max_adapters": 1, "max_cpu_adapters": 2, "dtype": "float32"},
    )
    core = ReplicaCore(cfg, "r0", catalog=None)
    try:

        async def load_all():
            for rec in records:
                await core.fetcher.ensure(rec)

        asyncio.run(load_all())
        # Three registered, two fit in host memory: the least recently loaded one is no longer resident.
        assert sorted(core.kernel.stats().loaded) == ["a", "b", "c"]
        assert core.stats().resident == ("b@1", "c@1")
        # A request for it reads it back in (the registry kept its loader) and it is resident again.
        out = core.kernel.infer(["hello"], ["a"], max_tokens=2, temperature=0.0)
        assert len(out) == 1
        assert "a@1" in core.stats().resident
        assert len(core.stats().resident) <= 2 + 1  # host cache + the one device slot
        core.sync.on_event({"type": "removed", "name": "b", "version": 1})
        assert "b@1" not in core.stats().resident
    finally:
        core.close()
