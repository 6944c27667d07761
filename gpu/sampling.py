"""Batched token sampling for the continuous-batching step loop.

Its pieces: ``gpu.sampling_params`` (a request's parameters), ``gpu.logits_filters`` (the
penalties, the logit bias and the top-k / top-p / min-p cutoffs), this module (the sampler,
its inputs and outputs).

One :class:`Sampler` call per engine step samples the next token of every sequence in the
batch. The work is vectorised over the vocabulary and, wherever possible, over the batch; the
only Python loops over rows build small index/parameter tensors or draw the noise of rows that
own a seeded ``torch.Generator``.

Pipeline (all math in fp32, the order vLLM and Hugging Face use):

0. **Allowed tokens, logit bias, grammar and bans**, only on rows that have them: a row with
   vLLM's ``allowed_token_ids`` keeps only those logits (the rest -inf), OpenAI's
   ``logit_bias`` is added (a scatter over the listed ids), then a constrained row's token
   bitmask (``gpu.grammar``, filled by the engine) sets every token its grammar does not allow
   to -inf, and a row gets -inf on its stop tokens while short of its ``min_tokens`` and on
   each token that would complete one of its ``bad_words``. A row these leave no token gets
   its EOS (it ends). Rows without any are not touched, so an unconstrained request in a
   constrained batch pays nothing.

1. **Penalties**, only on rows that set one (``repetition_penalty != 1`` or a non-zero
   presence/frequency penalty), vectorised as gather/scatter on one concatenated tensor of
   flat ``row * V + token`` indices for the whole batch (no padding, and O(tokens) work rather
   than the O(B * V) of a bincount/mask over the vocabulary):

   - repetition penalty (Hugging Face / vLLM semantics) over prompt + generated tokens: a
     logit ``> 0`` is divided by the penalty, any other is multiplied by it;
   - then frequency and presence penalties (OpenAI semantics) over generated tokens only:
     ``logit -= count * frequency_penalty + (count > 0) * presence_penalty``.

2. **Temperature**: logits of sampled rows are divided by their temperature. A temperature
   below ``GREEDY_EPS`` (0 in practice) makes the row greedy.

3. **Greedy rows** take the argmax of their penalised logits. If every row is greedy no random
   work, softmax or sort is done at all (fast path).

4. **Filtering** of sampled rows, in vLLM's order: min-p (relative to the most likely token
   of the whole row) and top-k, then top-p over what they left, renormalised. Each
   filter is reduced to a per-row logit *cutoff* and a token survives iff its logit is
   ``>= cutoff``; tokens tied with the last survivor therefore survive too (what Hugging Face's
   top-k does), which also makes the kept set a function of the values only, never of the
   order a sort happens to give to ties. Top-k uses ``torch.topk`` with the largest k of the
   batch, never a full sort. Top-p takes the cumulative mass over the row's top 256, then top
   4096, candidates (``gpu.logits_filters.TOP_P_CANDIDATES``) and sorts the full row only when
   the nucleus is wider: the same cutoff as one full descending sort, at a fraction of the cost
   on CPU.

5. **Sampling** with the exponential race (the trick vLLM uses): the token is
   ``argmax(probs / q)`` with ``q ~ Exponential(1)`` i.i.d. per vocabulary entry (drawn as
   ``-log U``), which draws exactly from ``probs`` (filtered-out tokens have probability 0)
   without a CDF search; ``probs`` need not even be renormalised after filtering. A row
   whose request is seeded draws its ``q`` from its own generator, one ``[V]`` draw per step,
   so its tokens depend only on its seed, its logits and its step count, never on what else
   shares the batch; unseeded rows share the sampler's generator (torch's default generator
   when none was given). Batch invariance also needs the row's numbers to be independent of the
   batch: everything on the sampling path is elementwise or a per-row kernel (softmax, topk,
   sort, cumsum, max), never a cross-thread reduction whose rounding depends on the batch shape.

Logprobs: by default (``logprobs_mode="raw"``, vLLM's default ``raw_logprobs``) the returned
logprobs are ``log_softmax`` of the model's logits, a constrained row's grammar mask applied
(a token it forbids is -inf) but no logit bias, min_tokens ban, penalty or temperature: the
model's own distribution, as OpenAI's are. ``"processed"`` (vLLM's ``processed_logprobs``):
``log_softmax`` of the logits sampled from, after all of those (greedy rows have no
temperature) but before top-k/top-p/min-p, left out so that the top-N alternatives keep finite,
comparable values. For rows that asked (``logprobs=N``) the output holds the sampled token's
logprob and the top-N ``(token, logprob)`` pairs sorted by descending logprob; rows that did
not ask hold NaN and ``[]``.

Waits for the device: none inside a call on CUDA. Parameter and index tensors are staged
through pinned memory (``gpu.transfers``), whatever is sized by the data (penalty indices, the
top-p ladder's subsets) is built on the host or replaced by one full sort, and every result
stays on the device until :meth:`SamplerOutput.to_host` reads them all back with one wait.

Copies: the caller's logits are never written. At most one full fp32 working copy is made
(none at all for an fp32, all-greedy, penalty-free batch); sampled rows additionally need a
``probs`` and a noise tensor of their own size, and rows asking for logprobs a log_softmax.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from gpu.formats import LOGPROBS_MODES
from gpu.logits_filters import (
    apply_logit_bias,
    apply_penalties,
    ban_tokens,
    filter_cutoffs,
    keep_only,
    stop_dead_rows,
)
from gpu.sampling_params import SamplingParams
from gpu.transfers import HostCopy, to_device


@dataclass
class SamplerInput:
    """Everything the sampler needs besides the logits; built once per step by the engine.

    Row ``i`` of every list describes row ``i`` of the logits. ``generators[i]`` must be set for
    a sampled (non-greedy) row whose params carry a seed (see :func:`make_generator`).
    """

    params: list[SamplingParams]
    prompt_token_ids: list[list[int]]
    output_token_ids: list[list[int]]
    generators: list[torch.Generator | None]
    # Constrained decoding: int32 [B, ceil(V / 32)] allowed-token bits (``gpu.grammar``) on the
    # logits' device, applied to ``masked_rows`` only.
    token_bitmask: torch.Tensor | None = None
    masked_rows: list[int] = field(default_factory=list)
    # The model's EOS ids: a row under its min_tokens may not sample them (nor its
    # stop_token_ids), counted by the length of its output_token_ids.
    eos_token_ids: tuple[int, ...] = ()

    def banned_stops(self) -> dict[int, tuple[int, ...]]:
        """Row -> the stop tokens it may not sample now (rows under their min_tokens). A
        constrained row is left to its grammar: a document complete before min_tokens allows
        nothing but a stop token, and banning it too would leave the row no token at all."""
        out: dict[int, tuple[int, ...]] = {}
        if not any(p.min_tokens for p in self.params):  # (every step: the usual answer)
            return out
        constrained = set(self.masked_rows)
        for i, p in enumerate(self.params):
            if (
                p.min_tokens
                and i not in constrained
                and (ids := p.stop_ids_banned(self.eos_token_ids, len(self.output_token_ids[i])))
            ):
                out[i] = ids
        return out

    def banned_tokens(self) -> dict[int, tuple[int, ...]]:
        """Row -> every token it may not sample now: its stop tokens under min_tokens
        (``banned_stops``) and the tokens that would complete one of its bad words."""
        out = self.banned_stops()
        for i, p in enumerate(self.params):
            if p.bad_words_token_ids and (ends := p.bad_word_ends(self.output_token_ids[i])):
                out[i] = out.get(i, ()) + ends
        return out


@dataclass
class TopLogprobs:
    """The top-N logprobs of the rows that asked, still on the device: ``ids`` and ``values``
    ``[len(rows), N]`` (N the most any row asked, descending), row ``j`` of them for logits row
    ``rows[j]``, which keeps the first ``counts[j]``."""

    rows: list[int]
    counts: list[int]
    ids: torch.Tensor
    values: torch.Tensor


@dataclass
class SampledOnHost:
    """A :class:`SamplerOutput` as Python values: ``logprobs`` per row (NaN where a row did not
    ask) and ``top_logprobs`` per row (``[]`` where it did not), each None when no row asked."""

    token_ids: list[int]
    logprobs: list[float] | None
    top_logprobs: list[list[tuple[int, float]]] | None


@dataclass
class SamplerOutput:
    """``token_ids``: int64 ``[B]``. ``logprobs``: float32 ``[B]``, the sampled token's logprob
    (see the module docstring for which distribution), NaN on rows that did not ask; None when
    no row asked. ``top``: the top-N pairs of the rows that asked for N > 0, else None. All on
    the logits' device: :meth:`to_host` reads them back with one wait for it."""

    token_ids: torch.Tensor
    logprobs: torch.Tensor | None
    top: TopLogprobs | None = None

    def to_host(self) -> SampledOnHost:
        return self.start_to_host().wait()

    def start_to_host(self) -> PendingSample:
        """The read-back queued now, waited for later (the overlapped step loop)."""
        tensors = [self.token_ids]
        if self.logprobs is not None:
            tensors.append(self.logprobs)
        if self.top is not None:
            tensors += [self.top.ids, self.top.values]
        return PendingSample(HostCopy(*tensors), self.logprobs is not None, self.top)


@dataclass
class PendingSample:
    """A :class:`SamplerOutput` on its way to the host: :meth:`wait` for it."""

    copy: HostCopy
    has_logprobs: bool
    top: TopLogprobs | None

    def wait(self) -> SampledOnHost:
        host = self.copy.wait()
        if not self.has_logprobs:  # no row asked, so there is no top-N either
            return SampledOnHost(host[0], None, None)
        top: list[list[tuple[int, float]]] = [[] for _ in host[0]]
        if self.top is not None:
            ids, values = host[-2], host[-1]
            for j, (row, n) in enumerate(zip(self.top.rows, self.top.counts, strict=True)):
                top[row] = list(zip(ids[j][:n], values[j][:n], strict=True))
        return SampledOnHost(host[0], host[1], top)


class Sampler:
    """Samples one token per row of ``logits`` ``[B, V]``; see the module docstring.

    ``generator`` is the shared generator of unseeded rows (torch's default when None); it must
    live on the logits' device. ``logprobs_mode``: ``raw`` or ``processed`` (module docstring).
    """

    def __init__(
        self, generator: torch.Generator | None = None, logprobs_mode: str = "raw"
    ) -> None:
        if logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(
                f"logprobs_mode must be one of {LOGPROBS_MODES}, got {logprobs_mode!r}"
            )
        self.generator = generator
        self.logprobs_mode = logprobs_mode

    def logprob_logits(
        self, logits: torch.Tensor, inp: SamplerInput, processed: torch.Tensor
    ) -> torch.Tensor:
        """What logprobs are the ``log_softmax`` of, for ``logits`` (``processed``: theirs after
        ``_processed``): the processed logits, or the raw ones with the grammar masks."""
        if self.logprobs_mode == "processed":
            return processed
        raw = logits.to(torch.float32, copy=bool(inp.masked_rows))
        if inp.masked_rows:
            from gpu.grammar import apply_bitmask

            assert inp.token_bitmask is not None
            apply_bitmask(raw, inp.token_bitmask, inp.masked_rows)
        return raw

    def __call__(self, logits: torch.Tensor, inp: SamplerInput) -> SamplerOutput:
        if logits.dim() != 2:
            raise ValueError(f"logits must be [batch, vocab], got shape {tuple(logits.shape)}")
        batch = logits.shape[0]
        params = inp.params
        for name in ("params", "prompt_token_ids", "output_token_ids", "generators"):
            if len(getattr(inp, name)) != batch:
                raise ValueError(
                    f"SamplerInput.{name} has {len(getattr(inp, name))} rows, logits {batch}"
                )
        device = logits.device
        if batch == 0:
            return SamplerOutput(torch.empty(0, dtype=torch.int64, device=device), None)

        greedy_rows = [i for i, p in enumerate(params) if p.is_greedy]
        sampled_rows = [i for i, p in enumerate(params) if not p.is_greedy]
        pen_rows = [i for i, p in enumerate(params) if p.has_penalties]

        if (
            not pen_rows
            and not sampled_rows
            and not inp.masked_rows
            and all(p.logprobs is None and not p.edits_logits for p in params)
        ):
            # Fast path: all greedy, nothing to compute but an argmax (a bf16 -> fp32 cast is
            # exact and monotone, so no cast either). max(dim)'s indices are argmax's (the
            # first maximum, NaN counting as one) at a third of its time on CPU: 61 -> 20 us
            # for one row of SmolLM2's 49,152 logits.
            return SamplerOutput(logits.max(dim=-1).indices, None)

        work = self._processed(logits, inp, copy=False)  # 1-2: penalties, temperature

        # 3. greedy rows.
        token_ids = torch.empty(batch, dtype=torch.int64, device=device)
        if len(greedy_rows) == batch:
            token_ids = work.argmax(dim=-1)
        elif greedy_rows:
            g_idx = to_device(greedy_rows, torch.int64, device)
            token_ids[g_idx] = work.index_select(0, g_idx).argmax(dim=-1)

        # 4-5. filter and sample the rest.
        if sampled_rows:
            s_idx = to_device(sampled_rows, torch.int64, device)
            xs = work if len(sampled_rows) == batch else work.index_select(0, s_idx)
            s_params = [params[i] for i in sampled_rows]
            probs = torch.softmax(xs, dim=-1)
            cutoff = filter_cutoffs(xs, probs, s_params)
            if cutoff is not None:
                probs.masked_fill_(xs < cutoff.unsqueeze(1), 0.0)
            probs.div_(self._noise(probs, [inp.generators[i] for i in sampled_rows], s_params))
            sampled = probs.argmax(dim=-1)
            if len(sampled_rows) == batch:
                token_ids = sampled
            else:
                token_ids[s_idx] = sampled

        if all(p.logprobs is None for p in params):
            return SamplerOutput(token_ids, None)
        return self._logprobs(self.logprob_logits(logits, inp, work), token_ids, params)

    @staticmethod
    def _processed(logits: torch.Tensor, inp: SamplerInput, copy: bool) -> torch.Tensor:
        """Steps 1-2: fp32 logits with penalties and temperature applied. ``logits`` is never
        written; it may be returned as is (fp32, nothing to apply) unless ``copy``."""
        params = inp.params
        pen_rows = any(p.has_penalties for p in params)
        bias_rows = [i for i, p in enumerate(params) if p.logit_bias]
        allowed_rows = [i for i, p in enumerate(params) if p.allowed_token_ids]
        banned = inp.banned_tokens()
        written = pen_rows or any((bias_rows, allowed_rows, inp.masked_rows, banned))
        # The only full copy, and only when something must be written.
        work = logits.to(torch.float32, copy=copy or written, memory_format=torch.contiguous_format)
        owned = copy or written or logits.dtype != torch.float32
        if allowed_rows:
            keep_only(work, params, allowed_rows)
        if bias_rows:
            apply_logit_bias(work, params, bias_rows)
        if inp.masked_rows:
            if inp.token_bitmask is None:
                raise ValueError("SamplerInput.masked_rows needs a token_bitmask")
            from gpu.grammar import apply_bitmask  # xgrammar loads only for constrained batches

            apply_bitmask(work, inp.token_bitmask, inp.masked_rows)
        if banned:
            ban_tokens(work, banned)
        if guarded := sorted(set(allowed_rows) | set(banned)):
            stop_dead_rows(work, guarded, inp.eos_token_ids)
        if pen_rows:
            apply_penalties(work, params, inp.prompt_token_ids, inp.output_token_ids)
        # Temperature (greedy rows divide by 1, which is exact).
        temps = [1.0 if p.is_greedy else float(p.temperature) for p in params]
        if any(t != 1.0 for t in temps):
            t = to_device(temps, torch.float32, logits.device).unsqueeze(1)
            work = work.div_(t) if owned else work / t
        return work

    def distributions(
        self, logits: torch.Tensor, inp: SamplerInput
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """What ``__call__`` would sample from, as numbers: ``(processed, probs)``.

        ``processed``: fp32 ``[B, V]`` logits after penalties and temperature (greedy rows take
        its argmax; logprobs are its ``log_softmax``). ``probs``: fp32 ``[B, V]``, each sampled
        row's distribution after top-k/top-p/min-p, renormalised to sum to 1; greedy rows are
        one-hot at their argmax. None when every row is greedy. Speculative verification needs
        these to accept or reject draft tokens (``gpu.spec_decode``).
        """
        if logits.dim() != 2 or logits.shape[0] != len(inp.params):
            raise ValueError(
                f"logits {tuple(logits.shape)} do not match {len(inp.params)} parameter rows"
            )
        params = inp.params
        processed = self._processed(logits, inp, copy=False)
        if all(p.is_greedy for p in params):
            return processed, None
        probs = torch.softmax(processed, dim=-1)
        cutoff = filter_cutoffs(processed, probs, params)
        if cutoff is not None:
            probs.masked_fill_(processed < cutoff.unsqueeze(1), 0.0)
            probs.div_(probs.sum(dim=-1, keepdim=True))
        greedy = [i for i, p in enumerate(params) if p.is_greedy]
        if greedy:
            idx = to_device(greedy, torch.int64, logits.device)
            top = processed.index_select(0, idx).argmax(dim=-1, keepdim=True)
            one_hot = torch.zeros(
                (len(greedy), probs.shape[1]), dtype=probs.dtype, device=probs.device
            )
            probs[idx] = one_hot.scatter_(1, top, 1.0)
        return processed, probs

    def logprobs(
        self, processed: torch.Tensor, token_ids: torch.Tensor, params: Sequence[SamplingParams]
    ) -> SamplerOutput:
        """Logprobs of ``token_ids`` (and top-N) under ``log_softmax(processed)`` for the rows
        whose params ask, as ``__call__`` reports them."""
        return self._logprobs(processed, token_ids, params)

    def _noise(
        self,
        probs: torch.Tensor,
        generators: Sequence[torch.Generator | None],
        params: Sequence[SamplingParams],
    ) -> torch.Tensor:
        """Exponential(1) noise shaped like ``probs``; row ``j`` from ``generators[j]`` if set.

        Drawn as ``-log(U)``, ``U ~ Uniform[0, 1)`` (inverse CDF; ~6x faster than
        ``Tensor.exponential_`` on CPU). ``U = 0`` gives ``q = inf`` and so ``p / q = 0``, never
        NaN, and ``q >= -log(1 - 2**-24) > 0`` otherwise, so ``p / q`` stays finite.
        """
        q = torch.empty(probs.shape, dtype=probs.dtype, device=probs.device)  # contiguous rows
        if any(g is None for g in generators):
            q.uniform_(generator=self.generator)
        for j, (gen, p) in enumerate(zip(generators, params, strict=True)):
            if gen is None:
                if p.seed is not None:
                    raise ValueError(
                        "SamplerInput.generators: a seeded sampled row needs its own generator "
                        "(see make_generator)"
                    )
                continue
            if gen.device != probs.device:
                raise ValueError(
                    f"SamplerInput.generators: generator on {gen.device}, logits on {probs.device}"
                )
            q[j].uniform_(generator=gen)  # one contiguous [V] draw: batch-independent
        return q.log_().neg_()

    @staticmethod
    def _logprobs(
        processed: torch.Tensor, token_ids: torch.Tensor, params: Sequence[SamplingParams]
    ) -> SamplerOutput:
        """Logprobs under ``log_softmax(processed)`` for the rows that asked."""
        lp_rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        if not lp_rows:
            return SamplerOutput(token_ids, None)
        device = processed.device
        batch = processed.shape[0]
        idx = to_device(lp_rows, torch.int64, device)
        sub = processed if len(lp_rows) == batch else processed.index_select(0, idx)
        sub = torch.log_softmax(sub, dim=-1)
        chosen = sub.gather(1, token_ids[idx].unsqueeze(1)).squeeze(1)
        logprobs = torch.full((batch,), math.nan, dtype=torch.float32, device=device)
        logprobs[idx] = chosen
        n_max = max(params[i].logprobs or 0 for i in lp_rows)
        if n_max == 0:
            return SamplerOutput(token_ids, logprobs)
        vals, ids = sub.topk(min(n_max, sub.shape[1]), dim=-1)
        counts = [params[i].logprobs or 0 for i in lp_rows]
        return SamplerOutput(token_ids, logprobs, TopLogprobs(lp_rows, counts, ids, vals))
