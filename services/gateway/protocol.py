"""OpenAI request bodies -> one typed ``ApiRequest``, or a ``RequestError`` naming the field.

Validation follows the OpenAI API (and vLLM where OpenAI is silent): optional fields may be
absent or null; a wrong type or an out-of-range value is a 400 whose ``param`` names the field;
an unknown ``model`` is a 404 ``model_not_found``. Unknown fields are ignored (clients send
extras), but known features the mesh does not implement (chat's echo, suffix, functions, ...)
are rejected rather than silently dropped. ``tools``/``tool_choice``/``response_format`` are read
by ``services.gateway.structured``. ``model`` may be omitted (it defaults to the served
model, as in vLLM).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any, Literal

from common.generation_defaults import SAMPLING_KEYS, SAMPLING_RANGES
from common.runtime import RequestError, context_too_long
from common.wire.tokenizer import ChatMessage, ResponseFormat, ToolChoice, WireSamplingParams
from services.gateway.body import Body, bad_request, out_of_range, unicode_text, wrong_type
from services.gateway.config import GatewayConfig
from services.gateway.structured import (
    parse_message_tool_calls,
    parse_structured_output,
    parse_tools,
)

Kind = Literal["completion", "chat", "embedding"]

MAX_TOKEN_ID = 2**31 - 1
# What a chat template gets from the request itself (chat_template_kwargs may not set them)
TEMPLATE_VARIABLES = frozenset(
    {"messages", "tools", "add_generation_prompt", "continue_final_message", "documents"}
)
MAX_INT = 2**31 - 1
SEED_RANGE = (-(2**63), 2**63 - 1)

# developer is OpenAI's newer name for system; chat templates only know the classic roles.
ROLES = {
    "system": "system",
    "developer": "system",
    "user": "user",
    "assistant": "assistant",
    "tool": "tool",
}

# Stop strings (the count is --max-stop): the detokenizer scans the held-back text against
# every stop string at each text delta, at worst about (sum of lengths) x (longest length)
# character comparisons; 4096 characters in all, 1024 each, bounds that near 0.35 ms a delta
# on one core (measured on StopMatcher) while allowing any real stop sequence.
MAX_STOP_CHARS = 1024
MAX_STOP_TOTAL_CHARS = 4096
# stop_token_ids: models have a handful of end-of-turn ids; 256 covers every special token of
# common tokenizers while bounding the per-token membership test and the message size.
MAX_STOP_TOKEN_IDS = 256
# logit_bias: OpenAI's bounds on each bias; the entry count bounds the per-step scatter.
LOGIT_BIAS_RANGE = (-100.0, 100.0)
MAX_LOGIT_BIAS = 1024
# allowed_token_ids: a whitelist is gathered and put back each step, O(its length), and rides
# in every message about the request (each step's drafts, with speculation: ~5 bytes an id);
# this bounds both while admitting any real restriction (labels, digits, a script's tokens).
MAX_ALLOWED_TOKEN_IDS = 16384
# bad_words: each is matched against the output's tail every step; vLLM's own bounds on the
# count (its tokens: MAX_BAD_WORDS_TOKENS, checked by the tokenizer once it encodes them).
MAX_BAD_WORDS = 128
MAX_BAD_WORD_CHARS = 256
# prompt_logprobs: vLLM's -1 (the whole vocabulary) is not offered; the engine's own bound.
MAX_PROMPT_LOGPROBS = 20


@dataclass(frozen=True)
class ApiRequest:
    """A validated completions or chat request; ``n`` choices share ``params`` (each choice's
    seed is derived from it in the tokenizer: ``GenerateRequest.choices``)."""

    kind: Kind
    model: str
    n: int
    stream: bool
    include_usage: bool
    params: WireSamplingParams
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    messages: list[ChatMessage] | None = None
    priority: int = 0
    response_format: ResponseFormat | None = None
    tools: ToolChoice | None = None
    max_tokens_chosen: bool = True  # False: a chat default, cut to what the context leaves
    # the SAMPLING_KEYS the body left unset: the model's generation_config may fill them
    sampling_unset: list[str] = dataclasses.field(default_factory=list)
    # chat only: vLLM's template controls (``GenerateRequest``)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: str = ""
    # the LoRA adapter the request names as its model (``--lora-modules``; "": the base)
    lora: str = ""
    # vLLM's: with a reasoning parser on, the answer's reasoning is sent (else left out)
    include_reasoning: bool = True
    # stream_options.continuous_usage_stats (vLLM's): every chunk carries the usage so far
    continuous_usage: bool = False
    # vLLM's: words the output may not contain; the prompt cut to its last N tokens
    bad_words: list[str] = dataclasses.field(default_factory=list)
    truncate_prompt_tokens: int | None = None
    # completions' echo: each choice's text (and logprobs) start with the prompt's; with
    # max_tokens 0 (echo_only) nothing else
    echo: bool = False
    echo_only: bool = False
    # completions' batched prompts: one request each (this one's fields, its own prompt); the
    # choices of prompt k are k * n ... k * n + n - 1, as OpenAI orders them
    batch: list[ApiRequest] = dataclasses.field(default_factory=list)

    @property
    def prompt_only(self) -> bool:
        """The one token generated is not the client's (echo with max_tokens 0, an
        embedding): its response and the metrics count none."""
        return self.echo_only or self.kind == "embedding"

    @property
    def prompts(self) -> list[ApiRequest]:
        """The requests to send: the batch's, or this one alone."""
        return self.batch or [self]

    @property
    def num_choices(self) -> int:
        return len(self.prompts) * self.n


def parse_completion(raw: Any, config: GatewayConfig) -> ApiRequest:
    body = Body(raw)
    model = parse_model(body, config)
    batch = parse_prompts(body.get("prompt"), config.max_batch_choices)
    prompt, token_ids = batch[0]
    if body.get("suffix"):
        raise bad_request("'suffix' is not supported.", "suffix", "unsupported_parameter")
    n = body.integer("n", 1, 1, config.max_n)
    if len(batch) > 1 and len(batch) * n > config.max_batch_choices:
        raise bad_request(
            f"A batch of {len(batch)} prompts with n={n} asks for {len(batch) * n} choices; "
            f"at most {config.max_batch_choices}.",
            "prompt",
            "invalid_value",
        )
    best_of = body.optional_integer("best_of", 1, config.max_n)
    if best_of is not None and best_of != n:
        raise bad_request("'best_of' is only supported equal to 'n'.", "best_of")
    echo = body.boolean("echo", False)
    # max_tokens 0 with echo (vLLM's): the prompt scored, nothing generated (one token is, and
    # left out of the response)
    max_tokens = body.integer("max_tokens", 16, 0 if echo else 1, config.max_completion_tokens)
    echo_only, max_tokens = max_tokens == 0, max(max_tokens, 1)
    # (OpenAI's completions allow 5; vLLM, and harnesses written for it, up to 20)
    logprobs = body.optional_integer("logprobs", 0, MAX_PROMPT_LOGPROBS)
    response_format = parse_structured_output(body)  # (vLLM's completions take it too)
    api = finish(body, "completion", model, n, max_tokens, logprobs, config, prompt, token_ids)
    truncate = api.truncate_prompt_tokens
    for _, ids in batch:
        if ids is not None:
            kept = len(ids) if truncate is None else min(len(ids), truncate)
            check_context(kept, max_tokens, "max_tokens", config)
    params = api.params
    if echo and params.prompt_logprobs is None:
        # the prompt's logprobs head the choice's (vLLM: prompt_logprobs defaults to logprobs)
        params = dataclasses.replace(params, prompt_logprobs=logprobs)
    api = dataclasses.replace(api, response_format=response_format, echo=echo, echo_only=echo_only)

    def one(text: str | None, ids: list[int] | None) -> ApiRequest:
        # (the detokenizer decodes a prompt of token ids for the echo)
        own = dataclasses.replace(params, echo=echo and ids is not None)
        return dataclasses.replace(api, prompt=text, prompt_token_ids=ids, params=own)

    if len(batch) == 1:
        return one(prompt, token_ids)
    return dataclasses.replace(one(prompt, token_ids), batch=[one(*p) for p in batch])


def parse_chat(raw: Any, config: GatewayConfig) -> ApiRequest:
    body = Body(raw)
    model = parse_model(body, config)
    messages = parse_messages(body.get("messages"))

    response_format = parse_structured_output(body)
    tools = parse_tools(body)
    n = body.integer("n", 1, 1, config.max_n)
    limit = config.max_completion_tokens
    # max_completion_tokens replaces the deprecated max_tokens; either is honoured.
    max_tokens = body.optional_integer("max_completion_tokens", 1, limit)
    if max_tokens is None:
        max_tokens = body.optional_integer("max_tokens", 1, limit)
    chosen = max_tokens is not None
    if max_tokens is None:
        max_tokens = config.chat_default_max_tokens
    want_logprobs = body.boolean("logprobs", False)
    top_logprobs = body.optional_integer("top_logprobs", 0, 20)
    if top_logprobs is not None and not want_logprobs:
        raise bad_request("'logprobs' must be true when 'top_logprobs' is set.", "top_logprobs")
    logprobs = (top_logprobs or 0) if want_logprobs else None
    if body.boolean("echo", False):  # (vLLM's chat echo repeats the last message)
        raise bad_request("'echo' is not supported.", "echo", "unsupported_parameter")
    api = finish(body, "chat", model, n, max_tokens, logprobs, config, messages=messages)
    return dataclasses.replace(
        api,
        response_format=response_format,
        tools=tools,
        max_tokens_chosen=chosen,
        include_reasoning=body.boolean("include_reasoning", True),
        **parse_template_controls(body, messages),
    )


def parse_template_controls(body: Body, messages: list[ChatMessage]) -> dict[str, Any]:
    """vLLM's ``add_generation_prompt``, ``continue_final_message`` (assistant prefill),
    ``chat_template_kwargs`` and ``documents``, checked as vLLM checks them."""
    add = body.boolean("add_generation_prompt", True)
    cont = body.boolean("continue_final_message", False)
    if add and cont:
        raise bad_request(
            "'continue_final_message' continues the final message: it needs "
            "'add_generation_prompt': false.",
            "continue_final_message",
        )
    if cont and messages[-1].role != "assistant":
        raise bad_request(
            "'continue_final_message' needs a final assistant message to continue.",
            "continue_final_message",
        )
    kwargs = body.get("chat_template_kwargs")
    if kwargs is None:
        kwargs = {}
    if not isinstance(kwargs, dict):
        raise wrong_type("chat_template_kwargs", "an object", kwargs)
    for key in kwargs:
        if key in TEMPLATE_VARIABLES:
            raise bad_request(
                f"'chat_template_kwargs' may not set '{key}': the request's own field does.",
                f"chat_template_kwargs.{key}",
            )
    documents = body.get("documents")
    if documents is not None:
        if not isinstance(documents, list) or not all(isinstance(d, dict) for d in documents):
            raise wrong_type("documents", "a list of objects", documents)
        kwargs = {**kwargs, "documents": documents}
    return {
        "add_generation_prompt": add,
        "continue_final_message": cont,
        "chat_template_kwargs": json.dumps(kwargs) if kwargs else "",
    }


def finish(
    body: Body,
    kind: Kind,
    model: str,
    n: int,
    max_tokens: int,
    logprobs: int | None,
    config: GatewayConfig,
    prompt: str | None = None,
    prompt_token_ids: list[int] | None = None,
    messages: list[ChatMessage] | None = None,
) -> ApiRequest:
    """The fields both endpoints share: streaming and sampling."""
    stream = body.boolean("stream", False)
    include_usage, continuous_usage = parse_stream_options(body, stream)
    body.string("user")  # accepted and ignored, but it must be a string
    params = parse_sampling(body, config, max_tokens, logprobs)
    params = dataclasses.replace(params, prompt_logprobs=parse_prompt_logprobs(body, stream))
    priority = parse_priority(body, config.max_client_priority)
    unset = [key for key in SAMPLING_KEYS if body.get(key) is None]
    return ApiRequest(
        kind, model, n, stream, include_usage, params, prompt, prompt_token_ids, messages,
        priority, sampling_unset=unset, continuous_usage=continuous_usage,
        bad_words=parse_bad_words(body), truncate_prompt_tokens=parse_truncation(body, config),
        lora=adapter_of(model, config),
    )  # fmt: skip


# --- fields -------------------------------------------------------------------------------------


def adapter_of(model: str, config: GatewayConfig) -> str:
    """The LoRA adapter a request names as its model ("": the base model)."""
    return "" if model == config.served_model_name else model


def parse_model(body: Body, config: GatewayConfig) -> str:
    model = body.string("model")
    if model is None:
        return config.served_model_name
    if model != config.served_model_name and model not in config.lora_names:
        raise RequestError(
            f"The model `{model}` does not exist.",
            404,
            "invalid_request_error",
            "model",
            "model_not_found",
        )
    return model


def parse_prompts(
    value: Any, limit: int, param: str = "prompt"
) -> list[tuple[str | None, list[int] | None]]:
    """A string or an array of token ids, or a batch of either (an array of them, at most
    ``limit``): each prompt as (text, None) or (None, ids)."""
    if value is None:
        raise bad_request(f"Missing required parameter: '{param}'.", param, "missing_required")
    if not (isinstance(value, list) and value and isinstance(value[0], str | list)):
        return [parse_prompt(value, param)]
    if len(value) > limit:
        raise bad_request(
            f"'{param}' may batch at most {limit} prompts, got {len(value)}.",
            param,
            "invalid_value",
        )
    return [parse_prompt(v, f"{param}[{i}]") for i, v in enumerate(value)]


def parse_prompt(value: Any, param: str) -> tuple[str | None, list[int] | None]:
    """A string or a list of token ids."""
    if isinstance(value, str):
        return unicode_text(value, param), None
    if not isinstance(value, list):
        raise wrong_type(param, "a string or an array of token ids", value)
    if not value:
        raise bad_request(f"'{param}' must not be empty.", param, "invalid_value")
    for i, token in enumerate(value):
        if isinstance(token, bool) or not isinstance(token, int):
            raise wrong_type(f"{param}[{i}]", "a token id (integer)", token)
        if not 0 <= token <= MAX_TOKEN_ID:
            raise out_of_range(f"{param}[{i}]", token, "a non-negative token id")
    return None, list(value)


def parse_priority(body: Body, limit: int) -> int:
    """vLLM's convention (an extension of the OpenAI API): a lower value runs first, 0 (the
    default) sits in the middle. Clients may use -limit..limit; limit 0 turns the field off."""
    value = body.optional_int("priority")
    if not value:
        return 0
    if limit == 0:
        raise bad_request(
            "Request priorities are disabled on this server: omit 'priority' or send 0, "
            f"got {value}.",
            "priority",
            "unsupported_parameter",
        )
    if not -limit <= value <= limit:
        raise bad_request(
            f"'priority' must be an integer between {-limit} and {limit} (a lower value runs "
            f"first), got {value}.",
            "priority",
            "invalid_value",
        )
    return value


def check_context(prompt_tokens: int, max_tokens: int, param: str, config: GatewayConfig) -> None:
    if prompt_tokens + max_tokens > config.max_model_len:
        raise context_too_long(config.max_model_len, prompt_tokens, max_tokens, "prompt", param)


def parse_messages(value: Any) -> list[ChatMessage]:
    if value is None:
        raise bad_request("Missing required parameter: 'messages'.", "messages", "missing_required")
    if not isinstance(value, list):
        raise wrong_type("messages", "an array", value)
    if not value:
        raise bad_request("'messages' must not be empty.", "messages", "invalid_value")
    return [parse_message(m, f"messages[{i}]") for i, m in enumerate(value)]


def parse_message(value: Any, where: str) -> ChatMessage:
    if not isinstance(value, dict):
        raise wrong_type(where, "an object", value)
    role = value.get("role")
    if not isinstance(role, str):
        raise wrong_type(f"{where}.role", "a string", role)
    if role not in ROLES:
        raise bad_request(
            f"Unsupported role '{role}' in '{where}.role': use one of {', '.join(ROLES)}.",
            f"{where}.role",
            "invalid_value",
        )
    content = value.get("content")
    param = f"{where}.content"
    tool_calls = ""
    if role == "assistant" and value.get("tool_calls") is not None:
        tool_calls = parse_message_tool_calls(value["tool_calls"], f"{where}.tool_calls")
    if content is None and role == "assistant":
        content = ""  # an assistant turn may carry no content (a tool call instead)
    if isinstance(content, list):
        parts = [parse_text_part(part, f"{param}[{i}]") for i, part in enumerate(content)]
        content = "\n".join(parts)
    if not isinstance(content, str):
        raise wrong_type(param, "a string or an array of text parts", content)
    tool_call_id = value.get("tool_call_id")
    if role == "tool" and not isinstance(tool_call_id, str):
        raise wrong_type(f"{where}.tool_call_id", "a string", tool_call_id)
    name = value.get("name")
    return ChatMessage(
        ROLES[role],
        unicode_text(content, param),
        tool_calls=tool_calls,
        tool_call_id=unicode_text(tool_call_id, f"{where}.tool_call_id")
        if isinstance(tool_call_id, str) and role == "tool"
        else "",
        name=unicode_text(name, f"{where}.name") if isinstance(name, str) else "",
    )


def parse_text_part(part: Any, where: str) -> str:
    if not isinstance(part, dict):
        raise wrong_type(where, "an object", part)
    if part.get("type") != "text":
        raise bad_request(
            f"Only text content parts are supported, got type {part.get('type')!r}.",
            f"{where}.type",
            "unsupported_value",
        )
    text = part.get("text")
    if not isinstance(text, str):
        raise wrong_type(f"{where}.text", "a string", text)
    return text


def parse_stream_options(body: Body, stream: bool) -> tuple[bool, bool]:
    """``include_usage`` (a last chunk with the usage) and ``continuous_usage_stats`` (vLLM's:
    the usage so far on every chunk; with ``include_usage`` only, as vLLM has it)."""
    options = body.get("stream_options")
    if options is None:
        return False, False
    if not stream:
        raise bad_request(
            "'stream_options' is only allowed when 'stream' is true.", "stream_options"
        )
    if not isinstance(options, dict):
        raise wrong_type("stream_options", "an object", options)
    flags = []
    for key in ("include_usage", "continuous_usage_stats"):
        value = options.get(key)
        if value is not None and not isinstance(value, bool):
            raise wrong_type(f"stream_options.{key}", "a boolean", value)
        flags.append(bool(value))
    include_usage, continuous = flags
    return include_usage, include_usage and continuous


def parse_stop(body: Body, max_stop: int) -> list[str]:
    value = body.get("stop")
    if value is None:
        return []
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise wrong_type("stop", "a string or an array of strings", value)
    if len(stops) > max_stop:
        raise bad_request(
            f"'stop' may hold at most {max_stop} sequences, got {len(stops)}.",
            "stop",
            "invalid_value",
        )
    if any(not s for s in stops):
        raise bad_request("'stop' sequences must not be empty.", "stop", "invalid_value")
    for i, stop in enumerate(stops):
        if len(stop) > MAX_STOP_CHARS:
            raise bad_request(
                f"Each 'stop' sequence may be at most {MAX_STOP_CHARS} characters, got "
                f"{len(stop)} in stop[{i}].",
                "stop",
                "invalid_value",
            )
        unicode_text(stop, "stop")
    total = sum(len(s) for s in stops)
    if total > MAX_STOP_TOTAL_CHARS:
        raise bad_request(
            f"The 'stop' sequences may hold at most {MAX_STOP_TOTAL_CHARS} characters in all, "
            f"got {total}.",
            "stop",
            "invalid_value",
        )
    return list(stops)


def parse_token_ids(
    body: Body, name: str, limit: int = MAX_STOP_TOKEN_IDS, at_least: int = 0
) -> list[int]:
    value = body.get(name)
    if value is None:
        return []
    ids = token_id_list(value, name)
    if not at_least <= len(ids) <= limit:
        held = f"must hold {at_least} to {limit}" if at_least else f"may hold at most {limit}"
        raise bad_request(f"'{name}' {held} token ids, got {len(ids)}.", name, "invalid_value")
    return ids


def token_id_list(value: Any, name: str) -> list[int]:
    """``value`` if it is an array of token ids (non-negative 32-bit integers), else a 400."""
    ok = isinstance(value, list) and all(
        isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= MAX_TOKEN_ID for t in value
    )
    if not ok:
        raise wrong_type(name, "an array of token ids", value)
    return list(value)


def parse_allowed_token_ids(body: Body) -> list[int]:
    """vLLM's whitelist; ids are checked against the vocabulary by the executor. An empty list
    would allow nothing: a 400, as in vLLM."""
    ids = parse_token_ids(body, "allowed_token_ids", MAX_ALLOWED_TOKEN_IDS, at_least=1)
    return sorted(set(ids))


def parse_bad_words(body: Body) -> list[str]:
    """vLLM's ``bad_words``: non-blank strings (the tokenizer encodes them)."""
    value = body.get("bad_words")
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(w, str) for w in value):
        raise wrong_type("bad_words", "an array of strings", value)
    if len(value) > MAX_BAD_WORDS:
        raise bad_request(
            f"'bad_words' may hold at most {MAX_BAD_WORDS} words, got {len(value)}.",
            "bad_words",
            "invalid_value",
        )
    for word in value:
        if not word.strip() or len(word) > MAX_BAD_WORD_CHARS:
            raise bad_request(
                f"Each of 'bad_words' must be 1 to {MAX_BAD_WORD_CHARS} characters and not "
                f"blank, got {word!r}.",
                "bad_words",
                "invalid_value",
            )
        unicode_text(word, "bad_words")
    return list(value)


def parse_truncation(body: Body, config: GatewayConfig) -> int | None:
    """vLLM's ``truncate_prompt_tokens``: keep the prompt's last N tokens (-1: as many as the
    context holds); more than the context is a 400, as in vLLM."""
    value = body.optional_int("truncate_prompt_tokens")
    if value is None:
        return None
    if value == -1:
        return config.max_model_len
    if not 1 <= value <= config.max_model_len:
        raise bad_request(
            f"'truncate_prompt_tokens' must be -1 (the context length) or within 1.."
            f"{config.max_model_len} (this server's context length), got {value}.",
            "truncate_prompt_tokens",
            "invalid_value",
        )
    return value


def parse_prompt_logprobs(body: Body, stream: bool) -> int | None:
    """vLLM's ``prompt_logprobs``: top-N alternatives per prompt token, in the response (not
    in a stream, as vLLM: 0 is accepted there and nothing is computed or sent, more is a 400;
    completions' echo streams them within the logprobs)."""
    value = body.optional_integer("prompt_logprobs", 0, MAX_PROMPT_LOGPROBS)
    if value == 0 and stream:
        return None
    if value is not None and stream:
        raise bad_request(
            "'prompt_logprobs' are not available when 'stream' is true.",
            "prompt_logprobs",
            "unsupported_value",
        )
    return value


def parse_logit_bias(body: Body) -> list[tuple[int, float]]:
    """OpenAI's ``{"<token id>": bias}`` with biases in [-100, 100]; ids are checked against
    the vocabulary by the executor (the gateway does not know it)."""
    value = body.get("logit_bias")
    if value is None:
        return []
    if not isinstance(value, dict):
        raise wrong_type("logit_bias", "an object mapping token ids to biases", value)
    if len(value) > MAX_LOGIT_BIAS:
        raise bad_request(
            f"'logit_bias' may hold at most {MAX_LOGIT_BIAS} tokens, got {len(value)}.",
            "logit_bias",
            "invalid_value",
        )
    lo, hi = LOGIT_BIAS_RANGE
    out = []
    for key, bias in value.items():
        # ASCII digits only: str.isdigit also takes "²" and "①", which int() refuses.
        ascii_id = isinstance(key, str) and key.isascii() and key.isdigit() and len(key) <= 10
        token = int(key) if ascii_id else -1
        if not 0 <= token <= MAX_TOKEN_ID:
            raise bad_request(
                f"'logit_bias' keys must be token ids (non-negative integers as strings), "
                f"got {key!r}.",
                "logit_bias",
                "invalid_value",
            )
        if isinstance(bias, bool) or not isinstance(bias, int | float) or not lo <= bias <= hi:
            raise bad_request(
                f"'logit_bias' values must be numbers in [{lo:g}, {hi:g}], got {bias!r} for "
                f"token {key}.",
                "logit_bias",
                "invalid_value",
            )
        out.append((token, float(bias)))
    return out


def parse_sampling(
    body: Body, config: GatewayConfig, max_tokens: int, logprobs: int | None
) -> WireSamplingParams:
    logit_bias = parse_logit_bias(body)
    top_k = body.integer("top_k", -1, -1, MAX_INT)
    return WireSamplingParams(
        max_tokens=max_tokens,
        temperature=ranged(body, "temperature", 1.0),
        top_p=ranged(body, "top_p", 1.0),
        top_k=-1 if top_k == 0 else top_k,  # 0 and -1 both mean "no top-k", as in vLLM
        min_p=ranged(body, "min_p", 0.0),
        # Choice i samples with seed + i (GenerateRequest.choices): room for n of them.
        seed=body.optional_integer("seed", SEED_RANGE[0], SEED_RANGE[1] - config.max_n),
        presence_penalty=body.number("presence_penalty", 0.0, -2.0, 2.0),
        frequency_penalty=body.number("frequency_penalty", 0.0, -2.0, 2.0),
        repetition_penalty=ranged(body, "repetition_penalty", 1.0),
        stop=parse_stop(body, config.max_stop),
        stop_token_ids=parse_token_ids(body, "stop_token_ids"),
        ignore_eos=body.boolean("ignore_eos", False),
        logprobs=logprobs,
        skip_special_tokens=body.boolean("skip_special_tokens", True),
        logit_bias=logit_bias,
        min_tokens=body.integer("min_tokens", 0, 0, max_tokens),
        include_stop_str_in_output=body.boolean("include_stop_str_in_output", False),
        allowed_token_ids=parse_allowed_token_ids(body),
    )


def ranged(body: Body, name: str, default: float) -> float:
    """One of the sampling numbers a model's generation_config may also set, in its range."""
    low, high, low_open = SAMPLING_RANGES[name]
    return body.number(name, default, low, high, lo_open=low_open)
