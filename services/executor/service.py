"""Executor handlers and the step loop.

Incoming requests and aborts are buffered and applied on the event-loop thread between steps
(the engine is not thread-safe); ``engine.step()`` runs on a worker thread so NATS traffic keeps
flowing while the model computes. All torch work of the process (building the engine too) runs on
that one thread: OpenMP keeps a thread team per calling thread, and once a process holds more
team threads than cores, libgomp cuts its spin-wait short and every parallel region of a step
pays for futex sleeps and wake-ups (decode steps were ~25% slower on 2 cores). Each step's
tokens go out as ONE ``StepTokens`` message per detokenizer shard.

On SIGTERM the executor drains: it reports ``draining`` in its heartbeat (the scheduler sends it
nothing new) and finishes the sequences it holds before it exits.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import sys
import threading
import time
import uuid
from collections import defaultdict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import nats.errors
import torch

from common.config import parse_lora_modules
from common.metrics import EngineSnapshot, ExecutorMetrics
from common.recent_ids import RecentIds
from common.runtime import RequestError, Service
from common.wire.codec import PAYLOAD_HEADROOM, Message, encode_within
from common.wire.detokenizer import (
    PROMPT_TAIL_TOKENS,
    SeqTokens,
    StepTokens,
    StreamStart,
    WirePromptLogprobs,
    WireTokenLogprob,
    float32_bytes,
)
from common.wire.executor import (
    AbortRequests,
    KVAgentQuery,
    LoraUpdate,
    LoraUpdated,
    PrefillDone,
    PrefillRequest,
    TokenizedRequest,
)
from common.wire.gateway import ErrorEvent
from common.wire.scheduler import Heartbeat
from gpu.config import ModelError
from gpu.engine import Engine, EngineConfig, StepOutput
from gpu.gguf import resolve_model_path
from gpu.loader import release_freed_memory
from gpu.lora import (
    AdapterBusy,
    AdapterFiles,
    LoraSet,
    UnknownAdapter,
    build_adapter,
    load_adapter,
    read_adapter,
)
from gpu.parallel.group import ParallelGroupLost
from gpu.proposers import NgramProposer
from gpu.replica import build_runner
from gpu.sequence import Sequence
from gpu.warmup import WarmupReport
from services.executor.config import ExecutorConfig
from services.executor.decode_side import DecodeSide
from services.executor.grammars import GrammarCache, tokenizer_info
from services.executor.kv_events import KVEventPublisher
from services.executor.kv_transport import KVTransport
from services.executor.prefill_side import PrefillSide
from services.executor.speculation import RemoteProposer
from services.executor.timeline import Timelines
from services.sampling import sampling_params

log = logging.getLogger("meshserve.executor")

# The closest two heartbeats may follow each other when sequences end (``report_freed_slots``).
EARLY_HEARTBEAT_MIN_S = 0.02


class ExecutorService:
    def __init__(
        self, config: ExecutorConfig, engine: Engine, worker: ThreadPoolExecutor | None = None
    ) -> None:
        self.config = config
        self.engine = engine
        self.svc = Service("executor", config.mesh)
        self.subjects = config.mesh.subjects
        self.requests: dict[str, TokenizedRequest] = {}
        self.started: set[str] = set()
        self.pending_adds: list[TokenizedRequest] = []
        # Constrained requests whose grammar compiles (``grammars.py``), then its result until
        # the request is added to the engine.
        self.compiling: dict[str, TokenizedRequest] = {}
        self.compiled: dict[str, Any] = {}
        self._grammar_cache: asyncio.Task[GrammarCache] | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self.pending_aborts: set[str] = set()
        # Requests in the engine as guests (spilled in from another region), those reserved
        # for a KV handoff included: preempted there, once admitted, for a request of this
        # region's own (``gpu/scheduler.py``).
        self.guests: set[str] = set()
        # Requests that ended everywhere (the client left, a stop string): a submit that
        # arrives after its abort (they travel different paths) is dropped, not run for nobody.
        self.ended: RecentIds[str, bool] = RecentIds()
        self.wake = asyncio.Event()
        # LoRA adapter changes the step loop runs on the engine's thread between steps (with
        # nothing else changing the engine meanwhile), each answered through its future
        self.lora_ops: list[tuple[Callable[[], bool], asyncio.Future[bool]]] = []
        self.worker = worker or engine_thread(config.engine_nice)
        self.draining = False
        # A step failed, or the tensor-parallel group lost a rank: nothing runs here again.
        self.broken = False
        self.broken_because = ""
        self.incarnation = uuid.uuid4().hex[:12]
        self.warmup: WarmupReport | None = None  # set by start(), before the first heartbeat
        self.load = (0, 0, engine.pages.num_free, 0)  # running, waiting, free pages, pending
        self.last_heartbeat = 0.0  # monotonic
        self.deferred_report: asyncio.Task[None] | None = None  # see report_freed_slots
        self.kv_events = KVEventPublisher(self.svc, config.executor_id)
        self.metrics = ExecutorMetrics(self.svc.registry, config.executor_id, self.engine_state)
        self.timelines = Timelines(self.svc.tracer, self.metrics, config.executor_id)
        self.remote: RemoteProposer | None = None  # drafts from the speculator service
        if config.speculator == "remote":
            self.remote = RemoteProposer(self.svc, config.speculator_timeout_s)
        # Disaggregation (--role prefill|decode): the KV pool registered with NIXL once.
        self.transport: KVTransport | None = None
        self.prefill_side: PrefillSide | None = None
        self.decode_side: DecodeSide | None = None
        if config.role != "mixed":
            agent = f"{config.executor_id}-{self.incarnation}"
            self.transport = KVTransport(agent, engine.runner.kv.layout())
            if config.role == "prefill":
                self.prefill_side = PrefillSide(self, self.transport)
            else:
                self.decode_side = DecodeSide(self, self.transport)

    async def start(self) -> None:
        await self.svc.connect()
        await self.svc.subscribe(
            self.subjects.executor_submit(self.config.executor_id), TokenizedRequest, self.on_submit
        )
        await self.svc.subscribe(self.subjects.abort, AbortRequests, self.on_abort)
        me = self.config.executor_id
        if self.prefill_side is not None:
            side = self.prefill_side
            await self.svc.subscribe(
                self.subjects.executor_prefill(me), PrefillRequest, side.on_prefill
            )
        if self.decode_side is not None:
            decode = self.decode_side
            await self.svc.subscribe(
                self.subjects.executor_prefilled(me), PrefillDone, decode.on_prefilled
            )
            # Whether each prefill peer lives: pages it may write into are held until it cannot.
            await self.svc.subscribe(
                self.subjects.executor_heartbeat, Heartbeat, decode.on_heartbeat
            )
            await self.svc.serve(
                self.subjects.executor_kv_agent(me), KVAgentQuery, decode.on_kv_agent
            )
            self.svc.spawn(decode.pump(), "kv-pump")
        await self.svc.serve(self.subjects.executor_lora(me), LoraUpdate, self.on_lora_update)
        await self.warm_up()
        await self.kv_events.start()  # before the first step: the index starts from "cleared"
        self.svc.spawn(self.step_loop(), "step-loop")
        self.svc.spawn(self.svc.every(self.config.heartbeat_s, self.heartbeat), "heartbeat")

    async def warm_up(self) -> None:
        """Every kernel built and one step of each kind run (``gpu/warmup.py``), on the engine
        thread, before the first heartbeat: until then the scheduler sends this executor
        nothing, so no request waits behind a compile. Submits that arrive meanwhile (from a
        scheduler that knew an earlier incarnation) wait in ``pending_adds``."""
        loop = asyncio.get_running_loop()
        report = await loop.run_in_executor(self.worker, self.engine.warm_up)
        self.warmup = report
        log.info("executor %s: warmed up in %s", self.config.executor_id, report.describe())

    # -- handlers ---------------------------------------------------------------------------
    async def on_submit(self, req: TokenizedRequest) -> None:
        if req.request_id in self.ended:
            log.info("executor: dropping %s: it was aborted before it arrived", req.request_id)
            return
        self.timelines.received(req.request_id, len(req.prompt_token_ids))
        if req.grammar is not None:
            if self.holds_constrained(req.request_id):
                # A replayed submit: its compiled grammar would wait for an add that never
                # comes (``apply_pending`` drops the duplicate).
                log.warning("executor: ignoring a second submit of %s", req.request_id)
                return
            self.compiling[req.request_id] = req
            task = asyncio.create_task(self.compile_grammar(req))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
            return
        self.pending_adds.append(req)
        self.wake.set()

    def holds_constrained(self, rid: str) -> bool:
        """Is ``rid`` compiling, waiting to be added or running here, and not withdrawn (an
        abort not yet applied, from the scheduler moving it: then a submit of it is new)?"""
        if rid in self.pending_aborts:
            return False
        waiting = any(r.request_id == rid for r in self.pending_adds)
        return rid in self.compiling or rid in self.requests or waiting

    def grammar_cache(self) -> asyncio.Task[GrammarCache]:
        """Built on first use, on a thread (xgrammar reads the whole vocabulary)."""
        if self._grammar_cache is None:
            folder = resolve_model_path(self.config.model)
            vocab = self.engine.runner.config.vocab_size
            stops = sorted(self.engine.eos_token_ids)

            def build() -> GrammarCache:
                from common.tokenizer import Tokenizer

                backend = Tokenizer.from_folder(folder).backend
                return GrammarCache(tokenizer_info(backend, vocab, stops))

            self._grammar_cache = asyncio.ensure_future(asyncio.to_thread(build))
        return self._grammar_cache

    async def compile_grammar(self, req: TokenizedRequest) -> None:
        """Compile off the step loop; the request joins the engine when its grammar is ready
        (unless it was aborted meanwhile)."""
        assert req.grammar is not None
        try:
            cache = await self.grammar_cache()
        except Exception as exc:  # xgrammar refusing the vocabulary, a tokenizer file gone
            log.exception("executor: could not build the grammar compiler")
            self._grammar_cache = None  # the next constrained request tries again
            await self.fail_compile(req, 500, f"The grammar compiler failed: {exc!r}")
            return
        try:
            compiled = await cache.get(req.grammar)
        except ValueError as exc:
            await self.fail_compile(req, 400, str(exc))
            return
        except Exception as exc:  # a failure of ours, not of the request's grammar
            log.exception("executor: compiling the grammar of %s failed", req.request_id)
            await self.fail_compile(req, 500, f"Compiling the grammar failed: {exc!r}")
            return
        if not self.take_compiling(req):
            return  # aborted while it compiled (and maybe submitted again since)
        self.compiled[req.request_id] = compiled
        self.pending_adds.append(req)
        self.wake.set()

    def take_compiling(self, req: TokenizedRequest) -> bool:
        """Is ``req`` itself still compiling (taken out now)? Not when it was aborted, nor when
        it was withdrawn and its id submitted again: that run has a compile of its own."""
        if self.compiling.get(req.request_id) is not req:
            return False
        del self.compiling[req.request_id]
        return True

    async def fail_compile(self, req: TokenizedRequest, status: int, message: str) -> None:
        """End a request whose grammar did not compile (unless it was aborted meanwhile): its
        client gets the error (the scheduler forgets it by the next heartbeat)."""
        if not self.take_compiling(req):
            return
        self.timelines.finished(req.request_id, "error")
        if status == 400:
            error = ErrorEvent(req.request_id, 400, message, param="response_format")
        else:
            error = ErrorEvent(req.request_id, status, message, "server_error")
        await self.try_publish(req.reply_to, error)

    async def on_abort(self, msg: AbortRequests) -> None:
        """Aborts apply in arrival order with submits: one for a request still waiting to be
        admitted removes it now, one for a running request is applied before the next step
        admits anything (so a withdraw-then-resubmit of the same id runs the new one)."""
        if msg.executor_id and msg.executor_id != self.config.executor_id:
            # Another executor's requests withdrawn: ours too, if we prefill them for it.
            if self.prefill_side is not None:
                await self.prefill_side.peer_withdrawn(msg.executor_id, msg.request_ids)
            return
        ids = set(msg.request_ids)
        if not msg.executor_id:
            self.ended.add_all(ids, True)
        elif self.prefill_side is not None:  # a decode side that never heard back asks again
            self.prefill_side.answer_again(ids)
        compiling = [self.compiling.pop(rid) for rid in ids.intersection(self.compiling)]
        for req in compiling:  # its compile goes on (the grammar is cached); it is not added
            self.forget(req.request_id)
        if msg.error:  # they failed elsewhere: we know their clients' inboxes, so tell them
            known = [*self.requests.values(), *self.pending_adds, *compiling]
            for req in (r for r in known if r.request_id in ids):
                await self.try_publish(
                    req.reply_to,
                    ErrorEvent(req.request_id, 503, msg.error, "server_error", "stream_lost"),
                )
        running = ids.intersection(self.requests)
        kept = []
        for req in self.pending_adds:
            if req.request_id not in ids:
                kept.append(req)
            elif req.request_id not in running:  # (else a duplicate submit of a running one:
                self.compiled.pop(req.request_id, None)  # forgotten once the engine drops it)
                self.forget(req.request_id)  # (a prefill job's decode side then frees its pages)
        self.pending_adds = kept
        if running:
            self.pending_aborts.update(running)
            self.wake.set()

    def snapshot_load(self) -> None:
        """Read the engine's load; only between steps (the step thread mutates it)."""
        sched = self.engine.scheduler
        pending = sum(self.to_compute(s) for s in sched.waiting) + sum(
            s.num_pending for s in sched.running
        )
        pending += self.engine.num_inflight_tokens  # (overlapped steps: sampled, not yet read)
        self.load = (len(sched.running), len(sched.waiting), self.engine.pages.num_free, pending)

    def cached_prefix_tokens(self, req: TokenizedRequest) -> int:
        """Prompt tokens the prefix cache would serve ``req`` now. Load reports count only the
        rest: a waiting cache hit is not a full prefill, and the kv router must not see it as
        one (it would push requests away from the executor holding their prefix)."""
        if req.params.every_prompt_position:  # (it takes no cache hit)
            return 0
        cache = self.engine.pages.hash_to_page
        pages = 0
        for page_hash in req.page_hashes:  # dict lookups only: safe while a step runs
            if page_hash not in cache:
                break
            pages += 1
        return min(pages * self.config.page_size, len(req.prompt_token_ids) - 1)

    def to_compute(self, seq: Sequence) -> int:
        req = self.requests.get(seq.request_id)
        if seq.table.pages or req is None:  # admitted (or matched) already: exact
            return seq.num_pending
        return max(1, seq.num_pending - self.cached_prefix_tokens(req))

    async def report_freed_slots(self) -> None:
        """Sequences ended this step: heartbeat now, not at the next period. The scheduler
        counts a finished sequence as running until it hears otherwise, and meanwhile sends
        the next request to another executor, which may be mid-step (the request then waits
        that step out) while this one idles. At most one such early report per
        ``EARLY_HEARTBEAT_MIN_S``: a busy executor ends sequences nearly every step. A report
        that comes too soon is sent when that interval is up, not dropped: the last sequences
        of a burst often end one step after the others, and then nothing else would tell the
        scheduler before the next period."""
        wait_s = self.last_heartbeat + EARLY_HEARTBEAT_MIN_S - time.monotonic()
        if wait_s <= 0:
            self.snapshot_load()  # between steps: the ended sequences have left the batch
            await self.heartbeat()
        elif self.deferred_report is None:
            self.deferred_report = asyncio.create_task(self.report_later(wait_s))

    async def report_later(self, wait_s: float) -> None:
        asked_at = time.monotonic()
        try:
            await asyncio.sleep(wait_s)
        finally:
            self.deferred_report = None
        # ``self.load`` is fresh: the step loop reads it before each step and before it idles,
        # so a periodic beat sent meanwhile carried the ended sequences already.
        if self.last_heartbeat < asked_at:
            try:
                await self.heartbeat()
            except Exception as exc:  # (a task of its own: nobody else would hear of it)
                log.warning("executor: an early load report failed: %r", exc)

    async def on_lora_update(self, update: LoraUpdate) -> LoraUpdated:
        """Load a LoRA adapter or unload one, at run time. The files are read off the event
        loop; the adapter is built and the slots change on the engine's thread, in the step
        loop between steps (``run_lora_ops``). Loading the folder it has under that name is
        a no-op; another folder under it is a 400. The heartbeat that says so goes out
        before the answer."""
        runner = self.engine.runner
        try:
            if update.path:
                if runner.peers is not None:
                    raise ModelError("LoRA adapters are not supported with tensor parallelism")
                files = None  # (a name loaded already: decided on the engine's thread)
                if runner.loras.source_of(update.name) is None:
                    files = await asyncio.to_thread(read_adapter, update.path)
                add = functools.partial(self.add_adapter, update.name, update.path, files)
                changed = await self.lora_op(add)
            else:
                changed = await self.lora_op(functools.partial(self.remove_adapter, update.name))
        except UnknownAdapter as exc:
            raise RequestError(str(exc), 404, param="lora_name", code="model_not_found") from exc
        except AdapterBusy as exc:
            raise RequestError(str(exc), 503, "server_error", "lora_name") from exc
        except ModelError as exc:
            raise RequestError(str(exc), 400, param="lora_path") from exc
        if changed:
            log.info("executor: %s LoRA adapter %s", "loaded" if update.path else "unloaded",
                     update.name)  # fmt: skip
        await self.heartbeat()
        return LoraUpdated(list(runner.loras.slots), changed)

    async def lora_op(self, op: Callable[[], bool]) -> bool:
        done: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self.lora_ops.append((op, done))
        self.wake.set()
        return await done

    async def run_lora_ops(self) -> None:
        """The queued adapter changes, and the freeing of unloaded adapters no sequence uses
        any more (an executor that went idle frees them here), on the engine's thread."""
        loop = asyncio.get_running_loop()
        ops, self.lora_ops = self.lora_ops, []
        for op, done in ops:
            try:
                changed = await loop.run_in_executor(self.worker, op)
            except Exception as exc:
                if not done.done():
                    done.set_exception(exc)
            else:
                if not done.done():
                    done.set_result(changed)
        if self.engine.runner.loras.retired:
            await loop.run_in_executor(self.worker, self.engine.release_loras)

    def add_adapter(self, name: str, path: str, files: AdapterFiles | None) -> bool:
        """(On the engine's thread.) False: this folder is loaded under the name already.
        ``files``: the folder's, read (None where the name was loaded when asked)."""
        runner = self.engine.runner
        self.engine.release_loras()  # (a name unloaded earlier may be free now)
        loaded = runner.loras.source_of(name)
        if loaded == str(Path(path)):
            return False
        if loaded is not None:
            raise ModelError(f"The LoRA adapter `{name}` is loaded already, from {loaded}.")
        runner.add_lora(build_adapter(name, files or read_adapter(path), runner.config))
        return True

    def remove_adapter(self, name: str) -> bool:
        """(On the engine's thread: its memory is freed at once where no sequence uses it.)"""
        self.engine.runner.loras.remove(name)
        self.engine.release_loras()
        return True

    async def heartbeat(self) -> None:
        if self.broken:
            return  # silence: the scheduler counts this executor lost and moves its work
        peers = self.engine.runner.peers
        if peers is not None and not self.engine.has_unfinished():  # (a step checks itself)
            try:
                peers.check_alive()
            except ParallelGroupLost as exc:
                await self.lose_group(exc)
                return
        self.last_heartbeat = time.monotonic()
        self.ended.prune()  # here for want of a sweep: it runs a few times a second anyway
        running, waiting, free_pages, pending = self.load
        await self.svc.publish(
            self.subjects.executor_heartbeat,
            Heartbeat(
                executor_id=self.config.executor_id,
                running=running,
                waiting=waiting + len(self.pending_adds) + len(self.compiling),
                free_pages=free_pages,
                total_pages=self.engine.pages.num_pages,
                page_size=self.config.page_size,
                max_num_seqs=self.config.max_num_seqs,
                pending_tokens=pending
                + sum(
                    len(r.prompt_token_ids) - self.cached_prefix_tokens(r)
                    for r in self.pending_adds
                ),
                draining=self.draining,
                sent_at=time.time(),
                request_ids=[
                    *self.requests,
                    *(r.request_id for r in self.pending_adds),
                    *self.compiling,
                ],
                incarnation=self.incarnation,
                max_model_len=self.engine.max_seq_len,
                role=self.config.role,
                loras=list(self.engine.runner.loras.slots),
                # (as ``sequences``: a reservation for a KV handoff is in neither)
                guests=sum(rid not in self.engine.reserved for rid in self.guests),
            ),
        )

    # -- the step loop ------------------------------------------------------------------------
    async def step_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await self.run_lora_ops()
            await self.apply_pending()
            await self.expire_deadlines()
            # Pages evicted between steps (reserved for a prefill executor's write): told now,
            # not after the next step, which may be as far off as the prefill side's answer.
            self.kv_events.add(self.engine.drain_kv_events())
            self.snapshot_load()
            if not self.engine.has_unfinished():
                if self.remote is not None:  # the last ones' drafts are not held while idle
                    await self.remote.publish_released()
                # Draining, it keeps stepping until stopped: a submit the scheduler sent
                # before it saw the draining heartbeat, or a grammar compiled late, still runs.
                self.wake.clear()
                await self.wake.wait()
                continue
            if self.remote is not None:
                await self.propose_drafts(self.remote)
            started_ns = time.time_ns()
            try:
                outputs = await loop.run_in_executor(self.worker, self.engine.step)
            except ParallelGroupLost as exc:
                await self.lose_group(exc)
                return
            except Exception as exc:  # CUDA out of memory, a kernel error: the engine's state
                # is past trusting (an overlapped step advanced its sequences already)
                log.exception("executor: a step failed; leaving the mesh")
                self.leave_mesh(f"a step failed: {exc!r}")
                return
            self.timelines.stepped(started_ns, time.time_ns(), outputs, self.admitted)
            self.kv_events.add(self.engine.drain_kv_events())
            await self.publish_outputs(outputs)
            if any(out.finish_reason is not None for out in outputs):
                await self.report_freed_slots()

    async def lose_group(self, exc: ParallelGroupLost) -> None:
        """A rank of this executor's tensor-parallel group died: no step can run again here.
        The executor stops heartbeating and leaves the mesh at once, so the scheduler moves
        its requests to other executors (or fails them clearly) within its heartbeat
        timeout; waiting out a drain would only hold them longer."""
        log.error("executor: tensor-parallel group lost (%s); leaving the mesh", exc)
        self.leave_mesh(str(exc))

    def leave_mesh(self, why: str) -> None:
        """No step runs here again: go silent at once (the scheduler then moves this
        executor's requests to others within its heartbeat timeout, where a drain would
        report them as running here for 30 s more) and stop, with a failure exit."""
        self.broken = True
        self.broken_because = why
        self.svc.shutdown_requested.set()

    async def propose_drafts(self, remote: RemoteProposer) -> None:
        """Drafts for the coming step from the speculator (see ``speculation.py``); the engine
        is idle meanwhile, and submits/aborts arriving now wait for the next iteration."""
        sampling = {rid: req.params for rid, req in self.requests.items()}
        self.engine.set_drafts(await remote.propose(self.engine.draft_requests(), sampling))

    async def expire_deadlines(self) -> None:
        """A request past its deadline stops here too (its pages are freed), not only at the
        gateway that gave up on it; the abort tells every other stage to forget it."""
        now = time.time()
        expired = [r for r in self.requests.values() if r.deadline and r.deadline < now]
        for req in expired:
            timeout = ErrorEvent(
                req.request_id, 504, "The request timed out.", "timeout_error", "request_timeout"
            )
            await self.fail_request(req.request_id, timeout, "timeout")

    async def apply_pending(self) -> None:
        adds, self.pending_adds = self.pending_adds, []
        aborts, self.pending_aborts = self.pending_aborts, set()
        for rid in aborts:  # first: they arrived before anything still pending (on_abort)
            # Not in the engine but still ours: a decode executor asking the detokenizer
            # before it computes the prompt itself (``DecodeSide.fall_back``); its resume
            # must find it gone.
            if self.drop(rid) or rid in self.requests:
                self.forget(rid)
        for req in adds:
            if req.request_id in self.requests:
                # One request id runs once here: a duplicate submit (a replayed message) must
                # neither run it twice nor fail the original with "already in use".
                log.warning("executor: ignoring a second submit of %s", req.request_id)
                continue
            try:
                if await self.reserve(req):
                    self.timelines.prefilled_elsewhere(req.request_id)
                else:
                    params = sampling_params(req.params)
                    self.engine.add_request(
                        req.request_id,
                        req.prompt_token_ids,
                        params,
                        req.output_token_ids,
                        grammar=self.compiled.pop(req.request_id, None),
                        guest=req.guest,
                        lora=req.lora,
                        grammar_after=req.grammar.after_token if req.grammar else None,
                        grammar_open=req.grammar.open_token if req.grammar else None,
                    )
            except ValueError as exc:  # ModelError included: the request, not the executor
                self.timelines.finished(req.request_id, "error")
                error = ErrorEvent(req.request_id, 400, str(exc))
                if isinstance(exc, UnknownAdapter):  # (the gateway and this executor differ)
                    error = ErrorEvent(
                        req.request_id, 404, str(exc), code="model_not_found", param="model"
                    )
                await self.try_publish(req.reply_to, error)
                if self.prefill_side is not None:  # its client has the answer: nothing to
                    self.prefill_side.forget(req.request_id, "finished")  # compute there
                continue
            self.requests[req.request_id] = req
            if req.guest:
                self.guests.add(req.request_id)
        if self.decode_side is not None:
            await self.decode_side.apply()

    async def reserve(self, req: TokenizedRequest) -> bool:
        """A request paired with a prefill executor: reserve its pages here (decode side).
        False: compute it here (not paired, not a decode executor, or no room now)."""
        if self.decode_side is None or not req.prefill_executor or req.output_token_ids:
            return False
        return await self.decode_side.reserve(req)

    async def try_publish(self, subject: str, message: Message | bytes) -> bool:
        """Publish; a failure (NATS down past its reconnect buffer, a payload over the limit)
        is logged and reported as False, never raised: the step loop must outlive it."""
        try:
            await self.svc.publish(subject, message)
        except (nats.errors.Error, OSError, ValueError) as exc:
            log.error(
                "executor: could not publish %s to %s: %r", type(message).__name__, subject, exc
            )
            return False
        return True

    def drop(self, request_id: str) -> bool:
        """Stop a request in the engine (between steps); False if it holds none of it. Pages
        reserved for a prefill executor's write are held until it cannot write any more."""
        if self.decode_side is not None and self.decode_side.withdraw(request_id):
            return True
        return self.engine.abort(request_id)

    async def try_publish_quietly(self, subject: str, message: Message) -> None:
        await self.try_publish(subject, message)

    def forget(self, request_id: str, reason: str = "abort") -> None:
        self.requests.pop(request_id, None)
        self.started.discard(request_id)
        self.guests.discard(request_id)
        self.timelines.finished(request_id, reason)
        if self.remote is not None:
            self.remote.release([request_id])
        if self.prefill_side is not None:
            self.prefill_side.forget(request_id)
        if self.decode_side is not None:
            self.decode_side.forget(request_id)

    def admitted(self, request_id: str) -> bool:
        """Has the engine scheduled this request at least once (or already dropped it)? One
        received during the step that just ended is not in the engine yet: not admitted."""
        seq = self.engine.seqs.get(request_id)
        if seq is not None:
            return seq.admitted
        return all(req.request_id != request_id for req in self.pending_adds)

    def engine_state(self) -> EngineSnapshot:
        """Read at scrape time, possibly mid-step: only atomic reads (lengths and ints)."""
        pages, sched, spec = self.engine.pages, self.engine.scheduler, self.engine.spec
        tp = self.engine.runner.model.tp
        overlap = self.engine.overlap
        return EngineSnapshot(
            running=len(sched.running),
            waiting=len(sched.waiting) + len(self.pending_adds),
            kv_cache_usage=1.0 - pages.num_free / pages.num_pages,
            prefix_cache_queries=pages.queries,
            prefix_cache_hits=pages.hits,
            spec_drafts=spec.num_spec_steps,
            spec_draft_tokens=spec.num_draft_tokens,
            spec_accepted_tokens=spec.num_accepted_tokens,
            spec_accepted_per_pos=tuple(spec.accepted_at),
            spec_emitted_tokens=spec.num_emitted_tokens,
            forward_passes=self.engine.num_forward_passes,
            overlapped_steps=overlap is not None,
            overlap_dropped_rows=0 if overlap is None else overlap.dropped_rows,
            tensor_parallel_size=1 if tp is None else tp.world,
            collective_seconds=0.0 if tp is None else tp.comm_ns / 1e9,
            preempted_for_pages=sched.num_preempted_for_pages,
            guests_yielded=sched.num_guests_yielded,
        )

    async def publish_outputs(self, outputs: list[StepOutput]) -> None:
        by_shard: dict[int, list[SeqTokens]] = defaultdict(list)
        for out in outputs:
            req = self.requests.get(out.request_id)
            if req is None:
                continue
            start = None
            if out.request_id not in self.started:
                self.started.add(out.request_id)
                start = StreamStart(
                    stop=req.params.stop,
                    skip_special_tokens=req.params.skip_special_tokens,
                    prompt_tokens=out.prompt_tokens,
                    cached_tokens=out.cached_tokens,
                    trace=self.timelines.carrier(out.request_id),
                    reply_to=req.reply_to,
                    deadline=req.deadline,
                    output_token_ids=req.output_token_ids,
                    prompt_tail=req.prompt_token_ids[-PROMPT_TAIL_TOKENS:],
                    migrations=req.migrations,
                    min_tokens=req.params.min_tokens,
                    include_stop_str_in_output=req.params.include_stop_str_in_output,
                    echo_prompt_ids=req.prompt_token_ids
                    if req.params.echo and not req.output_token_ids
                    else [],
                    think=req.think,
                )
            prompt_logprobs = None
            if (plp := out.prompt_logprobs) is not None:
                prompt_logprobs = WirePromptLogprobs(
                    plp.token_ids, plp.logprobs, plp.ranks, plp.top
                )
            logprobs = None
            if out.logprobs is not None:
                logprobs = [
                    WireTokenLogprob(lp.token_id, lp.logprob, lp.top) for lp in out.logprobs
                ]
            by_shard[req.detok_shard].append(
                SeqTokens(
                    request_id=out.request_id,
                    token_ids=out.new_token_ids,
                    finish_reason=out.finish_reason.value if out.finish_reason else None,
                    output_tokens=out.output_tokens,
                    start=start,
                    logprobs=logprobs,
                    continues_on=self.prefill_side.continues_on(out.request_id)
                    if self.prefill_side is not None
                    else None,
                    stop_token=out.stop_token,
                    prompt_logprobs=prompt_logprobs,
                    embedding=None if out.embedding is None else float32_bytes(out.embedding),
                )
            )
        limit = self.svc.nc.max_payload - PAYLOAD_HEADROOM
        for shard, seqs in by_shard.items():
            step = functools.partial(
                StepTokens, self.config.executor_id, incarnation=self.incarnation
            )
            messages, too_large = encode_within(seqs, step, limit)
            for seq in too_large:
                what, param = ("stop strings", "stop")
                if seq.prompt_logprobs is not None:
                    what, param = ("prompt logprobs", "prompt_logprobs")
                elif seq.start is not None and seq.start.echo_prompt_ids:
                    what, param = ("echoed prompt", "echo")
                await self.fail_request(
                    seq.request_id,
                    ErrorEvent(
                        seq.request_id,
                        400,
                        f"Too large to stream: the request's {what} (over the message "
                        f"bus's {limit}-byte payload limit).",
                        param=param,
                    ),
                )
            for data, in_message in messages:
                if not await self.try_publish(self.subjects.detok(shard), data):
                    # Lost tokens leave a gap in these streams: end them with a clear error
                    # (and free their pages) rather than stream text with a hole in it.
                    for seq in in_message:
                        await self.fail_request(
                            seq.request_id,
                            ErrorEvent(
                                seq.request_id,
                                503,
                                "The executor could not deliver this request's tokens; retry.",
                                "server_error",
                                "delivery_failed",
                            ),
                        )
        if self.prefill_side is not None:  # their KV to the decode side, before the next step
            await self.prefill_side.hand_off(outputs)
        # Forgotten only now: a finished request whose last tokens could not be sent still
        # needs its inbox for the error above.
        for out in outputs:
            if out.finish_reason is not None and out.request_id in self.requests:
                self.forget(out.request_id, out.finish_reason.value)

    async def fail_request(self, request_id: str, error: ErrorEvent, reason: str = "error") -> None:
        """End one request here with ``error`` for its client; every stage forgets it."""
        req = self.requests.get(request_id)
        self.drop(request_id)
        self.forget(request_id, reason)
        if req is not None:
            await self.try_publish(req.reply_to, error)
        await self.try_publish(self.subjects.abort, AbortRequests([request_id], reason))

    async def drain(self) -> None:
        """Finish what we hold, then stop; the heartbeat says we take nothing new."""
        self.draining = True
        await self.heartbeat()
        self.wake.set()

    async def stop(self) -> None:
        """Leave the mesh: the index forgets this executor's cache, then NATS drains."""
        if self.deferred_report is not None:
            self.deferred_report.cancel()
        try:
            await asyncio.wait_for(self.kv_events.close(), 5)
        except Exception as exc:  # NATS gone: the index expires us by heartbeat instead
            log.warning("executor: could not clear its KV events: %s", exc)
        await self.svc.close()
        if self.transport is not None:
            self.transport.close()
        await asyncio.get_running_loop().run_in_executor(self.worker, self.engine.runner.close)


def engine_thread(nice: int = 0) -> ThreadPoolExecutor:
    """The one thread that runs the engine (see the module docstring), ``nice`` steps below
    the process's priority (Linux sets niceness per thread; threads it starts inherit it)."""
    return ThreadPoolExecutor(
        max_workers=1, thread_name_prefix="engine", initializer=_lower_priority, initargs=(nice,)
    )


def _lower_priority(nice: int) -> None:
    if nice <= 0 or sys.platform != "linux":
        return
    tid = threading.get_native_id()
    try:
        current = os.getpriority(os.PRIO_PROCESS, tid)
        os.setpriority(os.PRIO_PROCESS, tid, min(19, current + nice))
    except OSError as exc:
        log.warning("executor: could not lower the engine thread's priority: %s", exc)


def overlaps_steps(config: ExecutorConfig) -> bool:
    """``--overlap-steps`` resolved: auto overlaps on CUDA; a prefill executor hands each
    sequence off at its first token, so a step queued ahead would only be wasted there."""
    if config.overlap_steps == "off" or config.role == "prefill":
        return False
    return config.overlap_steps == "on" or torch.device(config.device).type == "cuda"


def build_engine(config: ExecutorConfig) -> Engine:
    if config.tensor_parallel_size > 1 and config.role != "mixed":
        # KV handoff registers one pool with NIXL; a split replica has one per rank.
        raise ValueError("tensor parallelism runs on mixed executors only (--role mixed)")
    folder = resolve_model_path(config.model)
    if config.cpu_threads:  # in the engine thread, which runs every step: torch's is per thread
        torch.set_num_threads(config.cpu_threads)
    runner = build_runner(
        folder,
        torch.device(config.device),
        config.quantization,
        num_pages=config.num_pages,
        page_size=config.page_size,
        kv_cache=config.kv_cache_dtype,
        tensor_parallel_size=config.tensor_parallel_size,
        timeout_s=config.tensor_parallel_timeout_s,
        cuda_graphs=config.cuda_graphs,
        fused_rope_append=config.fused_rope_append,
        triton_gemv=config.triton_gemv,
        max_num_batched_tokens=config.max_num_batched_tokens,
    )
    loras = parse_lora_modules(config.lora_modules)
    runner.load_loras(
        LoraSet([load_adapter(name, path, runner.config) for name, path in loras.items()])
    )
    engine_config = EngineConfig(
        max_num_batched_tokens=config.max_num_batched_tokens,
        max_num_seqs=config.max_num_seqs,
        enable_prefix_caching=config.enable_prefix_caching,
        num_speculative_tokens=config.num_speculative_tokens,
        overlap_steps=overlaps_steps(config),
        logprobs_mode=config.logprobs_mode,
    )
    from common.tokenizer import Tokenizer

    eos = Tokenizer.from_folder(folder).eos_token_ids
    release_freed_memory()  # the tokenizer (~50 MB, only read for its EOS ids) is gone again
    # "remote": the step loop fetches drafts from the speculator service before each step.
    proposer = NgramProposer() if config.speculator == "ngram" else None
    return Engine(runner, engine_config, eos_token_ids=eos, proposer=proposer)
