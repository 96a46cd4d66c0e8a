import os
from pathlib import Path

import pytest

from tests.fixtures.models import TINY_MODELS, build_tiny_model


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, Path]:
    """All tiny model folders, built once per session."""
    root = tmp_path_factory.mktemp("models")
    return {kind: build_tiny_model(root / kind, kind) for kind in TINY_MODELS}


@pytest.fixture(scope="session")
def llama_dir(tiny_models) -> Path:
    return tiny_models["llama-gqa"]


# Environment a module may change only for itself: a leaked RAY_ADDRESS made every later ray.init in the session
# (and every subprocess) try to join a cluster that was gone; a leaked AWS_ENDPOINT_URL sent later S3 clients to
# a dead moto server. (Ray's own process-wide settings, e.g. RAY_AUTH_MODE or RAY_USAGE_STATS_ENABLED, which
# ray.init writes itself, are left alone.)
_SCOPED_ENV = ("RAY_ADDRESS", "RAY_AUTH_TOKEN", "AWS_", "LORALAND_")


@pytest.fixture(scope="module", autouse=True)
def no_env_leaks():
    """Puts the cluster address/token, AWS_* and LORALAND_* back as they were after each module, and fails the
    module that left them changed."""
    before = {k: v for k, v in os.environ.items() if k.startswith(_SCOPED_ENV)}
    yield
    after = {k: v for k, v in os.environ.items() if k.startswith(_SCOPED_ENV)}
    for k in after.keys() - before.keys():
        del os.environ[k]
    os.environ.update(before)
    leaked = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
    assert not leaked, f"this module left {leaked} changed in os.environ (restored now)"
