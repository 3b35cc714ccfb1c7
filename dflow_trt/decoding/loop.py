"""The speculative decoding loop: one function for `ar`, `dflash` and `dflow`."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from .acceptance import Verdict, judge
from .flow import carry_flow, right_align
from .interfaces import Drafter, Target
from .options import DecodeOptions
from .policy import Plan, policy_for
from .sampling import pick


@dataclass
class RoundEvent:
    """What one round committed, per row (empty list for finished rows)."""

    round: int
    new_tokens: list[list[int]]


@dataclass
class GenerationResult:
    token_ids: list[list[int]]  # generated tokens per row (prompt excluded, stop token included)
    acceptance_lengths: list[list[int]]  # tokens committed per target forward, per row and round
    prefill_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    total_s: float = 0.0
    rounds: int = 0
    verified_drafts: int = 0  # drafts sent to the target, all rows' rounds (the verify cost beside τ)
    hints_taken: int = 0  # dflow: verified drafts a verifier hint had replaced (`take_hints`), all rows' rounds
    alternatives_taken: int = 0  # rounds (all rows') that accepted a first-draft alternative instead of draft 1
    finish_reasons: list[str] = field(default_factory=list)  # "stop" | "length"

    @property
    def tau(self) -> float:
        """Mean acceptance length over all rows' rounds."""
        flat = [a for row in self.acceptance_lengths for a in row]
        return sum(flat) / len(flat) if flat else 0.0

    @property
    def tokens_per_s(self) -> float:
        n = sum(len(r) for r in self.token_ids)
        return n / self.total_s if self.total_s > 0 else 0.0


def pad_left(prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    T = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), T), pad_id, dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, T - len(p):] = torch.tensor(p, dtype=torch.long)
    return ids, torch.tensor([len(p) for p in prompts])


class Transcript:
    """The host's record of a generation: tokens, stops, counters. `record` is the round's one
    host sync: every per-row number the host needs comes over in one transfer."""

    def __init__(self, first: torch.Tensor, max_new_tokens: int, stop: set[int]):
        self.max_new, self.stop = max_new_tokens, stop
        self.tokens: list[list[int]] = [[t] for t in first.tolist()]  # the prefill's sync
        self.accept_lens: list[list[int]] = [[] for _ in self.tokens]
        self.done = [t[0] in stop or max_new_tokens <= 1 for t in self.tokens]
        self.reasons = ["stop" if t[0] in stop else "length" for t in self.tokens]
        self.rounds = self.verified = self.hints = self.alts_taken = 0
        self.chain_accepted: list[int] = []  # the last round's `Verdict.chain_accepted`, per row

    def record(self, plan: Plan, v: Verdict) -> list[list[int]]:
        """Append the round's committed tokens per row (finished rows commit nothing); return them."""
        took = v.num_accepted.new_zeros(v.num_accepted.shape) if v.took_alt is None else v.took_alt.long()
        per_row = torch.stack([v.num_accepted, v.next_token, plan.proposed(), plan.proposed_alts(), took,
                               plan.hints_sent(), v.chain_accepted()], 1)  # [B, 7]
        rows = torch.cat([per_row, v.kept], 1).tolist()  # the sync
        self.rounds += 1
        self.chain_accepted = [r[6] for r in rows]
        committed: list[list[int]] = [[] for _ in rows]
        for b, (acc, nxt, sent, sent_alts, took_b, hints, _, _, *kept) in enumerate(rows):
            if self.done[b]:
                continue
            self.accept_lens[b].append(acc + 1)
            self.verified += sent + sent_alts
            self.alts_taken += took_b
            self.hints += hints
            for t in kept[:acc] + [nxt]:
                committed[b].append(t)
                self.tokens[b].append(t)
                if t in self.stop or len(self.tokens[b]) >= self.max_new:
                    self.done[b], self.reasons[b] = True, "stop" if t in self.stop else "length"
                    break
        return committed


@torch.inference_mode()
def generate(target: Target, drafter: Drafter | None, prompts: list[list[int]],
             options: DecodeOptions = DecodeOptions(),
             on_round: Callable[[RoundEvent], bool | None] | None = None) -> GenerationResult:
    """Decode `prompts` (lists of token ids) with the target, speculatively unless options.mode == "ar".

    Each round: plan (drafter + policy) -> verify (one target pass) -> accept -> commit.
    Invariant at the top of every round, per row b with n_b generated tokens:
    - committed = prompt + generated; the last generated token is the *anchor*, not yet seen by
      the target; the target cache holds exactly the committed positions before the anchor
      (its next position is anchor_pos[b] = prompt_len + n_b - 1);
    - the drafter context holds the tap states of those same positions; `ctx` holds the ones it
      has not been given yet;
    - in `dflow` mode `flow` holds the previous verify pass's states at its rejected positions,
      aligned with the coming block (see flow.py); nothing else of a rejected draft survives.
    Greedy output equals the target's own greedy decoding; sampled output has its distribution.
    `on_round` sees each round's committed tokens; returning True cancels the generation.
    """
    o = options
    o.check_against(target, drafter, prompts)
    policy = policy_for(o.mode, o.verify_threshold, o.hint_trust, o.alternatives)
    S = o.block_size or (drafter.block_size if o.speculative else 1)
    t_start = time.perf_counter()

    ids, lens = pad_left(prompts, pad_id=0)
    cache, out = target.prefill(ids, lens)
    lens, gen = lens.to(out.logits.device), o.sampling.generator(out.logits.device)
    anchor = pick(out.logits[:, -1], o.sampling, gen)  # [B]
    log = Transcript(anchor, o.max_new_tokens,
                     set(target.info.eos_token_ids if o.stop_token_ids is None else o.stop_token_ids))
    prefill_s = time.perf_counter() - t_start
    if on_round is not None and on_round(RoundEvent(0, [list(t) for t in log.tokens])):
        log.done = [True] * len(prompts)
    dstate = drafter.new_state(len(prompts), gen, S) if o.speculative else None
    ctx, ctx_lens, anchor_pos, flow = right_align(out.taps, lens), lens.clone(), lens.clone(), None
    draft_s = verify_s = 0.0
    while not all(log.done):
        t0 = time.perf_counter()
        if o.speculative:  # plan
            prop = drafter.draft(dstate, ctx, ctx_lens, anchor, anchor_pos, flow, o.sampling, policy.draft_threshold)
            plan = policy.plan(anchor, prop, flow)
        else:
            plan = Plan(anchor[:, None])
        t1 = time.perf_counter()
        out = target.verify(cache, plan.tokens, plan.parents)  # verify: [B, K1+A]
        v = judge(plan, out.logits, o.sampling, gen)  # accept
        target.commit(cache, v.num_accepted + 1, v.path)  # commit
        if o.speculative:
            ctx, ctx_lens = v.branch(out.taps), v.num_accepted + 1  # [B, K1, F]: the kept branch's first a+1
            if o.mode == "dflow":  # the chain's states as verified, rejected slots included
                K1 = plan.chain.shape[1]
                flow = carry_flow(plan.chain, out.taps[:, :K1], out.logits[:, :K1].argmax(-1), v.chain_accepted(), S)
        anchor, anchor_pos = v.next_token, anchor_pos + v.num_accepted + 1
        verify_s += time.perf_counter() - t1
        draft_s += t1 - t0
        committed = log.record(plan, v)
        if flow is not None:  # the host now knows how far the flow reaches: no read of it next round
            flow.rows = max(0, plan.chain.shape[1] - 1 - min(log.chain_accepted))
        if on_round is not None and on_round(RoundEvent(log.rounds, committed)):
            break
    return GenerationResult(token_ids=log.tokens, acceptance_lengths=log.accept_lens, prefill_s=prefill_s,
                            draft_s=draft_s, verify_s=verify_s, total_s=time.perf_counter() - t_start,
                            rounds=log.rounds, verified_drafts=log.verified, hints_taken=log.hints,
                            alternatives_taken=log.alts_taken, finish_reasons=log.reasons)
