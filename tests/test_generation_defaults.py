"""A model's generation_config.json sampling defaults, as vLLM applies them: a request that
leaves temperature, top_p, top_k, min_p or repetition_penalty unset gets the model's value."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from common.config import MeshConfig
from common.generation_defaults import sampling_defaults
from common.wire.executor import TokenizedRequest
from common.wire.tokenizer import GenerateRequest, WireSamplingParams
from services.gateway import GatewayConfig
from services.gateway.protocol import parse_chat, parse_completion
from services.tokenizer.service import TokenizerConfig, TokenizerService

QWEN_LIKE = {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05}


def test_the_valid_sampling_keys_are_read(tmp_path: Path) -> None:
    assert sampling_defaults(tmp_path) == {}  # no file
    (tmp_path / "generation_config.json").write_text(
        json.dumps({**QWEN_LIKE, "eos_token_id": 2, "min_p": 3.0, "do_sample": True})
    )
    assert sampling_defaults(tmp_path) == QWEN_LIKE  # min_p 3.0 is out of range: ignored
    (tmp_path / "generation_config.json").write_text(json.dumps({"top_k": 0}))
    assert sampling_defaults(tmp_path) == {"top_k": -1}  # no top-k, as the gateway reads 0
    (tmp_path / "generation_config.json").write_text("{not json")
    assert sampling_defaults(tmp_path) == {}


def test_the_gateway_says_which_keys_the_client_left_unset() -> None:
    config = GatewayConfig(served_model_name="m")
    api = parse_completion({"prompt": "x", "temperature": 0, "top_k": None}, config)
    assert api.sampling_unset == ["top_p", "top_k", "min_p", "repetition_penalty"]
    chat = {"messages": [{"role": "user", "content": "x"}], "top_p": 0.5, "min_p": 0.1}
    assert parse_chat(chat, config).sampling_unset == ["temperature", "top_k", "repetition_penalty"]


@pytest.mark.parametrize("mode", ["auto", "none"])
async def test_the_tokenizer_fills_them_from_the_model(
    tiny_llama: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str
) -> None:
    folder = tmp_path / "model"
    shutil.copytree(tiny_llama, folder)
    (folder / "generation_config.json").write_text(json.dumps({**QWEN_LIKE, "eos_token_id": 2}))
    service = TokenizerService(TokenizerConfig(MeshConfig(), str(folder), generation_config=mode))
    sent: list[TokenizedRequest] = []

    async def publish(subject: str, message: object, *args: object, **kwargs: object) -> None:
        assert isinstance(message, TokenizedRequest)
        sent.append(message)

    monkeypatch.setattr(service.svc, "publish", publish)
    params = WireSamplingParams(max_tokens=4, temperature=0.0, top_p=1.0, top_k=-1)
    unset = ["top_k", "min_p", "repetition_penalty"]  # the client set temperature and top_p
    await service.on_request(
        GenerateRequest("r", "inbox", params, prompt="hello", sampling_unset=unset)
    )
    got = sent[0].params
    assert (got.temperature, got.top_p, got.min_p) == (0.0, 1.0, 0.0)  # set, or no default
    if mode == "auto":
        assert (got.top_k, got.repetition_penalty) == (20, 1.05)
    else:
        assert (got.top_k, got.repetition_penalty) == (-1, 1.0)
