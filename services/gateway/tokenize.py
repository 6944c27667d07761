"""vLLM's ``/tokenize`` and ``/detokenize`` bodies -> the tokenizer's questions, and its answers
-> vLLM's response shapes. The tokenizer service answers them (request/reply), with the model's
own tokenizer and chat template: a client counts a prompt's tokens as the mesh will."""

from __future__ import annotations

from typing import Any

from common.wire.tokenizer import DetokenizeReply, DetokenizeRequest, TokenizeReply, TokenizeRequest
from services.gateway.body import Body, unicode_text, wrong_type
from services.gateway.config import GatewayConfig
from services.gateway.protocol import (
    parse_messages,
    parse_model,
    parse_template_controls,
    token_id_list,
)
from services.gateway.structured import parse_tools

# How long the gateway waits for a tokenizer's answer (it encodes one text: milliseconds).
TOKENIZE_TIMEOUT_S = 10.0


def parse_tokenize(raw: Any, config: GatewayConfig) -> TokenizeRequest:
    """A ``prompt`` (vLLM's completion form) or ``messages`` (its chat form, with the chat
    template's controls and ``tools``); ``add_special_tokens`` defaults as vLLM's do."""
    body = Body(raw)
    parse_model(body, config)
    strs = body.boolean("return_token_strs", False)
    if body.get("messages") is not None:
        messages = parse_messages(body.get("messages"))
        controls = parse_template_controls(body, messages)
        return TokenizeRequest(
            messages=messages,
            add_special_tokens=body.boolean("add_special_tokens", False),
            tools=parse_tools(body),
            return_token_strs=strs,
            **controls,
        )
    prompt = body.get("prompt")
    if not isinstance(prompt, str):
        raise wrong_type("prompt", "a string (or send 'messages')", prompt)
    return TokenizeRequest(
        prompt=unicode_text(prompt, "prompt"),
        add_special_tokens=body.boolean("add_special_tokens", True),
        return_token_strs=strs,
    )


def tokenize_response(reply: TokenizeReply, config: GatewayConfig) -> dict[str, Any]:
    """vLLM's ``TokenizeResponse``; ``max_model_len`` is what this gateway accepts (its own
    limit, within the model's)."""
    return {
        "count": len(reply.tokens),
        "max_model_len": min(reply.max_model_len, config.max_model_len),
        "tokens": reply.tokens,
        "token_strs": reply.token_strs,
    }


def parse_detokenize(raw: Any, config: GatewayConfig) -> DetokenizeRequest:
    body = Body(raw)
    parse_model(body, config)
    return DetokenizeRequest(token_id_list(body.get("tokens"), "tokens"))


def detokenize_response(reply: DetokenizeReply) -> dict[str, Any]:
    return {"prompt": reply.prompt}
