"""The gateway's side of the mesh: submit requests, receive their events, abort, liveness.

Outbound: one ``GenerateRequest`` for all ``n`` choices on ``tokenizer.encode`` (the tokenizer
fans it out into one request per choice after encoding the prompt once), a continuation of one
choice whose tokens were lost in transit (``resubmit``; ``resume.py``), ``AbortRequests`` on
``requests.abort``. Inbound: this instance's inbox (text deltas and errors for its requests),
executor heartbeats and every service's presence (``health.py``: /health, and requests fail
at once while a stage they need has no live member).

A request must fit in one NATS message: the server's ``max_payload`` (1 MiB by default) bounds
payload plus headers, and a client that publishes more is disconnected by the server (every
in-flight request would then fail). So ``submit`` measures each encoded request with its
headers first and answers one that does not fit with a 413, before anything is published.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from typing import Any

from nats.aio.msg import Msg
from opentelemetry import trace

from common.metrics import GatewayMetrics
from common.recent_ids import RecentIds
from common.runtime import RequestError, Service
from common.telemetry import Attr, inject
from common.wire.executor import AbortRequests
from common.wire.presence import Presence
from common.wire.scheduler import Heartbeat
from common.wire.tokenizer import GenerateRequest
from services.gateway.config import GatewayConfig
from services.gateway.health import MeshLiveness
from services.gateway.observe import RequestObserver
from services.gateway.protocol import ApiRequest
from services.gateway.streams import BatchedStreams, Inbox, RequestStream
from services.gateway.watchdog import STALL_S, check_stalled

log = logging.getLogger("meshserve.gateway")

ABANDONED_ABORT_S = 5.0  # an abandoned attempt that keeps sending is aborted again this often
CLUSTER_RECONNECT_S = 3.0  # a request waits this long for the gateway to reach another server


def mesh_unavailable(message: str) -> RequestError:
    """The 503 a client gets when the gateway cannot reach the mesh (retryable)."""
    return RequestError(message, 503, "server_error", code="mesh_unavailable")


class MeshClient:
    def __init__(self, config: GatewayConfig) -> None:
        self.config = config
        self.service = Service("gateway", config.mesh)
        self.metrics = GatewayMetrics(self.service.registry, config.served_model_name)
        self.subjects = config.mesh.subjects
        self.inbox_subject = self.subjects.gateway_inbox(config.mesh.instance_id)
        self.inbox = Inbox()
        self.liveness = MeshLiveness(
            config.required_stages,
            config.presence_ttl_s,
            config.heartbeat_ttl_s,
            config.startup_grace_s,
        )
        self._aborts: set[asyncio.Task[None]] = set()
        self._short_executors: dict[str, int] = {}  # executor -> its context, if too short
        # Abandoned attempts still sending (their abort was lost, across a partition say):
        # aborted again, at most every ABANDONED_ABORT_S each.
        self._reaborted: RecentIds[str, bool] = RecentIds(ttl_s=ABANDONED_ABORT_S)
        self.inbox.on_abandoned = self._abort_abandoned

    async def start(self) -> None:
        await self.service.connect()
        # Read again at every submit: a reconnect may land on a server with another limit.
        log.info("gateway: NATS accepts messages of up to %d bytes", self.service.nc.max_payload)

        # The inbox carries two message kinds (TextDeltas, ErrorEvent), so it is a raw
        # subscription routed by ``Inbox.deliver`` rather than ``Service.subscribe``.
        async def on_inbox(msg: Msg) -> None:
            self.inbox.deliver(msg.data)

        await self.service.nc.subscribe(self.inbox_subject, cb=on_inbox)
        await self.service.subscribe(
            self.subjects.executor_heartbeat, Heartbeat, self._on_heartbeat
        )
        self.liveness.start()
        await self.service.watch_presence(self._on_presence)  # probes: answers come at once
        if len(self.config.mesh.nats_servers) == 1:
            # One server: a disconnect means an outage. On a cluster the client is on another
            # server within milliseconds, and requests it was serving go on there (what a
            # lost message costs is the watchdog's to find, below).
            self.service.disconnect_callbacks.append(self._fail_in_flight)
        self.service.spawn(self.service.every(STALL_S, self._check_stalled), "watchdog")

    def _abort_abandoned(self, request_id: str) -> None:
        self._reaborted.prune()
        if request_id in self._reaborted:
            return
        self._reaborted.add(request_id, True)
        log.info("gateway: %s, resumed under another id, still sends: aborting it again",
                 request_id)  # fmt: skip
        task = asyncio.create_task(self._publish_abort([request_id], "resumed as a continuation"))
        self._aborts.add(task)
        task.add_done_callback(self._aborts.discard)

    async def _check_stalled(self) -> None:
        await check_stalled(
            self.service, self.inbox, queued_since=self.liveness.tokenizers_behind_since()
        )

    async def _fail_in_flight(self) -> None:
        """The bus is gone: messages for in-flight requests may be lost, so end them now with
        a clear error instead of letting clients wait for their deadline."""
        self.inbox.fail_all(
            "The gateway lost its connection to the message bus; retry the request.", 503
        )

    async def _on_heartbeat(self, heartbeat: Heartbeat) -> None:
        self.liveness.saw_heartbeat(heartbeat)
        if 0 < heartbeat.max_model_len < self.config.max_model_len:
            self.context_mismatch(heartbeat.executor_id, heartbeat.max_model_len)

    def context_mismatch(self, executor_id: str, holds: int) -> None:
        """Said once per executor: the gateway would accept requests it must refuse."""
        if self._short_executors.get(executor_id) == holds:
            return
        self._short_executors[executor_id] = holds
        log.error(
            "gateway: executor %s holds at most %d tokens per sequence, but this gateway "
            "accepts %d (--max-model-len): longer requests will fail there; lower "
            "--max-model-len or give the executor more --kv-cache-tokens",
            executor_id,
            holds,
            self.config.max_model_len,
        )

    async def _on_presence(self, presence: Presence) -> None:
        self.liveness.saw(presence)

    def health_problem(self) -> str | None:
        """Why this gateway cannot serve now, or None when it can."""
        if self.service.shutdown_requested.is_set():
            return "shutting down"
        if not self.service.nc.is_connected:
            return "not connected to NATS"
        return self.liveness.problem()

    def health_report(self) -> tuple[int, dict[str, Any]]:
        """``/health``'s status and body: 503 naming what is missing, and every stage's
        live members (optional stages included) either way."""
        stages = self.liveness.report()
        problem = self.health_problem()
        if problem is None:
            return 200, {"status": "ok", "stages": stages}
        missing = list(self.liveness.missing())
        status = "starting" if missing and self.liveness.in_grace() else "unavailable"
        body = {"status": status, "reason": problem, "missing": missing, "stages": stages}
        return 503, body

    async def require_stages(self) -> None:
        """Fail at once (503, code ``stage_unavailable``) while a stage the request needs has
        no live member; during the start-up grace, wait for its first announcement."""
        while missing := self.liveness.missing():
            if time.monotonic() >= self.liveness.grace_ends:
                raise RequestError(
                    "; ".join(missing.values()) + "; retry the request later.",
                    503,
                    "server_error",
                    code="stage_unavailable",
                )
            await asyncio.sleep(0.05)

    async def submit(self, api: ApiRequest, base_id: str) -> RequestStream:
        """Publish the request (all its n choices); their events arrive on the returned
        stream."""
        nc = self.service.nc
        await self.connected()
        await self.require_stages()
        span = trace.get_current_span()  # gateway.request, opened by the HTTP handler
        span.set_attributes(
            {
                Attr.REQUEST_ID: base_id,
                Attr.MODEL: api.model,
                Attr.N: api.n,
                Attr.STREAM: api.stream,
                Attr.MAX_TOKENS: api.params.max_tokens,
            }
        )
        now = time.time()
        request = GenerateRequest(
            request_id=base_id,
            reply_to=self.inbox_subject,
            params=api.params,
            prompt=api.prompt,
            prompt_token_ids=api.prompt_token_ids,
            messages=api.messages,
            priority=api.priority,
            deadline=now + self.config.request_timeout_s,
            arrival_time=now,
            n=api.n,
            response_format=api.response_format,
            tools=api.tools,
            max_tokens_chosen=api.max_tokens_chosen,
            sampling_unset=api.sampling_unset,
            add_generation_prompt=api.add_generation_prompt,
            continue_final_message=api.continue_final_message,
            chat_template_kwargs=api.chat_template_kwargs,
            bad_words=api.bad_words,
            truncate_prompt_tokens=api.truncate_prompt_tokens,
            lora=api.lora,
            reasoning_parser=self.config.reasoning_parser
            if api.kind == "chat" and self.config.reasoning_parser != "none"
            else "",
        )
        payload = request.encode()
        headers = inject(None)  # the trace context of gateway.request
        size = len(payload) + nats_header_bytes(headers)
        if size > nc.max_payload:
            raise too_large_for_the_bus(
                size, nc.max_payload, "messages" if api.kind == "chat" else "prompt"
            )
        stream = self.inbox.open(request.choice_ids(), self.config.request_timeout_s, base_id)
        stream.observer = RequestObserver(self.metrics, span, api.n, api.prompt_only)
        stream.origin, stream.resubmitter = request, self
        stream.max_resumes = self.config.max_resumes
        try:
            await nc.publish(self.subjects.tokenizer_encode, payload, headers=headers)
        except asyncio.CancelledError:  # the client left while we published
            await self.release(stream)
            raise
        except Exception as exc:
            log.exception("gateway: could not publish %s", base_id)
            error = mesh_unavailable("The gateway could not reach the mesh.")
            stream.failure = f"gateway failed to submit the request: {exc!r}"
            stream.observer.failed(error)  # (counted with the status its client gets)
            await self.release(stream)
            raise error from exc
        return stream

    async def connected(self) -> None:
        """Return once connected to NATS; raise a 503 (``mesh_unavailable``) if not. On a
        cluster, a lost server is replaced within a reconnect: that is waited for."""
        nc = self.service.nc
        if not nc.is_connected and len(self.config.mesh.nats_servers) > 1:
            deadline = time.monotonic() + CLUSTER_RECONNECT_S
            while not nc.is_connected and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
        if not nc.is_connected:
            raise mesh_unavailable("The gateway is not connected to the mesh.")

    async def resubmit(self, stream: RequestStream, request: GenerateRequest, lost_id: str) -> None:
        """A choice's continuation (``resume.py``): withdraw the lost attempt everywhere (it
        may still be generating, e.g. when only a delta was lost), route the continuation's
        events to ``stream``, and publish it as ``submit`` does, in the request's trace."""
        await self._publish_abort([lost_id], "resumed as a continuation")
        await self.connected()
        span = stream.observer.span if stream.observer is not None else None
        context = trace.set_span_in_context(span) if span is not None else None
        payload, headers = request.encode(), inject(None, context)
        # Larger than the request (it carries the tokens delivered): past the server's limit,
        # headers included, it would be refused with the gateway's connection, every stream
        # on it lost (nats-py checks the payload alone)
        size = len(payload) + nats_header_bytes(headers)
        if size > self.service.nc.max_payload:
            raise RequestError(
                f"The continuation ({size} bytes) is over the message bus limit "
                f"({self.service.nc.max_payload} bytes).",
                413,
                code="request_too_large",
            )
        self.inbox.route(stream, [request.request_id, *request.choice_ids()])
        stream.submitted_at = time.time()
        try:
            await self.service.nc.publish(self.subjects.tokenizer_encode, payload, headers=headers)
        except Exception as exc:
            log.exception("gateway: could not publish continuation %s", request.request_id)
            raise mesh_unavailable("The gateway could not reach the mesh.") from exc

    async def release(
        self, stream: RequestStream | BatchedStreams, reason: str | None = None
    ) -> None:
        """Stop routing ``stream``'s events; abort the choices that are still generating.

        Called from ``finally`` blocks, including when the handler was cancelled (the client
        went away, or shutdown outlasted its timeout), so the abort is published from a task
        of its own that a second cancellation of the handler cannot interrupt.
        """
        if isinstance(stream, BatchedStreams):  # each prompt's stream, all routed off now
            stream.close()
            releases = [self.release(one, reason) for one in stream.streams]
            await asyncio.shield(asyncio.gather(*releases))
            return
        self.inbox.close(stream)
        if stream.observer is not None and stream.unfinished:
            stream.observer.left(stream.failure)
        if stream.span is not None:  # (a batched prompt's)
            stream.span.end()
            stream.span = None
        # and the attempts choices were resumed away from: their aborts may have been lost
        # (a partition), and once the stream is closed nothing re-aborts them
        unfinished = stream.unfinished + stream.left_behind
        if not unfinished:
            return
        if reason is None:
            reason = stream.failure or (
                "gateway shutting down"
                if self.service.shutdown_requested.is_set()
                else "client disconnected"
            )
        log.info("gateway: aborting %s (%s)", ", ".join(unfinished), reason)
        task = asyncio.create_task(self._publish_abort(unfinished, reason))
        self._aborts.add(task)
        task.add_done_callback(self._aborts.discard)
        await asyncio.shield(task)

    async def _publish_abort(self, request_ids: list[str], reason: str) -> None:
        try:
            await self.service.publish(self.subjects.abort, AbortRequests(request_ids, reason))
        except Exception:
            log.exception("gateway: could not publish abort for %s", request_ids)

    async def close(self) -> None:
        if self._aborts:
            await asyncio.gather(*self._aborts, return_exceptions=True)
        await self.service.close()


def nats_header_bytes(headers: Mapping[str, str] | None) -> int:
    """What ``headers`` add to a NATS message, as nats-py frames them and nats-server counts
    them against max_payload: ``NATS/1.0\\r\\n``, ``key: value\\r\\n`` each, ``\\r\\n``."""
    if not headers:
        return 0
    lines = sum(len(k.encode()) + len(v.encode()) + 4 for k, v in headers.items())
    return len(b"NATS/1.0\r\n") + lines + 2


def too_large_for_the_bus(size: int, limit: int, field: str) -> RequestError:
    """413, not 503: the same request would never fit, so clients must not retry it."""
    return RequestError(
        f"The request is too large for the message bus: it encodes to {size} bytes, over its "
        f"limit of {limit} bytes (the NATS server's max_payload). Please shorten the {field}.",
        413,
        "invalid_request_error",
        field,
        "request_too_large",
    )
