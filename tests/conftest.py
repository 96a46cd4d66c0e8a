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
