"""A request's output constraint -> xgrammar EBNF text (``WireGrammar``), or a 400 naming the
part of the schema that cannot be enforced.

Why xgrammar (0.2.x): it is what vLLM and SGLang default to; it compiles a JSON schema into a
pushdown automaton with a per-vocabulary token-mask cache, so the per-step cost is a bitmask
fill of tens of microseconds, and it has a CPU path for applying the mask (our CPU executors)
next to the CUDA one. llguidance is comparable but has no wheel pinned here; outlines-core
compiles regex automata whose size explodes on nested schemas.

Where the work happens: converting a schema to EBNF is cheap (tens of microseconds) and needs
no vocabulary, so it happens here, once per distinct schema (cached), and catches every schema
xgrammar cannot handle before the request is queued. Compiling the EBNF against a vocabulary
(the token-mask cache: milliseconds to seconds) happens in each executor, off its step loop,
once per ``WireGrammar.key`` (``services.executor.grammars``).

Whitespace: JSON allows any amount between tokens, and models do spend their whole budget on
it under a grammar (runs of newlines: a known failure of ``any_whitespace`` in vLLM's issue
tracker; our random test models do it at once). The grammar therefore fixes the layout to
one-line JSON with ``", "`` and ``": "`` separators, which is also what OpenAI's structured
outputs return: every token then moves the document towards its end.

``strict``: every schema is enforced in xgrammar's strict mode (no properties or items beyond
what the schema lists), which is what OpenAI's ``strict: true`` means; a non-strict request
gets the same guarantee rather than a looser one. ``json_object`` allows any object.
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
from typing import Any

import xgrammar as xgr
import xgrammar.structural_tag as st

from common.runtime import RequestError
from common.tool_formats import HERMES, HERMES_CLOSE, HERMES_OPEN, MISTRAL, arguments_key
from common.wire.executor import WireGrammar
from common.wire.tokenizer import ResponseFormat, ToolChoice

CACHE_SIZE = 512  # distinct schemas kept converted


def grammar_for(
    response_format: ResponseFormat | None, tools: ToolChoice | None, tool_format: str
) -> WireGrammar | None:
    """The grammar the output must follow, or None for free text. A forced tool call
    (``required`` or a named function) wins over ``response_format``, which OpenAI applies to
    content only."""
    if tools is not None and tools.mode in ("required", "function"):
        several = tools.mode == "required" and tools.parallel
        return _tool_grammar(tools.tools, tools.name, tool_format, several)
    if response_format is None:
        return None
    kind, text = response_format.kind, response_format.schema
    if kind == "json_object":
        return _schema_grammar('{"type": "object"}', "response_format", strict=False)
    if kind == "json_schema":
        return _schema_grammar(text, response_format.param or "response_format.json_schema.schema")
    if kind in ("regex", "choice", "grammar"):
        return _guided_grammar(kind, text, response_format.param or kind)
    raise RequestError(f"unknown output constraint {kind!r}", 400, param="response_format")


@functools.lru_cache(maxsize=CACHE_SIZE)
def _guided_grammar(kind: str, text: str, param: str) -> WireGrammar:
    """vLLM's guided regex, choice (one of the strings, whole) and EBNF grammar."""
    try:
        if kind == "regex":
            return _wire(xgr.Grammar.from_regex(text))
        if kind == "choice":  # JSON string literals are EBNF string literals
            return _wire(
                xgr.Grammar.from_ebnf("root ::= " + " | ".join(map(json.dumps, json.loads(text))))
            )
        return _wire(xgr.Grammar.from_ebnf(text))
    except (RuntimeError, ValueError, TypeError) as exc:
        raise RequestError(
            f"The {kind} cannot be enforced: {_reason(exc)}",
            400,
            "invalid_request_error",
            param,
            "invalid_" + kind,
        ) from None


def _wire(grammar: xgr.Grammar) -> WireGrammar:
    text = str(grammar)
    return WireGrammar(hashlib.blake2b(text.encode(), digest_size=16).hexdigest(), text)


# xgrammar 0.2's strings of bounded length (maxLength, minLength) take any character but a
# quote, a backslash, CR and LF: a raw control character too, which JSON forbids (the
# document then fails json.loads). Its other strings exclude every control character; the
# bounded ones are made to as well.
_BOUNDED_CHARACTER = '[^\\"\\\\\\r\\n]'
_JSON_CHARACTER = '[^\\0-\\x1f\\"\\\\]'


def _from_schema(schema: str, *, strict: bool = True) -> xgr.Grammar:
    grammar = xgr.Grammar.from_json_schema(schema, any_whitespace=False, strict_mode=strict)
    text = str(grammar)
    if _BOUNDED_CHARACTER not in text:
        return grammar
    return xgr.Grammar.from_ebnf(text.replace(_BOUNDED_CHARACTER, _JSON_CHARACTER))


@functools.lru_cache(maxsize=CACHE_SIZE)
def _schema_grammar(schema: str, param: str, strict: bool = True) -> WireGrammar:
    try:
        return _wire(_from_schema(schema, strict=strict))
    except (RuntimeError, ValueError, TypeError) as exc:  # xgrammar's errors are RuntimeError
        raise _unsupported(schema, param, exc) from None


@functools.lru_cache(maxsize=CACHE_SIZE)
def _tool_grammar(tools_json: str, name: str, tool_format: str, several: bool) -> WireGrammar:
    """Calls in ``tool_format``: of the function ``name`` (one call), else of any of the tools
    (``several``: one or more, in the format's own list of calls: hermes blocks one per line,
    llama3_json objects separated by ``"; "``, Mistral's array)."""
    functions = [t["function"] for t in json.loads(tools_json)]
    if name:
        functions = [f for f in functions if f["name"] == name]
    key = arguments_key(tool_format)
    calls: list[dict[str, Any]] = [
        {
            "type": "object",
            "properties": {
                "name": {"const": f["name"]},
                key: f.get("parameters") or {"type": "object"},
            },
            "required": ["name", key],
        }
        for f in functions
    ]
    one: dict[str, Any] = calls[0] if len(calls) == 1 else {"anyOf": calls}
    # Mistral's calls are a JSON array (its [TOOL_CALLS] marker is a special token: the
    # grammar starts at the array)
    if tool_format == MISTRAL:
        one = {"type": "array", "items": one, "minItems": 1} | ({} if several else {"maxItems": 1})
    schema = json.dumps(one)
    try:
        call = _from_schema(schema)
    except (RuntimeError, ValueError, TypeError) as exc:
        raise _unsupported(schema, "tools", exc) from None
    if tool_format == MISTRAL or (tool_format != HERMES and not several):
        return _wire(call)
    content = st.GrammarFormat(grammar=str(call))  # the layout _from_schema fixes
    if tool_format == HERMES:
        block = st.TagFormat(begin=HERMES_OPEN + "\n", content=content, end="\n" + HERMES_CLOSE)
        calls_format: st.Format = st.TagsWithSeparatorFormat(
            tags=[block], separator="\n", at_least_one=True, stop_after_first=not several
        )
    else:
        more = st.SequenceFormat(elements=[st.ConstStringFormat(value="; "), content])
        calls_format = st.SequenceFormat(elements=[content, st.StarFormat(content=more)])
    return _wire(xgr.Grammar.from_structural_tag(st.StructuralTag(format=calls_format)))


# xgrammar's messages start with "[time] /path/file.cc:line: "; the rest is the reason.
_LOCATION = re.compile(r"^\[[^\]]*\]\s*\S+:\d+:\s*")


def _reason(exc: Exception) -> str:
    return _LOCATION.sub("", str(exc).strip())


def _unsupported(schema: str, param: str, exc: Exception) -> RequestError:
    """A 400 that says which part of the schema xgrammar refused: the deepest subschema that
    fails on its own (a JSON pointer), with xgrammar's reason."""
    try:
        where = _failing_part(json.loads(schema), "")
    except ValueError:
        where = None
    at = f" at '{where or '/'}'" if where is not None else ""
    return RequestError(
        f"The JSON schema cannot be enforced{at}: {_reason(exc)}",
        400,
        "invalid_request_error",
        param,
        "invalid_schema",
    )


def _children(schema: Any, path: str) -> list[tuple[Any, str]]:
    if not isinstance(schema, dict):
        return []
    out: list[tuple[Any, str]] = []
    # A schema is the client's JSON: a keyword may hold anything ("properties": [1]), and a
    # malformed one is the part to name, not a reason to fail.
    for key in ("properties", "$defs", "definitions", "patternProperties"):
        subs = schema.get(key)
        if isinstance(subs, dict):
            out += [(sub, f"{path}/{key}/{name}") for name, sub in subs.items()]
    for key in ("anyOf", "oneOf", "allOf", "prefixItems"):
        subs = schema.get(key)
        if isinstance(subs, list):
            out += [(sub, f"{path}/{key}/{i}") for i, sub in enumerate(subs)]
    for key in ("items", "additionalProperties", "not"):
        if isinstance(schema.get(key), dict):
            out.append((schema[key], f"{path}/{key}"))
    return out


def _failing_part(schema: Any, path: str) -> str | None:
    """The path of the deepest subschema that fails alone; None if the whole one converts.
    Subschemas with references are skipped (they only resolve against the root)."""
    for sub, sub_path in _children(schema, path):
        if "$ref" in json.dumps(sub):
            continue
        try:
            _from_schema(json.dumps(sub))
        except (RuntimeError, ValueError, TypeError):
            return _failing_part(sub, sub_path) or sub_path
    try:
        _from_schema(json.dumps(schema))
    except (RuntimeError, ValueError, TypeError):
        return path
    return None
