"""Three Ray nodes on this machine (deploy/local_cluster.py): a head with the ingress and Serve's proxy, two
workers with one replica each, Redis and moto's S3 server as their own processes. Run inside a loopback-only
network namespace (`unshare -n`), like every test that starts Ray.

Order is the story: replicas on both workers answer; a new version and a removal of an adapter reach every
replica of every node (pub/sub, and the TTL fallback when the event is lost); then a worker node dies under
mixed-adapter load and no non-streaming request is lost or wrong, the dead replica leaves the placement within
the heartbeat TTL, and its replacement warms the live hot adapters (and none of the removed ones) before it
takes traffic. The long version with more requests: load_tests/chaos/node_loss.py."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import openai
import pytest

from app.catalog.redis_server import free_port
from app.config.app_config import AppConfig
from app.router.http.ingress import REPLICA_HEADER
from deploy.cluster_app import running_replicas, serve_on, shutdown, wait_for
from deploy.local_cluster import LocalCluster
from deploy.nodes import default_nodes
from tests.fixtures.cluster import PROMPTS, Reference, mixed_load, push, tenant_key, tiny_adapters

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.timeout(600)]

ADMIN = "multinode-admin"
ADAPTERS = [f"m{i:02d}" for i in range(8)]
HEARTBEAT_S, TTL_S = 0.5, 3.0
MAX_ONGOING = 6  # small, so a burst spills over to the second replica


class Env:
    def __init__(self, cluster, base, key, ref, catalog, folders):
        self.cluster, self.base, self.key, self.ref, self.catalog = cluster, base, key, ref, catalog
        self.folders = folders

    def client(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(api_key=self.key, base_url=f"{self.base}/v1", max_retries=0, timeout=180)

    def holders(self, name: str) -> dict[str, list[str]]:
        """replica id -> the versions of `name` its last heartbeat says it holds."""
        return {
            rid: [r for r in info.resident if r.partition("@")[0] == name]
            for rid, info in self.catalog.replicas().items()
        }


async def complete(client, model: str, prompt: str, max_tokens: int) -> tuple[str, str]:
    raw = await client.completions.with_raw_response.create(model=model, prompt=prompt, max_tokens=max_tokens)
    return raw.parse().choices[0].text, raw.headers.get(REPLICA_HEADER, "")


async def burst(env: Env, model: str, n: int = 24, max_tokens: int = 8) -> list[tuple[str, str, str]]:
    """n concurrent requests for `model`: [(prompt, text, replica id)]."""
    async with env.client() as client:
        got = await asyncio.gather(
            *(complete(client, model, PROMPTS[i % len(PROMPTS)], max_tokens) for i in range(n))
        )
    return [(PROMPTS[i % len(PROMPTS)], text, rid) for i, (text, rid) in enumerate(got)]


def burst_until_every_replica(env: Env, model: str, expect_as: str, tries: int = 4) -> set[str]:
    """Bursts of `model` until every live replica has answered one; every answer must equal the reference
    of `expect_as`. Returns the replicas that answered."""
    live, seen = set(env.catalog.replicas()), set()
    for _ in range(tries):
        for prompt, text, rid in asyncio.run(burst(env, model)):
            assert text == env.ref.text(prompt, expect_as, 8), (model, rid, prompt)
            seen.add(rid)
        if live <= seen:
            return seen
    raise AssertionError(f"{model}: only replicas {sorted(seen)} of {sorted(live)} answered")


@pytest.fixture(scope="module")
def env(llama_dir, tmp_path_factory):
    from app.catalog.store import Catalog

    root = tmp_path_factory.mktemp("multinode")
    folders = tiny_adapters(root, ADAPTERS)
    folders |= tiny_adapters(root, ["ver-v1", "ver-v2", "gone", "quiet"], seed=2000)
    cluster = LocalCluster(default_nodes(workers=2, worker_cpus=3))
    ref = None
    try:
        cluster.start()
        print(f"\nnodes up in { {n: round(x.started_s, 1) for n, x in cluster.nodes.items()} } s")
        for name in ADAPTERS:
            push(cluster, llama_dir, name, folders[name])
        key = tenant_key(cluster, "alpha")
        ref = Reference(llama_dir, folders)
        cfg = AppConfig(
            model=str(llama_dir),
            served_model_name="tiny-llama",
            replicas=2,
            replica_num_cpus=1,
            ingress_num_cpus=0.25,
            max_ongoing_requests=MAX_ONGOING,
            redis_url=cluster.redis_url,
            admin_token=ADMIN,
            kernel={"max_adapters": 8, "max_batch_size": 16, "dtype": "float32"},
            heartbeat_s=HEARTBEAT_S,
            heartbeat_ttl_s=TTL_S,
            routing_stats_period_s=0.5,
            request_timeout_s=120,
            warm_adapters=4,
        )
        t0 = time.monotonic()
        base = serve_on(cluster, cfg, free_port())
        catalog = Catalog(cluster.redis_url)
        wait_for(lambda: len(catalog.replicas()) == 2, 60, "both replicas' heartbeats")
        print(f"app deployed in {time.monotonic() - t0:.1f}s")
        yield Env(cluster, base, key, ref, catalog, folders)
        catalog.close()
    finally:
        try:
            shutdown()
        except Exception:
            pass
        cluster.stop()
        if ref is not None:
            ref.close()


def test_replicas_on_both_workers_answer(env):
    import ray

    nodes = {rid: info.extra.get("node_ip") for rid, info in env.catalog.replicas().items()}
    assert sorted(nodes.values()) == ["127.0.0.2", "127.0.0.3"], nodes
    # The ingress holds a quarter of the head-only resource: it runs on the head.
    assert ray.available_resources().get("loraland_ingress") == 0.75
    seen: dict[str, set] = {}
    for name in ADAPTERS[:4]:
        for rid in burst_until_every_replica(env, name, name):
            seen.setdefault(nodes[rid], set()).add(name)
    assert set(seen) == {"127.0.0.2", "127.0.0.3"}


def test_new_version_and_removal_reach_every_replica(env, llama_dir):
    env.ref.add("ver-v2", env.folders["ver-v2"])
    push(env.cluster, llama_dir, "ver", env.folders["ver-v1"], prefix="ver-v1")
    burst_until_every_replica(env, "ver", "ver-v1")
    assert push(env.cluster, llama_dir, "ver", env.folders["ver-v2"], prefix="ver-v2")["version"] == 2
    time.sleep(2.5)  # the ingress trusts a resolved record for 2 s (service.RECORD_TTL_S)
    burst_until_every_replica(env, "ver", "ver-v2")
    wait_for(
        lambda: all(v == ["ver@2"] for v in env.holders("ver").values()), 10, "every replica to retire ver@1"
    )

    # Removal with its pub/sub event: every replica unloads at once.
    for name in ("gone", "quiet"):
        push(env.cluster, llama_dir, name, env.folders[name])
        burst_until_every_replica(env, name, name)
    t0 = time.monotonic()
    assert httpx.delete(
        f"{env.base}/v1/adapters/gone", headers={"Authorization": f"Bearer {ADMIN}"}, timeout=30
    ).is_success
    wait_for(lambda: not any(env.holders("gone").values()), TTL_S + 5, "every replica to unload 'gone'")
    pubsub_s = time.monotonic() - t0

    # Removal whose event is lost (published on a channel nobody hears): the TTL reconciliation unloads it.
    from app.catalog.store import Catalog

    with Catalog(env.cluster.redis_url) as silent:
        silent._channel = "loraland:nobody-listens"
        t0 = time.monotonic()
        assert silent.remove("quiet") == 1
    wait_for(
        lambda: not any(env.holders("quiet").values()), 2 * TTL_S + 5, "the TTL fallback to unload 'quiet'"
    )
    fallback_s = time.monotonic() - t0
    print(f"\nunload on every replica: pub/sub {pubsub_s:.2f}s, lost event (TTL fallback) {fallback_s:.2f}s")
    time.sleep(2.5)
    with pytest.raises(openai.NotFoundError):
        asyncio.run(burst(env, "quiet", n=1))


def test_worker_killed_mid_load_loses_no_request(env):
    before = env.catalog.replicas()
    victims = {rid for rid, info in before.items() if info.extra.get("node_ip") == "127.0.0.3"}
    assert len(victims) == 1
    n, streamed_every = 200, 8
    dropped_after: list[float] = []
    t_kill: list[float] = []

    def watch_placement() -> None:
        while time.monotonic() - t_kill[0] < 30:
            if not victims & set(env.catalog.replicas()):
                dropped_after.append(time.monotonic() - t_kill[0])
                return
            time.sleep(0.1)

    def kill_mid_load(done: int) -> None:
        if done == n // 5 and not t_kill:  # a fifth answered, the rest queued or in flight on both workers
            t_kill.append(time.monotonic())
            print(
                f"\nkilled worker2 ({env.cluster.kill_node('worker2')} processes) after {done} of {n} requests"
            )
            threading.Thread(target=watch_placement, daemon=True).start()

    t0 = time.monotonic()
    outcome, errors = asyncio.run(
        mixed_load(env.base, env.key, env.ref, [*ADAPTERS, "tiny-llama"], n, streamed_every=streamed_every,
                   on_done=kill_mid_load)
    )  # fmt: skip
    print(f"node loss: {outcome} in {time.monotonic() - t0:.1f}s; errors: {errors[:3]}")
    assert outcome["lost"] == 0 and outcome["wrong"] == 0, (outcome, errors[:5])
    assert outcome["ok"] == n - len(range(0, n, streamed_every))
    kill_at = t_kill[0]

    wait_for(lambda: dropped_after, TTL_S + 10, "the dead replica to leave the placement")
    print(f"dead replica left the placement {dropped_after[0]:.2f}s after the kill (TTL {TTL_S}s)")
    assert dropped_after[0] <= TTL_S + 3
    assert all(not victims & set(rids) for rids in env.catalog.placement().values())

    # Serve replaces the replica on the surviving worker; it warmed the live hot adapters, no removed one.
    wait_for(
        lambda: running_replicas() == 2 and len(env.catalog.replicas()) == 2, 180, "a replacement replica"
    )
    # Its warm-up result rides on a heartbeat after it is RUNNING: wait for that heartbeat, not the first one.
    wait_for(
        lambda: all("warmed" in i.extra for rid, i in env.catalog.replicas().items() if rid not in before),
        30,
        "the replacement's warm-up in its heartbeat",
    )
    print(f"replacement running {time.monotonic() - kill_at:.1f}s after the kill")
    after = env.catalog.replicas()
    (new_id,) = set(after) - set(before)
    new = after[new_id]
    assert new.extra["node_ip"] == "127.0.0.2"
    warmed = new.extra.get("warmed") or []
    assert warmed and {w.partition("@")[0] for w in warmed} <= set(ADAPTERS) | {"ver"}, warmed
    assert "ver@1" not in warmed
    # ... and it serves: the new version of `ver`, the reference answers, nothing removed.
    burst_until_every_replica(env, "ver", "ver-v2")
    with pytest.raises(openai.NotFoundError):
        asyncio.run(burst(env, "gone", n=1))
