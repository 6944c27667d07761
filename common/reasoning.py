"""Reasoning text between ``<think>`` and ``</think>`` (Qwen3, QwQ, DeepSeek-R1 and its
distills), split from the answer as vLLM's ``--reasoning-parser`` does: the chat response's
``reasoning`` (and its older name ``reasoning_content``), the rest ``content``.

Where the split starts depends on the prompt, which the tokenizer renders and the gateway
never sees: a template may open the block itself (DeepSeek-R1's distills, Qwen3's 2507 thinking
models end the prompt with ``<think>\\n``), close it at once (Qwen3 with ``enable_thinking:
false`` ends it with ``<think>\\n\\n</think>\\n\\n``), or leave it to the model (Qwen3 writes
``<think>`` first). ``think_state`` reads that off the rendered prompt (it travels to the
gateway with the stream's first delta); ``ReasoningSplitter`` then splits the output text as it
streams, holding back what may be the start of a tag.
"""

from __future__ import annotations

THINK_START = "<think>"
THINK_END = "</think>"
PARSERS = ("deepseek_r1", "qwen3")  # vLLM's names
OPEN, CLOSED = "open", "closed"


def think_state(prompt: str) -> str:
    """The prompt's last tag: ``OPEN`` (a ``<think>`` block the answer starts inside),
    ``CLOSED`` (a ``</think>``: thinking was switched off, or is over), "" (neither)."""
    start, end = prompt.rfind(THINK_START), prompt.rfind(THINK_END)
    if start < 0 and end < 0:
        return ""
    return OPEN if start > end else CLOSED


def starts_inside(parser: str, think: str) -> bool:
    """Whether the answer starts as reasoning. qwen3: where the prompt opened the block (else
    the model opens it with ``<think>``); deepseek_r1, as vLLM's: unless the prompt closed it
    (R1's templates open it, or the model writes the tag; either way it thinks first)."""
    return think == OPEN if parser == "qwen3" else think != CLOSED


def _partial_tag(text: str, tag: str) -> int:
    """The length of the longest end of ``text`` that starts ``tag`` (0: none)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class ReasoningSplitter:
    """One choice's output text in, ``(reasoning, content)`` out, as it streams.

    ``opened``: the output starts as reasoning (``starts_inside``); a ``<think>`` the model
    writes first anyway is dropped, as vLLM drops it. Otherwise a ``<think>`` the model writes
    first (whitespace before it is dropped) opens one; anywhere else it is content.
    ``</think>`` ends the reasoning (the tag itself is neither); what follows is content, as vLLM
    keeps it (Qwen3's ``\\n\\n`` after the tag included). ``closed``: the prompt ended the
    reasoning (``think_state`` CLOSED): all of the output is content, a leading tag included,
    as vLLM takes it.
    """

    def __init__(self, opened: bool, closed: bool = False) -> None:
        self.state = "reasoning" if opened else "content"
        self.pending = ""  # text that may yet be (part of) a tag
        self.reasoned = opened  # a reasoning block opened at all
        # nothing out yet: a <think> first (after whitespace) is a tag
        self.leading = not closed

    def feed(self, text: str) -> tuple[str, str]:
        buf, reasoning = self.pending + text, ""
        self.pending = ""
        if self.leading and buf:
            head = buf.lstrip()
            if head.startswith(THINK_START):
                buf, self.state, self.reasoned = head[len(THINK_START) :], "reasoning", True
            elif THINK_START.startswith(head):  # whitespace, or the tag's first characters
                self.pending = buf
                return "", ""
            self.leading = False
        if self.state == "reasoning":
            end = buf.find(THINK_END)
            if end < 0:
                keep = _partial_tag(buf, THINK_END)
                self.pending = buf[len(buf) - keep :]
                return buf[: len(buf) - keep], ""
            reasoning, buf, self.state = buf[:end], buf[end + len(THINK_END) :], "content"
        return reasoning, buf

    def finish(self) -> tuple[str, str]:
        """What was held back, at the stream's end: the rest of the block it was in."""
        rest, self.pending = self.pending, ""
        return (rest, "") if self.state == "reasoning" else ("", rest)
