"""Verification: which drafts the target accepts, and the token it adds. Pure functions.

Words as in vLLM's rejection sampler: *accepted* drafts are kept; at the first rejection the
target emits a *recovered* token; if every draft is accepted it emits a *bonus* token. Either way
each row commits `num_accepted + 1` tokens per round.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .policy import Plan
from .sampling import SamplingParams, pick, processed_probs


@dataclass
class Verdict:
    """What a verified round keeps, per row."""

    num_accepted: torch.Tensor  # [B] drafts kept (on the kept branch)
    next_token: torch.Tensor  # [B] the recovered or bonus token: the next anchor
    kept: torch.Tensor  # [B, K1] the kept branch's tokens; slots 0..num_accepted are committed
    path: torch.Tensor | None = None  # [B, K1+A] verified slots in the kept branch's order (None: the chain)
    took_alt: torch.Tensor | None = None  # [B] bool: rows that kept a first-draft alternative

    def branch(self, x: torch.Tensor) -> torch.Tensor:
        """The kept branch's rows of a verify output x [B, K1+A, ...] -> [B, K1, ...]."""
        K1 = self.kept.shape[1]
        if self.path is None:
            return x[:, :K1]
        return x.gather(1, self.path[:, :K1].view(*self.path.shape[:1], K1, *[1] * (x.dim() - 2)).expand(
            -1, -1, *x.shape[2:]))

    def chain_accepted(self) -> torch.Tensor:
        """[B] drafts of the chain accepted, as the flow sees them: a row that kept an alternative
        counts as fully accepted (it carries nothing, the chain read draft 1 there)."""
        if self.took_alt is None:
            return self.num_accepted
        return torch.where(self.took_alt, self.kept.shape[1] - 1, self.num_accepted)


def judge(plan: Plan, logits: torch.Tensor, sampling: SamplingParams,
          generator: torch.Generator | None) -> Verdict:
    """The accept step: plan and the verify pass's logits [B, K1+A, V] -> Verdict."""
    chain = plan.chain
    B, K1 = chain.shape
    if K1 == 1:  # plain decoding: the target's own token
        return Verdict(chain.new_zeros(B), pick(logits[:, 0], sampling, generator), chain)
    if not sampling.greedy:
        n, nxt = rejection_sample(chain[:, 1:], plan.draft_probs, processed_probs(logits, sampling), generator,
                                  plan.num_drafts)
        return Verdict(n, nxt, chain)
    n, nxt = greedy_accept(chain[:, 1:], logits[:, :K1], plan.num_drafts)
    if plan.alts is None:
        return Verdict(n, nxt, chain)
    which = accept_alternative(plan.alts, logits[:, 0].argmax(-1), n, plan.num_alts)  # [B], -1: none
    return take_alternative(chain, plan.alts, which, logits, n, nxt)


def _proposed(draft_ids: torch.Tensor, num_drafts: torch.Tensor | None) -> torch.Tensor:
    """[B, S-1] True where a row proposes that draft (its first num_drafts[b]; all when None)."""
    if num_drafts is None:
        return torch.ones_like(draft_ids, dtype=torch.bool)
    return torch.arange(draft_ids.shape[1], device=draft_ids.device)[None, :] < num_drafts[:, None]


def greedy_accept(draft_ids: torch.Tensor, target_logits: torch.Tensor,
                  num_drafts: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """draft_ids [B, S-1], target_logits [B, S, V] -> (num_accepted [B], next_token [B]).

    num_drafts [B]: row b proposes only its first num_drafts[b] drafts (the rest ride along unverified)."""
    B, S, _ = target_logits.shape
    assert draft_ids.shape == (B, S - 1), (draft_ids.shape, target_logits.shape)
    target_ids = target_logits.argmax(-1)  # [B, S]
    match = ((draft_ids == target_ids[:, :-1]) & _proposed(draft_ids, num_drafts)).long()  # [B, S-1]
    num_accepted = match.cumprod(-1).sum(-1)  # [B]
    next_token = target_ids.gather(1, num_accepted[:, None])[:, 0]  # [B]
    return num_accepted, next_token


def accept_alternative(alt_ids: torch.Tensor, anchor_target_ids: torch.Tensor, num_accepted: torch.Tensor,
                       num_alts: torch.Tensor | None = None) -> torch.Tensor:
    """Greedy, for first-draft alternatives verified beside the chain (each a child of the anchor).

    alt_ids [B, A]; anchor_target_ids [B]: the target's argmax at the anchor; num_accepted [B]: the
    chain's. A row whose chain rejected draft 1 takes the alternative that is the target's token
    (at most one: they are distinct tokens). Returns its index [B], -1 where none is taken.
    num_alts [B]: row b proposes only its first num_alts[b] alternatives."""
    hit = (alt_ids == anchor_target_ids[:, None]) & _proposed(alt_ids, num_alts) & (num_accepted == 0)[:, None]
    first = hit.long().argmax(-1)  # [B] (0 where no hit; masked below)
    return torch.where(hit.any(-1), first, torch.full_like(first, -1))


def rejection_sample(draft_ids: torch.Tensor, draft_probs: torch.Tensor, target_probs: torch.Tensor,
                     generator: torch.Generator | None = None,
                     num_drafts: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Lossless speculative sampling (Leviathan et al.; Chen et al.).

    draft_ids [B, S-1] were drawn from draft_probs [B, S-1, V]; target_probs [B, S, V].
    Accept draft i with probability min(1, target/draft); at the first rejection draw the
    recovered token from norm(max(target - draft, 0)); after S-1 acceptances draw the bonus
    token from target_probs[:, S-1]. Returns (num_accepted [B], next_token [B]).
    num_drafts [B]: row b proposes only its first num_drafts[b] drafts; after accepting them all it
    draws the bonus token from the target at the next slot, as if its block ended there.
    """
    B, S, V = target_probs.shape
    assert draft_ids.shape == (B, S - 1) and draft_probs.shape == (B, S - 1, V)
    idx = draft_ids[..., None]
    p_target = target_probs[:, :-1].gather(-1, idx)[..., 0]  # [B, S-1]
    p_draft = draft_probs.gather(-1, idx)[..., 0]  # [B, S-1]
    u = torch.rand(p_target.shape, generator=generator, device=p_target.device)
    proposed = _proposed(draft_ids, num_drafts)
    accepted = ((u * p_draft < p_target) & proposed).long()  # u < p_target / p_draft, without dividing by 0
    num_accepted = accepted.cumprod(-1).sum(-1)  # [B]

    at = num_accepted[:, None, None].expand(B, 1, V)
    target_at = target_probs.gather(1, at)[:, 0]  # [B, V]
    # slots a row did not propose (and the bonus slot) carry no draft: the target itself is drawn there
    padded_draft = torch.cat([draft_probs * proposed[..., None], draft_probs.new_zeros(B, 1, V)], 1)
    residual = (target_at - padded_draft.gather(1, at)[:, 0]).clamp(min=0)  # [B, V]
    mass = residual.sum(-1, keepdim=True)
    # Where rounding leaves no residual mass (target == draft), the target itself is the residual.
    residual = torch.where(mass > 0, residual / mass.clamp(min=1e-30), target_at)
    next_token = torch.multinomial(residual, 1, generator=generator)[:, 0]
    return num_accepted, next_token


def take_alternative(chain: torch.Tensor, alts: torch.Tensor, which: torch.Tensor, logits: torch.Tensor,
                     num_accepted: torch.Tensor, next_token: torch.Tensor) -> Verdict:
    """Rows with which[b] >= 0 keep [anchor, that alternative] and the target's token after it;
    the others keep their chain verdict. chain [B, K1] (K1 >= 2), alts [B, A], logits [B, K1+A, V]."""
    B, K1 = chain.shape
    rows = which >= 0
    slot = K1 + which.clamp(min=0)  # [B] the alternative's slot in the verified block
    path = torch.arange(K1 + alts.shape[1], device=chain.device).repeat(B, 1)  # [B, K1+A]
    path[:, 1] = torch.where(rows, slot, path[:, 1])  # only a row's first num_accepted+1 path slots are kept
    kept = chain.clone()
    kept[:, 1] = torch.where(rows, alts.gather(1, which.clamp(min=0)[:, None])[:, 0], kept[:, 1])
    after = logits.gather(1, slot[:, None, None].expand(B, 1, logits.shape[-1]))[:, 0].argmax(-1)  # [B]
    return Verdict(torch.where(rows, torch.ones_like(num_accepted), num_accepted),
                   torch.where(rows, after, next_token), kept, path, rows)
