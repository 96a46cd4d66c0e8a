"""The LoRA-Land Serve application on a LocalCluster (deploy/local_cluster.py): the ingress and Serve's HTTP
proxy on the head (the ingress asks for the head-only custom resource), the replicas on the workers (they ask
for the workers-only one), deployed from a driver in this process. `serve deploy` of a YAML config does the
same with a `deployments:` section (load_tests/chaos/ray_up_local.py)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from app.cli.serve import start_serve
from app.config.app_config import AppConfig
from app.config.env_patch import EnvPatch
from deploy.local_cluster import LocalCluster
from deploy.nodes import INGRESS_RESOURCE, REPLICA_RESOURCE

APP_NAME = "loraland"


def build_cluster_app(cfg: AppConfig):
    """app.main.build_app with placement: replicas need REPLICA_RESOURCE, the ingress INGRESS_RESOURCE."""
    from app.replica.deployment import make_replica_deployment
    from app.router.http.ingress import make_ingress_deployment

    args = cfg.to_dict()
    replicas = make_replica_deployment(cfg).options(
        ray_actor_options={
            "num_cpus": cfg.replica_num_cpus,
            "num_gpus": cfg.replica_num_gpus,
            "resources": {REPLICA_RESOURCE: 1},
        }
    )
    ingress = make_ingress_deployment(cfg).options(
        ray_actor_options={"num_cpus": cfg.ingress_num_cpus, "resources": {INGRESS_RESOURCE: 1 / 4}}
    )
    return ingress.bind(replicas.bind(args), args)


_saved_env: list[EnvPatch] = []  # what serve_on set in os.environ, for shutdown to put back


def serve_on(cluster: LocalCluster, cfg: AppConfig, port: int) -> str:
    """Connect this process to the cluster as a driver, start Serve's proxy on the head at 127.0.0.1:port and
    deploy the app; returns the base URL. Undo with `shutdown()`."""
    import ray
    from ray import serve

    _saved_env.append(cluster.use_in_this_process())
    ray.init(address=cluster.address, log_to_driver=False, namespace="loraland-tests")
    start_serve(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": port})
    serve.run(build_cluster_app(cfg), name=APP_NAME, route_prefix="/")
    return f"http://127.0.0.1:{port}"


def shutdown() -> None:
    """Remove Serve, disconnect, and give this process back the environment serve_on found (else RAY_ADDRESS
    and the cluster's token stay in os.environ, and every later ray.init in the process, and every subprocess,
    tries to join a cluster that is gone)."""
    import ray
    from ray import serve

    try:
        if ray.is_initialized():  # else serve.shutdown() would wait for a cluster that is not there
            serve.shutdown()
    finally:
        ray.shutdown()
        while _saved_env:
            LocalCluster.restore_env(_saved_env.pop())


def _replica_states() -> dict[str, int]:
    from ray import serve

    app = serve.status().applications.get(APP_NAME)
    if app is None or "LoraReplica" not in app.deployments:
        return {}
    return dict(app.deployments["LoraReplica"].replica_states)


def running_replicas() -> int:
    """LoraReplica replicas serving now."""
    return _replica_states().get("RUNNING", 0)


def all_replicas() -> int:
    """LoraReplica replicas Serve wants now: running, and those it is scheduling or starting."""
    states = _replica_states()
    return sum(n for state, n in states.items() if state not in ("STOPPING",))


def wait_for(predicate: Callable[[], Any], timeout_s: float, what: str, every_s: float = 0.25) -> Any:
    """Poll until predicate() is truthy; returns its value, or raises naming `what` after timeout_s."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(every_s)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
