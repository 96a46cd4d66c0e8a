"""Node loss, the long version of tests/test_multinode.py's: a worker of a local multi-node cluster killed
while many mixed-adapter requests are in flight.
Run: ./run bench node_loss [--help]. Method and results: load_tests/chaos/RESULTS.md."""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

from app.catalog.redis_server import free_port
from app.config.app_config import AppConfig
from deploy.cluster_app import running_replicas, serve_on, shutdown, wait_for
from deploy.local_cluster import LocalCluster
from deploy.nodes import default_nodes
from tests.fixtures.cluster import Reference, mixed_load, push, tenant_key, tiny_adapters

OUT = Path(__file__).resolve().parent / "results" / "node_loss.json"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=1000)
    p.add_argument("--workers", type=int, default=3)
    p.add_argument("--replicas", type=int, default=4)
    p.add_argument("--adapters", type=int, default=12)
    p.add_argument("--concurrency", type=int, default=24)
    p.add_argument("--streamed-every", type=int, default=8, help="every k-th request streams (0: none)")
    p.add_argument("--kill-after", type=float, default=0.2, help="kill when this fraction has answered")
    p.add_argument("--ttl", type=float, default=3.0, help="heartbeat TTL (heartbeats every TTL/6)")
    args = p.parse_args(argv)

    from tests.fixtures.models import build_tiny_model

    root = Path(tempfile.mkdtemp(prefix="node-loss-"))
    model = build_tiny_model(root / "model")
    names = [f"a{i:02d}" for i in range(args.adapters)]
    folders = tiny_adapters(root / "adapters", names)
    # Room for every replica on the survivors: Serve reschedules the dead node's replicas there.
    cluster = LocalCluster(default_nodes(args.workers, worker_cpus=args.replicas))
    ref = None
    result: dict = {"args": vars(args)}
    try:
        t = time.monotonic()
        cluster.start()
        result["nodes_up_s"] = round(time.monotonic() - t, 1)
        for name in names:
            push(cluster, model, name, folders[name])
        key = tenant_key(cluster, "alpha")
        ref = Reference(model, folders)
        cfg = AppConfig(
            model=str(model),
            served_model_name="tiny-llama",
            replicas=args.replicas,
            replica_num_cpus=1,
            ingress_num_cpus=0.25,
            max_ongoing_requests=8,
            redis_url=cluster.redis_url,
            kernel={"max_adapters": 8, "max_batch_size": 16, "dtype": "float32"},
            heartbeat_s=args.ttl / 6,
            heartbeat_ttl_s=args.ttl,
            routing_stats_period_s=0.5,
            request_timeout_s=300,
            warm_adapters=4,
        )
        t = time.monotonic()
        base = serve_on(cluster, cfg, free_port())
        from app.catalog.store import Catalog

        catalog = Catalog(cluster.redis_url)
        wait_for(lambda: len(catalog.replicas()) == args.replicas, 120, "every replica's heartbeat")
        result["deploy_s"] = round(time.monotonic() - t, 1)
        before = catalog.replicas()
        per_node = Counter(r.extra["node_ip"] for r in before.values())
        victim_ip, _ = per_node.most_common(1)[0]
        victim = next(n for n, node in cluster.nodes.items() if node.spec.ip == victim_ip)
        victims = {rid for rid, r in before.items() if r.extra["node_ip"] == victim_ip}
        result["replicas_per_node"] = dict(per_node)
        print(f"replicas per node {dict(per_node)}; killing {victim} ({victim_ip}) with {len(victims)}")

        # Warm every adapter somewhere first, so the kill meets a steady state, not first loads.
        asyncio.run(mixed_load(base, key, ref, names, 2 * len(names), concurrency=8, streamed_every=0))
        t_kill: list[float] = []
        dropped: list[float] = []

        def watch() -> None:
            while time.monotonic() - t_kill[0] < 60:
                if not victims & set(catalog.replicas()):
                    dropped.append(time.monotonic() - t_kill[0])
                    return
                time.sleep(0.05)

        def on_done(done: int) -> None:
            if not t_kill and done >= args.kill_after * args.requests:
                t_kill.append(time.monotonic())
                result["killed_processes"] = cluster.kill_node(victim)
                result["killed_after_requests"] = done
                threading.Thread(target=watch, daemon=True).start()

        t = time.monotonic()
        outcome, errors = asyncio.run(
            mixed_load(base, key, ref, [*names, "tiny-llama"], args.requests, concurrency=args.concurrency,
                       streamed_every=args.streamed_every, on_done=on_done)
        )  # fmt: skip
        result["load_s"] = round(time.monotonic() - t, 1)
        result["outcome"], result["errors"] = outcome, errors[:20]
        wait_for(lambda: dropped, args.ttl + 30, "the dead replicas to leave the placement")
        result["placement_drop_s"] = round(dropped[0], 2)
        wait_for(
            lambda: running_replicas() == args.replicas and len(catalog.replicas()) == args.replicas,
            600,
            "Serve to replace the dead replicas",
            every_s=0.5,
        )
        result["replaced_s"] = round(time.monotonic() - t_kill[0], 1)
        after = catalog.replicas()
        new = {rid: r for rid, r in after.items() if rid not in before}
        result["replacements"] = {
            rid: {"node_ip": r.extra["node_ip"], "warmed": r.extra.get("warmed")} for rid, r in new.items()
        }
        catalog.close()
    finally:
        try:
            shutdown()
        except Exception:
            pass
        cluster.stop()
        if ref is not None:
            ref.close()
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))
    ok = result["outcome"]["lost"] == 0 and result["outcome"]["wrong"] == 0
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
