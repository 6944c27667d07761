"""vLLM's chat-template controls: add_generation_prompt, continue_final_message (assistant
prefill), chat_template_kwargs and documents. They were accepted and ignored: the template
always ended with a fresh assistant turn."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path
from typing import Any

import pytest

from common.config import MeshConfig
from common.runtime import RequestError
from common.wire.tokenizer import ChatMessage, GenerateRequest, WireSamplingParams
from services.gateway import GatewayConfig
from services.gateway.protocol import parse_chat
from services.tokenizer.service import TokenizerConfig, TokenizerService
from tests.models import set_chat_template

CONFIG = GatewayConfig(served_model_name="m")
PREFILL = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "The answer is"}]


def rendered(service: TokenizerService, body: dict[str, Any]) -> str:
    api = parse_chat(body, CONFIG)
    assert api.messages is not None
    req = GenerateRequest(
        "r", "inbox", WireSamplingParams(), messages=api.messages,
        add_generation_prompt=api.add_generation_prompt,
        continue_final_message=api.continue_final_message,
        chat_template_kwargs=api.chat_template_kwargs, tools=api.tools,
    )  # fmt: skip
    return service.render_chat(req)


@pytest.fixture(scope="module")
def service(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> TokenizerService:
    folder = tmp_path_factory.mktemp("controls") / "model"
    shutil.copytree(tiny_llama, folder)
    set_chat_template(
        folder,
        "{{ greeting | default('') }}{% for d in documents or [] %}[{{ d['text'] }}]{% endfor %}"
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",
    )
    return TokenizerService(TokenizerConfig(MeshConfig(), str(folder)))


def test_the_final_assistant_message_is_continued(service: TokenizerService) -> None:
    body = {"messages": PREFILL, "add_generation_prompt": False, "continue_final_message": True}
    text = rendered(service, body)
    assert text.endswith("<|im_start|>assistant\nThe answer is")  # no end of turn after it
    assert rendered(service, {"messages": PREFILL}).endswith("<|im_start|>assistant\n")


def test_without_a_generation_prompt_and_with_template_variables(service) -> None:
    user = [{"role": "user", "content": "Hi"}]
    assert rendered(service, {"messages": user, "add_generation_prompt": False}).endswith(
        "Hi<|im_end|>\n"
    )
    body = {
        "messages": user,
        "chat_template_kwargs": {"greeting": "Hello! "},
        "documents": [{"text": "doc one"}],
    }
    assert rendered(service, body).startswith("Hello! [doc one]<|im_start|>user")


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"continue_final_message": True}, "continue_final_message"),  # with the default add
        ({"add_generation_prompt": False, "continue_final_message": True,
          "messages": [{"role": "user", "content": "x"}]}, "continue_final_message"),
        ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs.messages"),
        ({"chat_template_kwargs": [1]}, "chat_template_kwargs"),
        ({"documents": "x"}, "documents"),
        ({"echo": True}, "echo"),
    ],
)  # fmt: skip
def test_bad_controls_are_a_400_naming_them(extra: dict[str, Any], param: str) -> None:
    with pytest.raises(RequestError) as info:
        parse_chat({"messages": PREFILL, **extra}, CONFIG)
    assert info.value.status == 400 and info.value.param == param


def test_the_messages_reach_the_tokenizer_as_parsed() -> None:
    api = parse_chat({"messages": PREFILL}, CONFIG)
    assert api.messages == [ChatMessage("user", "Hi"), ChatMessage("assistant", "The answer is")]
    assert (api.add_generation_prompt, api.continue_final_message) == (True, False)


ALTERNATING = (  # Llama 2's rule: one optional system turn, then user/assistant in turn
    "{% if messages[0]['role'] == 'system' %}{% set turns = messages[1:] %}"
    "{% set system = messages[0]['content'] %}{% else %}{% set turns = messages %}"
    "{% set system = '' %}{% endif %}{% for m in turns %}"
    "{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate') }}{% endif %}"
    "{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}[SYS {{ system }}]"
)


def test_tools_on_a_template_without_them_join_the_system_turn(
    tiny_llama: Path, tmp_path: Path
) -> None:
    """The tools' hermes preamble went in as a second system turn: a template that checks
    roles alternate refused every tool request that had a system message of its own."""
    folder = tmp_path / "model"
    shutil.copytree(tiny_llama, folder)
    set_chat_template(folder, ALTERNATING)
    service = TokenizerService(TokenizerConfig(MeshConfig(), str(folder)))
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {}}}
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    text = rendered(service, {"messages": messages, "tools": [tool]})
    assert "get_weather" in text and text.endswith("\n\nBe brief.]")
    text = rendered(service, {"messages": messages[1:], "tools": [tool]})  # none of its own
    assert "get_weather" in text and text.startswith("user: Hi\n")


def test_a_prefill_the_template_trims_is_continued_where_its_text_ends(
    tiny_llama: Path, tmp_path: Path
) -> None:
    """Llama 3's template trims each message; a prefill ending in a space was a 400, where
    transformers (and so vLLM) continue after the trimmed text."""
    folder = tmp_path / "model"
    shutil.copytree(tiny_llama, folder)
    set_chat_template(
        folder,
        "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] | trim }}<|eot|>{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}",
    )
    service = TokenizerService(TokenizerConfig(MeshConfig(), str(folder)))
    for prefill in ("The answer is ", " The answer is"):
        messages = [PREFILL[0], {"role": "assistant", "content": prefill}]
        body = {"messages": messages, "add_generation_prompt": False}
        text = rendered(service, {**body, "continue_final_message": True})
        assert text.endswith("<|assistant|>The answer is"), text


async def test_the_tokenizer_says_since_when_it_is_behind_while_requests_wait(
    service: TokenizerService, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Presence carries the arrival time of the request in hand while more wait behind it
    (the gateway's watchdog then does not take those for lost), and nothing once it is not."""
    from types import SimpleNamespace

    seen: list[float | None] = []

    async def tokenize(req: GenerateRequest) -> None:
        seen.append(service.svc.presence().behind_since)

    monkeypatch.setattr(service, "tokenize", tokenize)
    waiting = SimpleNamespace(pending_msgs=2)
    monkeypatch.setattr(service, "requests", waiting)
    request = GenerateRequest("r", "inbox", WireSamplingParams(), prompt="x", arrival_time=1000.0)
    await service.on_request(request)
    assert seen == [1000.0] and service.svc.facts.behind_since == 1000.0  # more to do
    waiting.pending_msgs = 0
    await service.on_request(dataclasses.replace(request, arrival_time=1001.0))
    assert seen == [1000.0, 1001.0] and service.svc.presence().behind_since is None
