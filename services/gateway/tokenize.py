"""vLLM's ``/tokenize`` and ``/detokenize`` bodies -> the tokenizer's questions, and its answers
-> vLLM's response shapes. The tokenizer service answers them (request/reply), with the model's
own tokenizer and chat template: a client counts a prompt's tokens as the mesh will."""

from __future__ import annotations

from typing import Any

from common.wire.tokenizer import DetokenizeReply, DetokenizeRequest, TokenizeReply, TokenizeRequest
from services.gateway.body import Body, unicode_text, wrong_type
from services.gateway.config import GatewayConfig
from services.gateway.protocol import (
    MAX_TOKEN_ID,
    parse_messages,
    parse_model,
    parse_template_controls,
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
    tokens = body.get("tokens")
    ok = isinstance(tokens, list) and all(
        isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= MAX_TOKEN_ID for t in tokens
    )
    if not ok:
        raise wrong_type("tokens", "an array of token ids", tokens)
    return DetokenizeRequest(list(tokens))


def detokenize_response(reply: DetokenizeReply) -> dict[str, Any]:
    return {"prompt": reply.prompt}
