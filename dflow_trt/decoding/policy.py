"""Round policies: from the drafter's proposal to what the target verifies (`Plan`).

The loop asks a policy for a plan and never looks inside. `WholeBlock` verifies every draft, as
drafted: the DFlash path, and the paper's setting. `Selective` adds the three ways to spend a
verify pass better, each off at its zero: verifier hints (dflow), a verify length from the
drafter's confidence, and first-draft alternatives beside the chain (a token tree). None of them
changes the output; each changes only what the round costs and how much it commits.
`Budgeted` caps any of them at a number of verified tokens per round, shared by the batch's rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from .flow import take_hints
from .interfaces import FlowState, Proposal


@dataclass
class Plan:
    """What the target verifies this round: the chain, and maybe alternatives beside it."""

    chain: torch.Tensor  # [B, K1] anchor + drafts
    draft_probs: torch.Tensor | None = None  # [B, K1-1, V] what the drafts were drawn from (None: greedy)
    num_drafts: torch.Tensor | None = None  # [B] drafts each row proposes, a prefix (None: all K1-1)
    alts: torch.Tensor | None = None  # [B, A] runner-ups for draft 1, each a child of the anchor
    num_alts: torch.Tensor | None = None  # [B] alternatives each row proposes, a prefix
    hinted: torch.Tensor | None = None  # [B, K1-1] bool: drafts a verifier hint replaced

    @property
    def tokens(self) -> torch.Tensor:
        """[B, K1+A] the verified slots: the chain, then the alternatives."""
        return self.chain if self.alts is None else torch.cat([self.chain, self.alts], 1)

    @property
    def parents(self) -> torch.Tensor | None:
        """[K1+A] each slot's parent slot (-1: none), or None for a plain chain."""
        if self.alts is None:
            return None
        K1, A = self.chain.shape[1], self.alts.shape[1]
        return torch.cat([torch.arange(-1, K1 - 1), torch.zeros(A, dtype=torch.long)])

    def proposed(self) -> torch.Tensor:
        """[B] drafts each row sent to the target."""
        B, K1 = self.chain.shape
        return self.num_drafts if self.num_drafts is not None else self.chain.new_full((B,), K1 - 1)

    def proposed_alts(self) -> torch.Tensor:
        """[B] alternatives each row sent to the target."""
        return self.num_alts if self.num_alts is not None else self.chain.new_zeros(self.chain.shape[0])

    def hints_sent(self) -> torch.Tensor:
        """[B] hint-replaced drafts among those each row sent."""
        if self.hinted is None:
            return self.chain.new_zeros(self.chain.shape[0])
        sent = torch.arange(self.hinted.shape[1], device=self.hinted.device)[None, :] < self.proposed()[:, None]
        return (self.hinted & sent).sum(1)

    def within(self, per_row: int) -> Plan:
        """This plan verifying at most `per_row` slots a row (at least the anchor and one draft),
        cutting the chain's tail first, then alternatives. A prefix of the drafts is still a valid
        proposal, so the output is unchanged; only the round's cost and commitment are."""
        K1, A = self.chain.shape[1], 0 if self.alts is None else self.alts.shape[1]
        w = max(2, min(K1, per_row - A))  # chain width
        a = max(0, min(A, per_row - w))  # alternatives kept
        if w == K1 and a == A:
            return self
        cap = lambda n, m: None if n is None else n.clamp(max=m)  # noqa: E731
        return Plan(self.chain[:, :w], None if self.draft_probs is None else self.draft_probs[:, :w - 1],
                    cap(self.num_drafts, w - 1), self.alts[:, :a] if a else None, cap(self.num_alts, a) if a else None,
                    None if self.hinted is None else self.hinted[:, :w - 1])


class Policy(Protocol):
    draft_threshold: float  # passed to the drafter: it may stop drafting where no row verifies further

    def plan(self, anchor: torch.Tensor, prop: Proposal, flow: FlowState | None) -> Plan:
        """anchor [B], the drafter's proposal, this round's flow (dflow) -> what to verify."""


class WholeBlock:
    """Verify every draft as drafted: no host decision, no extra work."""

    draft_threshold = 0.0

    def plan(self, anchor: torch.Tensor, prop: Proposal, flow: FlowState | None) -> Plan:
        return Plan(torch.cat([anchor[:, None], prop.draft_ids.to(anchor.device)], 1), prop.draft_probs)


@dataclass(frozen=True)
class Selective:
    """Hints, verify length and alternatives; each off at 0.

    `hint_trust` (dflow): where the flow shows the verifier already read a draft's token, its
    guess for the next position replaces a draft the drafter is less sure of (`take_hints`).
    `verify_threshold`: each row proposes only the drafts whose estimated chance of acceptance
    stays at or above it (`verify_lengths`); the batch verifies its longest row's.
    `alternatives` (greedy, a tree target): up to this many of the drafter's runner-ups for draft
    1, under a threshold only those it gives at least that probability.
    Costs one host sync per round: the verified block's shape is decided on the host.
    """

    verify_threshold: float = 0.0
    hint_trust: float = 0.0
    alternatives: int = 0

    @property
    def draft_threshold(self) -> float:
        return self.verify_threshold

    def plan(self, anchor: torch.Tensor, prop: Proposal, flow: FlowState | None) -> Plan:
        hinted = None
        if flow is not None and self.hint_trust > 0:
            taken = take_hints(prop, flow, self.hint_trust)
            hinted, prop = taken.draft_ids != prop.draft_ids, taken  # [B, K]
        dev, K = anchor.device, prop.draft_ids.shape[1]
        n = na = None
        if self.verify_threshold > 0 and prop.confidence is not None:
            n = verify_lengths(prop.confidence, self.verify_threshold).to(dev)  # [B]
        if self.alternatives and prop.alt_ids is not None:
            na = alternative_counts(prop.alt_conf, self.alternatives, self.verify_threshold).to(dev)  # [B]
        zero = torch.zeros((), dtype=torch.long, device=dev)
        k, a = torch.stack([zero + K if n is None else n.max(), zero if na is None else na.max()]).tolist()
        chain = torch.cat([anchor[:, None], prop.draft_ids[:, :k].to(dev)], 1)  # [B, k+1]
        probs = None if prop.draft_probs is None else prop.draft_probs[:, :k]
        return Plan(chain, probs, n, prop.alt_ids[:, :a].to(dev) if a else None, na if a else None,
                    None if hinted is None else hinted[:, :k].to(dev))


@dataclass(frozen=True)
class Budgeted:
    """Any policy, its verify pass capped at `budget` tokens over all rows: each of B rows
    verifies at most budget // B slots (at least anchor + one draft).

    Why: a verify pass costs about its length once it is compute-bound (a CPU, or a GPU at high
    concurrency), and with a batch of rows the drafts deep in a block are rarely accepted but
    always paid for. One row keeps its whole block; eight share the budget. The width follows
    the batch's shape, known on the host, so it costs no sync. (TensorRT-LLM's draft-length
    schedule by batch size does the same, from a table.)
    """

    inner: Policy
    budget: int

    @property
    def draft_threshold(self) -> float:
        return self.inner.draft_threshold

    def plan(self, anchor: torch.Tensor, prop: Proposal, flow: FlowState | None) -> Plan:
        return self.inner.plan(anchor, prop, flow).within(self.budget // anchor.shape[0])


def verify_lengths(confidence: torch.Tensor, threshold: float) -> torch.Tensor:
    """How many drafts each row proposes [B]: the longest prefix whose estimated chance of being
    accepted whole (the product of the drafter's confidences [B, S-1]) is >= threshold; at least one."""
    return (confidence.float().cumprod(-1) >= threshold).sum(-1).clamp(min=1)


def alternative_counts(alt_conf: torch.Tensor, alternatives: int, threshold: float) -> torch.Tensor:
    """How many first-draft alternatives each row proposes [B]: its first `alternatives` (best
    first), and under a threshold only those the drafter gives at least that probability."""
    alt_conf = alt_conf[:, :alternatives]
    if threshold <= 0:
        return torch.full(alt_conf.shape[:1], alt_conf.shape[1], dtype=torch.long, device=alt_conf.device)
    return (alt_conf >= threshold).sum(-1)


def policy_for(mode: str, verify_threshold: float, hint_trust: float, alternatives: int,
               verify_budget: int = 0) -> Policy:
    """The policy-free loop unless a setting asks for more (hints count in dflow mode only)."""
    hint_trust = hint_trust if mode == "dflow" else 0.0
    if verify_threshold == 0 and hint_trust == 0 and alternatives == 0:
        policy: Policy = WholeBlock()
    else:
        policy = Selective(verify_threshold, hint_trust, alternatives)
    return Budgeted(policy, verify_budget) if verify_budget > 0 else policy
