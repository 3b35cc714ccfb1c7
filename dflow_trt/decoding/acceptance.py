"""Verification: which drafts the target accepts, and the token it adds. Pure functions.

Words as in vLLM's rejection sampler: *accepted* drafts are kept; at the first rejection the
target emits a *recovered* token; if every draft is accepted it emits a *bonus* token. Either way
each row commits `num_accepted + 1` tokens per round.
"""

from __future__ import annotations

import torch


def greedy_accept(draft_ids: torch.Tensor, target_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """draft_ids [B, S-1], target_logits [B, S, V] -> (num_accepted [B], next_token [B])."""
    B, S, _ = target_logits.shape
    assert draft_ids.shape == (B, S - 1), (draft_ids.shape, target_logits.shape)
    target_ids = target_logits.argmax(-1)  # [B, S]
    match = (draft_ids == target_ids[:, :-1]).long()  # [B, S-1]
    num_accepted = match.cumprod(-1).sum(-1)  # [B]
    next_token = target_ids.gather(1, num_accepted[:, None])[:, 0]  # [B]
    return num_accepted, next_token


def rejection_sample(draft_ids: torch.Tensor, draft_probs: torch.Tensor, target_probs: torch.Tensor,
                     generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Lossless speculative sampling (Leviathan et al.; Chen et al.).

    draft_ids [B, S-1] were drawn from draft_probs [B, S-1, V]; target_probs [B, S, V].
    Accept draft i with probability min(1, target/draft); at the first rejection draw the
    recovered token from norm(max(target - draft, 0)); after S-1 acceptances draw the bonus
    token from target_probs[:, S-1]. Returns (num_accepted [B], next_token [B]).
    """
    B, S, V = target_probs.shape
    assert draft_ids.shape == (B, S - 1) and draft_probs.shape == (B, S - 1, V)
    idx = draft_ids[..., None]
    p_target = target_probs[:, :-1].gather(-1, idx)[..., 0]  # [B, S-1]
    p_draft = draft_probs.gather(-1, idx)[..., 0]  # [B, S-1]
    u = torch.rand(p_target.shape, generator=generator, device=p_target.device)
    accepted = (u * p_draft < p_target).long()  # u < p_target / p_draft, without dividing by 0
    num_accepted = accepted.cumprod(-1).sum(-1)  # [B]

    at = num_accepted[:, None, None].expand(B, 1, V)
    target_at = target_probs.gather(1, at)[:, 0]  # [B, V]
    padded_draft = torch.cat([draft_probs, draft_probs.new_zeros(B, 1, V)], 1)  # bonus slot: no draft
    residual = (target_at - padded_draft.gather(1, at)[:, 0]).clamp(min=0)  # [B, V]
    mass = residual.sum(-1, keepdim=True)
    # Where rounding leaves no residual mass (target == draft), the target itself is the residual.
    residual = torch.where(mass > 0, residual / mass.clamp(min=1e-30), target_at)
    next_token = torch.multinomial(residual, 1, generator=generator)[:, 0]
    return num_accepted, next_token
