"""Serve autoscaling of the replicas on queue length, on a two-node cluster (deploy/local_cluster.py: the head
with the ingress, one worker with room for two replicas). Load makes Serve add a replica, which warms the hot
adapters before it takes traffic; idleness takes it away again. Short delays, so the test is quick; the
timings it prints are the report's numbers. Run inside a loopback-only network namespace (`unshare -n`)."""

from __future__ import annotations

import asyncio
import threading
import time

import openai
import pytest

from app.catalog.redis_server import free_port
from app.config.app_config import AppConfig
from deploy.cluster_app import all_replicas, running_replicas, serve_on, shutdown, wait_for
from deploy.local_cluster import LocalCluster
from deploy.nodes import default_nodes
from tests.fixtures.cluster import PROMPTS, Reference, push, tenant_key, tiny_adapters

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.timeout(600)]

HOT = [f"h{i}" for i in range(3)]
AUTOSCALING = {
    "min_replicas": 1,
    "max_replicas": 2,
    "target_ongoing_requests": 2,  # per replica: 12 requests in flight ask for 6 replicas, capped at 2
    "upscale_delay_s": 1.0,
    "downscale_delay_s": 5.0,
    "metrics_interval_s": 0.5,
    "look_back_period_s": 2.0,
}


class Load:
    """`concurrency` clients sending hot-adapter requests back to back until stop(); checks every answer."""

    def __init__(self, base: str, key: str, ref: Reference, concurrency: int = 12):
        self.base, self.key, self.ref, self.concurrency = base, key, ref, concurrency
        self.ok, self.wrong, self.errors = 0, 0, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)

    async def _run(self) -> None:
        async with openai.AsyncOpenAI(
            api_key=self.key, base_url=f"{self.base}/v1", max_retries=0, timeout=180
        ) as client:

            async def worker(w: int) -> None:
                i = w
                while not self._stop.is_set():
                    model, prompt = HOT[i % len(HOT)], PROMPTS[i % len(PROMPTS)]
                    try:
                        got = await client.completions.create(model=model, prompt=prompt, max_tokens=16)
                        if got.choices[0].text == self.ref.text(prompt, model, 16):
                            self.ok += 1
                        else:
                            self.wrong += 1
                    except openai.APIError as e:
                        self.errors.append(f"{model}: {e}")
                    i += self.concurrency

            await asyncio.gather(*(worker(w) for w in range(self.concurrency)))

    def start(self) -> Load:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=240)


def test_replicas_scale_up_under_load_warm_and_scale_down_when_idle(llama_dir, tmp_path_factory):
    from app.catalog.store import Catalog

    folders = tiny_adapters(tmp_path_factory.mktemp("autoscale"), HOT, seed=3000)
    cluster = LocalCluster(default_nodes(workers=1, worker_cpus=2))
    ref = None
    try:
        cluster.start()
        for name in HOT:
            push(cluster, llama_dir, name, folders[name])
        key = tenant_key(cluster, "alpha")
        ref = Reference(llama_dir, folders)
        cfg = AppConfig(
            model=str(llama_dir),
            served_model_name="tiny-llama",
            replica_num_cpus=1,
            ingress_num_cpus=0.25,
            max_ongoing_requests=4,
            redis_url=cluster.redis_url,
            kernel={"max_adapters": 8, "max_batch_size": 16, "dtype": "float32"},
            heartbeat_s=0.5,
            heartbeat_ttl_s=3.0,
            routing_stats_period_s=0.5,
            autoscaling=AUTOSCALING,
            warm_adapters=len(HOT),
        )
        base = serve_on(cluster, cfg, free_port())
        catalog = Catalog(cluster.redis_url)
        (first,) = wait_for(lambda: list(catalog.replicas()), 60, "the first replica's heartbeat")
        assert running_replicas() == 1

        # The first replica loads the hot adapters on demand; they are then what the placement calls hot.
        load = Load(base, key, ref, concurrency=1).start()
        wait_for(lambda: load.ok >= 2 * len(HOT), 120, "the hot adapters to load on the first replica")
        load.stop()
        wait_for(
            lambda: {f"{h}@1" for h in HOT} <= set(catalog.replicas()[first].resident), 10, "hot placement"
        )
        assert running_replicas() == 1  # one request at a time is under the target: no scale-up yet

        t0 = time.monotonic()
        load = Load(base, key, ref, concurrency=12).start()
        try:
            wait_for(lambda: all_replicas() == 2, 60, "Serve to decide on a second replica", every_s=0.25)
            decide_s = time.monotonic() - t0
            wait_for(lambda: running_replicas() == 2, 300, "Serve to add a replica under load", every_s=0.5)
            up_s = time.monotonic() - t0
            new_id = wait_for(lambda: set(catalog.replicas()) - {first}, 30, "the new replica's heartbeat")
            (new_id,) = new_id
            served_before = load.ok
            time.sleep(3)  # the new replica takes its share
        finally:
            load.stop()
        warmed = catalog.replicas()[new_id].extra.get("warmed")
        assert sorted(warmed) == sorted(f"{h}@1" for h in HOT), warmed  # loaded before its first request
        assert load.wrong == 0 and not load.errors, (load.wrong, load.errors[:3])

        t1 = time.monotonic()
        wait_for(lambda: running_replicas() == 1, 120, "Serve to remove the idle replica", every_s=0.5)
        down_s = time.monotonic() - t1
        wait_for(lambda: len(catalog.replicas()) == 1, 10, "the removed replica to leave the placement")
        print(
            f"\nautoscaling: second replica decided {decide_s:.1f}s and running {up_s:.1f}s after load began "
            f"(upscale_delay_s="
            f"{AUTOSCALING['upscale_delay_s']}); back to 1 {down_s:.1f}s after load stopped (downscale_delay_s="
            f"{AUTOSCALING['downscale_delay_s']}); {load.ok} requests ok ({served_before} before the new "
            f"replica ran), new replica warmed {warmed}"
        )
        catalog.close()
    finally:
        try:
            shutdown()
        except Exception:
            pass
        cluster.stop()
        if ref is not None:
            ref.close()
