"""The scale-out pieces that need no cluster: deploy/cluster-local.yaml and the Serve config `ray_up_local`
deploys validate with Ray's own schemas; the autoscaling option reaches the replica deployment; a replica warms
the catalog's hottest adapters and unloads one whose removal event it never heard (real Redis, tiny model)."""

from __future__ import annotations

import asyncio
import copy
from pathlib import Path

import pytest
import yaml

from app.catalog.redis_server import start_redis
from app.config.app_config import AppConfig, coerce_args
from app.protocol import ReplicaStats
from tests.fixtures.cluster import cli
from tests.fixtures.tiny_adapter import write_tiny_adapter

ROOT = Path(__file__).resolve().parents[1]


def test_cluster_local_yaml_validates_with_ray_autoscaler_schema():
    from ray.autoscaler._private.util import prepare_config, validate_config

    raw = yaml.safe_load((ROOT / "deploy" / "cluster-local.yaml").read_text())
    prepared = prepare_config(copy.deepcopy(raw))
    validate_config(prepared)
    assert prepared["provider"]["type"] == "local"
    node = prepared["available_node_types"]["local.cluster.node"]
    assert node["min_workers"] == node["max_workers"] == len(raw["provider"]["worker_ips"]) == 2
    # Never the stock `ray stop`: on one machine it would end every Ray cluster, not just this one.
    for cmd in raw["head_start_ray_commands"] + raw["worker_start_ray_commands"]:
        assert "ray stop" not in cmd and "--node-ip-address=" in cmd and "RAY_AUTH" not in cmd
        assert ". /tmp/loraland-ray-up/cluster.env" in cmd  # the token reaches every node from there
    assert "loraland_ingress" in raw["head_start_ray_commands"][0]
    assert "loraland_replica" in raw["worker_start_ray_commands"][0]


def test_ray_up_serve_config_validates_and_builds(tmp_path, monkeypatch):
    from ray.serve.schema import ServeDeploySchema

    from load_tests.chaos import ray_up_local

    monkeypatch.setattr(ray_up_local, "RUN", tmp_path)
    config = yaml.safe_load(ray_up_local.serve_config(Path("/models/tiny")).read_text())
    (app,) = ServeDeploySchema.model_validate(config).applications
    cfg = AppConfig.from_dict(coerce_args(dict(app.args)))
    assert cfg.replica_num_gpus == 0 and cfg.model == "/models/tiny"
    deployments = {d.name: d for d in app.deployments}
    assert deployments["LoraReplica"].ray_actor_options.resources == {"loraland_replica": 1}
    assert deployments["Ingress"].ray_actor_options.resources == {"loraland_ingress": 0.25}


def test_autoscaling_config_reaches_the_replica_deployment():
    from app.replica.deployment import make_replica_deployment

    fixed = make_replica_deployment(AppConfig(model="m", replicas=3))
    assert fixed.num_replicas == 3 and fixed._deployment_config.autoscaling_config is None
    scaling = {"min_replicas": 1, "max_replicas": 4, "target_ongoing_requests": 8, "upscale_delay_s": 2}
    auto = make_replica_deployment(AppConfig(model="m", autoscaling=scaling))
    got = auto._deployment_config.autoscaling_config
    assert (got.min_replicas, got.max_replicas, got.target_ongoing_requests, got.upscale_delay_s) == (
        1,
        4,
        8,
        2,
    )
    assert coerce_args({"autoscaling": '{"max_replicas": 2}'}) == {"autoscaling": {"max_replicas": 2}}


@pytest.mark.parametrize(
    "bad, words",
    [
        ({"max_replicas": 0}, "max_replicas"),
        ({"min_replicas": 3, "max_replicas": 2}, "max_replicas"),
        ({"target_replicas": 2}, "unknown keys ['target_replicas']"),
        ({"target_ongoing_requests": 0}, "target_ongoing_requests"),
        ([1, 2], "a mapping"),
    ],
)
def test_bad_autoscaling_names_the_key(bad, words):
    with pytest.raises(ValueError, match="autoscaling") as e:
        AppConfig(model="m", autoscaling=bad)
    assert words in str(e.value)


@pytest.fixture()
def catalog_env(monkeypatch):
    from app.catalog.store import Catalog

    url, stop = start_redis()
    monkeypatch.setenv("LORALAND_REDIS_URL", url)
    catalog = Catalog(url)
    try:
        yield url, catalog
    finally:
        catalog.close()
        stop()


def test_a_new_replica_warms_hot_adapters_and_reconciles_lost_removals(catalog_env, llama_dir, tmp_path):
    from app.catalog.store import Catalog
    from app.replica.core import ReplicaCore
    from app.replica.warmup import hot_records

    url, catalog = catalog_env
    for i, name in enumerate(["hot", "warm", "cold", "gone"]):
        folder = write_tiny_adapter(tmp_path / name, seed=10 + i)
        cli("adapters", "register", name, str(folder), "--public", "--model", str(llama_dir), "--json")
    cli(
        "adapters", "register", "hot", str(tmp_path / "warm"), "--public", "--model", str(llama_dir), "--json"
    )
    # What live replicas hold: hot on three (an old version on one), warm on two, gone on two, cold nowhere.
    beats = {"r1": ["hot@1", "warm@1", "gone@1"], "r2": ["hot@2", "warm@1", "gone@1"], "r3": ["hot@2", "a|b"]}
    for rid, resident in beats.items():
        catalog.heartbeat(ReplicaStats(rid, resident=tuple(resident), free_slots=1), load=0, ttl_s=30)
    catalog.remove("gone")
    assert [r.ref for r in hot_records(catalog, 5)] == ["hot@2", "warm@1"]  # newest version; no removed
    assert [r.ref for r in hot_records(catalog, 1)] == ["hot@2"]

    cfg = AppConfig(
        model=str(llama_dir), redis_url=url, warm_adapters=2, kernel={"max_adapters": 4, "dtype": "float32"}
    )
    core = ReplicaCore(cfg, "new", catalog=Catalog(url))
    try:
        assert sorted(asyncio.run(core.warm_up())) == ["hot@2", "warm@1"]
        assert sorted(core.stats().resident) == sorted(core.warmed) == ["hot@2", "warm@1"]
        # A removal whose event is lost (published where nobody listens): reconcile() unloads it anyway.
        with Catalog(url) as silent:
            silent._channel = "loraland:nobody-listens"
            silent.remove("warm")
        assert "warm@1" in core.stats().resident
        core.sync.reconcile()
        assert core.stats().resident == ("hot@2",)
    finally:
        core.close()


def test_loraland_serve_autoscaling_and_warm_flags():
    from app.cli import build_parser
    from app.cli.serve import config_from_args

    args = build_parser().parse_args(
        ["serve", "--model", "/m", "--replicas", "2", "--max-replicas", "6", "--target-ongoing", "8",
         "--warm-adapters", "3", "--replica-gpus", "0", "--ray-address", "127.0.0.1:6379"]
    )  # fmt: skip
    cfg = config_from_args(args, "redis://127.0.0.1:1/0")
    assert cfg.autoscaling == {"min_replicas": 2, "max_replicas": 6, "target_ongoing_requests": 8.0}
    assert cfg.warm_adapters == 3 and args.ray_address == "127.0.0.1:6379"
    plain = config_from_args(
        build_parser().parse_args(["serve", "--model", "/m", "--replica-gpus", "0"]), None
    )
    assert plain.autoscaling is None and plain.warm_adapters == 8
