from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from tests.models import write_tiny_model

torch.set_num_threads(min(2, os.cpu_count() or 1))


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One folder per architecture flavour, written once per test session."""
    root = tmp_path_factory.mktemp("models")
    return {kind: write_tiny_model(root / kind, kind) for kind in ("llama", "qwen2", "llama31")}


@pytest.fixture(scope="session")
def tiny_llama(tiny_models: dict[str, Path]) -> Path:
    return tiny_models["llama"]
