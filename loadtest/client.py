"""One streaming request to an OpenAI-compatible server: SSE parsing and timings.

Timings use ``time.perf_counter``.  A *token event* is a streamed chunk whose first choice
carries non-empty text (``delta.content`` or a reasoning field for chat, ``text`` for
completions): TTFT is the time to the first one, and every later one adds an inter-token gap.
Role-only and empty chunks, the final usage chunk and ``[DONE]`` are not token events.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any, Literal

import aiohttp

from loadtest.workloads import RequestSpec

__all__ = [
    "Endpoint",
    "RequestResult",
    "StreamError",
    "StreamParser",
    "send_request",
]

EndpointKind = Literal["chat", "completions"]


def api_url(base_url: str, kind: EndpointKind) -> str:
    """``base_url`` (with or without the trailing ``/v1``) joined with the endpoint path."""
    base = base_url.rstrip("/")
    if not base.endswith("/v1"):
        base += "/v1"
    return base + ("/chat/completions" if kind == "chat" else "/completions")


@dataclass(frozen=True)
class Endpoint:
    """Where and how to send requests."""

    base_url: str
    model: str
    kind: EndpointKind = "chat"
    api_key: str | None = None
    ignore_eos: bool = False
    extra_body: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # One choice a request: the stream's timings (TTFT, ITL, TPOT) follow one sequence,
        # and n > 1 would interleave the choices' chunks into it.
        for key in ("n", "best_of"):
            if self.extra_body.get(key, 1) != 1:
                raise ValueError(
                    f"extra body {key}={self.extra_body[key]!r}: the load test times one choice "
                    "a request; send more requests instead"
                )

    @property
    def url(self) -> str:
        return api_url(self.base_url, self.kind)

    def headers(self) -> dict[str, str]:
        h = {"Content-Type": "application/json", "Accept": "text/event-stream"}
        if self.api_key:
            h["Authorization"] = f"Bearer {self.api_key}"
        return h

    def payload(self, spec: RequestSpec) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": self.model,
            "max_tokens": spec.max_tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if self.kind == "chat":
            body["messages"] = spec.messages
        else:
            body["prompt"] = spec.prompt()
        if self.ignore_eos:
            # vLLM / SGLang extensions: produce exactly max_tokens tokens.
            body["ignore_eos"] = True
            body["min_tokens"] = spec.max_tokens
        body.update(self.extra_body)
        return body


class StreamError(Exception):
    """The server's stream broke the protocol (malformed chunk, error event, early end)."""


@dataclass
class RequestResult:
    """Everything measured about one request; times in seconds."""

    request_id: int
    start_s: float = 0.0
    """When it was sent, from the start of the run."""
    scheduled_s: float | None = None
    """When the arrival process meant to send it (open loop only)."""
    success: bool = False
    error_kind: str | None = None
    """``http_<status>``, ``timeout``, ``connection``, ``stream``, ``empty`` (a stream that
    carried no token: no TTFT, as vLLM's benchmark fails it) or ``client``."""
    error: str | None = None
    status: int | None = None
    ttft_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    e2e_s: float | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    """Prompt tokens served from the server's prefix cache (usage.prompt_tokens_details)."""
    output_tokens: int = 0
    usage_reported: bool = False
    content_chunks: int = 0
    finish_reason: str | None = None
    output_text: str = ""
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def tpot_s(self) -> float | None:
        """(e2e - ttft) / (output_tokens - 1); None for fewer than two tokens."""
        if self.e2e_s is None or self.ttft_s is None or self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)

    def to_json(self) -> dict[str, Any]:
        """The raw record written to the JSON output (times in ms; the text is left out)."""

        def ms(x: float | None) -> float | None:
            return None if x is None else round(x * 1000.0, 4)

        tpot = self.tpot_s
        return {
            "id": self.request_id,
            "start_s": round(self.start_s, 6),
            "scheduled_s": None if self.scheduled_s is None else round(self.scheduled_s, 6),
            "success": self.success,
            "error_kind": self.error_kind,
            "error": self.error,
            "status": self.status,
            "ttft_ms": ms(self.ttft_s),
            "tpot_ms": ms(tpot),
            "e2e_ms": ms(self.e2e_s),
            "itl_ms": [round(x * 1000.0, 4) for x in self.itl_s],
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "output_tokens": self.output_tokens,
            "usage_reported": self.usage_reported,
            "content_chunks": self.content_chunks,
            "finish_reason": self.finish_reason,
            "output_chars": len(self.output_text),
            **self.meta,
        }


class StreamParser:
    """Feeds SSE lines of an OpenAI stream into a :class:`RequestResult`.

    Each ``data:`` line is one event (OpenAI-style servers put each JSON chunk on one line);
    comments (``:``) and other SSE fields are ignored.
    """

    def __init__(self, result: RequestResult, kind: EndpointKind, start: float) -> None:
        self.result = result
        self.kind = kind
        self.start = start
        self.done = False
        self.events = 0
        self._last: float | None = None
        self._text: list[str] = []
        self._completion_tokens: int | None = None

    def feed_line(self, line: bytes, now: float) -> None:
        """Process one line (without its newline) received at ``now``."""
        line = line.rstrip(b"\r")
        if not line or line.startswith(b":") or not line.startswith(b"data:"):
            return
        data = line[5:].strip()
        if not data:
            return
        self.events += 1
        if data == b"[DONE]":
            self.done = True
            return
        try:
            obj = json.loads(data)
        except ValueError as e:
            raise StreamError(f"malformed chunk: {data[:200]!r}") from e
        if not isinstance(obj, dict):
            raise StreamError(f"chunk is not an object: {data[:200]!r}")
        if obj.get("error") is not None:
            raise StreamError(f"error event: {json.dumps(obj['error'])[:300]}")
        usage = obj.get("usage")
        if isinstance(usage, dict):
            pt, ct = usage.get("prompt_tokens"), usage.get("completion_tokens")
            if isinstance(pt, int):
                self.result.prompt_tokens = pt
            details = usage.get("prompt_tokens_details")
            if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
                self.result.cached_tokens = details["cached_tokens"]
            if isinstance(ct, int):
                self._completion_tokens = ct
                self.result.usage_reported = True
        choices = obj.get("choices")
        if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
            return
        choice = choices[0]
        if choice.get("finish_reason"):
            self.result.finish_reason = str(choice["finish_reason"])
        text, visible = self._choice_text(choice)
        if text:
            self._token_event(now)
        if visible:
            self._text.append(visible)

    def _choice_text(self, choice: dict[str, Any]) -> tuple[str, str]:
        """(all generated text, the part that is the answer's content)."""
        if self.kind == "completions":
            t = choice.get("text")
            return (t, t) if isinstance(t, str) else ("", "")
        delta = choice.get("delta")
        if not isinstance(delta, dict):
            return "", ""
        content = delta.get("content")
        content = content if isinstance(content, str) else ""
        reasoning = delta.get("reasoning_content", delta.get("reasoning"))
        reasoning = reasoning if isinstance(reasoning, str) else ""
        return content + reasoning, content

    def _token_event(self, now: float) -> None:
        r = self.result
        if self._last is None:
            r.ttft_s = now - self.start
        else:
            r.itl_s.append(now - self._last)
        self._last = now
        r.content_chunks += 1

    def finish(self, now: float) -> None:
        """Close the stream at ``now``: e2e time, token counts, the received text."""
        r = self.result
        r.e2e_s = now - self.start
        r.output_text = "".join(self._text)
        # The server's usage count; without one, the content chunks (which undercount when a
        # chunk carries several tokens: the summary's "requests with usage" says how many
        # requests were counted exactly; vLLM's benchmark tokenizes the text instead).
        r.output_tokens = (
            self._completion_tokens if self._completion_tokens is not None else r.content_chunks
        )


async def _read_stream(resp: aiohttp.ClientResponse, parser: StreamParser) -> float:
    """Read SSE lines until ``[DONE]`` or EOF; returns the time the stream ended."""
    buf = b""
    async for data in resp.content.iter_any():
        now = time.perf_counter()
        buf += data
        while (nl := buf.find(b"\n")) >= 0:
            parser.feed_line(buf[:nl], now)
            buf = buf[nl + 1 :]
            if parser.done:
                return now
    end = time.perf_counter()
    if buf:
        parser.feed_line(buf, end)
    return end


async def send_request(
    session: aiohttp.ClientSession,
    endpoint: Endpoint,
    spec: RequestSpec,
    *,
    request_id: int,
    run_start: float,
    timeout: float,
    scheduled_s: float | None = None,
) -> RequestResult:
    """Send ``spec`` and stream the answer; never raises for server or network failures."""
    result = RequestResult(request_id=request_id, scheduled_s=scheduled_s, meta=dict(spec.meta))
    result.meta.setdefault("max_tokens", spec.max_tokens)
    result.meta.setdefault("input_tokens_est", spec.input_tokens_est)
    payload = endpoint.payload(spec)
    start = time.perf_counter()
    result.start_s = start - run_start
    parser = StreamParser(result, endpoint.kind, start)
    try:
        async with asyncio.timeout(timeout):
            async with session.post(endpoint.url, json=payload, headers=endpoint.headers()) as resp:
                result.status = resp.status
                if resp.status >= 400:
                    body = await resp.text(errors="replace")
                    result.error_kind = f"http_{resp.status}"
                    result.error = body[:500]
                    parser.finish(time.perf_counter())
                    return result
                end = await _read_stream(resp, parser)
        parser.finish(end)
        if not (parser.done or result.finish_reason):
            raise StreamError(
                "stream ended before [DONE]" if parser.events else "no SSE data in the response"
            )
        if result.ttft_s is None:  # counted, it had no TTFT and a short e2e in the means
            _fail(result, parser, "empty", "the stream carried no token")
            return result
        result.success = True
    except TimeoutError:
        _fail(result, parser, "timeout", f"no complete answer within {timeout:g} s")
    except StreamError as e:
        _fail(result, parser, "stream", str(e))
    except aiohttp.ClientPayloadError as e:
        _fail(result, parser, "stream", f"{type(e).__name__}: {e}")
    except (aiohttp.ClientConnectionError, OSError) as e:
        kind = "connection" if result.status is None else "stream"
        _fail(result, parser, kind, f"{type(e).__name__}: {e}")
    except Exception as e:  # anything else is still one failed request, not a crashed run
        _fail(result, parser, "client", f"{type(e).__name__}: {e}")
    return result


def _fail(result: RequestResult, parser: StreamParser, kind: str, message: str) -> None:
    result.success = False
    result.error_kind = kind
    result.error = message
    if result.e2e_s is None:
        parser.finish(time.perf_counter())
