"""The speculative decoding loop: one round function for `ar`, `dflash` and `dflow`, and the batch
of rows it advances."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from .acceptance import Verdict, judge
from .flow import carry_flow, join_flow, right_align
from .interfaces import Drafter, Target, batches_rows
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
    batch_rows: int = 1  # most rows decoded beside each other in one round (continuous batching)

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


@dataclass
class RowRecord:
    """One row's host-side record: its tokens, why it stopped, and its counters."""

    tokens: list[int]
    max_new: int
    stop: set[int]
    accept_lens: list[int] = field(default_factory=list)
    done: bool = False
    reason: str = "length"
    verified: int = 0  # drafts (and alternatives) sent to the target
    hints: int = 0
    alts_taken: int = 0
    chain_accepted: int = 0  # the last round's `Verdict.chain_accepted`

    def __post_init__(self):
        first = self.tokens[0]
        self.done = first in self.stop or self.max_new <= 1
        self.reason = "stop" if first in self.stop else "length"


class Transcript:
    """The host's record of a batch's rows. `record` is the round's one host sync: every per-row
    number the host needs comes over in one transfer."""

    def __init__(self, first: torch.Tensor, max_new: list[int], stop: list[set[int]]):
        self.rows = [RowRecord([t], m, s) for t, m, s in zip(first.tolist(), max_new, stop)]  # the prefill's sync
        self.rounds = 0

    @property
    def done(self) -> list[bool]:
        return [r.done for r in self.rows]

    def record(self, plan: Plan, v: Verdict) -> list[list[int]]:
        """Append the round's committed tokens per row (finished rows commit nothing); return them."""
        took = v.num_accepted.new_zeros(v.num_accepted.shape) if v.took_alt is None else v.took_alt.long()
        per_row = torch.stack([v.num_accepted, v.next_token, plan.proposed(), plan.proposed_alts(), took,
                               plan.hints_sent(), v.chain_accepted()], 1)  # [B, 7]
        rows = torch.cat([per_row, v.kept], 1).tolist()  # the sync
        self.rounds += 1
        committed: list[list[int]] = [[] for _ in rows]
        for r, out, (acc, nxt, sent, sent_alts, took_b, hints, chain_acc, _, *kept) in zip(self.rows, committed, rows):
            r.chain_accepted = chain_acc
            if r.done:
                continue
            r.accept_lens.append(acc + 1)
            r.verified += sent + sent_alts
            r.alts_taken += took_b
            r.hints += hints
            for t in kept[:acc] + [nxt]:
                out.append(t)
                r.tokens.append(t)
                if t in r.stop or len(r.tokens) >= r.max_new:
                    r.done, r.reason = True, "stop" if t in r.stop else "length"
                    break
        return committed


class DecodeBatch:
    """Rows decoding together, and everything the loop carries between rounds.

    Invariant at the top of every round, per row b with n_b generated tokens:
    - committed = prompt + generated; the last generated token is the *anchor*, not yet seen by
      the target; the target cache holds exactly the committed positions before the anchor
      (its next position is anchor_pos[b] = prompt_len + n_b - 1);
    - the drafter context holds the tap states of those same positions; `ctx` holds the ones it
      has not been given yet;
    - in `dflow` mode `flow` holds the previous verify pass's states at its rejected positions,
      aligned with the coming block (see flow.py); nothing else of a rejected draft survives.
    Between rounds rows may leave (`keep`) and rows prefilled apart may join (`join`): continuous
    batching (serving/scheduler.py). Every row's arithmetic is its own, so a row decodes the same
    tokens alone or beside others (up to rounding in a batched matmul).
    """

    def __init__(self, target: Target, drafter: Drafter | None, prompts: list[list[int]],
                 options: DecodeOptions = DecodeOptions(), generator: torch.Generator | None = None,
                 rows: list[DecodeOptions] | None = None):
        """Prefill `prompts` and pick each row's first token. `generator` (None: one from the
        options' seed) draws every sampled token of the batch; `rows` (None: `options` for all)
        gives each row its own length and stop tokens."""
        o = self.options = options
        if rows is None:
            o.check_against(target, drafter, prompts)
            rows = [o] * len(prompts)
        else:  # each row against its own length
            for r, p in zip(rows, prompts):
                r.check_against(target, drafter, [p])
        self.target, self.drafter = target, drafter
        self.policy = policy_for(o.mode, o.verify_threshold, o.hint_trust, o.alternatives, o.verify_budget)
        self.block_size = o.block_size or (drafter.block_size if o.speculative else 1)
        t0 = time.perf_counter()
        ids, lens = pad_left(prompts, pad_id=0)
        self.cache, out = target.prefill(ids, lens)
        lens = lens.to(out.logits.device)
        self.gen = o.sampling.generator(out.logits.device) if generator is None else generator
        self.anchor = pick(out.logits[:, -1], o.sampling, self.gen)  # [B]
        self.log = Transcript(self.anchor, [r.max_new_tokens for r in rows],
                              [set(target.info.eos_token_ids if r.stop_token_ids is None else r.stop_token_ids)
                               for r in rows])
        self.dstate = drafter.new_state(len(prompts), self.gen, self.block_size) if o.speculative else None
        self.ctx, self.ctx_lens, self.anchor_pos = right_align(out.taps, lens), lens.clone(), lens.clone()
        self.flow = None
        self.prefill_s, self.draft_s, self.verify_s = time.perf_counter() - t0, 0.0, 0.0

    def __len__(self) -> int:
        return len(self.log.rows)

    def round(self) -> list[list[int]]:
        """plan -> verify -> accept -> commit, for every row; returns each row's committed tokens."""
        o, target, drafter = self.options, self.target, self.drafter
        t0 = time.perf_counter()
        if o.speculative:  # plan
            prop = drafter.draft(self.dstate, self.ctx, self.ctx_lens, self.anchor, self.anchor_pos, self.flow,
                                 o.sampling, self.policy.draft_threshold)
            plan = self.policy.plan(self.anchor, prop, self.flow)
        else:
            plan = Plan(self.anchor[:, None])
        t1 = time.perf_counter()
        out = target.verify(self.cache, plan.tokens, plan.parents)  # verify: [B, K1+A]
        v = judge(plan, out.logits, o.sampling, self.gen)  # accept
        target.commit(self.cache, v.num_accepted + 1, v.path)  # commit
        if o.speculative:
            self.ctx, self.ctx_lens = v.branch(out.taps), v.num_accepted + 1  # [B, K1, F]: the kept branch's first a+1
            if o.mode == "dflow":  # the chain's states as verified, rejected slots included
                K1 = plan.chain.shape[1]
                self.flow = carry_flow(plan.chain, out.taps[:, :K1], out.logits[:, :K1].argmax(-1),
                                       v.chain_accepted(), self.block_size)
        self.anchor, self.anchor_pos = v.next_token, self.anchor_pos + v.num_accepted + 1
        self.verify_s += time.perf_counter() - t1
        self.draft_s += t1 - t0
        committed = self.log.record(plan, v)
        if self.flow is not None:  # the host now knows how far the flow reaches: no read of it next round
            self.flow.rows = max(0, plan.chain.shape[1] - 1 - min(r.chain_accepted for r in self.log.rows))
        return committed

    # ------------------------------------------------------------------ rows joining and leaving

    def keep(self, rows: list[int]) -> None:
        """Keep only these rows (in this order); the others' state is freed."""
        idx = torch.tensor(rows, dtype=torch.long, device=self.anchor.device)
        self.cache = self.target.keep(self.cache, idx)
        if self.dstate is not None:
            self.dstate = self.drafter.keep(self.dstate, idx)
        self.anchor, self.anchor_pos = self.anchor[idx], self.anchor_pos[idx]
        self.ctx, self.ctx_lens = self.ctx[idx], self.ctx_lens[idx]
        if self.flow is not None:
            self.flow = self.flow.select(idx)
        self.log.rows = [self.log.rows[i] for i in rows]

    def join(self, other: DecodeBatch) -> None:
        """Append `other`'s rows (prefilled apart, same models and options); `other` is consumed."""
        assert other.target is self.target and other.drafter is self.drafter and other.block_size == self.block_size
        self.cache = self.target.join(self.cache, other.cache)
        if self.dstate is not None:  # the newcomers' prompt context goes in first, unpadded
            self.drafter.append(other.dstate, other.ctx, other.ctx_lens)
            other.ctx, other.ctx_lens = other.ctx[:, :0], torch.zeros_like(other.ctx_lens)
            self.dstate = self.drafter.join(self.dstate, other.dstate)
        self.anchor = torch.cat([self.anchor, other.anchor])
        self.anchor_pos = torch.cat([self.anchor_pos, other.anchor_pos])
        N = max(self.ctx.shape[1], other.ctx.shape[1])  # right-padded: pad the shorter at the end
        pad = lambda x: torch.nn.functional.pad(x, (0, 0, 0, N - x.shape[1]))  # noqa: E731
        self.ctx, self.ctx_lens = torch.cat([pad(self.ctx), pad(other.ctx)]), torch.cat([self.ctx_lens, other.ctx_lens])
        self.flow = join_flow(self.flow, other.flow, len(self), len(other), self.block_size)
        self.log.rows += other.log.rows
        self.prefill_s += other.prefill_s


def can_batch(target: Target, drafter: Drafter | None) -> bool:
    """Whether rows can join and leave a running batch of these models (`DecodeBatch.join`/`keep`)."""
    return batches_rows(target) and (drafter is None or batches_rows(drafter))


@torch.inference_mode()
def generate(target: Target, drafter: Drafter | None, prompts: list[list[int]],
             options: DecodeOptions = DecodeOptions(),
             on_round: Callable[[RoundEvent], bool | None] | None = None) -> GenerationResult:
    """Decode `prompts` (lists of token ids) with the target, speculatively unless options.mode == "ar".

    One batch from prefill until its last row ends (finished rows ride along, committing nothing).
    Greedy output equals the target's own greedy decoding; sampled output has its distribution.
    `on_round` sees each round's committed tokens; returning True cancels the generation.
    """
    t_start = time.perf_counter()
    batch = DecodeBatch(target, drafter, prompts, options)
    log = batch.log
    if on_round is not None and on_round(RoundEvent(0, [list(r.tokens) for r in log.rows])):
        for r in log.rows:
            r.done = True
    while not all(log.done):
        committed = batch.round()
        if on_round is not None and on_round(RoundEvent(log.rounds, committed)):
            break
    return result(batch, time.perf_counter() - t_start)


def result(batch: DecodeBatch, total_s: float, rows: list[int] | None = None) -> GenerationResult:
    """The batch's rows (default all) as a GenerationResult."""
    rs = batch.log.rows if rows is None else [batch.log.rows[i] for i in rows]
    return GenerationResult(token_ids=[r.tokens for r in rs], acceptance_lengths=[r.accept_lens for r in rs],
                            prefill_s=batch.prefill_s, draft_s=batch.draft_s, verify_s=batch.verify_s,
                            total_s=total_s, rounds=batch.log.rounds, verified_drafts=sum(r.verified for r in rs),
                            hints_taken=sum(r.hints for r in rs), alternatives_taken=sum(r.alts_taken for r in rs),
                            finish_reasons=[r.reason for r in rs], batch_rows=len(batch))
