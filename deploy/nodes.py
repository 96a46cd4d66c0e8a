"""One Ray node of a LocalCluster (deploy/local_cluster.py): what it is (NodeSpec: name, 127.0.0.x address,
CPUs, custom resources), the default head-and-workers layout, and its `ray start` command line.

What Ray 2.60 needs in that command, learned the hard way:
- `--node-ip-address` on every node: otherwise Ray asks 8.8.8.8:53 which address is its own.
- Every agent port given explicitly: with port 0 the raylet waits ~15 s for the dashboard agent to write its
  port file and aborts the node when a loaded machine is slower than that.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from app.catalog.redis_server import free_port

RAY = Path(sys.executable).with_name("ray")
INGRESS_RESOURCE = "loraland_ingress"  # only the head has it: the ingress deployment asks for it
REPLICA_RESOURCE = "loraland_replica"  # only workers have it: replicas never land on the head
# Node death is noticed by the GCS's health checks (defaults: 3 s period x 5 failures); a test wants it sooner.
FAST_FAILURE_DETECTION = {
    "RAY_health_check_period_ms": "1000",
    "RAY_health_check_timeout_ms": "1000",
    "RAY_health_check_failure_threshold": "3",
}


@dataclass(frozen=True)
class NodeSpec:
    name: str
    ip: str
    num_cpus: int
    resources: dict[str, float] = field(default_factory=dict)


def default_nodes(workers: int = 2, worker_cpus: int = 4) -> list[NodeSpec]:
    """A head (the ingress resource, and no replica resource) and `workers` replica hosts. The head's CPUs are
    scheduling tokens, but the raylet starts at most that many worker processes at once: with 1, Serve's
    controller, proxy and ingress start one after the other and the proxy can miss Serve's 60 s deadline."""
    head = NodeSpec("head", "127.0.0.1", 4, {INGRESS_RESOURCE: 1})
    return [head] + [
        NodeSpec(f"worker{i}", f"127.0.0.{i + 1}", worker_cpus, {REPLICA_RESOURCE: worker_cpus})
        for i in range(1, workers + 1)
    ]


@dataclass
class Node:
    spec: NodeSpec
    proc: subprocess.Popen
    log: Path
    cache_dir: Path
    launched: float = 0.0  # time.monotonic() at `ray start`
    log_offset: int = 0  # where this start's output begins (a restarted node appends to its log)
    started_s: float = 0.0  # how long `ray start` took to report the node up


def ray_start_command(
    spec: NodeSpec, index: int, node_dir: Path, *, gcs_port: int, object_store_mb: int
) -> list[str]:
    """`ray start --block` for the node at `index` in the cluster's node list (0 is the head, whose GCS listens
    on `gcs_port`; the others join it)."""
    ports = [free_port() for _ in range(6)]
    lo = 10002 + 1000 * index  # disjoint worker-port ranges: the nodes share one machine
    cmd = [
        str(RAY), "start", "--block", f"--node-ip-address={spec.ip}",
        f"--num-cpus={spec.num_cpus}", "--num-gpus=0", f"--resources={json.dumps(spec.resources)}",
        f"--temp-dir={node_dir / 'ray'}", f"--object-store-memory={object_store_mb << 20}",
        f"--node-manager-port={ports[0]}", f"--object-manager-port={ports[1]}",
        f"--metrics-export-port={ports[2]}", f"--dashboard-agent-listen-port={ports[3]}",
        f"--dashboard-agent-grpc-port={ports[4]}", f"--runtime-env-agent-port={ports[5]}",
        f"--min-worker-port={lo}", f"--max-worker-port={lo + 999}", "--disable-usage-stats",
    ]  # fmt: skip
    if index == 0:
        return cmd + ["--head", f"--port={gcs_port}", "--include-dashboard=false"]
    return cmd + [f"--address=127.0.0.1:{gcs_port}"]
