"""What the tokenizer receives: a request from the gateway (``tokenizer.encode``), and the
gateway's ``/tokenize`` and ``/detokenize`` questions (request/reply).

``WireSamplingParams`` rides along in ``TokenizedRequest`` (scheduler, executor) and
``DraftSeq`` (speculator) too.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import ClassVar

from common.wire.codec import Message, require

# Choices of one request: the tokenizer publishes one message per choice, so a forged n must not
# make it publish millions. Far above any --max-n (OpenAI allows 128).
MAX_CHOICES = 1024


@dataclass(frozen=True)
class WireSamplingParams(Message):
    """The request's sampling and stopping settings as validated by the gateway: the wire form
    of the engine's ``gpu.sampling_params.SamplingParams``.

    Every field but ``DETOKENIZER_ONLY`` is also a field of ``SamplingParams`` under the same
    name, and ``services.sampling`` converts by name: add a field to both.
    """

    # Applied to text by the detokenizer (it gets them in ``StreamStart``); the engine never
    # sees them.
    DETOKENIZER_ONLY: ClassVar[frozenset[str]] = frozenset(
        {"stop", "skip_special_tokens", "include_stop_str_in_output", "echo"}
    )

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True
    # OpenAI's logit_bias as (token id, bias) pairs, biases in [-100, 100]: added to the logits.
    logit_bias: list[tuple[int, float]] = field(default_factory=list)
    # vLLM's extensions: no stop token ends the output before min_tokens, and no stop string
    # completed within them (the detokenizer's part); include_stop_str_in_output keeps the
    # stop string (or stop token) that ended it in the text.
    min_tokens: int = 0
    include_stop_str_in_output: bool = False
    # vLLM's allowed_token_ids (empty: any token), and its bad_words as the tokenizer encodes
    # them (``GenerateRequest.bad_words``): the sampler bans what would complete one.
    allowed_token_ids: list[int] = field(default_factory=list)
    bad_words_token_ids: list[list[int]] = field(default_factory=list)
    # vLLM's prompt_logprobs (top-N per prompt token); completions' echo of a prompt of token
    # ids: the first delta carries the prompt decoded by the detokenizer (the gateway has a
    # text prompt's own text)
    prompt_logprobs: int | None = None
    echo: bool = False
    # /v1/embeddings: the prompt's final hidden states pooled into one vector, sent with the
    # one token generated (``gpu.pooling``). The gateway sends "model" and the request's
    # dimensions and normalize (None: the model's default); the tokenizer puts the model's own
    # pooling ("last", "mean", "cls") and normalization in their place.
    pooling: str = ""
    pooling_dimensions: int | None = None
    pooling_normalize: bool | None = None

    @property
    def every_prompt_position(self) -> bool:
        """Its executor computes every prompt position, taking none from its prefix cache
        (``gpu.sequence.Sequence.every_prompt_position``): prompt logprobs, mean or CLS
        pooling. The router then credits no executor with the prompt's cached pages."""
        return self.prompt_logprobs is not None or self.pooling in ("mean", "cls")


@dataclass(frozen=True)
class ChatMessage(Message):
    """One turn. ``tool_calls``: an assistant turn's calls as OpenAI spells them (a JSON array,
    arguments already parsed into objects for the chat template); ``tool_call_id``: a tool
    turn's answer to that call."""

    role: str
    content: str
    tool_calls: str = ""  # JSON text: msgpack would need a schema for arbitrary objects
    tool_call_id: str = ""
    name: str = ""


@dataclass(frozen=True)
class ResponseFormat(Message):
    """``response_format`` other than text: ``json_object`` (any JSON object) or
    ``json_schema`` with the schema as JSON text; or vLLM's ``guided_*`` /
    ``structured_outputs``: ``regex`` (the pattern in ``schema``), ``choice`` (a JSON array of
    strings) or ``grammar`` (EBNF). The tokenizer turns it into a grammar; ``param`` names the
    request field a 400 about it points at."""

    kind: str  # "json_object" | "json_schema" | "regex" | "choice" | "grammar"
    schema: str = ""
    name: str = ""
    param: str = ""


@dataclass(frozen=True)
class ToolChoice(Message):
    """The request's ``tools`` (a JSON array of OpenAI function tools, for the chat template)
    and ``tool_choice``: ``none``, ``auto``, ``required`` or ``function`` (named: ``name``).
    ``required`` and a named function are enforced with a grammar (the tokenizer builds it):
    a named function is one call; ``required`` one or more, one when ``parallel`` (OpenAI's
    ``parallel_tool_calls``) is false."""

    tools: str
    mode: str = "auto"
    name: str = ""
    parallel: bool = True


@dataclass(frozen=True)
class GenerateRequest(Message):
    """One prompt and the ``n`` sequences (OpenAI's choices) to generate from it.

    The tokenizer encodes the prompt once and forwards one ``TokenizedRequest`` per choice
    (``choices``): from there on each choice is a request of its own, under its own id. An
    error the tokenizer answers under ``request_id`` itself fails every choice.
    """

    request_id: str
    reply_to: str
    params: WireSamplingParams
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    messages: list[ChatMessage] | None = None
    priority: int = 0
    deadline: float | None = None  # unix seconds; past it the request fails with a timeout
    arrival_time: float = 0.0
    n: int = 1
    response_format: ResponseFormat | None = None
    tools: ToolChoice | None = None
    # A continuation (the gateway resumes a request lost in transit): the tokens its client
    # already received. They ride on to ``TokenizedRequest.output_token_ids``: the executor
    # prefills prompt + these and generates the rest, as for a migration.
    output_token_ids: list[int] = field(default_factory=list)
    # The client chose params.max_tokens (a completions default included): more than the
    # context leaves is then a 400, as vLLM answers; a chat default is cut to fit instead.
    max_tokens_chosen: bool = False
    # Sampling fields the client left unset (of common.generation_defaults.SAMPLING_KEYS): the
    # tokenizer gives them the model's generation_config values, as vLLM does.
    sampling_unset: list[str] = field(default_factory=list)
    # vLLM's chat-template controls: end with the assistant header (the default), or continue
    # the final (assistant) message as written (prefill); extra template variables as a JSON
    # object (``chat_template_kwargs``, and ``documents``).
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: str = ""
    # vLLM's: words the output may not contain (the tokenizer encodes them into
    # ``params.bad_words_token_ids``), and a prompt cut to its last this many tokens.
    bad_words: list[str] = field(default_factory=list)
    truncate_prompt_tokens: int | None = None
    # vLLM's --lora-modules: the LoRA adapter the request names as its model ("": the base)
    lora: str = ""
    # A chat request to a gateway with a --reasoning-parser (deepseek_r1, qwen3): a grammar
    # starts after the reasoning where the answer starts inside it (``common.reasoning``)
    reasoning_parser: str = ""

    def __post_init__(self) -> None:
        require(
            "GenerateRequest",
            {
                f"n must be within 1..{MAX_CHOICES}": 1 <= self.n <= MAX_CHOICES,
                "a continuation (output_token_ids) has n = 1": self.n == 1
                or not self.output_token_ids,
                "truncate_prompt_tokens is >= 1": self.truncate_prompt_tokens is None
                or self.truncate_prompt_tokens >= 1,
            },
        )

    def choice_ids(self) -> list[str]:
        """The request id of each choice, in choice order (the gateway awaits these)."""
        return [f"{self.request_id}-{i}" for i in range(self.n)]

    def choices(self) -> list[tuple[str, WireSamplingParams]]:
        """Each choice's request id and sampling settings. Choice ``i`` samples with seed + i,
        so seeded choices differ from each other yet repeat across identical requests (the
        gateway keeps seed + n - 1 in range); unseeded choices differ by their own draws, and
        greedy ones are all equal."""
        seed = self.params.seed
        return [
            (cid, self.params if seed is None or i == 0 else replace(self.params, seed=seed + i))
            for i, cid in enumerate(self.choice_ids())
        ]


@dataclass(frozen=True)
class TokenizeRequest(Message):
    """vLLM's ``/tokenize``: a prompt, or messages rendered by the chat template with vLLM's
    controls, encoded as a request's would be; ``add_special_tokens`` as the client says (vLLM's
    defaults: on for a prompt, off for messages, whose template holds them)."""

    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: str = ""
    tools: ToolChoice | None = None
    return_token_strs: bool = False  # each token's own vocabulary entry too


@dataclass(frozen=True)
class TokenizeReply(Message):
    tokens: list[int]
    max_model_len: int  # the model's context length
    token_strs: list[str] | None = None


@dataclass(frozen=True)
class DetokenizeRequest(Message):
    """vLLM's ``/detokenize``: token ids back to text, special tokens included."""

    tokens: list[int]


@dataclass(frozen=True)
class DetokenizeReply(Message):
    prompt: str
