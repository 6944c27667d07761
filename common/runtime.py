"""The one service runtime: connect, subscribe, decode, error -> reply, drain on SIGTERM.

A service file holds handlers; this module holds everything around them (nats.py ``micro``
style). Handlers receive decoded, validated messages. A handler that raises ``RequestError``
(or anything else) for a message carrying ``request_id`` and ``reply_to`` has an
``ErrorEvent`` published to that inbox, so the client gets an answer and the service lives on.

Presence: once a service has started (``ready``), its runtime announces it on
``presence.<service>`` every ``PRESENCE_INTERVAL_S``, at once when a watcher probes, and one
last time as ``draining`` when it closes; watchers (``watch_presence``: the gateway, the
scheduler) learn from it which stages of the mesh are alive.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import signal
import sys
import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import nats
import nats.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js.api import DeliverPolicy
from nats.js.errors import NotFoundError
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import Status, StatusCode, Tracer

from common.config import MeshConfig
from common.metrics import MetricsServer, ServiceMetrics, new_registry
from common.telemetry import Tracing, extract, inject
from common.wire.codec import Message, MessageError, decode_any
from common.wire.gateway import ErrorEvent
from common.wire.presence import Presence, PresenceProbe

log = logging.getLogger("meshserve")

M = TypeVar("M", bound=Message)

# How often every service says it is alive. Watchers count a member gone after a few missed
# announcements (the gateway's --presence-ttl-s, 3 s by default).
PRESENCE_INTERVAL_S = 1.0
# How often a watched replay (``Service.replay`` with a stream) checks that it still receives.
REPLAY_CHECK_S = 2.0


@dataclass
class PresenceFacts:
    """What a service's announcements carry beyond its name (see ``Presence``): set by the
    service before it starts, e.g. a tokenizer's page size or a detokenizer's shard."""

    shard: int | None = None
    page_size: int | None = None
    detok_shards: int | None = None
    tool_format: str | None = None
    behind_since: float | None = None  # a tokenizer's backlog (``Presence.behind_since``)


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


def context_too_long(
    max_model_len: int, prompt_tokens: int, max_tokens: int, where: str, param: str
) -> RequestError:
    """The 400 for a prompt (``where``: the request field) plus ``max_tokens`` (asked for as
    ``param``) past the context, worded as vLLM's."""
    return RequestError(
        f"This model's maximum context length is {max_model_len} tokens. However, you "
        f"requested {prompt_tokens + max_tokens} tokens ({prompt_tokens} in the {where}, "
        f"{max_tokens} for the completion). Please reduce the {where} or {param}.",
        400,
        "invalid_request_error",
        "prompt" if prompt_tokens >= max_model_len else param,
        "context_length_exceeded",
    )


class NoAnswer(Exception):
    """A request/reply call got no usable answer (timeout, no responder, bad or error reply)."""


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
        # Run when the connection to NATS is lost (before nats.py reconnects): e.g. the gateway
        # fails its in-flight requests rather than letting clients wait for lost messages.
        self.disconnect_callbacks: list[Callable[[], Awaitable[None]]] = []
        # Run after a reconnect: e.g. an executor snapshots its cache again (the server may
        # have come back without its JetStream store).
        self.reconnect_callbacks: list[Callable[[], Awaitable[None]]] = []
        # Observability: this service's tracer and metrics registry (common/telemetry.py,
        # common/metrics.py); /metrics + /health on mesh.metrics_port when one is set.
        self.tracing = Tracing(name, mesh.instance_id, mesh.otlp_endpoint, mesh.region)
        self.registry = new_registry()
        self.metrics = ServiceMetrics(self.registry, name, mesh.region)
        self.metrics_server: MetricsServer | None = None
        # Presence (module docstring). ``ready`` is set once the service's handlers are
        # subscribed (``serve_until_shutdown`` does it after ``start``): announcing earlier
        # would let a watcher send requests to subjects nobody listens on yet. A service
        # started some other way announces anyway one interval after it connected.
        self.facts = PresenceFacts()
        self.ready = asyncio.Event()
        self.presence_interval_s = PRESENCE_INTERVAL_S
        self._announcing = False
        self._presence_started = False
        self._watching = False
        # JetStream replays (``replay``): subject -> (its subscription, how to start it again)
        self._replays: dict[str, tuple[Subscription, Callable[[], Awaitable[Subscription]]]] = {}

    @property
    def tracer(self) -> Tracer:
        return self.tracing.tracer

    def health_problem(self) -> str | None:
        """Why this service cannot work now, or None when it can (``/health``)."""
        if self.shutdown_requested.is_set():
            return "shutting down"
        if not self.connected:
            return "not connected to NATS"
        return None

    @property
    def connected(self) -> bool:
        return self._nc is not None and self._nc.is_connected

    @property
    def nc(self) -> Client:
        if self._nc is None:
            raise RuntimeError(f"{self.name}: not connected")
        return self._nc

    async def connect(self) -> None:
        """Connect, retrying while the server is unreachable (it may start after us), but
        failing at once with a clear error when the server rejects our credentials."""
        rejected: asyncio.Future[Exception] = asyncio.get_running_loop().create_future()

        async def on_error(exc: Exception) -> None:
            if "authorization" in str(exc).lower() and not rejected.done():
                rejected.set_result(exc)
            log.warning("%s: nats error: %s", self.name, exc)

        async def on_disconnect() -> None:
            if self.stopping.is_set():
                return  # our own close(), not a failure
            log.warning("%s: disconnected from nats", self.name)
            for callback in self.disconnect_callbacks:
                await callback()

        async def on_reconnect() -> None:
            log.info("%s: reconnected to nats", self.name)
            if self._watching:  # announcements were missed meanwhile: ask again
                await self._probe()
            await self._restart_replays()
            for callback in self.reconnect_callbacks:
                await callback()

        connecting = asyncio.ensure_future(
            nats.connect(
                servers=self.mesh.nats_servers,
                name=f"{self.name}-{self.mesh.instance_id}",
                max_reconnect_attempts=-1,
                reconnect_time_wait=0.5,
                connect_timeout=5,
                error_cb=on_error,
                disconnected_cb=on_disconnect,
                reconnected_cb=on_reconnect,
                **self.mesh.auth.connect_options(self.mesh.region),
            )
        )
        waiters: set[asyncio.Future[Any]] = {connecting, rejected}
        await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
        if not connecting.done():
            connecting.cancel()
            raise PermissionError(
                f"{self.name}: NATS at {self.mesh.nats_url} rejected our credentials "
                f"({rejected.result()}); check --nats-user/--nats-password/--nats-creds"
            )
        self._nc = connecting.result()
        where = f" in region {self.mesh.region}" if self.mesh.region else ""
        log.info(
            "%s %s%s connected to %s",
            self.name,
            self.mesh.instance_id,
            where,
            self._nc.connected_url.geturl() if self._nc.connected_url else self.mesh.nats_url,
        )
        if self.mesh.metrics_port is not None and self.metrics_server is None:
            self.metrics_server = MetricsServer(
                self.registry, self.health_problem, self.mesh.metrics_host, self.mesh.metrics_port
            )
            await self.metrics_server.start()
        if not self._presence_started:
            self._presence_started = True
            await self.nc.subscribe(self.subjects.presence_probe, cb=self._on_probe)
            self.spawn(self._announce_loop(), "presence")

    # -- presence ---------------------------------------------------------------------------
    def presence(self) -> Presence:
        """This instance's announcement now."""
        return Presence(
            service=self.name,
            instance_id=self.mesh.instance_id,
            draining=self.shutdown_requested.is_set() or self.stopping.is_set(),
            sent_at=time.time(),
            shard=self.facts.shard,
            page_size=self.facts.page_size,
            detok_shards=self.facts.detok_shards,
            tool_format=self.facts.tool_format,
            behind_since=self.facts.behind_since,
        )

    async def announce(self) -> None:
        await self.nc.publish(self.subjects.presence(self.name), self.presence().encode())

    async def _announce_loop(self) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.ready.wait(), self.presence_interval_s)
        self._announcing = True
        await self.every(self.presence_interval_s, self.announce)

    async def _on_probe(self, msg: Msg) -> None:
        if not self._announcing or self.stopping.is_set():
            return  # not started yet: the first announcement follows when it is
        try:
            await self.announce()
        except Exception as exc:
            log.warning("%s: could not answer a presence probe: %s", self.name, exc)

    async def _probe(self) -> None:
        try:
            probe = PresenceProbe(f"{self.name}-{self.mesh.instance_id}")
            await self.nc.publish(self.subjects.presence_probe, probe.encode())
        except Exception as exc:
            log.warning("%s: could not probe the mesh's presence: %s", self.name, exc)

    async def watch_presence(self, handler: Callable[[Presence], Awaitable[None]]) -> None:
        """Deliver every service's announcements to ``handler``, starting with an answer from
        each live instance at once (a probe), and again after a reconnect."""
        await self.subscribe(self.subjects.presence_all, Presence, handler)
        self._watching = True
        await self._probe()

    async def subscribe(
        self,
        subject: str,
        kind: type[M],
        handler: Callable[[M], Awaitable[None]],
        queue: str = "",
        span: str | None = None,
    ) -> Subscription:
        """Deliver decoded ``kind`` messages to ``handler``; errors never kill the service.

        The handler runs inside the sender's trace context (from the message headers), in a
        span named ``span`` when one is given, so what it publishes continues the trace.
        """

        async def on_msg(msg: Msg) -> None:
            try:
                decoded = kind.decode(msg.data)
            except MessageError as exc:
                log.error("%s: dropping bad message on %s: %s", self.name, msg.subject, exc)
                return
            started = time.perf_counter()
            with self.tracing.handling(span, extract(msg.headers), decoded):
                await self.guarded(decoded, handler)
            self.metrics.handled(kind.__name__, time.perf_counter() - started)

        sub = await self.nc.subscribe(subject, queue=queue, cb=on_msg)
        self._subs.append(sub)
        return sub

    async def serve(
        self,
        subject: str,
        kind: type[M],
        handler: Callable[[M], Awaitable[Message]],
        queue: str = "",
    ) -> None:
        """Request/reply: answer each decoded ``kind`` request with ``handler``'s message.

        A bad request or a failing handler is answered with an ``ErrorEvent``, so the asker
        learns at once (``request`` raises ``NoAnswer``) instead of waiting for its timeout.
        """

        async def on_msg(msg: Msg) -> None:
            if not msg.reply:
                return
            started = time.perf_counter()
            try:
                decoded = kind.decode(msg.data)
                with self.tracing.handling(None, extract(msg.headers), decoded):
                    answer = await handler(decoded)
            except MessageError as exc:
                answer = ErrorEvent("", 400, str(exc))
            except RequestError as exc:  # the asker's request is at fault: its own status
                answer = exc.event("")
            except Exception as exc:
                log.exception("%s: handler for %s failed", self.name, subject)
                answer = ErrorEvent("", 500, f"internal error: {exc}", "server_error")
            data = answer.encode()
            if len(data) > self.nc.max_payload:  # (publishing would raise: a reply has no headers)
                why = "The answer is too large for the message bus."
                answer = ErrorEvent("", 413, why, code="response_too_large")
                data = answer.encode()
            if isinstance(answer, ErrorEvent):
                self.metrics.error_reply(answer.status)
            else:
                self.metrics.handled(kind.__name__, time.perf_counter() - started)
            await self.nc.publish(msg.reply, data)

        self._subs.append(await self.nc.subscribe(subject, queue=queue, cb=on_msg))

    async def request(
        self,
        subject: str,
        message: Message,
        reply_kind: type[M],
        timeout: float,
        raise_errors: bool = False,
    ) -> M:
        """Ask and wait; ``NoAnswer`` on timeout, no responder, or a bad or error reply (an
        error reply is raised as its ``RequestError`` with ``raise_errors``)."""
        try:
            msg = await self.nc.request(
                subject, message.encode(), timeout=timeout, headers=inject(None)
            )
        except (TimeoutError, nats.errors.Error) as exc:
            raise NoAnswer(f"{subject}: {type(exc).__name__}") from exc
        try:
            answer = decode_any(msg.data, reply_kind, ErrorEvent)
        except MessageError as exc:
            raise NoAnswer(f"{subject}: {exc}") from exc
        if isinstance(answer, ErrorEvent) and raise_errors:
            raise RequestError(
                answer.message, answer.status, answer.type, answer.param, answer.code
            )
        if not isinstance(answer, reply_kind):
            raise NoAnswer(f"{subject}: {getattr(answer, 'message', answer)}")
        return answer

    async def replay(
        self,
        subject: str,
        kind: type[M],
        handler: Callable[[M, int], Awaitable[None]],
        stream: str = "",
        ensure: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        """Every message of the JetStream stream over ``subject``, from its first, then new
        ones as they arrive, in order (an ordered consumer: nothing to acknowledge, and a gap
        is re-fetched by the client). ``handler`` gets each decoded message and how many
        stream messages were still undelivered behind it (0: caught up). A bad message or a
        failing handler is logged and skipped.

        With ``stream`` (its name), the replay is watched: a consumer that stopped delivering
        while the stream grew (on a cluster it may have lived on a server that died, while
        this client's own server lives on, so no reconnect tells us) is started again. So is
        one of a stream that is gone or new (a nats-server back without its store: its
        sequence numbers start again), after ``ensure()`` creates it if need be; it also runs
        before the first subscribe."""
        # Stream sequence of the last message delivered; at the last check (-1: none yet, so
        # a replay is judged only against an earlier look, never on its first).
        delivered = [0, -1]
        created: list[Any] = [None]  # the stream's creation time, as last seen

        async def on_msg(msg: Msg) -> None:
            delivered[0] = max(delivered[0], msg.metadata.sequence.stream)
            started = time.perf_counter()
            try:
                await handler(kind.decode(msg.data), msg.metadata.num_pending)
                self.metrics.handled(kind.__name__, time.perf_counter() - started)
            except MessageError as exc:
                log.error("%s: skipping bad message on %s: %s", self.name, msg.subject, exc)
            except Exception:
                log.exception("%s: handler for %s failed", self.name, msg.subject)

        async def start() -> Subscription:
            if ensure is not None:
                await ensure()
            return await self.nc.jetstream().subscribe(
                subject,
                cb=on_msg,
                ordered_consumer=True,
                deliver_policy=DeliverPolicy.ALL,
                idle_heartbeat=5.0,
            )

        sub = await start()
        self._subs.append(sub)
        self._replays[subject] = (sub, start)

        async def check() -> None:
            try:
                info = await self.nc.jetstream().stream_info(stream)
            except NotFoundError:
                info = None
            if info is None or created[0] not in (None, info.created):
                log.warning("%s: stream %s is gone or new; replaying it", self.name, stream)
                delivered[:] = [0, -1]
                created[0] = None
                await self._restart_replays()
                return
            created[0] = info.created
            stalled = delivered[0] == delivered[1] and info.state.last_seq > delivered[0]
            delivered[1] = delivered[0]
            if stalled:  # unless what lies past it was purged (the stream keeps its last_seq)
                stalled = await self._has_message_after(stream, subject, delivered[0])
            if stalled:
                log.warning("%s: replay of %s stalled; starting it again", self.name, stream)
                await self._restart_replays()

        if stream:
            self.spawn(self.every(REPLAY_CHECK_S, check), f"replay-check-{stream}")

    async def _has_message_after(self, stream: str, subject: str, seq: int) -> bool:
        """Does ``stream`` hold a message on ``subject`` past sequence ``seq``? (True when it
        cannot say: a replay taken for stalled is only started again.)"""
        try:
            await self.nc.jetstream().get_msg(stream, seq=seq + 1, subject=subject, next=True)
        except NotFoundError:
            return False
        except Exception as exc:
            log.debug("%s: could not look past message %d of %s: %s", self.name, seq, stream, exc)
        return True

    async def _restart_replays(self) -> None:
        """After a reconnect (on a cluster: to another server), replay each stream again from
        its first message: the ephemeral consumer may have lived on the server that was lost,
        and the stream's content (a snapshot plus later deltas per executor) rebuilds the same
        view over the one a handler already holds."""
        for subject, (old, start) in list(self._replays.items()):
            with contextlib.suppress(Exception):
                await old.unsubscribe()
            try:
                sub = await start()
            except Exception as exc:
                log.error("%s: could not replay %s again: %s", self.name, subject, exc)
                continue
            self._subs = [sub if s is old else s for s in self._subs]
            self._replays[subject] = (sub, start)

    async def guarded(self, message: M, handler: Callable[[M], Awaitable[None]]) -> None:
        """Run ``handler``; turn its failure into an error reply for the request."""
        try:
            await handler(message)
        except RequestError as exc:
            trace.get_current_span().set_status(Status(StatusCode.ERROR, str(exc)))
            await self.reply_error(message, exc)
        except Exception as exc:
            log.exception("%s: handler failed", self.name)
            span = trace.get_current_span()
            span.record_exception(exc)
            span.set_status(Status(StatusCode.ERROR, repr(exc)))
            await self.reply_error(
                message, RequestError(f"internal error: {exc}", 500, "server_error")
            )

    async def reply_error(self, message: Message, error: RequestError) -> None:
        request_id = getattr(message, "request_id", None)
        reply_to = getattr(message, "reply_to", None)
        if request_id and reply_to:
            self.metrics.error_reply(error.status)
            await self.publish(reply_to, error.event(request_id))

    async def publish(
        self,
        subject: str,
        message: Message | bytes,
        headers: dict[str, str] | None = None,
        context: Context | None = None,
    ) -> None:
        """Publish with the W3C trace context of ``context`` (default: the current one);
        ``message`` may come encoded already (a sender that had to measure its size)."""
        data = message if isinstance(message, bytes) else message.encode()
        await self.nc.publish(subject, data, headers=inject(headers, context))

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
            if self._announcing and self._nc.is_connected:
                # Watchers stop counting on us now, not when our announcements time out.
                with contextlib.suppress(Exception):
                    await self.announce()
            with contextlib.suppress(Exception):
                await self._nc.drain()
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        if self.metrics_server is not None:
            await self.metrics_server.stop()
        # Flushing spans may wait on the network: not on the event loop.
        await asyncio.to_thread(self.tracing.shutdown)

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
    except ImportError:  # only the import: an ImportError inside main() must not rerun it
        asyncio.run(main())
    else:
        uvloop.run(main())


async def serve_until_shutdown(
    service: Service,
    start: Callable[[], Awaitable[None]],
    stop: Callable[[], Awaitable[None]] | None = None,
) -> None:
    """Start, run until SIGTERM/SIGINT (or a crashed background loop) asks for shutdown, then
    stop: ``stop()`` when given, else ``service.close()`` (drain, then close). A signal that
    arrives before ``start`` returns still has its default effect (the process ends)."""
    await start()
    service.ready.set()  # handlers are subscribed: presence announcements may begin
    service.install_signal_handlers()
    try:
        await service.shutdown_requested.wait()
    finally:
        await (stop() if stop is not None else service.close())


class Runnable(Protocol):
    """A service process's object: its ``Service`` and how to start it."""

    @property
    def svc(self) -> Service: ...

    async def start(self) -> None: ...


class HasMesh(Protocol):
    """A service's config: it carries the mesh-wide settings."""

    @property
    def mesh(self) -> MeshConfig: ...


C = TypeVar("C", bound=HasMesh)
R = TypeVar("R", bound=Runnable)


def run_service(
    name: str,
    parse_args: Callable[[list[str]], C],
    build: Callable[[C], R | Awaitable[R]],
    stop: Callable[[R], Awaitable[None]] | None = None,
) -> None:
    """The whole ``python -m services.<name>``: parse the command line, log the config, build
    the service (``build`` may be async, e.g. to load a model off the event loop), then
    ``serve_until_shutdown``; ``stop(service)`` replaces the default ``service.svc.close()``."""
    service_log = logging.getLogger(f"meshserve.{name}")

    async def main() -> None:
        config = parse_args(sys.argv[1:])
        logging.getLogger().setLevel(config.mesh.log_level.upper())
        service_log.info("%s config: %s", name.replace("_", " "), config)
        built = build(config)
        service = await built if inspect.isawaitable(built) else built
        await serve_until_shutdown(
            service.svc, service.start, None if stop is None else lambda: stop(service)
        )

    run(main)
