"""Flow bookkeeping: which verifier states of this round become the next round's flow, and the
verifier hints the next round takes from it (`take_hints`).

A round verifies the block [x_L, d_1..d_{S-1}] at positions L..L+S-1 and accepts a drafts. The
committed positions L..L+a become drafter context. Positions L+a+1..L+S-1 held rejected drafts;
the target still computed states there. The next block starts at L' = L+a+1, so the state at
L+a+1+j lines up with next-block position j, for j < S-1-a. A full acceptance carries nothing.
"""

from __future__ import annotations

import dataclasses

import torch

from .interfaces import FlowState, Proposal


def carry_flow(block_ids: torch.Tensor, block_taps: torch.Tensor, block_target_ids: torch.Tensor,
               num_accepted: torch.Tensor, next_size: int | None = None) -> FlowState:
    """Verified block [B, S] (ids, taps [B, S, F], the target's argmax ids) and num_accepted [B]
    -> FlowState over the next block [B, next_size] (default S; larger when this round verified a
    shortened block)."""
    B, S = block_ids.shape
    n = next_size or S
    src = num_accepted[:, None] + 1 + torch.arange(n, device=block_ids.device)  # [B, n] source slot
    valid = src < S
    src = src.clamp(max=S - 1)
    taps = block_taps.gather(1, src[..., None].expand(B, n, block_taps.shape[-1]))
    taps = taps * valid[..., None]
    token_ids = block_ids.gather(1, src) * valid
    hint_ids = block_target_ids.gather(1, src) * valid
    return FlowState(taps=taps, token_ids=token_ids, hint_ids=hint_ids, valid=valid)


def join_flow(a: FlowState | None, b: FlowState | None, na: int, nb: int, S: int) -> FlowState | None:
    """The flows of two batches of na and nb rows stacked; a batch without one (rows just
    prefilled) carries nothing."""
    if a is None and b is None:
        return None
    ref = a if a is not None else b
    none = lambda n: FlowState(ref.taps.new_zeros(n, S, ref.taps.shape[-1]), ref.token_ids.new_zeros(n, S),  # noqa: E731
                               ref.hint_ids.new_zeros(n, S), ref.valid.new_zeros(n, S), 0)
    a, b = a or none(na), b or none(nb)
    rows = None if a.rows is None or b.rows is None else max(a.rows, b.rows)
    return FlowState(torch.cat([a.taps, b.taps]), torch.cat([a.token_ids, b.token_ids]),
                     torch.cat([a.hint_ids, b.hint_ids]), torch.cat([a.valid, b.valid]), rows)


def right_align(x: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
    """Left-padded x [B, T, ...] with true lengths [B] -> right-padded (row b's tokens first)."""
    B, T = x.shape[:2]
    src = (torch.arange(T, device=x.device)[None, :] + (T - lens)[:, None]).clamp(max=T - 1)  # [B, T]
    return x.gather(1, src.view(B, T, *([1] * (x.dim() - 2))).expand_as(x))


# How often a consistent hint (below) names the target's token: 52% on held-out prompts of the
# training sources with the shipped DFlow drafter (36% for its own drafts there); replayed decodes
# give 0.5 within 0.004 tau of the best trust, 0.6-0.7 (`dflow-trt bench hints`, docs/hint_stats.json;
# never the eval sets; earlier drafters: best at 0.4-0.6). Also the confidence a taken hint reports
# to the verify-length policy.
HINT_TRUST = 0.5


def take_hints(prop: Proposal, flow: FlowState, trust: float = HINT_TRUST) -> Proposal:
    """Replace drafts with the verifier's own guesses where the flow shows it saw the same token.

    Flow slot j holds the token the previous verify pass read at block position j and the target's
    argmax there, its guess for position j+1. When the (possibly replaced) draft at position j is
    that same token, the guess was made on the right token at j (only the context further left
    differs), so it beats a drafter that is less than `trust` sure at j+1: draft j+1 becomes the
    guess and reports confidence `trust`. Draft 1 is left alone: slot 0 held the rejected draft, not
    the anchor (bar a row that rode along unjudged in a shortened, batched verify). Left to right,
    so a taken guess can qualify the next one.

    Sampling stays lossless: a taken guess is a point mass (`draft_probs` one-hot), decided from
    earlier drafts and the drafter's confidence at j+1, never from the token drawn there.
    """
    ids = prop.draft_ids.clone()  # [B, K]
    conf = None if prop.confidence is None else prop.confidence.clone()
    probs = None if prop.draft_probs is None else prop.draft_probs.clone()
    B, K = ids.shape
    valid, seen, guess = (t.to(ids.device) for t in (flow.valid, flow.token_ids, flow.hint_ids))
    taken_conf = None if conf is None else conf.new_tensor(trust)
    for k in range(2, min(K, flow.prefix()) + 1):  # draft k sits at block position k, its guess at flow slot k-1
        j = k - 1
        take = valid[:, j] & (seen[:, j] == ids[:, j - 1])  # [B]
        if conf is not None:
            take &= conf[:, k - 1] < trust
        ids[:, k - 1] = torch.where(take, guess[:, j], ids[:, k - 1])
        if conf is not None:
            conf[:, k - 1] = torch.where(take, taken_conf, conf[:, k - 1])
        if probs is not None:
            onehot = torch.nn.functional.one_hot(guess[:, j], probs.shape[-1]).to(probs.dtype)  # [B, V]
            probs[:, k - 1] = torch.where(take[:, None], onehot, probs[:, k - 1])
    return dataclasses.replace(prop, draft_ids=ids, draft_probs=probs, confidence=conf)
