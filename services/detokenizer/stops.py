"""Stop strings matched across token boundaries without leaking a partial match to the client.

Text is released only when no stop string could still start inside it: the longest suffix of
the pending text that is a prefix of some stop string is held back until the next tokens
decide. When a stop string appears, the text before it is released and the stream ends; the
stop string itself is not sent (OpenAI semantics) unless ``include`` (vLLM's
``include_stop_str_in_output``). Text fed with ``may_stop`` False (vLLM's ``min_tokens``: the
first tokens cannot end the stream) completes no stop string, but its tail is still held, so a
stop string that begins there and ends later is found.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class StopMatcher:
    stops: list[str]
    held: str = field(default="")
    stopped: bool = False
    include: bool = False
    # How much of ``held`` came with may_stop False: a stop string must end after it (one
    # held whole inside it, a prefix of a longer one, was found at the next feed)
    unstoppable: int = 0

    def feed(self, text: str, may_stop: bool = True) -> str:
        """Add newly decoded text; return what is safe to send now."""
        if self.stopped:
            return ""
        pending = self.held + text
        if not self.stops:
            self.held = ""
            return pending
        fixed = len(pending) if not may_stop else self.unstoppable  # may end no stop string
        found = [
            (i, len(s))
            for s in self.stops
            if (i := pending.find(s, max(0, fixed - len(s) + 1))) >= 0
        ]
        if found:
            cut, length = min(found)
            self.stopped = True
            self.held = ""
            return pending[: cut + length] if self.include else pending[:cut]
        keep = self._partial_suffix(pending)
        self.held = pending[len(pending) - keep :] if keep else ""
        self.unstoppable = max(0, fixed - (len(pending) - keep))
        return pending[: len(pending) - keep]

    def flush(self) -> str:
        """End of stream without a stop string: release what was held back."""
        out, self.held = ("" if self.stopped else self.held), ""
        return out

    def _partial_suffix(self, text: str) -> int:
        best = 0
        for stop in self.stops:
            for n in range(min(len(stop) - 1, len(text)), best, -1):
                if text.endswith(stop[:n]):
                    best = n
                    break
        return best
