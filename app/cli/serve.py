"""`loraland serve`: start a local Ray (and a private Redis unless one is given), deploy the app, serve until
Ctrl-C, then stop them all; or, with --ray-address, deploy onto a running cluster (`ray up`, or
deploy/local_cluster.py) and remove only the app on exit. --max-replicas autoscales the replicas. `deploy` and
`env_for_workers` also start `loraland demo` (demo.py)."""

from __future__ import annotations

import argparse
import logging
import math
import os
import signal
import threading
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from app.config.app_config import AppConfig
from app.config.settings import Settings
from app.router.http.middleware import PROXY_CALLBACK, PROXY_CALLBACK_ENV

log = logging.getLogger("loraland.serve")

APP_NAME = "loraland"


def register(subparsers: Any) -> argparse.ArgumentParser:
    """Add the `serve` subcommand to an argparse subparsers object; it sets `func` to `run_serve`."""
    p = subparsers.add_parser("serve", help="serve the OpenAI-compatible API on a local Ray cluster")
    p.add_argument(
        "--model",
        required=True,
        help="Hugging Face model folder, Hub id, .gguf file, or a packaged model: smollm2-135m, gemma3-270m",
    )
    p.add_argument("--served-model-name", default=None, help="the id clients use for the base model")
    p.add_argument("--replicas", type=int, default=1, help="model replicas (each one LLMKernel)")
    p.add_argument(
        "--max-replicas",
        type=int,
        default=None,
        help="autoscale between --replicas and this many replicas on queue length (Serve autoscaling)",
    )
    p.add_argument(
        "--target-ongoing",
        type=float,
        default=16.0,
        help="with --max-replicas: requests running + queued per replica that Serve scales toward",
    )
    p.add_argument(
        "--warm-adapters",
        type=int,
        default=None,
        help="hot adapters a new replica loads before taking traffic (default 8; 0: none)",
    )
    p.add_argument(
        "--ray-address",
        default=None,
        metavar="HOST:PORT",
        help="deploy onto this running Ray cluster (its token in RAY_AUTH_TOKEN) instead of starting one; "
        "on exit only the app is removed",
    )
    p.add_argument("--host", default="127.0.0.1", help="HTTP bind address (default: loopback only)")
    p.add_argument("--port", type=int, default=8000)
    # dest differs from the top-level `loraland --redis` so neither parser's default overwrites the other.
    p.add_argument(
        "--redis",
        dest="serve_redis",
        default=None,
        metavar="URL",
        help="catalog Redis (default: $LORALAND_REDIS_URL, else a private local Redis)",
    )
    p.add_argument(
        "--adapter-store",
        default=None,
        metavar="DIR|s3://bucket/prefix",
        help="where POST /v1/adapters {name} finds adapters (a folder is also allowed as a local root)",
    )
    p.add_argument("--no-auth", action="store_true", help="no API keys, admin routes open: local demo ONLY")
    p.add_argument(
        "--replica-cpus",
        type=float,
        default=None,
        help="CPUs Ray reserves per replica (default: this machine's cores / --replicas, at least 1)",
    )
    p.add_argument(
        "--replica-threads",
        type=int,
        default=None,
        help="torch threads per replica (default: --replica-cpus rounded down, at least 1)",
    )
    p.add_argument(
        "--replica-gpus", type=float, default=None, help="default: 1 when CUDA is available, else 0"
    )
    p.add_argument("--max-adapters", type=int, default=None, help="adapter slots per replica")
    p.add_argument("--max-batch-size", type=int, default=None)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        help="token budget of one engine step (default 4096)",
    )
    p.add_argument("--dtype", default=None)
    p.add_argument(
        "--chat-template",
        default=None,
        help="replaces the model's chat template: a Jinja file, or the template itself",
    )
    p.set_defaults(func=run_serve)
    return p


def _chat_template(value: str | None) -> str | None:
    """A --chat-template file is read here, so replicas on any node get its text."""
    if value is None or "{{" in value or "{%" in value:
        return value
    try:
        return Path(value).expanduser().read_text()
    except OSError as e:
        raise SystemExit(
            f"--chat-template {value!r}: neither a readable file ({e.strerror}) nor a Jinja template"
        ) from e


def config_from_args(args: argparse.Namespace, redis_url: str) -> AppConfig:
    kernel = {
        k: v
        for k, v in {
            "max_adapters": args.max_adapters,
            "max_batch_size": args.max_batch_size,
            "max_model_len": args.max_model_len,
            "max_num_batched_tokens": args.max_num_batched_tokens,
            "dtype": args.dtype,
            "chat_template": _chat_template(getattr(args, "chat_template", None)),
        }.items()
        if v is not None
    }
    gpus = args.replica_gpus
    if gpus is None:
        import torch

        gpus = 1.0 if torch.cuda.is_available() else 0.0
    store = args.adapter_store
    if store and not store.startswith(("s3://", "hf://")):
        store = str(Path(store).expanduser().resolve())
    scaling = getattr(args, "max_replicas", None)
    extra: dict[str, Any] = {}
    if scaling is not None:
        extra["autoscaling"] = {
            "min_replicas": args.replicas,
            "max_replicas": scaling,
            "target_ongoing_requests": args.target_ongoing,
        }
    if getattr(args, "warm_adapters", None) is not None:
        extra["warm_adapters"] = args.warm_adapters
    return AppConfig(
        model=args.model,
        served_model_name=args.served_model_name,
        replicas=args.replicas,
        **extra,
        replica_num_cpus=args.replica_cpus
        if args.replica_cpus is not None
        else max(1.0, float((os.cpu_count() or 1) // args.replicas)),
        replica_threads=args.replica_threads,
        replica_num_gpus=gpus,
        redis_url=redis_url,
        adapter_store=store,
        no_auth=args.no_auth,
        kernel=kernel,
    )


def env_for_workers(cfg: AppConfig) -> dict[str, str]:
    """Replica and ingress processes read LORALAND_* (and boto3/HF their own variables) through Settings; hand
    them this process's values. Copying the environment on is the one read of it outside Settings."""
    env = {k: v for k, v in os.environ.items() if k.startswith(("LORALAND_", "AWS_", "HF_"))}
    env["LORALAND_REDIS_URL"] = cfg.redis_url or ""
    if cfg.adapter_store and not cfg.adapter_store.startswith(("s3://", "hf://")):
        roots = [r for r in env.get("LORALAND_LOCAL_ROOTS", "").split(":") if r]
        env["LORALAND_LOCAL_ROOTS"] = ":".join([*roots, cfg.adapter_store])
    # Serve's proxy answers for an ingress replica that died (IngressLossMiddleware; the proxy reads this when it
    # starts). A value set here wins; an empty one turns the middleware off.
    env[PROXY_CALLBACK_ENV] = os.environ.get(PROXY_CALLBACK_ENV, PROXY_CALLBACK)
    return env


def init_ray(attempts: int = 3, **options: Any) -> None:
    """ray.init(**options), tried `attempts` times. On a loaded machine a local Ray's raylet may not register with
    its GCS within Ray's fixed 30 s ("The current node timed out during startup"); a second start then succeeds."""
    import ray

    for attempt in range(1, attempts + 1):
        try:
            ray.init(**options)
            return
        except Exception as e:
            if attempt == attempts or "timed out during startup" not in str(e):
                raise
            log.warning("Ray did not start (%s); shutting it down and trying again", str(e)[:200])
            ray.shutdown()


def start_serve(attempts: int = 3, **options: Any) -> None:
    """serve.start(**options), tried `attempts` times. On a busy machine Serve's controller can give up on its
    HTTP proxy before the proxy's worker has even started ("HTTP proxies not available after 60s", the proxy
    killed before it ran); a second start, from a clean shutdown, then succeeds."""
    from ray import serve

    for attempt in range(1, attempts + 1):
        try:
            serve.start(**options)
            return
        except Exception as e:
            if attempt == attempts:
                raise
            log.warning("serve.start failed (%s); shutting Serve down and trying again", str(e)[:200])
            try:
                serve.shutdown()
            except Exception as shut:  # the controller may be half up; the next start replaces it
                log.warning("serve.shutdown after a failed start: %s", str(shut)[:200])


def deploy(cfg: AppConfig, *, host: str, port: int, blocking: bool = False):
    """Start Serve's HTTP proxy on host:port and deploy the application (Ray must be initialised)."""
    from ray import serve

    from app.main import build_app

    start_serve(http_options={"host": host, "port": port})
    return serve.run(build_app(cfg), name=APP_NAME, route_prefix="/", blocking=blocking)


def _serve(args: argparse.Namespace) -> int:
    import ray
    from ray import serve

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    with ExitStack() as stack:
        redis_url = args.serve_redis or args.redis
        if redis_url is None:
            from app.catalog.redis_server import start_redis

            redis_url, stop_redis = start_redis()
            stack.callback(stop_redis)
            log.info(
                "started a private Redis for the catalog at %s (stopped on exit; pass --redis for a real one)",
                redis_url,
            )
        cfg = config_from_args(args, redis_url)
        if cfg.no_auth:
            log.warning(
                "--no-auth: AUTHENTICATION IS OFF. Every caller can use every adapter and the admin "
                "routes. Use this only for a local demo on a loopback address."
            )
        elif not (cfg.admin_token or Settings.from_env().admin_token):
            log.warning(
                "LORALAND_ADMIN_TOKEN is not set: the admin routes (/v1/adapters, /v1/placement) are off"
            )
        if args.ray_address:  # someone else's cluster: join it, and on exit take away only this app
            ray.init(address=args.ray_address, runtime_env={"env_vars": env_for_workers(cfg)})
            stack.callback(ray.shutdown)
            stack.callback(serve.delete, APP_NAME)
        else:
            # Logical CPUs are scheduling tokens: make sure the requested replicas fit on a small machine.
            most = (cfg.autoscaling or {}).get("max_replicas", cfg.replicas)
            needed = math.ceil(most * cfg.replica_num_cpus + cfg.ingress_replicas * cfg.ingress_num_cpus)
            init_ray(
                num_cpus=max(os.cpu_count() or 1, needed),
                runtime_env={"env_vars": env_for_workers(cfg)},
                include_dashboard=False,
            )
            stack.callback(ray.shutdown)
            stack.callback(serve.shutdown)
        deploy(cfg, host=args.host, port=args.port)
        log.info(
            "LoRA-Land is serving %s at http://%s:%d/v1 (Ctrl-C to stop)",
            cfg.model_name,
            args.host,
            args.port,
        )
        # One scrape target for the whole cluster (every process's metrics, merged: app/router/http/metrics.py).
        where = "127.0.0.1" if args.host in ("0.0.0.0", "::", "") else args.host
        where = f"[{where}]" if ":" in where else where
        auth = "" if cfg.no_auth else " (Authorization: Bearer $LORALAND_ADMIN_TOKEN)"
        print(f"metrics: http://{where}:{args.port}/metrics{auth}", flush=True)
        print(f"status: http://{where}:{args.port}/status", flush=True)
        stop = threading.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
        stop.wait()
        log.info("shutting down")
    return 0


def run_serve(args: argparse.Namespace) -> int:
    """`loraland serve`: deploy, serve until Ctrl-C/SIGTERM, then stop Serve, Ray and the private Redis."""
    try:
        return _serve(args)
    except KeyboardInterrupt:  # Ctrl-C while still deploying: everything started is already stopped
        log.info("interrupted before the application was ready; stopped")
        return 130
