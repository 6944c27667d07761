from __future__ import annotations

import argparse
import os
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import openai
import pytest
import torch

from common.nats_server import LocalNatsServer, free_port
from common.tokenizer import Tokenizer
from gpu.engine import Engine, EngineConfig
from gpu.loader import load_model
from gpu.runner import ModelRunner
from gpu.sampling_params import SamplingParams
from services.launcher.mesh import LocalMesh
from services.launcher.up import parse_up_args
from tests.mesh import openai_client
from tests.models import hf_model, write_tiny_model

torch.set_num_threads(min(2, os.cpu_count() or 1))
# The tests run the Triton kernels on CPU tensors under Triton's interpreter (numpy underneath;
# the GPU check runs them compiled). It must be on before triton is first imported: its library
# functions are bound at import.
os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture
def nats_server() -> Iterator[LocalNatsServer]:
    """A nats-server of the test's own (modules sharing one per module define their own)."""
    server = LocalNatsServer.start()
    yield server
    server.stop()


@pytest.fixture
async def openai_clients() -> AsyncIterator[Callable[[str], openai.AsyncOpenAI]]:
    """Make OpenAI clients (``openai_clients(base_url)``) that are closed when the test ends,
    in its own loop (see ``tests.mesh.openai_client`` for why that matters)."""
    made: list[openai.AsyncOpenAI] = []

    def make(base_url: str) -> openai.AsyncOpenAI:
        made.append(openai_client(base_url))
        return made[-1]

    yield make
    for client in made:
        await client.close()


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One folder per architecture flavour, written once per test session."""
    root = tmp_path_factory.mktemp("models")
    return {
        kind: write_tiny_model(root / kind, kind)
        for kind in ("llama", "qwen2", "qwen3", "llama31", "mixtral", "qwen2_moe", "qwen3_moe")
    }


@pytest.fixture(scope="session")
def tiny_llama(tiny_models: dict[str, Path]) -> Path:
    return tiny_models["llama"]


def up_args(model, **overrides) -> argparse.Namespace:
    argv = ["--model", str(model), "--port", str(free_port()), "--served-model-name", "tiny"]
    for key, value in overrides.items():
        argv += [f"--{key.replace('_', '-')}", str(value)]
    return parse_up_args(argv)


@pytest.fixture
def process_mesh(tiny_llama):
    meshes = []

    def start(**overrides):
        mesh = LocalMesh(up_args(tiny_llama, **overrides), tiny_llama)
        meshes.append(mesh)
        mesh.start()
        mesh.wait_ready(120)
        return mesh

    yield start
    for mesh in meshes:
        mesh.stop()


@pytest.fixture(scope="module")
def offline(tiny_llama):
    """The mixed engine in this process, and transformers: what the pair must reproduce."""
    tok = Tokenizer.from_folder(tiny_llama)
    engine = Engine(
        ModelRunner(load_model(tiny_llama, progress=False), 256, 16), EngineConfig(), [2]
    )
    oracle = hf_model(tiny_llama)

    def run(prompt: str, params: SamplingParams) -> tuple[str, str | None]:
        ids = tok.encode(prompt)
        ours = tok.decode(engine.generate([ids], params)[0])
        if not params.is_greedy:
            return ours, None
        oracle.generation_config.eos_token_id = None
        with torch.no_grad():
            out = oracle.generate(
                torch.tensor([ids]), max_new_tokens=params.max_tokens, do_sample=False,
                pad_token_id=0,
            )  # fmt: skip
        return ours, tok.decode(out[0, len(ids) :].tolist())

    return run
