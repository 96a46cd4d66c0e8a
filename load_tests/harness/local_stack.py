"""A whole LoRA-Land stack on this machine whose parts can be killed and brought back: a real Ray cluster
(Serve: the ingress and N LLMKernel replicas on the tiny test model), a redis-server with an append-only file
(so a restart keeps the catalog, as a real deployment's would), moto's S3 server (restarted on the same port in
this process, so its buckets survive), adapters pushed to S3 with the `loraland` CLI, and an in-process
LLMKernel that gives the single-request greedy reference for every (model, prompt).

Used by load_tests/chaos/chaos.py, load_tests/chaos/soak.py and tests/test_chaos_short.py. Everything binds 127.0.0.1; run
it inside a loopback-only network namespace (../shared/tools/offline, or unshare -n), as Ray probes the network.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from app.catalog.redis_server import _ping, find_redis_server, free_port
from app.config.env_patch import EnvPatch

TENANT = "alpha"
ADMIN = "chaos-admin-token"
BUCKET = "loraland-chaos"


@dataclass(frozen=True)
class StackConfig:
    replicas: int = 2
    adapters: int = 10  # warm adapters ad00.. (public), used by the load from the start
    cold: int = 4  # cold00..: registered, first used while S3 is down
    max_adapters: int = 4  # device slots per replica: fewer than the adapters, so they move
    max_cpu_adapters: int | None = None  # host cache per replica; None: the kernel's default (at least 64)
    max_batch_size: int = 16
    max_tokens: int = 8
    request_timeout_s: float = 60.0
    heartbeat_s: float = 0.5
    heartbeat_ttl_s: float = 3.0
    replica_num_cpus: float = 0.5
    num_cpus: int = 4
    ingress_replicas: int = 1  # the chaos run uses 2: killing one leaves the other serving
    proxy_middleware: bool = True  # Serve's proxy wrapped in IngressLossMiddleware (False: Serve's as it is)
    # The replicas' admission between tenants (KernelConfig.scheduling_policy, .vtc_preempt)
    scheduling_policy: str = "vtc"
    vtc_preempt: bool = True
    # A model folder to serve instead of the tiny test model (e.g. load_tests/harness/models.py's bench model); the tiny
    # adapters fit the tiny model only, so then adapters = cold = 0.
    model_dir: Path | None = None
    oracle: bool = True  # the in-process reference kernel (reference()); off: no second copy of the model

    def __post_init__(self) -> None:
        if self.model_dir is not None and (self.adapters or self.cold):
            raise ValueError("StackConfig: the tiny test adapters fit the tiny model only: with model_dir, "
                             "set adapters=0 and cold=0")  # fmt: skip


class RestartableRedis:
    """redis-server on a fixed loopback port with an append-only file fsynced at every write."""

    def __init__(self, folder: Path) -> None:
        self.folder, self.port, self.proc = Path(folder), free_port(), None
        self.folder.mkdir(parents=True, exist_ok=True)
        self.url = f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 20.0) -> None:
        cmd = [find_redis_server(), "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.folder),
               "--appendonly", "yes", "--appendfsync", "always", "--save", "", "--daemonize", "no",
               "--loglevel", "warning", "--logfile", str(self.folder / "redis.log")]  # fmt: skip
        self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if _ping(self.port):
                return
            if self.proc.poll() is not None:
                break
            time.sleep(0.05)
        raise RuntimeError(f"redis-server did not start on {self.port}; see {self.folder / 'redis.log'}")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()  # SIGKILL: a crash, not a clean shutdown
            self.proc.wait(timeout=10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.kill()

    def keys(self) -> int:
        import redis

        return int(redis.Redis.from_url(self.url).dbsize())


class RestartableS3:
    """moto's S3 server in this process: its state lives in moto's in-process backends, so stopping the HTTP
    server and starting another on the same port is an outage that loses nothing."""

    def __init__(self) -> None:
        self.port, self.server = free_port(), None
        self.url = f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        from moto.server import ThreadedMotoServer

        logging.getLogger("werkzeug").setLevel(logging.ERROR)
        for _ in range(50):  # the port may linger for a moment after a stop
            try:
                self.server = ThreadedMotoServer(ip_address="127.0.0.1", port=self.port, verbose=False)
                self.server.start()
                return
            except OSError:
                time.sleep(0.2)
        raise RuntimeError(f"moto could not bind 127.0.0.1:{self.port}")

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()
            self.server = None


def _cli(*argv: str) -> Any:
    from app.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = main(list(argv))
    if rc != 0:
        raise RuntimeError(f"loraland {' '.join(argv)} -> {rc}: {out.getvalue()}")
    return json.loads(out.getvalue())


class LocalStack:
    def __init__(self, cfg: StackConfig = StackConfig(), workdir: Path | None = None) -> None:
        self.cfg = cfg
        self.workdir = Path(workdir or tempfile.mkdtemp(prefix="loraland-stack-"))
        self.redis = RestartableRedis(self.workdir / "redis")
        self.s3 = RestartableS3()
        self.warm = [f"ad{i:02d}" for i in range(cfg.adapters)]
        self.cold = [f"cold{i:02d}" for i in range(cfg.cold)]
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self._refs: dict[tuple, str] = {}
        self._started = False
        self._saved_env: EnvPatch | None = None  # what start() set in os.environ, for close() to put back

    # ------------------------------------------------------------------ bring-up
    def start(self) -> LocalStack:
        import ray
        from ray import serve

        from app.catalog.store import Catalog
        from app.cli.serve import start_serve
        from app.config.app_config import AppConfig
        from app.main import build_app
        from app.router.http.middleware import PROXY_CALLBACK, PROXY_CALLBACK_ENV
        from loraland import LLMKernel
        from tests.fixtures.models import build_tiny_model
        from tests.fixtures.services import aws_env, make_bucket
        from tests.fixtures.tiny_adapter import write_tiny_adapter

        t0 = time.monotonic()
        self.model_dir = self.cfg.model_dir or build_tiny_model(self.workdir / "model", "llama-gqa")
        self.redis.start()
        self.s3.start()
        make_bucket(self.s3.url, BUCKET)
        env = {**aws_env(self.s3.url), "LORALAND_REDIS_URL": self.redis.url}
        # This process is the CLI that pushes, and hands the env to Ray's workers; close() puts it back.
        env_here = {**env, "LORALAND_CACHE_DIR": str(self.workdir / "cli-cache")}
        self._saved_env = EnvPatch(env_here)
        self.api_key = _cli("tenants", "create", TENANT, "--json")["api_key"]
        self.folders = {}
        for i, name in enumerate(self.warm + self.cold):
            self.folders[name] = write_tiny_adapter(self.workdir / "adapters" / name, seed=2000 + i)
            _cli("adapters", "push", name, str(self.folders[name]), "--to", f"s3://{BUCKET}/{name}", "--public",
                 "--model", str(self.model_dir), "--json", "--no-progress")  # fmt: skip
        self.oracle = None
        if self.cfg.oracle:
            self.oracle = LLMKernel(self.model_dir, max_adapters=64, max_batch_size=4, dtype="float32")
            for name, folder in self.folders.items():
                self.oracle.load_adapter(name, folder, version=1)
        worker_env = {**env, "LORALAND_CACHE_DIR": str(self.workdir / "replica-cache"), "OMP_NUM_THREADS": "1",
                      "TOKENIZERS_PARALLELISM": "false",
                      PROXY_CALLBACK_ENV: PROXY_CALLBACK if self.cfg.proxy_middleware else ""}  # fmt: skip
        self._started = True
        for attempt in range(3):  # on a busy machine the raylet can miss Ray's fixed 30 s start window
            try:
                ray.init(num_cpus=self.cfg.num_cpus, include_dashboard=False,
                         runtime_env={"env_vars": worker_env}, log_to_driver=False)  # fmt: skip
                break
            except Exception as e:
                ray.shutdown()
                if attempt == 2:
                    raise
                print(f"ray.init failed ({str(e)[:120]}); retrying", flush=True)
        app_cfg = AppConfig(
            model=str(self.model_dir),
            served_model_name="tiny-llama",
            replicas=self.cfg.replicas,
            ingress_replicas=self.cfg.ingress_replicas,
            replica_num_cpus=self.cfg.replica_num_cpus,
            ingress_num_cpus=0.25,
            max_ongoing_requests=48,
            redis_url=self.redis.url,
            admin_token=ADMIN,
            kernel={
                "max_adapters": self.cfg.max_adapters,
                "max_cpu_adapters": self.cfg.max_cpu_adapters,
                "max_batch_size": self.cfg.max_batch_size,
                "dtype": "float32",
                "scheduling_policy": self.cfg.scheduling_policy,
                "vtc_preempt": self.cfg.vtc_preempt,
            },  # fmt: skip
            heartbeat_s=self.cfg.heartbeat_s,
            heartbeat_ttl_s=self.cfg.heartbeat_ttl_s,
            routing_stats_period_s=0.5,
            request_timeout_s=self.cfg.request_timeout_s,
        )
        start_serve(http_options={"host": "127.0.0.1", "port": self.port})
        serve.run(build_app(app_cfg), name="loraland", route_prefix="/")
        self.catalog = Catalog(self.redis.url)
        self.wait_healthy(300)
        print(
            f"stack up in {time.monotonic() - t0:.0f} s: {self.base}, {len(self.folders)} adapters",
            flush=True,
        )
        return self

    def close(self) -> None:
        if self._started:
            import ray
            from ray import serve

            if ray.is_initialized():  # else serve.shutdown() would start connecting to a cluster that is not
                with contextlib.suppress(Exception):  # there, and wait for its GCS without end
                    serve.shutdown()
            ray.shutdown()
        with contextlib.suppress(Exception):
            self.catalog.close()
        self.s3.stop()
        self.redis.stop()
        shutil.rmtree(self.workdir, ignore_errors=True)
        if self._saved_env is not None:
            self._saved_env.restore()

    def __enter__(self) -> LocalStack:
        try:
            return self.start()
        except BaseException:
            self.close()  # __exit__ does not run when __enter__ raises: stop what did start
            raise

    def __exit__(self, *exc) -> None:
        self.close()

    def add_tenant(self, name: str) -> str:
        """A new tenant; returns its API key (the ingress maps the key to the tenant, the replica's scheduler
        shares between tenants)."""
        return _cli("tenants", "create", name, "--json")["api_key"]

    # ------------------------------------------------------------------ state
    def replica_states(self) -> dict[str, int]:
        from ray import serve

        try:
            status = serve.status().applications["loraland"].deployments
            return {name: d.replica_states.get("RUNNING", 0) for name, d in status.items()}
        except Exception:
            return {}

    def healthy(self) -> bool:
        states = self.replica_states()
        if states.get("LoraReplica") != self.cfg.replicas or states.get("Ingress", 0) < 1:
            return False
        try:
            return len(self.catalog.replicas()) == self.cfg.replicas
        except Exception:
            return False

    def wait_healthy(self, timeout_s: float) -> float:
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout_s:
            if self.healthy():
                return time.monotonic() - t0
            time.sleep(0.5)
        raise RuntimeError(f"the stack is not healthy after {timeout_s:.0f} s: {self.replica_states()}")

    def pids(self, role: str) -> list[int]:
        """Worker processes of this cluster (descendants of this process) running `role`: 'LoraReplica' or
        'Ingress' (Ray titles an actor's process ray::ServeReplica:<app>:<deployment>)."""
        out = []
        for p in psutil.Process().children(recursive=True):
            with contextlib.suppress(psutil.Error):
                title = " ".join(p.cmdline())
                if title.startswith("ray::ServeReplica:loraland:" + role):
                    out.append(p.pid)
        return sorted(out)

    def kill(self, role: str, which: int = 0) -> int:
        pid = self.pids(role)[which]
        os.kill(pid, signal.SIGKILL)
        return pid

    def replica_resources(self) -> dict[int, dict[str, float]]:
        """RSS (MiB) and open file descriptors of every replica process."""
        out = {}
        for pid in self.pids("LoraReplica"):
            with contextlib.suppress(psutil.Error):
                p = psutil.Process(pid)
                out[pid] = {"rss_mib": p.memory_info().rss / 2**20, "fds": p.num_fds()}
        return out

    # ------------------------------------------------------------------ the reference
    def reference(self, model: str, prompt: str | None, messages: list | None, max_tokens: int) -> str:
        """The single-request greedy output of the in-process kernel (cached)."""
        from app.replica.chat import render_chat

        if self.oracle is None:
            raise RuntimeError("this stack has no reference kernel: StackConfig(oracle=True)")

        key = (model, prompt, json.dumps(messages), max_tokens)
        if key not in self._refs:
            text = render_chat(messages, self.oracle.tokenizer) if messages is not None else prompt
            adapter = None if model == "tiny-llama" else model
            self._refs[key] = self.oracle.complete([text], [adapter], max_tokens=max_tokens)[0].text
        return self._refs[key]


def in_offline_namespace() -> bool:
    """True when only loopback exists here (what running Ray safely needs)."""
    names = [n for n in psutil.net_if_addrs() if n != "lo"]
    return not names


def require_offline() -> None:
    if not in_offline_namespace():
        sys.exit(
            "run inside a loopback-only network namespace: ../shared/tools/offline python -m load_tests..."
        )
