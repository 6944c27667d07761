"""Tool calls out of generated text, as it streams, in the format the tokenizer announced
(``common.tool_formats``).

``ToolCallParser.feed`` takes each text delta and returns the content that is certainly not part
of a call (text that might open one is held back) and the calls completed so far; ``finish``
flushes the rest at the end of the choice. A block that does not parse as a call is content:
the client sees what the model wrote rather than losing it.
"""

from __future__ import annotations

import json
import re
import secrets
import string
import uuid
from dataclasses import dataclass
from typing import Any

from common.tool_formats import (
    HERMES_CLOSE,
    HERMES_OPEN,
    LLAMA3_JSON,
    LLAMA3_PYTHON_TAG,
    MISTRAL,
    MISTRAL_TOOL_CALLS,
)


@dataclass
class ToolCall:
    """A parsed call; ``arguments`` grows as the text streams in."""

    id: str
    name: str
    arguments: str  # a JSON object as text, as OpenAI sends it

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass(frozen=True)
class CallDelta:
    """What one feed adds to call ``index``: its opening (``id`` and ``name`` set) and/or a
    fragment of its arguments' JSON text."""

    index: int
    id: str = ""
    name: str = ""
    arguments: str = ""


def new_call_id(tool_format: str = "") -> str:
    """OpenAI's ``call_<24 hex>``; 9 letters and digits for Mistral, whose chat templates
    refuse any other id when the call comes back in the conversation."""
    if tool_format == MISTRAL:
        return "".join(secrets.choice(ID_ALPHABET) for _ in range(9))
    return f"call_{uuid.uuid4().hex[:24]}"


ID_ALPHABET = string.ascii_letters + string.digits


def parse_call(text: str, names: set[str], tool_format: str = "") -> ToolCall | None:
    """``{"name": ..., "arguments"|"parameters": {...}}`` naming one of ``names``, or None."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    return call_from(value, names, tool_format)


def call_from(value: Any, names: set[str], tool_format: str = "") -> ToolCall | None:
    """``parse_call`` of JSON already decoded."""
    if not isinstance(value, dict) or value.get("name") not in names:
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    arguments_text = json.dumps(arguments, ensure_ascii=False)
    return ToolCall(new_call_id(tool_format), value["name"], arguments_text)


def held_prefix(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


# The head of a hermes call, up to its arguments: what lets them stream before the call ends.
HERMES_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"([^"\\]*)"\s*,\s*"arguments"\s*:\s*(?=\{)')


class ArgumentsScanner:
    """Finds where a JSON object ends in text that arrives piece by piece (string-aware)."""

    def __init__(self) -> None:
        self.depth = 0
        self.in_string = False
        self.escaped = False
        self.done = False

    def take(self, text: str) -> int:
        """How many characters of ``text`` belong to the object (all, until it closes)."""
        for i, ch in enumerate(text):
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.in_string = False
            elif ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth == 0:
                    self.done = True
                    return i + 1
        return len(text)


class ToolCallParser:
    """``feed``/``finish`` return ``(content, deltas)``; ``calls`` holds every call so far.

    hermes: a call opens (id, name) as soon as its head ``{"name": ..., "arguments": `` has
    arrived, and its arguments stream as they are generated; a block whose head has another
    shape is parsed whole at its end. llama3_json: text that starts as JSON is held and parsed
    at the end (several ``;``-separated calls). mistral: the same, for text that starts with
    ``[TOOL_CALLS]`` or a JSON array (of calls)."""

    def __init__(self, tool_format: str, names: set[str]) -> None:
        self.tool_format = tool_format
        self.mistral = tool_format == MISTRAL
        # llama3_json, mistral: text that starts as a call is held and parsed whole at the end
        self.whole = tool_format in (LLAMA3_JSON, MISTRAL)
        self.call_starts = ("[", MISTRAL_TOOL_CALLS) if self.mistral else ("{", LLAMA3_PYTHON_TAG)
        self.names = names
        self.buffer = ""
        self.inside = False  # hermes: within <tool_call>...</tool_call>
        self.scanner: ArgumentsScanner | None = None  # hermes: a call whose arguments stream
        self.undecided = True  # whole: no text yet that says whether it is a call
        self.plain = False  # whole: it is content, streamed as it comes
        self.calls: list[ToolCall] = []
        # hermes: whitespace not yet known to be content (text follows it) or layout (a call
        # follows it, or the output ends after calls)
        self.held_space = ""

    def feed(self, text: str) -> tuple[str, list[CallDelta]]:
        self.buffer += text
        return self._whole() if self.whole else self._hermes(final=False)

    def finish(self) -> tuple[str, list[CallDelta]]:
        if not self.whole:
            return self._hermes(final=True)
        text, self.buffer = self.buffer, ""
        calls = self._mistral_calls(text) if self.mistral else self._llama_calls(text)
        if calls is None:
            return text, []
        return "", [self._add(call) for call in calls]

    def _add(self, call: ToolCall) -> CallDelta:
        self.calls.append(call)
        return CallDelta(len(self.calls) - 1, call.id, call.name, call.arguments)

    def _hermes(self, final: bool) -> tuple[str, list[CallDelta]]:
        content: list[str] = []
        deltas: list[CallDelta] = []
        while self.buffer:
            if not self.inside:
                at = self.buffer.find(HERMES_OPEN)
                if at < 0:
                    keep = 0 if final else held_prefix(self.buffer, HERMES_OPEN)
                    self._text(self.buffer[: len(self.buffer) - keep], content)
                    self.buffer = self.buffer[len(self.buffer) - keep :]
                    break
                self._text(self.buffer[:at], content)
                self.buffer = self.buffer[at + len(HERMES_OPEN) :]
                self.inside = True
            if self.scanner is None:
                head = HERMES_HEAD.match(self.buffer)
                if head is not None and head.group(1) in self.names:
                    call = ToolCall(new_call_id(self.tool_format), head.group(1), "")
                    self.held_space = ""  # layout before a call
                    deltas.append(self._add(call))
                    self.scanner = ArgumentsScanner()
                    self.buffer = self.buffer[head.end() :]
            if self.scanner is not None and not self.scanner.done:
                n = self.scanner.take(self.buffer)
                if n:
                    self.calls[-1].arguments += self.buffer[:n]
                    deltas.append(CallDelta(len(self.calls) - 1, arguments=self.buffer[:n]))
                    self.buffer = self.buffer[n:]
            end = self.buffer.find(HERMES_CLOSE)
            if end < 0 and not final:
                break  # the rest of the block (or the arguments) is still to come
            taken = end + len(HERMES_CLOSE) if end >= 0 else len(self.buffer)
            if self.scanner is None:  # not the usual head: the block parses whole, or is text
                block = self.buffer[: end if end >= 0 else None].strip()
                parsed = parse_call(block, self.names, self.tool_format)
                if parsed is None:
                    self._text(HERMES_OPEN + self.buffer[:taken], content)
                else:
                    self.held_space = ""
                    deltas.append(self._add(parsed))
            self.buffer = self.buffer[taken:]
            self.inside = False
            self.scanner = None
        if final:  # trailing whitespace: the text's own, unless calls came (layout then)
            content.append("" if self.calls else self.held_space)
            self.held_space = ""
        return "".join(content), deltas

    def _text(self, piece: str, out: list[str]) -> None:
        """Content, its trailing whitespace held until text follows it (it is then the
        text's): the same text whatever the pieces, one token or the whole output."""
        body = piece.rstrip()
        if body:
            out.append(self.held_space + body)
            self.held_space = piece[len(body) :]
        else:
            self.held_space += piece

    def _whole(self) -> tuple[str, list[CallDelta]]:
        if self.undecided:
            head = self.buffer.lstrip()
            if not head:
                return "", []
            self.undecided = False
            self.plain = not head.startswith(self.call_starts)
        if self.plain:
            text, self.buffer = self.buffer, ""
            return text, []
        return "", []  # a call: held to the end, then parsed whole

    def _llama_calls(self, text: str) -> list[ToolCall] | None:
        body = text.strip().removeprefix(LLAMA3_PYTHON_TAG).strip()
        decoder = json.JSONDecoder()
        calls = []
        while body:  # one or more objects, separated by ";"
            try:
                value, end = decoder.raw_decode(body)
            except ValueError:
                return None
            call = call_from(value, self.names, self.tool_format)
            if call is None:
                return None
            calls.append(call)
            body = body[end:].lstrip().removeprefix(";").lstrip()
        return calls or None

    def _mistral_calls(self, text: str) -> list[ToolCall] | None:
        """``[TOOL_CALLS] [{...}, ...]``, the marker optional: every element a call."""
        body = text.strip().removeprefix(MISTRAL_TOOL_CALLS).strip()
        try:
            value = json.loads(body)
        except ValueError:
            return None
        if isinstance(value, dict):
            value = [value]
        if not isinstance(value, list) or not value:
            return None
        calls = []
        for element in value:
            call = call_from(element, self.names, self.tool_format)
            if call is None:
                return None
            calls.append(call)
        return calls
