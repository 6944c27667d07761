"""Compiled grammars for constrained requests, one per ``WireGrammar.key``, built off the step
loop.

Compiling EBNF against the vocabulary (xgrammar's token-mask cache) takes milliseconds to
seconds; the step loop must not wait for it, so a constrained request is compiled on a thread
of its own (xgrammar releases the GIL while it compiles) and joins the engine when its grammar
is ready. Each key compiles once: requests with the same schema share one compile in flight
and then the cached result (LRU, ``capacity`` grammars).
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from common.wire.executor import WireGrammar


def tokenizer_info(tokenizer_backend: Any, vocab_size: int, stop_token_ids: list[int]) -> Any:
    """xgrammar's view of the vocabulary: the model's LM-head size (the bitmask width), its
    end-of-sequence ids as the grammar's stop tokens (the engine stops on the same ids)."""
    import xgrammar as xgr
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(tokenizer_object=tokenizer_backend)  # type: ignore[no-untyped-call]
    return xgr.TokenizerInfo.from_huggingface(
        hf, vocab_size=vocab_size, stop_token_ids=stop_token_ids
    )


class GrammarCache:
    def __init__(self, info: Any, capacity: int = 256, threads: int = 1) -> None:
        import xgrammar as xgr

        # xgrammar's own cache is off: ours is keyed by the short key, not the EBNF text.
        self.compiler = xgr.GrammarCompiler(info, max_threads=threads, cache_enabled=False)
        self.pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="grammar")
        self.capacity = capacity
        self.compiled: OrderedDict[str, Any] = OrderedDict()
        self.inflight: dict[str, asyncio.Future[Any]] = {}
        self.compile_seconds: list[float] = []  # per cold compile, for the benchmark

    async def get(self, grammar: WireGrammar) -> Any:
        """The compiled grammar for ``grammar.key`` (raises ``ValueError`` if it does not
        compile)."""
        hit = self.compiled.get(grammar.key)
        if hit is not None:
            self.compiled.move_to_end(grammar.key)
            return hit
        pending = self.inflight.get(grammar.key)
        if pending is None:
            loop = asyncio.get_running_loop()
            pending = asyncio.ensure_future(
                loop.run_in_executor(self.pool, self._compile, grammar.ebnf)
            )
            self.inflight[grammar.key] = pending
            pending.add_done_callback(lambda f, key=grammar.key: self._done(key, f))
        return await asyncio.shield(pending)

    def _compile(self, ebnf: str) -> Any:
        started = time.perf_counter()
        try:
            compiled = self.compiler.compile_grammar(ebnf)
        except RuntimeError as exc:
            raise ValueError(f"the grammar does not compile: {exc}") from None
        self.compile_seconds.append(time.perf_counter() - started)
        return compiled

    def _done(self, key: str, future: asyncio.Future[Any]) -> None:
        self.inflight.pop(key, None)
        if future.cancelled() or future.exception() is not None:
            return
        self.compiled[key] = future.result()
        while len(self.compiled) > self.capacity:
            self.compiled.popitem(last=False)

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
