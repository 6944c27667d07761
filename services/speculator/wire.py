"""Speculation on the wire: ``gpu.spec_decode`` types <-> ``common.wire.speculator``.

Used by both ends: the executor's ``RemoteProposer`` and the speculator service.
"""

from __future__ import annotations

from common.wire.speculator import DraftSeq, DraftTokens
from common.wire.tokenizer import WireSamplingParams
from gpu.spec_decode import DraftRequest, Proposal
from services.sampling import sampling_params


def draft_seq(req: DraftRequest, sampling: WireSamplingParams) -> DraftSeq:
    return DraftSeq(req.request_id, req.token_ids, req.num_prompt_tokens, req.num_draft, sampling)


def draft_request(seq: DraftSeq) -> DraftRequest:
    return DraftRequest(
        seq.request_id,
        seq.token_ids,
        seq.num_prompt_tokens,
        seq.num_draft,
        sampling_params(seq.params),  # raises ValueError if out of range
    )


def draft_tokens(request_id: str, proposal: Proposal) -> DraftTokens:
    return DraftTokens(request_id, proposal.token_ids, proposal.q_ids, proposal.q_probs)


def proposal(tokens: DraftTokens) -> Proposal:
    """Raises ``ValueError`` for an inconsistent draft (the executor then ignores it)."""
    return Proposal(tokens.token_ids, tokens.q_ids, tokens.q_probs)
