"""Detokenizer handlers: one StepTokens in, one TextDeltas out per gateway inbox.

Each shard keeps per-request state (incremental detokenizer, stop matcher) from the request's
first tokens to its finish; run one process per shard (``--shard i`` of ``--shards n``).
When a stop string ends a request, the executors are told to abort it so its pages are freed.
"""

from __future__ import annotations

import argparse
from collections import defaultdict
from dataclasses import dataclass

from opentelemetry.trace import Span

from common.config import MeshConfig, env
from common.messages import (
    AbortRequests,
    SeqTokens,
    StepTokens,
    TextDelta,
    TextDeltas,
    TextLogprob,
    TokenLogprobs,
    Usage,
)
from common.runtime import Service
from common.telemetry import Attr, extract
from common.tokenizer import IncrementalDetokenizer, Tokenizer
from gpu.gguf import resolve_model_path
from services.detokenizer.stops import StopMatcher


@dataclass(frozen=True)
class DetokenizerConfig:
    mesh: MeshConfig
    model: str | None
    shard: int = 0

    def __post_init__(self) -> None:
        if self.shard < 0:
            raise ValueError("shard must be >= 0")


def parse_args(argv: list[str] | None = None) -> DetokenizerConfig:
    p = argparse.ArgumentParser("python -m services.detokenizer")
    MeshConfig.add_args(p)
    p.add_argument("--model", default=env("MODEL", "") or None)
    p.add_argument("--shard", type=int, default=int(env("DETOK_SHARD", "0")))
    a = p.parse_args(argv)
    return DetokenizerConfig(MeshConfig.from_args(a), a.model, a.shard)


@dataclass
class Stream:
    detok: IncrementalDetokenizer
    stops: StopMatcher
    prompt_tokens: int
    cached_tokens: int
    span: Span  # detokenizer.stream: first tokens -> last delta (child of executor.decode)
    output_tokens: int = 0


class DetokenizerService:
    def __init__(self, config: DetokenizerConfig) -> None:
        self.config = config
        self.tokenizer = Tokenizer.from_folder(resolve_model_path(config.model))
        self.svc = Service("detokenizer", config.mesh)
        self.svc.facts.shard = config.shard  # the gateway needs a live detokenizer per shard
        self.streams: dict[str, Stream] = {}

    async def start(self) -> None:
        await self.svc.connect()
        subject = self.svc.subjects.detok(self.config.shard)
        await self.svc.subscribe(subject, StepTokens, self.on_step)

    async def on_step(self, step: StepTokens) -> None:
        out: dict[str, list[TextDelta]] = defaultdict(list)
        stopped: list[str] = []
        for seq in step.seqs:
            delta = self.advance(seq)
            if delta is None:
                continue
            out[seq.reply_to].append(delta)
            if delta.finish_reason == "stop" and seq.finish_reason is None:
                stopped.append(seq.request_id)
        for reply_to, deltas in out.items():
            await self.svc.publish(reply_to, TextDeltas(deltas))
        if stopped:
            await self.svc.publish(
                self.svc.subjects.abort, AbortRequests(stopped, reason="stop string")
            )

    def advance(self, seq: SeqTokens) -> TextDelta | None:
        rid = seq.request_id
        stream = self.streams.get(rid)
        if stream is None:
            if seq.start is None:
                # Tokens after a stop string (the executor has not seen the abort yet), or a
                # stream whose start this shard never saw: nothing to send.
                return None
            stream = Stream(
                detok=self.tokenizer.detokenizer(skip_special_tokens=seq.start.skip_special_tokens),
                stops=StopMatcher(list(seq.start.stop)),
                prompt_tokens=seq.start.prompt_tokens,
                cached_tokens=seq.start.cached_tokens,
                span=self.svc.tracer.start_span(
                    "detokenizer.stream",
                    context=extract(seq.start.trace),
                    attributes={
                        Attr.REQUEST_ID: rid,
                        Attr.PROMPT_TOKENS: seq.start.prompt_tokens,
                        Attr.CACHED_TOKENS: seq.start.cached_tokens,
                    },
                ),
            )
            self.streams[rid] = stream
        stream.output_tokens = seq.output_tokens
        text = stream.stops.feed(stream.detok.add(seq.token_ids))
        finish = seq.finish_reason
        if stream.stops.stopped:
            finish = "stop"
        elif finish is not None:
            text += stream.stops.feed(stream.detok.finish())
            text += stream.stops.flush()
            if stream.stops.stopped:
                finish = "stop"
        if finish is None:
            if not text and seq.logprobs is None:
                return None  # nothing the client can see yet (a held-back partial character)
            return TextDelta(rid, text, logprobs=self.logprobs(seq.logprobs))
        del self.streams[rid]
        stream.span.set_attribute(Attr.OUTPUT_TOKENS, stream.output_tokens)
        stream.span.set_attribute(Attr.FINISH_REASON, finish)
        stream.span.end()
        usage = Usage(stream.prompt_tokens, stream.output_tokens, stream.cached_tokens)
        return TextDelta(rid, text, finish, usage, self.logprobs(seq.logprobs))

    def logprobs(self, entries: list[TokenLogprobs] | None) -> list[TextLogprob] | None:
        if entries is None:
            return None
        result = []
        for e in entries:
            token = self.tokenizer.decode([e.token_id], skip_special_tokens=False)
            top = [(self.tokenizer.decode([t], skip_special_tokens=False), lp) for t, lp in e.top]
            result.append(TextLogprob(token, e.logprob, list(token.encode()), top))
        return result
