"""A fake OpenAI-compatible streaming server with known timings and injectable failures.

It runs an aiohttp app on 127.0.0.1 (a free port) in a thread of its own, so that both async
tests and the synchronous CLI (which calls ``asyncio.run``) can talk to it.

Each request streams ``num_tokens`` content chunks (or ``max_tokens`` when ``num_tokens`` is
None): the first ``ttft_s`` after the request arrived, then one every ``itl_s`` (on an
absolute schedule, so sleeps do not drift), then a ``finish_reason`` chunk, a usage chunk
(when asked for by ``stream_options.include_usage`` and ``send_usage``) and ``[DONE]``.
Token ``i`` of request ``n`` is the text ``"a{n}t{i} "``.

``pattern`` is cycled over the requests in arrival order:
``ok``; ``500`` (an HTTP 500); ``stall`` (two tokens, then silence until the server stops);
``malformed`` (two tokens, then a chunk that is not JSON); ``error_event`` (an in-stream error
object); ``cut`` (two tokens, then the connection is closed without ``[DONE]``); ``empty`` (no
token at all: the finish chunk, usage 0 and ``[DONE]``).
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web


@dataclass
class FakeConfig:
    ttft_s: float = 0.05
    itl_s: float = 0.01
    num_tokens: int | None = 20
    send_usage: bool = True
    pattern: list[str] = field(default_factory=lambda: ["ok"])


@dataclass
class Received:
    index: int
    path: str
    arrival: float  # time.perf_counter() on arrival
    payload: dict[str, Any]
    answer: str = ""


def answer_text(index: int, n: int) -> str:
    return "".join(f"a{index}t{i} " for i in range(n))


class FakeServer:
    def __init__(self, config: FakeConfig | None = None) -> None:
        self.config = config or FakeConfig()
        self.received: list[Received] = []
        self.in_flight = 0
        self.max_in_flight = 0
        self._counter = 0
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._runner: web.AppRunner | None = None
        self._stop: asyncio.Event | None = None
        self.port = 0

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    # -- lifecycle -------------------------------------------------------------------------

    def start(self) -> FakeServer:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        ready = threading.Event()
        self._loop = asyncio.new_event_loop()

        def serve() -> None:
            assert self._loop is not None
            asyncio.set_event_loop(self._loop)
            self._loop.run_until_complete(self._start(sock))
            ready.set()
            self._loop.run_forever()
            self._loop.close()

        self._thread = threading.Thread(target=serve, name="fake-openai", daemon=True)
        self._thread.start()
        if not ready.wait(10):
            raise RuntimeError("fake server did not start")
        return self

    async def _start(self, sock: socket.socket) -> None:
        self._stop = asyncio.Event()
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_post("/v1/completions", self._completions)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        await web.SockSite(self._runner, sock, shutdown_timeout=1.0).start()

    async def _shutdown(self) -> None:
        assert self._stop is not None and self._runner is not None
        self._stop.set()
        await asyncio.sleep(0.01)
        await self._runner.cleanup()

    def stop(self) -> None:
        if self._loop is None or self._thread is None:
            return
        fut = asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop)
        fut.result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop = None

    def __enter__(self) -> FakeServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- handlers --------------------------------------------------------------------------

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, "chat")

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, "completions")

    def _chunk(self, kind: str, index: int, text: str | None, finish: str | None) -> bytes:
        if kind == "chat":
            delta: dict[str, Any] = {} if text is None else {"content": text}
            choice: dict[str, Any] = {"index": 0, "delta": delta, "finish_reason": finish}
            obj = "chat.completion.chunk"
        else:
            choice = {"index": 0, "text": text or "", "finish_reason": finish}
            obj = "text_completion"
        body = {"id": f"req-{index}", "object": obj, "model": "fake", "choices": [choice]}
        return f"data: {json.dumps(body)}\n\n".encode()

    async def _handle(self, request: web.Request, kind: str) -> web.StreamResponse:
        arrival = time.perf_counter()
        payload = await request.json()
        with self._lock:
            index = self._counter
            self._counter += 1
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
            rec = Received(index, request.path, arrival, payload)
            self.received.append(rec)
        try:
            return await self._stream(request, kind, index, arrival, payload, rec)
        except (ConnectionResetError, ConnectionError):
            return web.Response(status=499)
        finally:
            with self._lock:
                self.in_flight -= 1

    async def _stream(
        self,
        request: web.Request,
        kind: str,
        index: int,
        arrival: float,
        payload: dict[str, Any],
        rec: Received,
    ) -> web.StreamResponse:
        cfg = self.config
        mode = cfg.pattern[index % len(cfg.pattern)]
        if mode == "500":
            return web.json_response({"error": {"message": "injected failure"}}, status=500)
        n = cfg.num_tokens if cfg.num_tokens is not None else int(payload.get("max_tokens", 16))
        if mode == "empty":
            n = 0
        resp = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await resp.prepare(request)
        await resp.write(b": keep-alive comment\n\n")
        if kind == "chat":  # vLLM-style role chunk, not a token
            role = {
                "index": 0,
                "delta": {"role": "assistant", "content": ""},
                "finish_reason": None,
            }
            chunk = {"id": f"req-{index}", "object": "chat.completion.chunk", "choices": [role]}
            await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
        for i in range(n):
            delay = arrival + cfg.ttft_s + i * cfg.itl_s - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            if i == 2 and mode in ("stall", "malformed", "error_event", "cut"):
                if mode == "stall":
                    assert self._stop is not None
                    await self._stop.wait()
                    return resp
                if mode == "malformed":
                    await resp.write(b'data: {"choices": [{"delta": \n\n')
                elif mode == "error_event":
                    err = {"error": {"message": "injected", "code": 500}}
                    await resp.write(f"data: {json.dumps(err)}\n\n".encode())
                else:  # cut
                    assert request.transport is not None
                    request.transport.close()
                    return resp
            text = f"a{index}t{i} "
            rec.answer += text
            await resp.write(self._chunk(kind, index, text, None))
        await resp.write(self._chunk(kind, index, None, "length"))
        opts = payload.get("stream_options") or {}
        if cfg.send_usage and opts.get("include_usage"):
            prompt = payload.get("prompt") or " ".join(
                m.get("content", "") for m in payload.get("messages", [])
            )
            usage = {
                "prompt_tokens": len(str(prompt).split()),
                "completion_tokens": n,
                "total_tokens": len(str(prompt).split()) + n,
            }
            body = {"id": f"req-{index}", "object": "chunk", "choices": [], "usage": usage}
            await resp.write(f"data: {json.dumps(body)}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp
