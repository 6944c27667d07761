"""Reasoning text between ``<think>`` and ``</think>`` (Qwen3, QwQ, DeepSeek-R1 and its
distills), split from the answer as vLLM's ``--reasoning-parser`` does: the chat response's
``reasoning`` (and its older name ``reasoning_content``), the rest ``content``.

Where the split starts depends on the prompt, which the detokenizer sees the end of
(``StreamStart.prompt_tail``) and the gateway does not: a template may open the block itself
(DeepSeek-R1's distills, Qwen3's 2507 thinking models end the prompt with ``<think>\\n``), close
it at once (Qwen3 with ``enable_thinking: false`` ends it with ``<think>\\n\\n</think>\\n\\n``),
or leave it to the model (Qwen3 writes ``<think>`` first). ``prompt_opens_reasoning`` says
which from the prompt's last tokens' text; ``ReasoningSplitter`` then splits the output text as
it streams, holding back what may be the start of a tag.
"""

from __future__ import annotations

THINK_START = "<think>"
THINK_END = "</think>"
PARSERS = ("deepseek_r1", "qwen3")  # vLLM's names; both are this <think> convention


def prompt_opens_reasoning(prompt_tail_text: str) -> bool:
    """Whether a prompt ending in this text leaves a ``<think>`` block open (its last
    ``<think>`` comes after its last ``</think>``)."""
    start = prompt_tail_text.rfind(THINK_START)
    return start >= 0 and start > prompt_tail_text.rfind(THINK_END)


def _partial_tag(text: str, tag: str) -> int:
    """The length of the longest end of ``text`` that starts ``tag`` (0: none)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class ReasoningSplitter:
    """One choice's output text in, ``(reasoning, content)`` out, as it streams.

    ``opened``: the prompt left a ``<think>`` block open, so the output starts as reasoning.
    Otherwise a ``<think>`` the model writes first (whitespace before it is dropped) opens one;
    anywhere else it is content. ``</think>`` ends the reasoning (the tag itself is neither);
    what follows is content, as vLLM keeps it (Qwen3's ``\\n\\n`` after the tag included).
    """

    def __init__(self, opened: bool) -> None:
        self.state = "reasoning" if opened else "start"
        self.pending = ""  # text that may yet be (part of) a tag
        self.reasoned = opened  # a reasoning block opened at all

    def feed(self, text: str) -> tuple[str, str]:
        buf, reasoning, content = self.pending + text, "", ""
        self.pending = ""
        while buf:
            if self.state == "reasoning":
                end = buf.find(THINK_END)
                if end >= 0:
                    reasoning += buf[:end]
                    buf, self.state = buf[end + len(THINK_END) :], "content"
                    continue
                keep = _partial_tag(buf, THINK_END)
                reasoning, self.pending = reasoning + buf[: len(buf) - keep], buf[len(buf) - keep :]
                break
            if self.state == "start":
                head = buf.lstrip()
                if head.startswith(THINK_START):
                    buf, self.state, self.reasoned = head[len(THINK_START) :], "reasoning", True
                    continue
                if THINK_START.startswith(head):  # whitespace, or the tag's first characters
                    self.pending = buf
                    break
                self.state = "content"
            content += buf
            break
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """What was held back, at the stream's end: the rest of the block it was in."""
        rest, self.pending = self.pending, ""
        return (rest, "") if self.state == "reasoning" else ("", rest)
