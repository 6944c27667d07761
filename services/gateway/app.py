"""HTTP side of the gateway: aiohttp routes, OpenAI error middleware, SSE, server wiring.

A request's life, top to bottom in ``Routes.generate``: read and validate the body, publish one
``GenerateRequest`` (for all ``n`` choices: the tokenizer splits it), wait for the first event
(an error before the first byte is an HTTP error status), then either stream SSE chunks or
aggregate one JSON response; whatever ends the request (done, error, timeout, client gone),
``MeshClient.release`` aborts what is still generating.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import json
import logging
import re
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web
from opentelemetry import trace

from common.metrics import metrics_handler
from common.runtime import NoAnswer, RequestError, serve_until_shutdown
from common.telemetry import Attr, inject
from common.wire.codec import M, Message
from common.wire.gateway import TextDelta
from common.wire.tokenizer import DetokenizeReply, TokenizeReply
from services.gateway.body import check_unicode
from services.gateway.config import GatewayConfig
from services.gateway.embeddings import embed, parse_embedding
from services.gateway.lora_admin import lora_routes
from services.gateway.mesh_client import MeshClient, nats_header_bytes, too_large_for_the_bus
from services.gateway.observe import request_span
from services.gateway.openapi import SPEC
from services.gateway.protocol import ApiRequest, parse_chat, parse_completion
from services.gateway.responses import (
    DONE,
    Json,
    ResponseBuilder,
    dump_json,
    error_body,
    error_from,
    sse,
)
from services.gateway.responses_api import ResponsesRequest, parse_responses
from services.gateway.responses_view import ResponsesView, new_id
from services.gateway.scores import parse_rerank, parse_score, rerank, score
from services.gateway.streams import BatchedStreams, RequestStream
from services.gateway.tokenize import (
    TOKENIZE_TIMEOUT_S,
    detokenize_response,
    parse_detokenize,
    parse_tokenize,
    tokenize_response,
)

log = logging.getLogger("meshserve.gateway")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
Parser = Callable[[Any, GatewayConfig], ApiRequest]

SSE_HEADERS = {
    "Content-Type": "text/event-stream",
    "Cache-Control": "no-cache",
    "X-Accel-Buffering": "no",  # tell proxies (nginx) not to buffer the stream
}


def json_response(
    body: Any, status: int = 200, headers: dict[str, str] | None = None
) -> web.Response:
    """Every JSON body the gateway sends: strict JSON (see ``dump_json``), UTF-8."""
    return web.Response(
        body=dump_json(body), status=status, headers=headers, content_type="application/json"
    )


def error_response(status: int, body: Json, headers: dict[str, str] | None = None) -> web.Response:
    return json_response(body, status, headers)


@web.middleware
async def openai_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every failure leaves as an OpenAI error object; the gateway keeps serving."""
    try:
        return await handler(request)
    except RequestError as exc:
        # Overload and unavailability are temporary: tell clients (and the openai SDK, which
        # honours it) when to retry.
        retry = {"Retry-After": "1"} if exc.status in (429, 503) else None
        return error_response(exc.status, error_from(exc), retry)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        message = (
            f"Invalid URL ({request.method} {request.path})"
            if exc.status in (404, 405)
            else exc.text or exc.reason
        )
        allow = {"Allow": exc.headers["Allow"]} if "Allow" in exc.headers else None
        return error_response(exc.status, error_body(message, "invalid_request_error"), allow)
    except Exception:
        log.exception("gateway: unhandled error in %s %s", request.method, request.path)
        message = "The server had an error while processing your request."
        return error_response(500, error_body(message, "server_error"))


def bearer_token(header: str) -> bytes | None:
    """The token of an ``Authorization: Bearer ...`` header as the bytes the client sent.

    aiohttp decodes header bytes as UTF-8 with ``surrogateescape``, so a header that is not
    UTF-8 (``Bearer \\xff``) holds lone surrogates that a plain ``encode()`` refuses; encoding
    back the same way recovers the original bytes, which then simply fail to match a key.
    """
    scheme, _, token = header.strip().partition(" ")
    if scheme.lower() != "bearer" or not token.strip():  # (RFC 9110: any case, a token)
        return None
    try:
        return token.strip().encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:  # a surrogate that was not an escaped byte: matches no key
        return None


# Paths outside /v1/ that need the API key too (vLLM leaves /tokenize open; here it spends the
# mesh's tokenizers, so it is the key holders')
PROTECTED = frozenset({"/metrics", "/tokenize", "/detokenize", "/score", "/rerank", "/v2/rerank"})


def require_api_key(keys: tuple[str, ...]) -> Any:
    accepted = [key.encode() for key in keys]

    @web.middleware
    async def check(request: web.Request, handler: Handler) -> web.StreamResponse:
        # /metrics too: its labels and counts describe the traffic (Prometheus in compose
        # scrapes the unpublished --metrics-port instead); /health stays open for probes.
        if request.path.startswith("/v1/") or request.path in PROTECTED:
            given = bearer_token(request.headers.get("Authorization", ""))
            # Compare with every key even after a match: the time taken says nothing.
            matches = [given is not None and hmac.compare_digest(given, key) for key in accepted]
            if not any(matches):
                raise RequestError("Incorrect API key provided.", 401, code="invalid_api_key")
        return await handler(request)

    return check


# The content types a browser sends cross-site without asking first (CORS "simple" requests):
# parsed as JSON, they let any web page the user opens spend the mesh's GPUs (vLLM's FastAPI
# routes do not parse them either)
SIMPLE_CONTENT_TYPES = ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data")
BODY_TIMEOUT_S = 60.0  # a body still arriving after this is a 408 (a slow upload holds a slot)
# A stream the client has stopped reading (its connection open, its window full) for this long
# is taken as left: the handler waited on the write forever, its request never aborted.
WRITE_TIMEOUT_S = 60.0


async def send(response: web.StreamResponse, data: bytes) -> None:
    try:
        async with asyncio.timeout(WRITE_TIMEOUT_S):
            await response.write(data)
    except TimeoutError:
        raise ConnectionResetError(f"the client read nothing for {WRITE_TIMEOUT_S:g} s") from None


async def read_json(request: web.Request, limit: int) -> Any:
    if request.content_type in SIMPLE_CONTENT_TYPES:
        raise RequestError(
            f"Send the body as JSON ('Content-Type: application/json'), not "
            f"{request.content_type!r}.",
            415,
            "invalid_request_error",
            None,
            "unsupported_media_type",
        )
    too_large = RequestError(
        f"The request body is larger than the limit of {limit} bytes.",
        413,
        "invalid_request_error",
        None,
        "request_too_large",
    )
    if request.content_length is not None and request.content_length > limit:
        raise too_large
    try:
        async with asyncio.timeout(BODY_TIMEOUT_S):
            raw = await request.read()  # aiohttp enforces client_max_size on unknown sizes
    except web.HTTPRequestEntityTooLarge:
        raise too_large from None
    except TimeoutError:
        raise RequestError(
            f"The request body did not arrive within {BODY_TIMEOUT_S:g} s.",
            408,
            "invalid_request_error",
            None,
            "request_timeout",
        ) from None
    try:
        body = json.loads(raw)
    except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError
        raise invalid_json(str(exc)) from None
    except RecursionError:  # e.g. 100000 nested "[": the C decoder gives up at the limit
        raise invalid_json("it is nested too deeply") from None
    if SURROGATE_ESCAPE.search(raw):  # (a pair is fine; only then is there one to look for)
        check_unicode(body)
    return body


# A lone surrogate comes from an escape of one, or from the UTF-8-like bytes of one, which
# json.loads decodes with "surrogatepass".
SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]|\xed[\xa0-\xbf]")


def invalid_json(reason: str) -> RequestError:
    return RequestError(
        f"We could not parse the JSON body of your request ({reason}).",
        400,
        "invalid_request_error",
        None,
        "invalid_json",
    )


class Routes:
    def __init__(self, config: GatewayConfig, mesh: MeshClient) -> None:
        self.base_config = config
        self._config = config
        self.mesh = mesh
        self.started = int(time.time())

    @property
    def config(self) -> GatewayConfig:
        """The gateway's settings with the LoRA adapters the executors announce now (models
        a request may name, as its own --lora-modules are)."""
        served = self.base_config.served_model_name
        announced = tuple(n for n in self.mesh.liveness.executors.loras() if n != served)
        if announced != self._config.announced_loras:
            self._config = dataclasses.replace(self.base_config, announced_loras=announced)
        return self._config

    async def tokenize(self, request: web.Request) -> web.Response:
        """vLLM's ``/tokenize``, answered by a tokenizer service."""
        ask = parse_tokenize(await read_json(request, self.config.max_body_bytes), self.config)
        subject = self.mesh.service.subjects.tokenizer_tokenize
        field = "prompt" if ask.messages is None else "messages"
        reply = await self.ask(subject, ask, TokenizeReply, field)
        return json_response(tokenize_response(reply, self.config))

    async def detokenize(self, request: web.Request) -> web.Response:
        ask = parse_detokenize(await read_json(request, self.config.max_body_bytes), self.config)
        subject = self.mesh.service.subjects.tokenizer_detokenize
        reply = await self.ask(subject, ask, DetokenizeReply, "tokens")
        return json_response(detokenize_response(reply))

    async def ask(self, subject: str, message: Message, kind: type[M], field: str) -> M:
        """A tokenizer's answer; a 413 for a question the bus cannot carry (the same one
        never would: no retry; ``field`` is what to shorten), a 503 when none answers."""
        # (measured as the request goes out: with its trace context's headers)
        size = len(message.encode()) + nats_header_bytes(inject(None))
        if size > self.mesh.service.nc.max_payload:
            raise too_large_for_the_bus(size, self.mesh.service.nc.max_payload, field)
        try:
            return await self.mesh.service.request(
                subject, message, kind, TOKENIZE_TIMEOUT_S, raise_errors=True
            )
        except RequestError as exc:
            if exc.status < 500:
                raise
            log.warning("gateway: a tokenizer failed on %s: %s", subject, exc)
            raise RequestError(
                "The tokenizer failed on this request.", exc.status, "server_error"
            ) from None
        except NoAnswer as exc:
            raise RequestError(
                "No tokenizer answered; retry.", 503, "server_error", None, "service_unavailable"
            ) from exc

    async def embeddings(self, request: web.Request) -> web.Response:
        """OpenAI's ``/v1/embeddings`` (``services.gateway.embeddings``)."""
        return await self.pooled(request, parse_embedding, "embd", embed)

    async def score(self, request: web.Request) -> web.Response:
        """vLLM's ``/score``: the cosine similarity of each pair's embeddings
        (``services.gateway.scores``)."""
        return await self.pooled(request, parse_score, "score", score)

    async def rerank(self, request: web.Request) -> web.Response:
        """vLLM's ``/rerank`` (Jina's and Cohere's shape): the documents by the cosine
        similarity of their embeddings to the query's."""
        return await self.pooled(request, parse_rerank, "rerank", rerank)

    async def pooled(
        self,
        request: web.Request,
        parse: Callable[[Any, GatewayConfig], Any],
        id_prefix: str,
        answer: Callable[[MeshClient, Any, str, int], Awaitable[Json]],
    ) -> web.Response:
        """A request whose inputs are embedded through the mesh, answered whole, under one
        ``gateway.request`` span."""
        with request_span(self.mesh.service.tracer, request.headers, request.path) as span:
            ask = parse(await read_json(request, self.config.max_body_bytes), self.config)
            response_id = f"{id_prefix}-{uuid.uuid4().hex}"
            body = await answer(self.mesh, ask, response_id, self.config.embedding_concurrency)
            span.set_attribute(Attr.HTTP_STATUS, 200)
            return json_response(body, headers={"X-Request-Id": response_id})

    async def responses(self, request: web.Request) -> web.StreamResponse:
        """OpenAI's Responses API, as a view of a chat completion
        (``services.gateway.responses_api``, ``responses_view``)."""
        with request_span(self.mesh.service.tracer, request.headers, request.path) as span:
            ask = parse_responses(await read_json(request, self.config.max_body_bytes), self.config)
            api = ask.api
            response_id, created = new_id("resp"), int(time.time())
            stream = await self.submit(api, response_id)
            try:
                builder = ResponseBuilder(
                    api,
                    response_id,
                    created,
                    self.mesh.liveness.tool_format,
                    self.config.reasoning_parser,
                )
                view = ResponsesView(response_id, created, api.model, ask.echoed)
                try:  # nothing sent yet: a failure is an HTTP error, in the body's names
                    first = await anext(stream)
                except RequestError as exc:
                    raise ask.renamed(exc) from None
                if api.stream:
                    response = await self.stream_responses(
                        request, builder, view, stream, first, ask
                    )
                else:
                    view.add(builder.add(*first))
                    async for index, delta in stream:
                        view.add(builder.add(index, delta))
                    view.closing(builder.usage())
                    headers = {"X-Request-Id": response_id}
                    response = json_response(view.response(), headers=headers)
                span.set_attribute(Attr.HTTP_STATUS, response.status)
                return response
            except Exception as exc:
                stream.failure = stream.failure or f"gateway error: {exc!r}"
                raise
            finally:
                await self.mesh.release(stream)

    async def stream_responses(
        self,
        request: web.Request,
        builder: ResponseBuilder,
        view: ResponsesView,
        stream: RequestStream | BatchedStreams,
        first: tuple[int, TextDelta],
        ask: ResponsesRequest,
    ) -> web.StreamResponse:
        """The Responses events as SSE (``event:`` and ``data:`` lines; no ``[DONE]``); a
        stage that fails mid-stream ends it with ``error`` and ``response.failed``."""
        response = web.StreamResponse(headers={**SSE_HEADERS, "X-Request-Id": view.id})
        try:
            await response.prepare(request)
            await send(response, named_events(view.opening() + view.add(builder.add(*first))))
            try:
                async for index, delta in stream:
                    events = view.add(builder.add(index, delta))
                    if events:
                        await send(response, named_events(events))
                await send(response, named_events(view.closing(builder.usage())))
            except RequestError as exc:
                failed = ask.renamed(exc)
                events = view.failing(failed.code, str(failed), failed.param, failed.status)
                await send(response, named_events(events))
            except ConnectionResetError:
                raise
            except Exception as exc:
                log.exception("gateway: response %s failed", view.id)
                stream.failure = f"gateway error: {exc!r}"
                events = view.failing("server_error", "The server had an error.", None)
                await send(response, named_events(events))
            await response.write_eof()
        except ConnectionResetError:
            log.info("gateway: client left response %s", view.id)
        return response

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self.generate(request, parse_completion, "cmpl")

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self.generate(request, parse_chat, "chatcmpl")

    async def generate(
        self, request: web.Request, parse: Parser, id_prefix: str
    ) -> web.StreamResponse:
        """The request's trace root, ``gateway.request``, around everything it causes."""
        with request_span(self.mesh.service.tracer, request.headers, request.path) as span:
            response = await self.respond(request, parse, id_prefix)
            span.set_attribute(Attr.HTTP_STATUS, response.status)
            return response

    async def respond(
        self, request: web.Request, parse: Parser, id_prefix: str
    ) -> web.StreamResponse:
        api = parse(await read_json(request, self.config.max_body_bytes), self.config)
        response_id = f"{id_prefix}-{uuid.uuid4().hex}"
        created = int(time.time())
        stream = await self.submit(api, response_id)
        try:
            # The tool-call format is the tokenizer's: read after submit, which waits (in the
            # start-up grace) until a tokenizer has announced itself.
            tool_format = self.mesh.liveness.tool_format
            builder = ResponseBuilder(
                api, response_id, created, tool_format, self.config.reasoning_parser
            )
            first = await anext(stream)  # nothing sent yet: a failure here is an HTTP error
            if api.stream:
                return await self.stream_sse(request, builder, stream, first)
            builder.add(*first)
            async for index, delta in stream:
                builder.add(index, delta)
            return json_response(builder.response(), headers={"X-Request-Id": response_id})
        except Exception as exc:
            stream.failure = stream.failure or f"gateway error: {exc!r}"
            raise
        finally:  # cancelled (client gone, shutdown) or failed: abort what still runs
            await self.mesh.release(stream)

    async def submit(self, api: ApiRequest, response_id: str) -> RequestStream | BatchedStreams:
        """One request per prompt (a batch's each under ``<id>-<k>``), as one stream."""
        if not api.batch:
            return await self.mesh.submit(api, response_id)
        streams: list[RequestStream] = []
        tracer = self.mesh.service.tracer
        try:
            for k, one in enumerate(api.batch):
                # Each prompt's own span (its latency, tokens and the mesh's spans below it)
                # under gateway.request, ended when its stream is released.
                span = tracer.start_span("gateway.prompt", attributes={Attr.PROMPT_INDEX: k})
                try:
                    with trace.use_span(span):
                        stream = await self.mesh.submit(one, f"{response_id}-{k}")
                except BaseException:
                    span.end()
                    raise
                stream.span = span
                streams.append(stream)
        except BaseException as exc:  # (a later prompt refused: the earlier ones are aborted)
            batch = BatchedStreams(streams, api.n)
            if isinstance(exc, RequestError):
                batch.fail_all(exc, f"prompt {len(streams)} of the batch was refused: {exc}")
            await self.mesh.release(batch)
            raise
        span = trace.get_current_span()  # gateway.request: the batch's
        span.set_attributes({Attr.REQUEST_ID: response_id, Attr.N: api.num_choices})
        return BatchedStreams(streams, api.n)

    async def stream_sse(
        self,
        request: web.Request,
        builder: ResponseBuilder,
        stream: RequestStream | BatchedStreams,
        first: tuple[int, TextDelta],
    ) -> web.StreamResponse:
        response = web.StreamResponse(headers={**SSE_HEADERS, "X-Request-Id": builder.head["id"]})
        try:
            await response.prepare(request)
            first_chunks = builder.add(*first)  # (its usage first: the opening chunks show it)
            await send(response, encode(builder.opening_chunks() + first_chunks))
            try:
                async for index, delta in stream:
                    chunks = builder.add(index, delta)
                    if chunks:
                        await send(response, encode(chunks))
                tail = [builder.usage_chunk()] if builder.api.include_usage else []
                await send(response, encode(tail) + DONE)
            except RequestError as exc:  # a stage failed mid-stream: the error is a chunk
                await send(response, sse(error_from(exc)) + DONE)
            except ConnectionResetError:
                raise  # the client left while we wrote: nothing to tell it
            except Exception as exc:
                log.exception("gateway: stream %s failed", builder.head["id"])
                stream.failure = f"gateway error: {exc!r}"
                body = error_body("The server had an error while streaming.", "server_error")
                await send(response, sse(body) + DONE)
            await response.write_eof()
        except ConnectionResetError:  # the client went away; release() aborts the rest
            log.info("gateway: client left stream %s", builder.head["id"])
        return response

    async def models(self, request: web.Request) -> web.Response:
        names = [self.config.served_model_name, *self.config.lora_names]
        return json_response({"object": "list", "data": [self.model_card(n) for n in names]})

    async def model(self, request: web.Request) -> web.Response:
        name = request.match_info["model"]
        if name != self.config.served_model_name and name not in self.config.lora_names:
            raise RequestError(
                f"The model `{name}` does not exist.", 404, param="model", code="model_not_found"
            )
        return json_response(self.model_card(name))

    def model_card(self, name: str) -> Json:
        """vLLM's card: a LoRA adapter's names its base model as ``parent``, and its folder
        as ``root``."""
        base = self.config.served_model_name
        root = self.config.lora_paths.get(name, name)
        return {
            "id": name,
            "object": "model",
            "created": self.started,
            "owned_by": "meshserve",
            "root": root,
            "parent": None if name == base else base,
            "max_model_len": self.config.max_model_len,
        }

    async def health(self, request: web.Request) -> web.Response:
        status, body = self.mesh.health_report()  # every stage; 503 names the missing ones
        return json_response(body, status)


def encode(chunks: list[Json]) -> bytes:
    return b"".join(sse(chunk) for chunk in chunks)


def named_events(events: list[Json]) -> bytes:
    """Server-sent events with their ``event:`` line (the Responses API's framing)."""
    return b"".join(b"event: " + event["type"].encode() + b"\n" + sse(event) for event in events)


def build_app(config: GatewayConfig, mesh: MeshClient) -> web.Application:
    middlewares = [openai_errors]
    if config.api_keys:
        middlewares.append(require_api_key(config.api_keys))
    app = web.Application(client_max_size=config.max_body_bytes, middlewares=middlewares)
    app.on_response_prepare.append(echo_request_id)
    routes = Routes(config, mesh)
    app.router.add_post("/v1/completions", routes.completions)
    app.router.add_post("/v1/chat/completions", routes.chat)
    app.router.add_post("/v1/embeddings", routes.embeddings)
    app.router.add_post("/v1/responses", routes.responses)
    for path in ("/score", "/v1/score"):
        app.router.add_post(path, routes.score)
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        app.router.add_post(path, routes.rerank)
    app.router.add_get("/v1/models", routes.models)
    app.router.add_get("/v1/models/{model:.+}", routes.model)  # (names hold a "/")
    app.router.add_post("/tokenize", routes.tokenize)
    app.router.add_post("/detokenize", routes.detokenize)
    app.router.add_get("/health", routes.health)
    app.router.add_get("/metrics", metrics_handler(mesh.service.registry))
    app.router.add_get("/openapi.json", openapi)
    if config.allow_runtime_lora_updating:
        lora_routes(app, config, mesh, read_json)
    return app


CLIENT_REQUEST_ID = re.compile(r"[\x21-\x7e]{1,128}")  # printable, no spaces, bounded


async def echo_request_id(request: web.Request, response: web.StreamResponse) -> None:
    """A client's ``X-Request-Id`` comes back on every response, errors included, as vLLM's
    ``--enable-request-id-headers`` gives it (the mesh keeps its own unique ids); without
    one, a completion's response carries its own id."""
    given = request.headers.get("X-Request-Id", "")
    if CLIENT_REQUEST_ID.fullmatch(given):
        response.headers["X-Request-Id"] = given


async def openapi(request: web.Request) -> web.Response:
    return json_response(SPEC)


class GatewayServer:
    """The mesh client plus the HTTP server; ``start``/``stop`` serve both main and tests."""

    def __init__(self, config: GatewayConfig) -> None:
        self.config = config
        self.mesh = MeshClient(config)
        self.app = build_app(config, self.mesh)
        self._runner: web.AppRunner | None = None

    @property
    def port(self) -> int:
        """The bound port (useful with ``port=0``)."""
        if self._runner is None:
            raise RuntimeError("gateway not started")
        return int(self._runner.addresses[0][1])

    async def start(self) -> None:
        await self.mesh.start()
        # handler_cancellation: a client that disconnects cancels its handler at once (even
        # while it waits for tokens), and the handler's cleanup aborts the request mesh-wide.
        # keepalive_timeout: aiohttp arms it when a connection opens and when a response
        # ends, and disarms it only once a whole request has arrived: bytes that trickle in
        # do not extend it, so it bounds the header read as well as the idle wait (its
        # default is an hour).
        runner = web.AppRunner(
            self.app,
            handler_cancellation=True,
            shutdown_timeout=self.config.shutdown_timeout_s,
            keepalive_timeout=self.config.http_idle_timeout_s,
        )
        await runner.setup()
        await web.TCPSite(runner, self.config.host, self.config.port).start()
        self._runner = runner
        log.info(
            "gateway %s serving %s on http://%s:%d",
            self.config.mesh.instance_id,
            self.config.served_model_name,
            self.config.host,
            self.port,
        )

    async def stop(self) -> None:
        """Stop accepting connections, let in-flight requests finish (up to the shutdown
        timeout; the rest are cancelled and aborted), then drain NATS."""
        self.mesh.service.shutdown_requested.set()  # /health fails while we drain
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        await self.mesh.close()


async def serve(config: GatewayConfig) -> None:
    logging.getLogger().setLevel(config.mesh.log_level.upper())
    log.info("gateway config: %s", config)
    if not config.api_keys:
        level = logging.WARNING if config.allow_unauthenticated else logging.INFO
        log.log(
            level,
            "gateway: NO AUTHENTICATION: anyone who reaches %s:%d can use /v1 and /metrics "
            "(set MESHSERVE_API_KEYS to require a key)",
            config.host,
            config.port,
        )
    server = GatewayServer(config)

    async def stop() -> None:
        log.info("gateway: shutting down; in-flight requests get %gs", config.shutdown_timeout_s)
        await server.stop()

    await serve_until_shutdown(server.mesh.service, server.start, stop)  # SIGTERM / SIGINT
