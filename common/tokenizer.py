"""Tokenizer for the serving path: a Hugging Face folder's ``tokenizer.json`` without transformers.

Encoding and decoding go through the ``tokenizers`` library; chat templates are rendered with
jinja2 the way transformers renders them (sandboxed, ``trim_blocks``/``lstrip_blocks``, the same
globals and ``tojson`` filter), so prompts match transformers' ``apply_chat_template``.

:class:`IncrementalDetokenizer` turns a stream of generated ids into text deltas without ever
emitting a half-decoded UTF-8 character (the prefix/read offset scheme of vLLM and TGI).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2 import nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as _Backend

from common.token_bytes import TokenBytes
from common.wire.detokenizer import PROMPT_TAIL_TOKENS

__all__ = ["IncrementalDetokenizer", "Tokenizer", "TokenizerError"]

REPLACEMENT_CHAR = "\ufffd"


class TokenizerError(ValueError):
    """A tokenizer folder, chat template or chat input that cannot be used; the message says why."""


def _token_content(value: Any) -> str | None:
    """A special token as tokenizer_config.json spells it: a string or an AddedToken dict."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise TokenizerError(f"{path} is not valid JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise TokenizerError(f"{path} does not hold a JSON object")
    return value


def _ids(value: Any) -> list[int]:
    if isinstance(value, bool) or value is None:
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [int(v) for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


def _chat_templates(folder: Path, config: Mapping[str, Any]) -> dict[str, str]:
    """The model's chat templates by name, found where transformers looks: template files
    (``chat_template.jinja``, the default, and ``additional_chat_templates/<name>.jinja``)
    before ``tokenizer_config.json``'s ``chat_template`` (one string, or a list of named ones)."""
    files = {}
    default_file = folder / "chat_template.jinja"  # where transformers >= 4.50 saves it
    if default_file.is_file():
        files["default"] = default_file.read_text(encoding="utf-8")
    extra = folder / "additional_chat_templates"
    if extra.is_dir():
        for path in sorted(extra.glob("*.jinja")):
            files[path.stem] = path.read_text(encoding="utf-8")
    if files:
        return files
    template = config.get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": "..."}, ...]
        return {
            t["name"]: t["template"]
            for t in template
            if isinstance(t, Mapping) and isinstance(t.get("name"), str)
            and isinstance(t.get("template"), str) and t["template"]
        }  # fmt: skip
    return {"default": template} if isinstance(template, str) and template else {}


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` (transformers' assistant-mask marker) renders
    its body unchanged; it only matters for training masks, but templates use it."""

    tags = {"generation"}  # noqa: RUF012 - jinja2 declares it as a set

    def parse(self, parser: Any) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        call = self.call_method("_render")
        return nodes.CallBlock(call, [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return str(caller())


def _compile_template(source: str) -> Any:
    """Compile a chat template in the environment transformers uses."""

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(
        value: Any,
        ensure_ascii: bool = False,
        indent: int | None = None,
        separators: tuple[str, str] | None = None,
        sort_keys: bool = False,
    ) -> str:
        return json.dumps(
            value,
            ensure_ascii=ensure_ascii,
            indent=indent,
            separators=separators,
            sort_keys=sort_keys,
        )

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    try:
        return env.from_string(source)
    except jinja2.exceptions.TemplateSyntaxError as exc:
        raise TokenizerError(f"the chat template does not compile: {exc}") from exc


class Tokenizer:
    """Encode, decode and chat-template for one Hugging Face tokenizer folder."""

    def __init__(
        self,
        backend: Any,
        *,
        chat_template: str | Mapping[str, str] | None = None,
        special_tokens: Mapping[str, str | None] | None = None,
        eos_token_ids: Sequence[int] = (),
        name: str = "tokenizer",
    ) -> None:
        self._tok = backend
        self._token_bytes: TokenBytes | None = None  # built on first use (reads the vocab)
        # by name, as transformers keeps several: "tool_use" renders requests with tools
        self.chat_templates: dict[str, str] = (
            dict(chat_template) if isinstance(chat_template, Mapping)
            else {"default": chat_template} if chat_template else {}
        )  # fmt: skip
        self._compiled: dict[str, Any] = {}
        self.special_tokens: dict[str, str] = {
            key: value for key, value in (special_tokens or {}).items() if value is not None
        }
        self.bos_token: str | None = self.special_tokens.get("bos_token")
        self.eos_token: str | None = self.special_tokens.get("eos_token")
        self.bos_token_id: int | None = self.token_to_id(self.bos_token)
        ids: list[int] = []
        for tid in [*eos_token_ids, self.token_to_id(self.eos_token)]:
            if tid is not None and tid not in ids:
                ids.append(tid)
        self.eos_token_ids: tuple[int, ...] = tuple(ids)
        self.name = name

    @classmethod
    def from_folder(cls, path: str | Path) -> Tokenizer:
        """Load ``tokenizer.json`` plus ``tokenizer_config.json`` and the generation/model configs.

        End-of-sequence ids are the union of ``generation_config.json``'s ``eos_token_id``
        (int or list), ``config.json``'s and the tokenizer's ``eos_token``.
        """
        folder = Path(path)
        tokenizer_file = folder / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise TokenizerError(f"{folder} has no tokenizer.json")
        try:
            backend = _Backend.from_file(str(tokenizer_file))
        except Exception as exc:  # the Rust side raises plain Exception subclasses
            raise TokenizerError(f"{tokenizer_file} cannot be loaded: {exc}") from exc
        config = _read_json(folder / "tokenizer_config.json")
        special = {
            key: _token_content(config.get(key))
            for key in ("bos_token", "eos_token", "unk_token", "pad_token")
        }
        eos_ids = _ids(_read_json(folder / "generation_config.json").get("eos_token_id"))
        eos_ids += _ids(_read_json(folder / "config.json").get("eos_token_id"))
        return cls(
            backend,
            chat_template=_chat_templates(folder, config),
            special_tokens=special,
            eos_token_ids=eos_ids,
            name=folder.name,
        )

    # ------------------------------------------------------------------ basics

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer can produce (added tokens included)."""
        return int(self._tok.get_vocab_size(with_added_tokens=True))

    @property
    def backend(self) -> Any:
        """The underlying ``tokenizers.Tokenizer``."""
        return self._tok

    def token_to_id(self, token: str | None) -> int | None:
        if token is None:
            return None
        tid = self._tok.token_to_id(token)
        return None if tid is None else int(tid)

    def id_to_token(self, token_id: int) -> str | None:
        token = self._tok.id_to_token(token_id)
        return None if token is None else str(token)

    def token_bytes(self, token_id: int) -> bytes:
        """The token's own bytes (``common.token_bytes``): part of a character, maybe."""
        if self._token_bytes is None:
            self._token_bytes = TokenBytes(self._tok)
        return self._token_bytes(token_id)

    def token_text(self, token_id: int) -> str:
        """The token as text of its own (logprobs' ``token``): its bytes, U+FFFD for part of a
        character. Not ``decode([id])``: a SentencePiece decoder strips the leading space of
        the first token it decodes, so "▁cat" and "cat" would both read "cat"."""
        return self.token_bytes(token_id).decode("utf-8", "replace")

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; ``add_special_tokens`` applies the tokenizer's post-processor
        (e.g. a BOS for Llama 3). Pass False for text already rendered by a chat template."""
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)

    def encode_batch(
        self, texts: Sequence[str], add_special_tokens: bool = True
    ) -> list[list[int]]:
        encodings = self._tok.encode_batch(list(texts), add_special_tokens=add_special_tokens)
        return [list(e.ids) for e in encodings]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return str(self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens))

    # ------------------------------------------------------------------ chat

    def template_name(self, tools: bool = False) -> str | None:
        """The template a request renders with, chosen as transformers chooses: ``tool_use``
        for a request with tools where the model has one, else ``default`` (else the only or
        first one)."""
        if tools and "tool_use" in self.chat_templates:
            return "tool_use"
        if "default" in self.chat_templates:
            return "default"
        return next(iter(self.chat_templates), None)

    def chat_template_text(self, tools: bool = False) -> str | None:
        name = self.template_name(tools)
        return self.chat_templates[name] if name is not None else None

    @property
    def chat_template(self) -> str | None:
        """The template of requests without tools."""
        return self.chat_template_text(tools=False)

    def _template(self, tools: bool) -> Any:
        name = self.template_name(tools)
        if name is None:
            raise TokenizerError(f"tokenizer {self.name!r} has no chat template")
        if name not in self._compiled:
            self._compiled[name] = _compile_template(self.chat_templates[name])
        return self._compiled[name]

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        **kwargs: Any,
    ) -> str:
        """Render ``messages`` (``{"role", "content", ...}`` dicts) into the prompt text.

        The template sees what transformers gives it: ``messages``, ``tools``, ``documents``,
        ``add_generation_prompt``, the special tokens (``bos_token``, ``eos_token``, ...) and any
        extra ``kwargs``. A template's ``raise_exception`` (e.g. roles that do not alternate)
        surfaces as :class:`TokenizerError`.
        """
        for message in messages:
            if not isinstance(message, Mapping):
                raise TokenizerError(f"chat messages must be objects, got {message!r}")
        context: dict[str, Any] = {**self.special_tokens, **kwargs}
        context.update(
            messages=[dict(m) for m in messages],
            tools=[dict(t) for t in tools] if tools is not None else None,
            add_generation_prompt=add_generation_prompt,
        )
        context.setdefault("documents", None)
        try:
            return str(self._template(tools is not None).render(**context))
        except jinja2.exceptions.TemplateError as exc:
            raise TokenizerError(f"chat template error: {exc}") from exc
        except Exception as exc:  # the request's values (chat_template_kwargs) met the template
            raise TokenizerError(f"chat template error: {type(exc).__name__}: {exc}") from exc

    def encode_user_turn(self, content: str) -> list[int]:
        """One user message in the chat template (generation prompt added), encoded as the
        tokenizer service encodes a chat request: the template already holds the special
        tokens."""
        return self.encode(
            self.apply_chat_template([{"role": "user", "content": content}]),
            add_special_tokens=False,
        )

    def detokenizer(
        self, prompt_ids: Sequence[int] = (), *, skip_special_tokens: bool = True
    ) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(
            self, prompt_ids=prompt_ids, skip_special_tokens=skip_special_tokens
        )


class IncrementalDetokenizer:
    """Turn generated ids into text deltas, one call per step.

    It decodes a small window of ids: ``[prefix_offset, read_offset)`` is text already emitted
    (kept as context so tokenizers that drop a leading space on the first token decode the next
    ones right), ``[read_offset, end)`` is pending. While the window's text ends in U+FFFD (a
    multi-byte character cut between tokens) nothing past the last complete character is
    emitted; :meth:`finish` flushes whatever remains at the end of the stream.

    ``prompt_ids`` (optional) seeds the context with the prompt's last few ids, from the first
    that starts a character: a SentencePiece byte-fallback decoder turns a run of byte tokens
    that is not valid UTF-8 into U+FFFD as a whole, so a context opening mid-character would
    spoil the generated bytes that join its run.
    """

    CONTEXT_TOKENS = PROMPT_TAIL_TOKENS  # (what an executor sends of the prompt)

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_ids: Sequence[int] = (),
        *,
        skip_special_tokens: bool = True,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = list(prompt_ids[-self.CONTEXT_TOKENS :]) if prompt_ids else []
        while self._ids and self._decode(self._ids).startswith(REPLACEMENT_CHAR):
            self._ids.pop(0)
        self._read = len(self._ids)
        self._anchor: list[int] = list(self._ids)  # the last context ids that had text
        # characters of decode(self._ids) already emitted (or belonging to the prompt)
        self._emitted = len(self._decode(self._ids))
        self.text = ""
        self.num_tokens = 0

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip) if ids else ""

    def add(self, token_ids: Iterable[int]) -> str:
        """Feed newly generated ids; return the text they complete (may be empty)."""
        new = list(token_ids)
        if not new:
            return ""
        self._ids.extend(new)
        self.num_tokens += len(new)
        text = self._decode(self._ids)
        complete = not text.endswith(REPLACEMENT_CHAR)
        # hold back a trailing run of U+FFFD: more bytes may still turn it into a character
        stable = text if complete else text.rstrip(REPLACEMENT_CHAR)
        delta = stable[self._emitted :] if len(stable) > self._emitted else ""
        if delta:
            self._emitted = len(stable)
            self.text += delta
        if complete and len(text) >= self._emitted:
            # everything up to here is emitted: slide the window, keeping this step's ids as
            # context, after the last step's that had text when these have none (a skipped
            # special token: a SentencePiece decoder would strip the next token's leading
            # space as the start of the text). Bounded: two steps' ids at most.
            keep = self._ids[self._read :] or self._ids[-1:]
            if self._decode(keep):
                self._anchor = keep
                self._ids = list(keep)
            else:
                self._ids = [*self._anchor, *keep]
            self._read = len(self._ids)
            self._emitted = len(self._decode(self._ids))
        return delta

    def finish(self) -> str:
        """End of stream: return any text still held back (it may contain U+FFFD)."""
        text = self._decode(self._ids)
        delta = text[self._emitted :] if len(text) > self._emitted else ""
        self._ids = self._ids[-1:]
        self._read = len(self._ids)
        self._emitted = len(self._decode(self._ids))
        self.text += delta
        return delta
