"""Detokenizer handlers: one StepTokens in, one TextDeltas out per gateway inbox.

Each shard keeps per-request state (incremental detokenizer, stop matcher) from the request's
first tokens to its end; run one process per shard (``--shard i`` of ``--shards n``).
When a stop string ends a request, the executors are told to abort it so its pages are freed.
A stream is one client's text whichever executors produce it: when the scheduler moves a
request off a lost executor it asks here which tokens the stream has received, resubmits the
request with them, and the stream continues with the next executor's tokens. A stream the
gateway resumed after a loss in transit is a new one (a new id) that starts with the tokens its
client has (``StreamStart.output_token_ids``): they are replayed, not sent. Each delta carries
the tokens it covers (``TextDelta.token_ids``), the gateway's record to resume from.
"""

from __future__ import annotations

import functools
import logging
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from opentelemetry.trace import Span

from common.config import MeshConfig, model_setting
from common.metrics import DetokenizerMetrics
from common.recent_ids import RecentIds
from common.runtime import Service
from common.settings import parse, setting
from common.telemetry import Attr, extract
from common.tokenizer import IncrementalDetokenizer, Tokenizer
from common.wire.codec import PAYLOAD_HEADROOM, encode_within
from common.wire.detokenizer import (
    SeqTokens,
    StepTokens,
    StreamProgressReply,
    StreamProgressRequest,
    WirePromptLogprobs,
    WireTokenLogprob,
)
from common.wire.executor import AbortRequests
from common.wire.gateway import (
    ErrorEvent,
    TextDelta,
    TextDeltas,
    TextLogprob,
    TextPromptLogprobs,
    Usage,
)
from gpu.gguf import resolve_model_path
from services.detokenizer.stops import StopMatcher

log = logging.getLogger("meshserve.detokenizer")


def payload_error(limit: int, request_id: str) -> ErrorEvent:
    message = (
        f"One step of this request's output with its logprobs is over the message bus's "
        f"{limit}-byte payload limit; ask for fewer top_logprobs."
    )
    return ErrorEvent(request_id, 400, message, param="top_logprobs")


def gap_error(request_id: str) -> ErrorEvent:
    return ErrorEvent(
        request_id,
        503,
        "The stream lost part of its tokens on the way (a message-bus server failed); "
        "retry the request.",
        "server_error",
        "stream_gap",
    )


# Who sends a stream's tokens: (executor id, incarnation). A restarted executor keeps its id
# but is another process, and may be the one a request moves to.
Source = tuple[str, str]


@dataclass(frozen=True)
class DetokenizerConfig:
    mesh: MeshConfig
    model: str | None = model_setting()
    shard: int = setting(
        0,
        "this process's shard, 0 .. the tokenizer's --detok-shards - 1",
        env="MESHSERVE_DETOK_SHARD",
    )

    def __post_init__(self) -> None:
        if self.shard < 0:
            raise ValueError("shard must be >= 0")


def parse_args(argv: list[str] | None = None) -> DetokenizerConfig:
    return parse(DetokenizerConfig, argv, "python -m services.detokenizer")


@dataclass
class Stream:
    detok: IncrementalDetokenizer
    stops: StopMatcher
    reply_to: str
    prompt_tokens: int
    cached_tokens: int
    deadline: float | None
    span: Span  # detokenizer.stream: first tokens -> last delta (child of executor.decode)
    source: Source | None  # whose tokens it takes; None while it moves to another executor
    token_ids: list[int] = field(default_factory=list)  # all received: a migration resumes them
    output_tokens: int = 0
    deltas_sent: int = 0  # TextDelta.seq of the last delta sent
    unsent_ids: list[int] = field(default_factory=list)  # received since the last delta sent
    min_tokens: int = 0  # output tokens no stop string may end it within (vLLM's min_tokens)
    # for the first delta sent, when asked for: the prompt's logprobs and its echoed text
    prompt_logprobs: TextPromptLogprobs | None = None
    prompt_text: str | None = None
    think: str = ""  # the prompt's last <think> tag (StreamStart.think)
    embedding: bytes | None = None  # an embedding request's vector (SeqTokens.embedding)


class DetokenizerService:
    """State per stream lives from its first tokens until it finishes, is aborted (any stage's
    ``AbortRequests``) or passes its deadline; nothing else keeps it."""

    def __init__(self, config: DetokenizerConfig) -> None:
        self.config = config
        self.tokenizer = Tokenizer.from_folder(resolve_model_path(config.model))
        self.svc = Service("detokenizer", config.mesh)
        self.svc.facts.shard = config.shard  # the gateway needs a live detokenizer per shard
        self.streams: dict[str, Stream] = {}
        self.ended: RecentIds[str, bool] = RecentIds()  # tokens arriving after the end: dropped
        # (request id -> executor, and the migrations of the run) that the scheduler moved the
        # request away from: that run's tokens are late (it is dead or was only slow) and are
        # dropped; -1: migrations not said.
        self.withdrawn: RecentIds[str, tuple[Source, int]] = RecentIds()
        DetokenizerMetrics(self.svc.registry, lambda: len(self.streams))

    async def start(self) -> None:
        await self.svc.connect()
        s = self.svc.subjects
        await self.svc.subscribe(s.detok(self.config.shard), StepTokens, self.on_step)
        await self.svc.subscribe(s.abort, AbortRequests, self.on_abort)
        await self.svc.serve(
            s.detok_progress(self.config.shard), StreamProgressRequest, self.on_progress
        )
        self.svc.spawn(self.svc.every(1.0, self.sweep), "sweep")

    async def on_step(self, step: StepTokens) -> None:
        out: dict[str, list[TextDelta]] = defaultdict(list)
        stopped: list[str] = []
        unknown: list[str] = []
        gapped: list[tuple[str, str]] = []  # (request id, its client's inbox)
        for seq in step.seqs:
            stream = self.stream_for(seq, (step.executor_id, step.incarnation))
            if stream is None:
                if self.never_seen(seq):
                    unknown.append(seq.request_id)
                continue
            if seq.continues_on is not None:
                # Disaggregated: the prefill executor hands the stream to the decode one.
                stream.source = seq.continues_on
            if len(stream.token_ids) + len(seq.token_ids) != seq.output_tokens:
                # A step message before this one never came (core NATS drops what was in
                # flight on a server that died): the text would silently miss its tokens.
                gapped.append((seq.request_id, stream.reply_to))
                continue
            delta = self.advance(stream, seq)
            if delta is None:
                continue
            out[stream.reply_to].append(delta)
            if delta.finish_reason == "stop" and seq.finish_reason is None:
                stopped.append(seq.request_id)
        limit = self.svc.nc.max_payload - PAYLOAD_HEADROOM
        for reply_to, deltas in out.items():
            # Text and logprobs take more bytes than the token ids the executor fitted under
            # the bus's limit: as many messages as it takes.
            messages, too_large = encode_within(deltas, TextDeltas, limit)
            for data, _ in messages:
                await self.svc.publish(reply_to, data)
            if too_large:  # one step of a stream alone: it cannot go on
                await self.fail_streams(
                    [(d.request_id, reply_to) for d in too_large],
                    functools.partial(payload_error, limit),
                    "output over the payload limit",
                )
        if stopped:
            await self.svc.publish(
                self.svc.subjects.abort, AbortRequests(stopped, reason="stop string")
            )
        if gapped:  # retryable, with the code of the gateway's own check on text deltas
            await self.fail_streams(gapped, gap_error, "stream gap")
        if unknown:
            # Its start (and the text so far) went with a detokenizer that restarted: the
            # stream cannot go on correctly, so it fails clearly instead of hanging.
            self.ended.add_all(unknown, True)
            log.warning("detokenizer: failing %d streams it has no state for", len(unknown))
            await self.svc.publish(
                self.svc.subjects.abort,
                AbortRequests(
                    unknown,
                    reason="detokenizer lost the stream",
                    error="The stream was interrupted (a detokenizer restarted); retry.",
                ),
            )

    async def fail_streams(
        self, failed: list[tuple[str, str]], error: Callable[[str], ErrorEvent], reason: str
    ) -> None:
        """End these streams (request id, client inbox) with ``error(request id)`` to their
        clients, and have their executors stop them."""
        rids = [rid for rid, _ in failed]
        log.warning("detokenizer: failing %d streams (%s): %s", len(rids), reason, rids)
        for rid, reply_to in failed:
            self.end(rid, "error")
            await self.svc.publish(reply_to, error(rid))
        await self.svc.publish(self.svc.subjects.abort, AbortRequests(rids, reason=reason))

    def never_seen(self, seq: SeqTokens) -> bool:
        """Tokens of a stream this shard has no record of at all (not ended, not moved: one
        moved before its start came here is known by its move, and its next executor's
        start is on the way)."""
        rid = seq.request_id
        known = rid in self.streams or rid in self.ended or rid in self.withdrawn
        return seq.start is None and not known

    def stream_for(self, seq: SeqTokens, source: Source) -> Stream | None:
        """The stream these tokens continue, or None when they must be dropped: after its end
        (tokens that passed a stop string's abort), from an executor it was moved away from,
        or from a second executor while another one serves it."""
        rid = seq.request_id
        if rid in self.ended:
            return None
        stream = self.streams.get(rid)
        withdrawn = self.withdrawn.get(rid)
        if withdrawn is not None and withdrawn[0] in (source, seq.continues_on):
            # The run it was moved away from, or its prefill executor's tokens for it. But the
            # scheduler may send it back to that same process (or pair it with that decode
            # executor again): a start with more migrations is the new run. Migrations not
            # said: a start from that process while the stream waits for its next executor
            # (a run sends its start once, and this one's came already, or there would be
            # no stream).
            (moved_off, migrations), start = withdrawn, seq.start
            if migrations >= 0:
                new_run = start is not None and start.migrations > migrations
            else:
                waiting = stream is not None and stream.source is None
                new_run = moved_off == source and waiting and start is not None
            if not new_run:
                return None
            self.withdrawn.discard(rid)
        if stream is not None:
            if stream.source is None and seq.start is not None:
                stream.source = source  # the executor it moved to: continue
            if stream.source != source:
                log.warning("detokenizer: dropping tokens of %s from %s", rid, source)
                return None
            return stream
        if seq.start is None:
            return None  # a stream whose start this shard never saw: nothing to send
        start = seq.start
        stream = Stream(
            detok=self.tokenizer.detokenizer(
                start.prompt_tail, skip_special_tokens=start.skip_special_tokens
            ),
            stops=StopMatcher(list(start.stop), include=start.include_stop_str_in_output),
            min_tokens=start.min_tokens,
            reply_to=start.reply_to,
            prompt_tokens=start.prompt_tokens,
            cached_tokens=start.cached_tokens,
            deadline=start.deadline,
            span=self.svc.tracer.start_span(
                "detokenizer.stream",
                context=extract(start.trace),
                attributes={
                    Attr.REQUEST_ID: rid,
                    Attr.PROMPT_TOKENS: start.prompt_tokens,
                    Attr.CACHED_TOKENS: start.cached_tokens,
                },
            ),
            source=source,
        )
        stream.think = start.think
        if start.echo_prompt_ids:
            stream.prompt_text = self.tokenizer.decode(
                start.echo_prompt_ids, skip_special_tokens=start.skip_special_tokens
            )
        if start.output_token_ids:
            self.replay(stream, start.output_token_ids)
        self.streams[rid] = stream
        return stream

    @staticmethod
    def replay(stream: Stream, token_ids: list[int]) -> None:
        """A resumed stream: its client already has these tokens' text (the gateway resumes
        from the tokens of the deltas it took), so they only bring the detokenizer and the stop
        matcher to the lost stream's state, held-back text included; nothing is sent. No stop
        string ends it there (none did, or the stream would have ended, but for those that
        min_tokens kept from ending it)."""
        stream.stops.feed(stream.detok.add(token_ids), may_stop=False)
        stream.token_ids.extend(token_ids)
        stream.output_tokens = len(token_ids)

    def advance(self, stream: Stream, seq: SeqTokens) -> TextDelta | None:
        rid = seq.request_id
        ids, logprobs_in = seq.token_ids, seq.logprobs
        if seq.prompt_logprobs is not None:
            stream.prompt_logprobs = self.prompt_logprobs(seq.prompt_logprobs)
        if seq.embedding is not None:
            stream.embedding = seq.embedding
        # The stop token that ended it (an EOS, a stop_token_ids entry) has no text in the
        # completion, as in vLLM: "<|im_end|>" with skip_special_tokens off, say.
        # (include_stop_str_in_output keeps it, as it keeps a stop string)
        stop_token = seq.stop_token and seq.finish_reason == "stop" and not stream.stops.include
        shown = ids[:-1] if stop_token else ids
        # Of this step's tokens, how many are within min_tokens (no stop string ends there).
        unstoppable = max(0, stream.min_tokens - stream.output_tokens)
        if not stream.stops.stops or (len(shown) <= 1 and not unstoppable):
            text = stream.stops.feed(stream.detok.add(shown))
        else:  # several tokens (speculation): one at a time, to stop where a one-token step
            text = ""  # would (the tokens after a stop string are not the client's)
            for i, token in enumerate(shown):
                text += stream.stops.feed(stream.detok.add([token]), i >= unstoppable)
                if stream.stops.stopped:
                    ids = ids[: i + 1]
                    logprobs_in = logprobs_in[: i + 1] if logprobs_in is not None else None
                    break
        stream.output_tokens = seq.output_tokens - (len(seq.token_ids) - len(ids))
        stream.token_ids.extend(ids)
        stream.unsent_ids.extend(ids)
        finish = seq.finish_reason
        if stream.stops.stopped:
            finish = "stop"
        elif finish is not None:
            text += stream.stops.feed(stream.detok.finish(), unstoppable < len(shown))
            text += stream.stops.flush()
            if stream.stops.stopped:
                finish = "stop"
        if finish is None:
            if not text and logprobs_in is None:
                return None  # nothing the client can see yet (a held-back partial character)
            stream.deltas_sent += 1
            return TextDelta(
                rid,
                text,
                # the first: the prompt's usage, for continuous_usage_stats from the start
                usage=self.usage(stream) if stream.deltas_sent == 1 else None,
                logprobs=self.logprobs(logprobs_in),
                seq=stream.deltas_sent,
                token_ids=self.take_unsent(stream),
                **self.take_prompt(stream),
            )
        self.end(rid, finish)
        usage = self.usage(stream)
        stream.deltas_sent += 1
        logprobs = self.logprobs(logprobs_in)
        unsent = self.take_unsent(stream)
        return TextDelta(
            rid, text, finish, usage, logprobs, stream.deltas_sent, unsent,
            **self.take_prompt(stream),
        )  # fmt: skip

    @staticmethod
    def usage(stream: Stream) -> Usage:
        return Usage(stream.prompt_tokens, stream.output_tokens, stream.cached_tokens)

    @staticmethod
    def take_unsent(stream: Stream) -> list[int]:
        ids, stream.unsent_ids = stream.unsent_ids, []
        return ids

    @staticmethod
    def take_prompt(stream: Stream) -> dict[str, Any]:
        """The prompt's logprobs, echoed text and last <think> tag, for the first delta sent
        (then gone)."""
        taken = {
            "prompt_logprobs": stream.prompt_logprobs,
            "prompt_text": stream.prompt_text,
            "think": stream.think,
            "embedding": stream.embedding,
        }
        stream.prompt_logprobs = stream.prompt_text = stream.embedding = None
        stream.think = ""
        return taken

    def end(self, request_id: str, reason: str) -> None:
        """Forget a stream (its tokens still on the way are dropped) and close its span."""
        self.ended.add(request_id, True)
        stream = self.streams.pop(request_id, None)
        if stream is None:
            return
        stream.span.set_attribute(Attr.OUTPUT_TOKENS, stream.output_tokens)
        stream.span.set_attribute(Attr.FINISH_REASON, reason)
        stream.span.end()

    async def on_abort(self, msg: AbortRequests) -> None:
        if msg.executor_id:
            return  # the scheduler moving work between executors: the stream goes on
        for rid in msg.request_ids:
            self.end(rid, "abort")

    async def on_progress(self, ask: StreamProgressRequest) -> StreamProgressReply:
        """The scheduler moves these requests off ``ask.executor_id``: say what each stream
        has received, and from now on take its tokens only from the executor it moves to."""
        streamed: dict[str, list[int]] = {}
        ended: list[str] = []
        migrations = ask.migrations or [-1] * len(ask.request_ids)
        for rid, moves in zip(ask.request_ids, migrations, strict=True):
            self.withdrawn.add(rid, ((ask.executor_id, ask.incarnation), moves))
            stream = self.streams.get(rid)
            if stream is not None:
                stream.source = None
                streamed[rid] = list(stream.token_ids)
            elif rid in self.ended:
                ended.append(rid)
        return StreamProgressReply(streamed, ended)

    async def sweep(self) -> None:
        """Forget streams past their deadline (their gateway has given up on them)."""
        now = time.time()
        for rid, stream in list(self.streams.items()):
            if stream.deadline is not None and stream.deadline < now:
                self.end(rid, "timeout")
        self.ended.prune()
        self.withdrawn.prune()

    def prompt_logprobs(self, wire: WirePromptLogprobs) -> TextPromptLogprobs:
        ids = set(wire.token_ids) | {t for top in wire.top for t, _ in top}
        texts = {t: self.tokenizer.token_text(t) for t in ids}
        return TextPromptLogprobs(wire.token_ids, wire.logprobs, wire.ranks, wire.top, texts)

    def logprobs(self, entries: list[WireTokenLogprob] | None) -> list[TextLogprob] | None:
        if entries is None:
            return None
        tok, result = self.tokenizer, []
        for e in entries:
            token = tok.token_text(e.token_id)
            top = [(tok.token_text(t), lp) for t, lp in e.top]
            top_bytes = [list(tok.token_bytes(t)) for t, _ in e.top]
            result.append(
                TextLogprob(token, e.logprob, list(tok.token_bytes(e.token_id)), top, top_bytes)
            )
        return result
