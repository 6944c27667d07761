"""How a model family writes a tool call, chosen from its chat template.

The tokenizer picks the format once from the template (and announces it with its presence),
builds the grammar that forces a call in that format for ``tool_choice`` ``required`` or a
named function, and the gateway parses calls out of the text in the same format. The two
formats cover the families meshserve serves (as vLLM's ``hermes`` and ``llama3_json`` parsers):

- ``hermes``: ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``, one block per
  call: Qwen2/2.5, Hermes, SmolLM2 and any template that does not say otherwise.
- ``llama3_json``: Llama 3.1/3.2's JSON form, ``{"name": ..., "parameters": {...}}``, optionally
  after ``<|python_tag|>``, several calls separated by ``;``.
- ``mistral``: Mistral's (v0.3 and later templates, ``[AVAILABLE_TOOLS]``/``[TOOL_CALLS]``):
  ``[TOOL_CALLS]`` (a special token, so usually not in the text) then a JSON array of
  ``{"name": ..., "arguments": {...}}``; its templates want call ids of 9 letters and digits.
"""

from __future__ import annotations

HERMES = "hermes"
LLAMA3_JSON = "llama3_json"
MISTRAL = "mistral"
FORMATS = (HERMES, LLAMA3_JSON, MISTRAL)

HERMES_OPEN = "<tool_call>"
HERMES_CLOSE = "</tool_call>"
LLAMA3_PYTHON_TAG = "<|python_tag|>"
MISTRAL_TOOL_CALLS = "[TOOL_CALLS]"


def detect_tool_format(chat_template: str | None) -> str:
    """The tool-call format a chat template teaches its model."""
    template = chat_template or ""
    if HERMES_OPEN in template:
        return HERMES
    if MISTRAL_TOOL_CALLS in template or "[AVAILABLE_TOOLS]" in template:
        return MISTRAL
    # Llama 3.1's template announces tools to the "ipython" environment and asks for JSON.
    if LLAMA3_PYTHON_TAG in template or "ipython" in template:
        return LLAMA3_JSON
    return HERMES


def arguments_key(tool_format: str) -> str:
    """The key a call's arguments sit under in the model's JSON."""
    return "parameters" if tool_format == LLAMA3_JSON else "arguments"


def renders_tools(chat_template: str | None) -> bool:
    """Whether the template itself shows the model its ``tools`` (else the tokenizer adds
    them as a system message in the hermes format)."""
    return "tools" in (chat_template or "")
