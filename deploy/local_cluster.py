"""A Ray cluster of several nodes on this machine: a head and worker raylets, each its own `ray start` with
its own node IP (127.0.0.x), CPUs, custom resources, temp dir and adapter disk cache, plus Redis and moto's
S3 server as separate processes. Tests and benchmarks start and stop it; it ends only the PIDs it started.

Run everything that uses it inside a loopback-only network namespace (`unshare -n`, lo up): there all of
127/8 is on lo, so each node gets a distinct address, and nothing can leave the machine.

    python -m deploy.local_cluster up                  # start, print the client env, wait for Ctrl-C
    python -m deploy.local_cluster run -- CMD ARGS...  # start, run CMD with the client env, stop

What Ray 2.60 needs here, learned the hard way:
- Token authentication is on: one token (RAY_AUTH_MODE=token, RAY_AUTH_TOKEN) in the environment of every
  node and every client (`ray status`, `serve deploy`, a driver), or they are refused with InvalidAuthToken.
- `--node-ip-address` on every node, and every agent port given explicitly (deploy/nodes.py says why; the
  nodes' specs and their `ray start` command live there, moto's S3 server in deploy/s3_server.py).
"""

from __future__ import annotations

import argparse
import atexit
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from app.catalog.redis_server import free_port, start_redis
from app.config.env_patch import EnvPatch
from app.router.http.middleware import PROXY_CALLBACK, PROXY_CALLBACK_ENV
from deploy.nodes import FAST_FAILURE_DETECTION, Node, NodeSpec, default_nodes, ray_start_command
from deploy.processes import (
    boost_priority,
    end_pids,
    pids_with_marker,
    refresh_ray_auth,
    send_signal,
    set_autogroup_nice,
)
from deploy.s3_server import s3_env, start_s3

REPO = Path(__file__).resolve().parents[1]


class LocalCluster:
    """Start with `start()` (or `with LocalCluster() as c:`); `client_env()` is what a driver, `ray status` or
    `serve deploy` needs; `kill_node(name)` is a machine dying (SIGKILL to every process of that node)."""

    def __init__(
        self,
        nodes: list[NodeSpec] | None = None,
        *,
        root: Path | None = None,
        env: dict[str, str] | None = None,
        s3: bool = True,
        object_store_mb: int = 80,
        fast_failure_detection: bool = True,
        start_timeout_s: float = 180.0,
    ):
        self.specs = default_nodes() if nodes is None else list(nodes)  # []: Redis and S3 only
        if self.specs and self.specs[0].ip != "127.0.0.1":
            raise ValueError("the head must be 127.0.0.1: a driver on this machine attaches to it")
        self.root = Path(root or tempfile.mkdtemp(prefix="llc-", dir="/tmp"))  # short: socket paths
        self.root.mkdir(parents=True, exist_ok=True)
        self.extra_env, self.want_s3 = dict(env or {}), s3
        self.object_store_mb, self.start_timeout_s = object_store_mb, start_timeout_s
        self.fast = fast_failure_detection
        self.token = secrets.token_hex(32)
        self.gcs_port = free_port()
        self.nodes: dict[str, Node] = {}
        self.redis_url: str | None = None
        self.s3_endpoint: str | None = None
        self._stop_redis = None
        self._stop_s3 = None

    # ------------------------------------------------------------------ lifecycle
    def __enter__(self) -> LocalCluster:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.gcs_port}"

    def start(self) -> LocalCluster:
        """Redis, S3, the head, then every worker at once (each `ray start` takes ~25 s on a busy machine)."""
        atexit.register(self.stop)  # a driver that exits without stop() must not leave the nodes running
        try:
            self.redis_url, self._stop_redis = start_redis()
            if self.want_s3:
                self._start_s3()
            if self.specs:
                self._wait(self._launch(self.specs[0]))
            for node in [self._launch(spec) for spec in self.specs[1:]]:
                self._wait(node)
        except BaseException:
            self.stop()
            raise
        return self

    def _start_s3(self) -> None:
        self.s3_endpoint, self._stop_s3 = start_s3(self.root / "s3.log")

    def aws_env(self) -> dict[str, str]:
        return s3_env(self.s3_endpoint) if self.s3_endpoint else {}

    def client_env(self) -> dict[str, str]:
        """What any Ray client of this cluster needs in its environment (merge into os.environ)."""
        return {
            "RAY_ADDRESS": self.address,
            "RAY_AUTH_MODE": "token",
            "RAY_AUTH_TOKEN": self.token,
            "RAY_USAGE_STATS_ENABLED": "0",
            "LORALAND_REDIS_URL": self.redis_url or "",
            **self.aws_env(),
        }

    def use_in_this_process(self) -> EnvPatch:
        """Put client_env() into os.environ for a driver in this process (`ray.init(address=...)`); the returned
        patch goes to `restore_env`. Ray caches the auth mode and token at import, so the cache is refreshed
        too (what Ray's own authentication_test_utils do)."""
        patch = EnvPatch(self.client_env())
        refresh_ray_auth()
        return patch

    @staticmethod
    def restore_env(patch: EnvPatch) -> None:
        patch.restore()
        refresh_ray_auth()

    def _node_env(self, spec: NodeSpec, cache_dir: Path) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
        env.update(self.client_env())
        env.pop("RAY_ADDRESS")
        if self.fast:
            env.update(FAST_FAILURE_DETECTION)
        env.update(
            {
                # Replicas inherit the raylet's environment: each node its own disk cache, like a real host.
                "LORALAND_CACHE_DIR": str(cache_dir),
                "OMP_NUM_THREADS": "1",
                "TOKENIZERS_PARALLELISM": "false",
                "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p),
                # Serve's proxy on this node answers for an ingress replica that died (IngressLossMiddleware).
                PROXY_CALLBACK_ENV: PROXY_CALLBACK,
            }
        )
        env.update(self.extra_env)
        return env

    def start_node(self, spec: NodeSpec) -> Node:
        """Add a node (or restart a killed one) and return once Ray says it is up."""
        return self._wait(self._launch(spec))

    def _launch(self, spec: NodeSpec) -> Node:
        """`ray start --block` for one node, in its own session (its own process group)."""
        if spec.name in self.nodes and self.nodes[spec.name].proc.poll() is None:
            raise ValueError(f"node {spec.name} is already running")
        if spec.name not in {s.name for s in self.specs}:
            self.specs.append(spec)
        index = [s.name for s in self.specs].index(spec.name)
        ndir = self.root / spec.name
        cache_dir = ndir / "cache"
        cache_dir.mkdir(parents=True, exist_ok=True)
        cmd = ray_start_command(
            spec, index, ndir, gcs_port=self.gcs_port, object_store_mb=self.object_store_mb
        )
        log = ndir / "ray-start.log"
        offset = log.stat().st_size if log.exists() else 0
        with open(log, "ab") as out:
            proc = subprocess.Popen(
                cmd,
                env=self._node_env(spec, cache_dir),
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,  # killing the node never touches the caller's process group
                cwd=REPO,
                preexec_fn=boost_priority,
            )
        node = Node(spec, proc, log, cache_dir, launched=time.monotonic(), log_offset=offset)
        self.nodes[spec.name] = node
        return node

    def _wait(self, node: Node) -> Node:
        deadline = node.launched + self.start_timeout_s
        while time.monotonic() < deadline:
            if b"Ray runtime started" in node.log.read_bytes()[node.log_offset :]:
                node.started_s = time.monotonic() - node.launched
                self._unboost(node)
                return node
            if node.proc.poll() is not None:
                break
            time.sleep(0.25)
        tail = node.log.read_text(errors="replace")[-2000:]
        raise RuntimeError(
            f"node {node.spec.name} ({node.spec.ip}) did not start within {self.start_timeout_s}s:\n{tail}"
        )

    # ------------------------------------------------------------------ processes
    def _unboost(self, node: Node) -> None:
        """Back to normal priority once the node is up (the whole session: workers started later too)."""
        set_autogroup_nice(node.proc.pid, 0)

    def _pids(self, node: Node) -> set[int]:
        """Every process of one node: the `ray start` tree, plus any that outlived their parent (found by the
        node's own temp dir on their command line: a path only this cluster uses)."""
        import psutil

        pids: set[int] = set()
        try:
            root = psutil.Process(node.proc.pid)
            pids |= {root.pid} | {p.pid for p in root.children(recursive=True)}
        except psutil.NoSuchProcess:
            pass
        return pids | pids_with_marker(f"{self.root / node.spec.name}/")

    def kill_node(self, name: str) -> int:
        """A machine dying: SIGKILL every process of node `name` at once (raylet, workers, agents).
        Returns how many processes were killed."""
        node = self.nodes[name]
        pids = self._pids(node)
        send_signal(pids, signal.SIGKILL)
        node.proc.wait(timeout=10)
        return len(pids)

    def stop_node(self, name: str, grace_s: float = 10.0) -> None:
        node = self.nodes.get(name)
        if node is None:
            return
        end_pids(self._pids(node), grace_s, again=lambda: self._pids(node))
        try:
            node.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass

    def stop(self) -> None:
        """Workers first, then the head, then S3 and Redis; every node's temp dir goes too."""
        for name in reversed(list(self.nodes)):
            self.stop_node(name)
        if self._stop_s3 is not None:
            self._stop_s3()
            self._stop_s3 = None
        if self._stop_redis is not None:
            self._stop_redis()
            self._stop_redis = None
        atexit.unregister(self.stop)
        if not os.environ.get("LORALAND_KEEP_CLUSTER_LOGS"):
            shutil.rmtree(self.root, ignore_errors=True)


# ---------------------------------------------------------------------- CLI
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m deploy.local_cluster", description=__doc__.split("\n\n")[0])
    p.add_argument("command", choices=["up", "run", "stop-marked"])
    p.add_argument(
        "--marker",
        help="stop-marked (give it before the command): end the processes whose command line holds this",
    )
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--worker-cpus", type=int, default=4)
    p.add_argument("cmd", nargs=argparse.REMAINDER, help="for `run`: the command after --")
    args = p.parse_args(argv)
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if args.command == "stop-marked":  # `ray stop` of one cluster: load_tests/chaos/ray_up_local.py's shim
        if not args.marker or len(args.marker) < 12 or not args.marker.startswith("/tmp/"):
            p.error("stop-marked: --marker must be a cluster's own temp dir under /tmp")
        pids = pids_with_marker(args.marker)
        end_pids(pids)
        print(f"stopped {len(pids)} processes of the cluster at {args.marker}")
        return 0
    if args.command == "run" and not cmd:
        p.error("run: give a command after --")
    cluster = LocalCluster(default_nodes(args.workers, args.worker_cpus))
    with cluster:
        for node in cluster.nodes.values():
            print(f"node {node.spec.name} {node.spec.ip} up in {node.started_s:.1f}s", file=sys.stderr)
        env = cluster.client_env()
        if args.command == "run":
            return subprocess.call(cmd, env={**os.environ, **env})
        for k, v in env.items():
            print(f"export {k}={v}")
        sys.stdout.flush()
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
        signal.sigwait({signal.SIGINT, signal.SIGTERM})
    return 0


if __name__ == "__main__":
    sys.exit(main())
