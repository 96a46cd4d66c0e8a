"""serve_config.yaml and cluster.yaml validate with Ray's own schemas and agree with the application builder."""

from __future__ import annotations

import argparse
import copy
import inspect
import os
from pathlib import Path

import pytest
import yaml

from app.config.app_config import AppConfig, coerce_args
from app.config.kernel_config import KernelConfig

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def serve_yaml() -> dict:
    return yaml.safe_load((ROOT / "serve_config.yaml").read_text())


@pytest.fixture(scope="module")
def cluster_yaml() -> dict:
    return yaml.safe_load((ROOT / "cluster.yaml").read_text())


def test_serve_config_validates_with_ray_schema(serve_yaml):
    from ray.serve.schema import ServeDeploySchema

    schema = ServeDeploySchema.model_validate(serve_yaml)
    (app,) = schema.applications
    assert app.import_path == "app.main:app_builder" and app.route_prefix == "/"
    assert {d.name for d in app.deployments} == {"LoraReplica", "Ingress"}


def test_ray_schema_rejects_a_broken_serve_config(serve_yaml):
    from pydantic import ValidationError
    from ray.serve.schema import ServeDeploySchema

    broken = copy.deepcopy(serve_yaml)
    broken["applications"][0]["deployments"][0]["num_replicas"] = -1
    with pytest.raises(ValidationError):
        ServeDeploySchema.model_validate(broken)


def test_builder_matches_the_yaml(serve_yaml):
    from ray.serve._private.build_app import build_app
    from ray.serve._private.utils import import_attr
    from ray.serve.request_router import RequestRouter

    from app.main import app_builder

    app_cfg = serve_yaml["applications"][0]
    args = app_cfg["args"]
    built = build_app(app_builder(args), name=app_cfg["name"])
    deployments = {d.name: d for d in built.deployments}
    assert set(deployments) == {d["name"] for d in app_cfg["deployments"]}
    replica = deployments["LoraReplica"]
    router = replica._deployment_config.request_router_config
    cls = import_attr(router.request_router_class)
    assert inspect.isclass(cls) and issubclass(cls, RequestRouter)
    assert router.request_routing_stats_period_s == AppConfig.from_dict(args).routing_stats_period_s
    yaml_replica = next(d for d in app_cfg["deployments"] if d["name"] == "LoraReplica")
    assert yaml_replica["num_replicas"] == args["replicas"]
    assert yaml_replica["ray_actor_options"]["num_gpus"] == args["replica_num_gpus"] == 1
    assert replica.ray_actor_options["num_gpus"] == 1
    assert replica._deployment_config.max_ongoing_requests == args["max_ongoing_requests"]
    # the handle-side queue bound (429 beyond it)
    assert replica._deployment_config.max_queued_requests == args["max_queued_requests"]


def test_cluster_yaml_validates_with_ray_autoscaler_schema(cluster_yaml):
    from ray.autoscaler._private.util import prepare_config, validate_config

    prepared = prepare_config(copy.deepcopy(cluster_yaml))
    validate_config(prepared)
    nodes = prepared["available_node_types"]
    head = nodes[prepared["head_node_type"]]
    workers = [n for name, n in nodes.items() if name != prepared["head_node_type"]]
    assert head["resources"].get("GPU", 0) == 0  # the head only routes
    assert workers and all(w["resources"].get("GPU", 0) >= 1 for w in workers)
    setup = " ".join(prepared["setup_commands"])
    assert "pip install" in setup and "loraland" in setup  # the project is installed on every node
    assert "redis-server" not in setup  # Redis comes by URL, not from the cluster


def test_ray_autoscaler_rejects_a_broken_cluster_yaml(cluster_yaml):
    import jsonschema
    from ray.autoscaler._private.util import prepare_config, validate_config

    broken = copy.deepcopy(cluster_yaml)
    broken["available_node_types"]["head"]["not_a_field"] = 1
    with pytest.raises(jsonschema.ValidationError):
        validate_config(prepare_config(broken))


def test_ingress_runs_on_the_head(serve_yaml, cluster_yaml):
    ingress = next(d for d in serve_yaml["applications"][0]["deployments"] if d["name"] == "Ingress")
    wanted = ingress["ray_actor_options"]["resources"]
    head = cluster_yaml["available_node_types"][cluster_yaml["head_node_type"]]
    for resource, amount in wanted.items():
        assert head["resources"][resource] >= amount * ingress["num_replicas"]
        assert resource in " ".join(cluster_yaml["head_start_ray_commands"])
    assert serve_yaml["proxy_location"] == "HeadOnly"


@pytest.mark.parametrize(
    "change, field",
    [
        ({"kernel": {"max_adaptors": 3}}, "kernel"),
        ({"router": {"speed": 1}}, "router"),
        ({"redis_url": "http://x"}, "redis_url"),
        ({"replicas": 0}, "replicas"),
        ({"replica_threads": 0}, "replica_threads"),
        ({"heartbeat_ttl_s": 1.0, "heartbeat_s": 2.0}, "heartbeat_ttl_s"),
        ({"model": ""}, "model"),
    ],
)
def test_app_config_errors_name_the_field(change, field):
    with pytest.raises(ValueError, match=field):
        AppConfig(**{"model": "m", **change})


@pytest.mark.parametrize(
    "options, field",
    [
        ({"max_adapters": 0}, "max_adapters"),
        ({"max_batch_size": True}, "max_batch_size"),
        ({"max_lora_rank": 2.5}, "max_lora_rank"),
        ({"num_kv_blocks": 0}, "num_kv_blocks"),
        ({"max_num_batched_tokens": -1}, "max_num_batched_tokens"),
        ({"gpu_memory_utilization": 1.5}, r"gpu_memory_utilization must be in \(0, 1\]"),
        ({"gpu_memory_utilization": 0}, "gpu_memory_utilization"),
        ({"dtype": "float64"}, "dtype 'float64' is not supported"),
        ({"device": ""}, "device"),
        ({"enable_prefix_caching": "yes"}, "enable_prefix_caching"),
    ],
)
def test_kernel_config_errors_name_the_field_and_range(options, field):
    with pytest.raises(ValueError, match=field):
        KernelConfig(**options)
    with pytest.raises(ValueError, match=f"kernel: {field}"):  # the same rule, said at the app's level
        AppConfig(model="m", kernel=options)


def test_kernel_config_is_the_one_home_of_the_kernel_options():
    import dataclasses

    from app.replica.engine_config import EngineConfig

    # AppConfig's `kernel:` takes exactly the kernel's options; the engine's step budget default agrees
    assert KernelConfig.option_names() == {f.name for f in dataclasses.fields(KernelConfig)}
    assert KernelConfig().max_num_batched_tokens == EngineConfig.max_num_batched_tokens == 4096
    assert KernelConfig().max_lora_rank == 64
    with pytest.raises(TypeError, match="max_adaptors"):
        KernelConfig.from_options({"max_adaptors": 3})
    # a torch dtype is kept by name, so the config stays plain data (YAML, JSON, Ray)
    import torch

    assert KernelConfig(dtype=torch.bfloat16).dtype == "bfloat16"
    # YAML and `serve run` give a dict of the keys they set; the rest are KernelConfig's defaults
    cfg = AppConfig.from_dict(
        coerce_args({"model": "m", "kernel": '{"max_adapters": 8, "dtype": "float32"}'})
    )
    assert cfg.kernel == KernelConfig(max_adapters=8, dtype="float32")
    assert AppConfig.from_dict(cfg.to_dict()) == cfg  # what build_app hands the deployments round-trips
    assert AppConfig(model="m").kernel == KernelConfig()


def test_app_config_from_serve_run_strings():
    args = coerce_args(
        {
            "model": "/models/tiny",
            "replicas": "2",
            "no_auth": "true",
            "replica_num_cpus": "0.5",
            "redis_url": "none",
        }
    )
    cfg = AppConfig.from_dict(args)
    assert (cfg.replicas, cfg.no_auth, cfg.replica_num_cpus, cfg.redis_url) == (2, True, 0.5, None)
    assert cfg.model_name == "tiny" and cfg.base_ids == {"tiny", "/models/tiny"}
    assert AppConfig(model="org/model").model_name == "org/model"
    # torch threads per replica: explicit, else the reserved CPUs rounded down (at least one)
    assert AppConfig.from_dict(coerce_args({"model": "m", "replica_threads": "3"})).threads == 3
    assert AppConfig.from_dict(coerce_args({"model": "m", "replica_threads": "none"})).threads == 1
    assert AppConfig(model="m", replica_num_cpus=2.5).threads == 2
    with pytest.raises(ValueError, match="unknown application args"):
        AppConfig.from_dict({"model": "m", "replica": 2})
    with pytest.raises(ValueError, match="no_auth"):
        coerce_args({"no_auth": "maybe"})


def test_loraland_serve_arguments():
    from app.cli.serve import config_from_args, register

    parser = argparse.ArgumentParser(prog="loraland")
    parser.add_argument("--redis", default=None)
    register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(
        [
            "serve",
            "--model",
            "/m/tiny",
            "--replicas",
            "2",
            "--port",
            "8123",
            "--redis",
            "redis://127.0.0.1:1/0",
        ]
        + ["--adapter-store", "s3://bucket/prefix", "--no-auth", "--replica-gpus", "0", "--max-adapters", "8"]
        + ["--max-num-batched-tokens", "4096"]
    )
    assert args.func.__name__ == "run_serve" and args.host == "127.0.0.1" and args.port == 8123
    cfg = config_from_args(args, args.serve_redis)
    assert (cfg.replicas, cfg.redis_url, cfg.adapter_store, cfg.no_auth) == (
        2,
        "redis://127.0.0.1:1/0",
        "s3://bucket/prefix",
        True,
    )
    assert (
        cfg.kernel == KernelConfig(max_adapters=8, max_num_batched_tokens=4096) and cfg.replica_num_gpus == 0
    )
    # one replica on this machine: it reserves every core, and torch uses as many threads
    assert cfg.replica_num_cpus == max(1.0, float((os.cpu_count() or 1) // 2)) and cfg.threads >= 1


def test_every_way_of_starting_ray_wraps_the_proxy(cluster_yaml, monkeypatch):
    """IngressLossMiddleware only runs where Serve's proxy finds RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH in its
    environment: `loraland serve`/`demo` (the job's env_vars), the AWS cluster and `ray up` on one machine."""
    import importlib

    from app.cli.serve import env_for_workers
    from app.router.http.middleware import PROXY_CALLBACK, PROXY_CALLBACK_ENV, IngressLossMiddleware

    monkeypatch.delenv(PROXY_CALLBACK_ENV, raising=False)
    cfg = AppConfig(model="m", redis_url="redis://127.0.0.1:1/0")
    assert env_for_workers(cfg)[PROXY_CALLBACK_ENV] == PROXY_CALLBACK
    monkeypatch.setenv(PROXY_CALLBACK_ENV, "")  # an operator's empty value turns it off
    assert env_for_workers(cfg)[PROXY_CALLBACK_ENV] == ""
    export = f"export {PROXY_CALLBACK_ENV}={PROXY_CALLBACK}"
    assert export in " ".join(cluster_yaml["setup_commands"])
    local = yaml.safe_load((ROOT / "deploy" / "cluster-local.yaml").read_text())
    for commands in (local["head_start_ray_commands"], local["worker_start_ray_commands"]):
        assert export in " ".join(commands)
    module, func = PROXY_CALLBACK.split(":")
    (middleware,) = getattr(importlib.import_module(module), func)()
    assert middleware.cls is IngressLossMiddleware
