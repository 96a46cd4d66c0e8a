"""The Serve application: an OpenAI-compatible ingress in front of N LLMKernel replicas.

serve run app.main:app_builder model=/path/to/model replicas=2 redis_url=redis://127.0.0.1:6379
serve deploy serve_config.yaml        # import_path: app.main:app_builder, args: {...}
loraland serve --model MODEL ...      # app/cli/serve.py: local Ray + embedded Redis
"""

from __future__ import annotations

from typing import Any

from app.config.app_config import AppConfig, coerce_args


def build_app(cfg: AppConfig):
    """Bind the two deployments: Ingress(handle to LoraReplica, config)."""
    from app.replica.deployment import make_replica_deployment
    from app.router.http.ingress import make_ingress_deployment

    args = cfg.to_dict()
    replicas = make_replica_deployment(cfg).bind(args)
    return make_ingress_deployment(cfg).bind(replicas, args)


def app_builder(args: dict[str, Any]):
    """Serve's application-builder entry point (`import_path: app.main:app_builder`)."""
    return build_app(AppConfig.from_dict(coerce_args(dict(args))))
