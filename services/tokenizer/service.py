"""Tokenizer handlers: render the chat template, encode, hash full pages, forward to the scheduler
one request per choice (``GenerateRequest.n``).

Stateless; run any number of replicas in the ``tokenizer`` queue group.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
import zlib
from dataclasses import dataclass
from typing import Any

from nats.aio.subscription import Subscription
from opentelemetry import trace

from common.config import MeshConfig, model_setting, page_size_setting
from common.generation_defaults import sampling_defaults
from common.page_hash import namespace_root, page_hashes
from common.reasoning import CLOSED, THINK_END, THINK_START, starts_inside, think_state
from common.runtime import RequestError, Service, context_too_long
from common.settings import parse, setting
from common.telemetry import Attr
from common.tokenizer import Tokenizer, TokenizerError
from common.tool_formats import detect_tool_format, renders_tools
from common.wire.executor import TokenizedRequest, WireGrammar
from common.wire.tokenizer import (
    ChatMessage,
    DetokenizeReply,
    DetokenizeRequest,
    GenerateRequest,
    TokenizeReply,
    TokenizeRequest,
    WireSamplingParams,
)
from gpu.config import ModelConfig
from gpu.gguf import resolve_model_path
from gpu.pooler_config import PoolerConfig, PoolingError
from services.tokenizer.grammars import grammar_for

log = logging.getLogger("meshserve.tokenizer")

# vLLM's bound on all of a request's bad words, encoded (each is matched every step).
MAX_BAD_WORDS_TOKENS = 1024
# (top-N + 1) x (prompt tokens - 1) prompt logprobs at most: they travel in one message of
# the bus and one response. With their texts that is ~0.5-0.9 MB at ids over 65,535 and 4-16
# bytes a token: within the 1 MiB default payload, unless the tokens are longer still (the
# stream then ends with a clear error, the detokenizer's for a delta that cannot fit).
MAX_PROMPT_LOGPROB_ENTRIES = 16384


@dataclass(frozen=True)
class TokenizerConfig:
    mesh: MeshConfig
    model: str | None = model_setting()
    page_size: int = page_size_setting()
    detok_shards: int = setting(
        1, "detokenizer shards; each request goes to one, picked from its id"
    )
    generation_config: str = setting(
        "auto",
        "auto: a request that leaves temperature, top_p, top_k, min_p or repetition_penalty "
        "unset gets the model's generation_config.json value (as vLLM does); none: OpenAI's "
        "defaults",
        choices=("auto", "none"),
    )

    def __post_init__(self) -> None:
        if self.page_size < 1 or self.detok_shards < 1:
            raise ValueError("page_size and detok_shards must be >= 1")


def parse_args(argv: list[str] | None = None) -> TokenizerConfig:
    return parse(TokenizerConfig, argv, "python -m services.tokenizer")


def detok_shard(request_id: str, shards: int) -> int:
    """Stable across processes (``hash`` is salted per process)."""
    return zlib.crc32(request_id.encode()) % shards


class TokenizerService:
    def __init__(self, config: TokenizerConfig) -> None:
        folder = resolve_model_path(config.model)
        self.config = config
        self.requests: Subscription | None = None  # its backlog: messages not yet handled
        self.tokenizer = Tokenizer.from_folder(folder)
        self.max_model_len = ModelConfig.from_folder(folder).max_position_embeddings
        self.pooler = PoolerConfig.from_folder(folder)  # (how /v1/embeddings pool)
        # An embedding's input may fill the context (its one token is never computed), or
        # sentence-transformers' max_seq_length where the model has one
        self.embedding_context = min(
            self.max_model_len, self.pooler.max_seq_length or self.max_model_len
        )
        self.svc = Service("tokenizer", config.mesh)
        # Announced with its presence: the scheduler refuses executors paging differently
        # (their caches would never match these hashes); the gateway learns the shards.
        self.svc.facts.page_size = config.page_size
        self.svc.facts.detok_shards = config.detok_shards
        # The gateway parses tool calls in the format this template teaches the model.
        self.tool_format = detect_tool_format(self.tokenizer.chat_template_text(tools=True))
        self.svc.facts.tool_format = self.tool_format
        self.think_start = think_token(self.tokenizer, THINK_START)
        self.think_end = think_token(self.tokenizer, THINK_END)
        self.warned_think_tokens = False
        self.sampling_defaults = (
            sampling_defaults(folder) if config.generation_config == "auto" else {}
        )
        if self.sampling_defaults:
            log.info("requests that leave them unset sample with the model's generation_config "
                     "%s (--generation-config none: OpenAI's defaults)",
                     self.sampling_defaults)  # fmt: skip

    async def start(self) -> None:
        await self.svc.connect()
        subjects = self.svc.subjects
        self.requests = await self.svc.subscribe(
            subjects.tokenizer_encode,
            GenerateRequest,
            self.on_request,
            queue="tokenizer",
            span="tokenizer.encode",
        )
        await self.svc.serve(
            subjects.tokenizer_tokenize, TokenizeRequest, self.on_tokenize, queue="tokenizer"
        )
        await self.svc.serve(
            subjects.tokenizer_detokenize, DetokenizeRequest, self.on_detokenize, queue="tokenizer"
        )

    async def on_tokenize(self, ask: TokenizeRequest) -> TokenizeReply:
        """vLLM's ``/tokenize``: what a request with this prompt or these messages would be
        encoded as (the chat template with the same controls and tools)."""
        req = GenerateRequest(
            "tokenize",
            "",
            WireSamplingParams(),
            prompt=ask.prompt,
            messages=ask.messages,
            tools=ask.tools,
            add_generation_prompt=ask.add_generation_prompt,
            continue_final_message=ask.continue_final_message,
            chat_template_kwargs=ask.chat_template_kwargs,
        )
        try:
            text = self.render_chat(req) if ask.messages is not None else ask.prompt or ""
            ids = self.tokenizer.encode(text, add_special_tokens=ask.add_special_tokens)
        except TokenizerError as exc:
            field = "prompt" if ask.messages is None else "messages"
            raise RequestError(str(exc), param=field) from exc
        strs = None
        if ask.return_token_strs:
            strs = [self.tokenizer.id_to_token(t) or "" for t in ids]
        return TokenizeReply(ids, self.max_model_len, strs)

    async def on_detokenize(self, ask: DetokenizeRequest) -> DetokenizeReply:
        """vLLM's ``/detokenize``: the text of these ids, special tokens included."""
        vocab = self.tokenizer.vocab_size
        bad = [t for t in ask.tokens if not 0 <= t < vocab]
        if bad:
            raise RequestError(f"token ids out of range [0, {vocab}): {bad[:5]}", param="tokens")
        return DetokenizeReply(self.tokenizer.decode(ask.tokens, skip_special_tokens=False))

    def encode(self, req: GenerateRequest) -> tuple[list[int], str, str]:
        """The prompt's token ids, the request field they came from (for error params), and
        a chat prompt's last <think> tag (``common.reasoning.think_state``)."""
        try:
            if req.messages is not None:
                text = self.render_chat(req)
                ids = self.tokenizer.encode(text, add_special_tokens=False)
                return ids, "messages", think_state(text)
            if req.prompt_token_ids is not None:
                vocab = self.tokenizer.vocab_size
                bad = [t for t in req.prompt_token_ids if not 0 <= t < vocab]
                if bad:
                    raise RequestError(
                        f"prompt token ids out of range [0, {vocab}): {bad[:5]}", param="prompt"
                    )
                return list(req.prompt_token_ids), "prompt", ""
            if req.prompt is not None:
                return self.tokenizer.encode(req.prompt), "prompt", ""
        except TokenizerError as exc:
            field = "messages" if req.messages is not None else "prompt"
            raise RequestError(str(exc), param=field) from exc
        raise RequestError("the request has neither a prompt nor messages", param="prompt")

    def pooling(self, req: GenerateRequest) -> GenerateRequest:
        """An embedding request with the model's own pooling and, unless the request chose,
        its normalization (``gpu.pooler_config``); a 400 where the model serves no
        embeddings or not in the requested size."""
        params = req.params
        if params.pooling != "model":
            raise RequestError(f"unknown pooling {params.pooling!r}", param="input")
        if self.pooler.unsupported:
            raise RequestError(self.pooler.unsupported, param="model")
        try:
            self.pooler.check(params.pooling_dimensions)
        except PoolingError as exc:
            raise RequestError(str(exc), param="dimensions") from None
        normalize = params.pooling_normalize
        pooled = dataclasses.replace(
            params,
            pooling=self.pooler.pooling,
            pooling_normalize=self.pooler.normalize if normalize is None else normalize,
        )
        return dataclasses.replace(req, params=pooled)

    def after_reasoning(
        self, grammar: WireGrammar, parser: str, think: str
    ) -> tuple[WireGrammar, str]:
        """A constrained chat answer under a reasoning parser: where it starts inside the
        reasoning (``starts_inside``) the grammar holds from after ``</think>``, as vLLM
        orders them; where the model may open the block itself (``qwen3``, a prompt with no
        tag), from after it if the answer starts with ``<think>``, else from the first token.
        Otherwise (the prompt closed the block; tags of several tokens) the grammar holds from
        the first token and the answer has no reasoning (the block is reported closed, so the
        gateway takes all of it as content)."""
        end, start = self.think_end, self.think_start
        if end is None or start is None:
            if not self.warned_think_tokens:
                self.warned_think_tokens = True
                log.warning("this vocabulary has no single %s and %s tokens: a constrained "
                            "answer gets its grammar from its first token, with no reasoning",
                            THINK_START, THINK_END)  # fmt: skip
        elif starts_inside(parser, think):
            return dataclasses.replace(grammar, after_token=end), think
        elif parser == "qwen3" and not think:  # Qwen3's own templates leave it to the model
            return dataclasses.replace(grammar, after_token=end, open_token=start), think
        return grammar, CLOSED

    def truncated(self, req: GenerateRequest, ids: list[int], keep: int) -> list[int]:
        """vLLM's ``truncate_prompt_tokens``: the prompt's last ``keep`` tokens. A text prompt
        keeps the special tokens its encoding adds (a Llama BOS), as transformers' left
        truncation to ``max_length`` does in vLLM: BOS and the last ``keep - 1``."""
        if req.prompt is None or req.messages is not None or len(ids) <= keep:
            return ids[-keep:]
        core = self.tokenizer.encode(req.prompt, add_special_tokens=False)
        for start in range(len(ids) - len(core) + 1):
            if ids[start : start + len(core)] == core:
                head, tail = ids[:start], ids[start + len(core) :]
                room = max(0, keep - len(head) - len(tail))
                return head + core[len(core) - room :] + tail
        return ids[-keep:]

    def render_chat(self, req: GenerateRequest) -> str:
        """The chat template's prompt text, with vLLM's controls: ``add_generation_prompt``,
        ``chat_template_kwargs`` (never over the template's own variables), and
        ``continue_final_message``, which cuts the text where the final message's content
        ends, so that the model continues it (no end-of-turn after it)."""
        messages, tools = self.chat_input(req)
        kwargs = json.loads(req.chat_template_kwargs) if req.chat_template_kwargs else {}
        if not isinstance(kwargs, dict):
            raise RequestError("chat_template_kwargs must be an object", param="messages")
        for name in ("messages", "tools", "add_generation_prompt"):  # the request's own
            kwargs.pop(name, None)
        text = self.tokenizer.apply_chat_template(
            messages,
            req.add_generation_prompt and not req.continue_final_message,
            tools=tools,
            **kwargs,
        )
        if req.continue_final_message:
            # where the content ends; as transformers, its stripped form if the template trims
            # it (Llama 3's does)
            final = messages[-1]["content"]
            for content in (final, final.strip()) if final else ():
                end = text.rfind(content) if content else -1
                if end >= 0:
                    return text[: end + len(content)]
            raise RequestError(
                "The chat template does not render the final message's content as given, "
                "so it cannot be continued.",
                param="continue_final_message",
            )
        return text

    def chat_input(
        self, req: GenerateRequest
    ) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
        """The messages and tools as the chat template reads them (transformers' shapes).
        Tools go to a template that renders them; one that does not gets them as a system
        message in the hermes format (the gateway then parses that format), put before the
        request's own system message, in the same turn: a second system turn breaks templates
        that check the roles alternate (Llama 2, Mistral)."""
        messages = [chat_turn(m) for m in req.messages or []]
        tools = None
        if req.tools is not None and req.tools.mode != "none":
            tools = json.loads(req.tools.tools)
            if not renders_tools(self.tokenizer.chat_template_text(tools=True)):
                preamble = hermes_preamble(tools)
                if messages and messages[0]["role"] == "system":
                    own = messages[0]["content"]
                    messages[0] = {**messages[0], "content": f"{preamble}\n\n{own}"}
                else:
                    messages.insert(0, {"role": "system", "content": preamble})
                tools = None
        return messages, tools

    async def on_request(self, req: GenerateRequest) -> None:
        """Requests are handled one after another (one subscription); while more wait behind
        this one, presence says since when (``Presence.behind_since``): the gateway's watchdog
        then does not take a request still queued here for lost."""
        self.svc.facts.behind_since = req.arrival_time or time.time()
        try:
            await self.tokenize(req)
        finally:
            if self.requests is None or not self.requests.pending_msgs:
                self.svc.facts.behind_since = None

    async def tokenize(self, req: GenerateRequest) -> None:
        if req.deadline and req.deadline < time.time():
            raise RequestError("The request timed out.", 504, "timeout_error", None, "timeout")
        ids, field, think = self.encode(req)
        pooled = bool(req.params.pooling)
        if req.truncate_prompt_tokens is not None:
            keep = req.truncate_prompt_tokens
            ids = self.truncated(req, ids, min(keep, self.embedding_context) if pooled else keep)
        trace.get_current_span().set_attribute(Attr.PROMPT_TOKENS, len(ids))
        if not ids:
            raise RequestError("the prompt is empty", param=field)
        if (top := req.params.prompt_logprobs) is not None and (
            entries := (top + 1) * (len(ids) - 1)
        ) > MAX_PROMPT_LOGPROB_ENTRIES:
            raise RequestError(
                f"prompt_logprobs (or echo with logprobs) of {top} for {len(ids)} prompt tokens "
                f"would be {entries} entries; at most {MAX_PROMPT_LOGPROB_ENTRIES} are sent "
                "(ask for fewer alternatives, or a shorter prompt).",
                param="prompt_logprobs",
            )
        if pooled and len(ids) > self.embedding_context:
            raise RequestError(
                f"This model's maximum input length for embeddings is {self.embedding_context} "
                f"tokens. However, your input resulted in {len(ids)} tokens (truncate_prompt_"
                "tokens: -1 keeps its last tokens that fit).",
                param=field,
                code="context_length_exceeded",
            )
        if len(ids) >= self.max_model_len and not pooled:
            raise RequestError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"your {field} resulted in {len(ids)} tokens.",
                param=field,
                code="context_length_exceeded",
            )
        if req.params.pooling:
            req = self.pooling(req)
        if defaults := {k: v for k, v in self.sampling_defaults.items() if k in req.sampling_unset}:
            req = dataclasses.replace(req, params=dataclasses.replace(req.params, **defaults))
        if req.bad_words:
            words = bad_words_token_ids(self.tokenizer, req.bad_words)
            req = dataclasses.replace(
                req, params=dataclasses.replace(req.params, bad_words_token_ids=words)
            )
        grammar = grammar_for(req.response_format, req.tools, self.tool_format)
        if grammar is not None and req.reasoning_parser:
            grammar, think = self.after_reasoning(grammar, req.reasoning_parser, think)
        room = self.max_model_len - len(ids)
        if req.params.max_tokens > room and not pooled:  # (its one token is never computed)
            if req.max_tokens_chosen and not req.output_token_ids:  # (a continuation passed)
                raise context_too_long(
                    self.max_model_len, len(ids), req.params.max_tokens, field, "max_tokens"
                )
            if req.params.min_tokens > room and not req.output_token_ids:
                raise context_too_long(
                    self.max_model_len, len(ids), req.params.min_tokens, field, "min_tokens"
                )
            # As vLLM does for chat defaults: never ask for more than the context allows;
            # the output then ends with finish_reason "length".
            params = dataclasses.replace(
                req.params, max_tokens=room, min_tokens=min(req.params.min_tokens, room)
            )
            req = dataclasses.replace(req, params=params)
        # The n choices share the prompt: encoded and hashed once, then one request per choice
        # (its own id, so its own detokenizer shard, and its own seed).
        hashes = page_hashes(ids, self.config.page_size, namespace_root(req.lora))
        for choice_id, params in req.choices():
            await self.svc.publish(
                self.svc.subjects.scheduler_submit,
                TokenizedRequest(
                    request_id=choice_id,
                    reply_to=req.reply_to,
                    params=params,
                    prompt_token_ids=ids,
                    page_hashes=hashes,
                    detok_shard=detok_shard(choice_id, self.config.detok_shards),
                    priority=req.priority,
                    deadline=req.deadline,
                    arrival_time=req.arrival_time,
                    output_token_ids=req.output_token_ids,
                    grammar=grammar,
                    lora=req.lora,
                    think=think,
                ),
            )


def think_token(tokenizer: Tokenizer, tag: str) -> int | None:
    """The id of ``tag`` (``<think>``, ``</think>``) where the vocabulary has it as one token
    (Qwen3, QwQ, the R1 distills), else None."""
    tid = tokenizer.token_to_id(tag)
    if tid is None:
        ids = tokenizer.encode(tag, add_special_tokens=False)
        tid = ids[0] if len(ids) == 1 else None
    return tid


def bad_words_token_ids(tokenizer: Tokenizer, words: list[str]) -> list[list[int]]:
    """vLLM's encoding of ``bad_words``: each word as it starts a text, and with a leading
    space as it follows another word, the second kept only where the space makes another first
    token of the same length (a SentencePiece tokenizer gives both forms one encoding)."""
    out: list[list[int]] = []
    for word in words:
        alone = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        if not alone:  # (the gateway admits no blank word)
            continue
        out.append(alone)
        if spaced and spaced[0] != alone[0] and len(spaced) == len(alone):
            out.append(spaced)
    if sum(len(ids) for ids in out) > MAX_BAD_WORDS_TOKENS:
        raise RequestError(
            f"'bad_words' encode to more than {MAX_BAD_WORDS_TOKENS} tokens.", param="bad_words"
        )
    return out


def chat_turn(message: ChatMessage) -> dict[str, Any]:
    turn: dict[str, Any] = {"role": message.role, "content": message.content}
    if message.tool_calls:
        turn["tool_calls"] = json.loads(message.tool_calls)
    if message.tool_call_id:
        turn["tool_call_id"] = message.tool_call_id
    if message.name:
        turn["name"] = message.name
    return turn


def hermes_preamble(tools: list[dict[str, Any]]) -> str:
    """The tool instructions of the Hermes/Qwen2.5 templates, for templates without any."""
    listed = "\n".join(json.dumps(t) for t in tools)
    return (
        "You may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n"
        f"<tools>\n{listed}\n</tools>\n\n"
        "For each function call, return a json object with function name and arguments within "
        "<tool_call></tool_call> XML tags:\n<tool_call>\n"
        '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
    )
