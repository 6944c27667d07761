"""The one service runtime: connect, subscribe, decode, error -> reply, drain on SIGTERM.

A service file holds handlers; this module holds everything around them (nats.py ``micro``
style). Handlers receive decoded, validated messages. A handler that raises ``RequestError``
(or anything else) for a message carrying ``request_id`` and ``reply_to`` has an
``ErrorEvent`` published to that inbox, so the client gets an answer and the service lives on.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

import nats
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from common.config import MeshConfig
from common.messages import ErrorEvent, Message, MessageError

log = logging.getLogger("meshserve")

M = TypeVar("M", bound=Message)


class RequestError(Exception):
    """A request-level failure that becomes an OpenAI-style error for the client."""

    def __init__(
        self,
        message: str,
        status: int = 400,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.type = type
        self.param = param
        self.code = code

    def event(self, request_id: str) -> ErrorEvent:
        return ErrorEvent(request_id, self.status, str(self), self.type, self.code, self.param)


class Service:
    def __init__(self, name: str, mesh: MeshConfig) -> None:
        self.name = name
        self.mesh = mesh
        self.subjects = mesh.subjects
        self._nc: Client | None = None
        self._subs: list[Subscription] = []
        self._tasks: list[asyncio.Task[None]] = []
        self.shutdown_requested = asyncio.Event()  # SIGTERM/SIGINT: begin draining
        self.stopping = asyncio.Event()  # close(): background loops end

    @property
    def nc(self) -> Client:
        if self._nc is None:
            raise RuntimeError(f"{self.name}: not connected")
        return self._nc

    async def connect(self) -> None:
        async def on_error(exc: Exception) -> None:
            log.warning("%s: nats error: %s", self.name, exc)

        async def on_disconnect() -> None:
            log.warning("%s: disconnected from nats", self.name)

        async def on_reconnect() -> None:
            log.info("%s: reconnected to nats", self.name)

        self._nc = await nats.connect(
            servers=[self.mesh.nats_url],
            name=f"{self.name}-{self.mesh.instance_id}",
            max_reconnect_attempts=-1,
            reconnect_time_wait=0.5,
            connect_timeout=5,
            error_cb=on_error,
            disconnected_cb=on_disconnect,
            reconnected_cb=on_reconnect,
        )
        log.info("%s %s connected to %s", self.name, self.mesh.instance_id, self.mesh.nats_url)

    async def subscribe(
        self,
        subject: str,
        kind: type[M],
        handler: Callable[[M], Awaitable[None]],
        queue: str = "",
    ) -> None:
        """Deliver decoded ``kind`` messages to ``handler``; errors never kill the service."""

        async def on_msg(msg: Msg) -> None:
            try:
                decoded = kind.decode(msg.data)
            except MessageError as exc:
                log.error("%s: dropping bad message on %s: %s", self.name, msg.subject, exc)
                return
            await self.guarded(decoded, handler)

        self._subs.append(await self.nc.subscribe(subject, queue=queue, cb=on_msg))

    async def guarded(self, message: M, handler: Callable[[M], Awaitable[None]]) -> None:
        """Run ``handler``; turn its failure into an error reply for the request."""
        try:
            await handler(message)
        except RequestError as exc:
            await self.reply_error(message, exc)
        except Exception as exc:
            log.exception("%s: handler failed", self.name)
            await self.reply_error(
                message, RequestError(f"internal error: {exc}", 500, "server_error")
            )

    async def reply_error(self, message: Message, error: RequestError) -> None:
        request_id = getattr(message, "request_id", None)
        reply_to = getattr(message, "reply_to", None)
        if request_id and reply_to:
            await self.publish(reply_to, error.event(request_id))

    async def publish(
        self, subject: str, message: Message, headers: dict[str, str] | None = None
    ) -> None:
        await self.nc.publish(subject, message.encode(), headers=headers)

    def spawn(self, coro: Awaitable[None], name: str) -> None:
        """Run a background loop for the service's lifetime; a crash is logged, not silent."""

        async def runner() -> None:
            try:
                await coro
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("%s: background task %s crashed", self.name, name)
                self.shutdown_requested.set()

        self._tasks.append(asyncio.create_task(runner(), name=name))

    async def every(self, seconds: float, fn: Callable[[], Awaitable[None]]) -> None:
        while not self.stopping.is_set():
            try:
                await fn()
            except Exception:
                log.exception("%s: periodic task failed", self.name)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.stopping.wait(), seconds)

    async def close(self) -> None:
        """Drain subscriptions (in-flight handlers finish), stop loops, then close."""
        self.stopping.set()
        if self._nc is not None and not self._nc.is_closed:
            with contextlib.suppress(Exception):
                await self._nc.drain()
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

    def install_signal_handlers(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.shutdown_requested.set)


def run(main: Callable[[], Coroutine[Any, Any, None]]) -> None:
    """Entry point of every service process: uvloop when available, logging configured."""
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        import uvloop

        uvloop.run(main())
    except ImportError:
        asyncio.run(main())
