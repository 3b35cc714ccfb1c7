"""The speculative decoding loop: one function for `ar`, `dflash` and `dflow`."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from ..errors import UserError
from .acceptance import accept_alternative, greedy_accept, rejection_sample
from .flow import HINT_TRUST, carry_flow, right_align, take_hints
from .interfaces import MAX_ALTERNATIVES, Drafter, FlowState, Target
from .sampling import SamplingParams, pick, processed_probs

MODES = ("ar", "dflash", "dflow")


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


def _pad_left(prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    T = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), T), pad_id, dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, T - len(p):] = torch.tensor(p, dtype=torch.long)
    return ids, torch.tensor([len(p) for p in prompts])


@torch.inference_mode()
def generate(target: Target, drafter: Drafter | None, prompts: list[list[int]], mode: str = "dflow",
             max_new_tokens: int = 64, sampling: SamplingParams = SamplingParams(),
             stop_token_ids: tuple[int, ...] | None = None,
             on_round: Callable[[RoundEvent], bool | None] | None = None,
             verify_threshold: float = 0.0, hint_trust: float = HINT_TRUST,
             alternatives: int = 0) -> GenerationResult:
    """Decode `prompts` (lists of token ids) with the target, speculatively unless mode == "ar".

    Invariant at the top of every round, per row b with n_b generated tokens:
    - committed = prompt + generated; the last generated token is the *anchor*, not yet seen by
      the target; the target cache holds exactly the committed positions before the anchor
      (its next position is anchor_pos[b] = prompt_len + n_b - 1);
    - the drafter context holds the tap states of those same positions; `new_ctx` holds the ones
      it has not been given yet;
    - in `dflow` mode `flow` holds the previous verify pass's states at its rejected positions,
      aligned with the coming block (see flow.py); nothing else of a rejected draft survives.
    Greedy output equals the target's own greedy decoding; sampled output has its distribution.
    `on_round` sees each round's committed tokens; returning True cancels the generation.
    `verify_threshold` > 0: each row proposes only the drafts whose chance of acceptance, as the
    drafter's own confidence estimates it, stays at or above it (`verify_lengths`), and the batch
    verifies its longest row's; output is unchanged, a round costs less. 0 verifies the whole block.
    `hint_trust` (dflow): where the flow shows the verifier already read a draft's token, its guess
    for the next position replaces a draft the drafter is less sure of than this (`take_hints`);
    0 turns it off, leaving the learned flow conditioning alone.
    `alternatives` > 0 (greedy, a target with `supports_tree`): the target also verifies up to this
    many of the drafter's runner-up tokens for draft 1, each a child of the anchor beside the chain
    (a token tree, one target pass); under a verify threshold only those whose drafter probability
    reaches it. A row whose draft 1 is rejected commits the alternative that is the target's token,
    if any, and the target's token after it. Drafters that report no runner-ups verify the chain.
    """
    if mode not in MODES:
        raise UserError(f"unknown mode {mode!r}; use one of {', '.join(MODES)}")
    if not prompts or any(len(p) == 0 for p in prompts):
        raise UserError("empty prompt: give at least one token")
    if max_new_tokens < 1:
        raise UserError(f"max new tokens must be >= 1, got {max_new_tokens}")
    ctx = target.info.max_context
    if ctx and max(map(len, prompts)) + max_new_tokens > ctx:
        raise UserError(f"prompt ({max(map(len, prompts))} tokens) + max new tokens ({max_new_tokens}) exceed the "
                        f"target's context of {ctx} tokens; shorten the prompt or ask for fewer new tokens")
    if mode != "ar" and drafter is None:
        raise UserError(f"mode {mode!r} needs a drafter")
    if not 0.0 <= verify_threshold < 1.0:
        raise UserError(f"verify threshold must be in [0, 1), got {verify_threshold}")
    if not 0.0 <= hint_trust <= 1.0:
        raise UserError(f"hint trust must be in [0, 1], got {hint_trust}")
    if not 0 <= alternatives <= MAX_ALTERNATIVES:
        raise UserError(f"alternatives must be in [0, {MAX_ALTERNATIVES}], got {alternatives}")
    if alternatives and not sampling.greedy:
        raise UserError("first-draft alternatives are verified for greedy decoding only (temperature 0); "
                        "drop --alternatives or sample without them")
    if alternatives and mode != "ar" and not getattr(target, "supports_tree", False):
        raise UserError("this target back end verifies chains only, not the token tree that --alternatives needs; "
                        "drop --alternatives or use the PyTorch target")
    if mode == "dflow" and not drafter.uses_flow:
        raise UserError("this drafter was built without flow conditioning; use --mode dflash or a DFlow drafter")
    speculative = mode != "ar"
    stop = set(target.info.eos_token_ids if stop_token_ids is None else stop_token_ids)
    t_start = time.perf_counter()

    B = len(prompts)
    ids, lens = _pad_left(prompts, pad_id=0)
    cache, out = target.prefill(ids, lens)
    dev = out.logits.device  # the loop's small tensors live where the target's outputs do (CPU or GPU)
    lens, gen = lens.to(dev), sampling.generator(dev)
    first = pick(out.logits[:, -1], sampling, gen)  # [B]
    prefill_s = time.perf_counter() - t_start

    tokens: list[list[int]] = [[t] for t in first.tolist()]
    accept_lens: list[list[int]] = [[] for _ in range(B)]
    done = [t[0] in stop or max_new_tokens <= 1 for t in tokens]
    reasons = ["stop" if tokens[b][0] in stop else "length" for b in range(B)]
    if on_round is not None and on_round(RoundEvent(0, [list(t) for t in tokens])):
        done = [True] * B

    anchor, anchor_pos = first, lens.clone()
    dstate = drafter.new_state(B, gen) if speculative else None
    new_ctx, new_ctx_lens = right_align(out.taps, lens), lens.clone()
    flow: FlowState | None = None
    draft_s = verify_s = 0.0
    rounds = verified = hints = alts_taken = 0
    while not all(done):
        rounds += 1
        t0 = time.perf_counter()
        n_drafts = None  # per row: how many drafts it proposes (None: all)
        n_alts = alts = None  # per row: how many first-draft alternatives it proposes; [B, A] their ids
        replaced = None  # [B, K] dflow: drafts a verifier hint replaced
        if speculative:
            prop = drafter.draft(dstate, new_ctx, new_ctx_lens, anchor, anchor_pos,
                                 flow if mode == "dflow" else None, sampling, verify_threshold)
            if mode == "dflow" and flow is not None and hint_trust > 0:
                hinted = take_hints(prop, flow, hint_trust)
                replaced, prop = hinted.draft_ids != prop.draft_ids, hinted  # [B, K]
            if verify_threshold > 0 and prop.confidence is not None:
                n_drafts = verify_lengths(prop.confidence, verify_threshold).to(anchor.device)  # [B]
            k = None if n_drafts is None else int(n_drafts.max())  # the batch verifies its longest row's drafts
            drafts, draft_probs = prop.draft_ids[:, :k], None if prop.draft_probs is None else prop.draft_probs[:, :k]
            block = torch.cat([anchor[:, None], drafts.to(anchor.device)], 1)  # [B, k+1]
            if alternatives and prop.alt_ids is not None:
                n_alts = alternative_counts(prop.alt_conf, alternatives, verify_threshold).to(anchor.device)  # [B]
                a = int(n_alts.max())
                alts = prop.alt_ids[:, :a].to(anchor.device) if a else None
        else:
            block = anchor[:, None]  # [B, 1]
        t1 = time.perf_counter()
        K1 = block.shape[1]
        if alts is None:
            out = target.verify(cache, block)
        else:  # the alternatives after the chain, each a child of the anchor at slot 0
            parents = torch.cat([torch.arange(-1, K1 - 1), torch.zeros(alts.shape[1], dtype=torch.long)])
            out = target.verify(cache, torch.cat([block, alts], 1), parents)  # [B, K1+A]
        path = None  # [B, K1+A] block slots in the order the kept branch needs them (None: as verified)
        took = None  # [B] bool: rows that committed a first-draft alternative
        if not speculative:
            num_acc, nxt = torch.zeros(B, dtype=torch.long, device=dev), pick(out.logits[:, 0], sampling, gen)
        elif sampling.greedy:
            num_acc, nxt = greedy_accept(block[:, 1:], out.logits[:, :K1], n_drafts)
            if alts is not None:
                which = accept_alternative(alts, out.logits[:, 0].argmax(-1), num_acc, n_alts)  # [B], -1: none
                if bool((which >= 0).any()):
                    took, path, block, num_acc, nxt = _take_alternative(block, alts, which, out.logits, num_acc, nxt)
        else:
            num_acc, nxt = rejection_sample(block[:, 1:], draft_probs, processed_probs(out.logits, sampling), gen,
                                            n_drafts)
        if path is None:
            target.commit(cache, num_acc + 1)
        else:
            target.commit(cache, num_acc + 1, path)
        if speculative:
            taps = out.taps[:, :K1]  # [B, K1, F]
            if path is not None:
                taps = out.taps.gather(1, path[:, :K1, None].expand(B, K1, out.taps.shape[-1]))
            new_ctx, new_ctx_lens = taps, num_acc + 1  # committed slots are the kept branch's first a+1
            if mode == "dflow":  # a row that took an alternative carries nothing: the chain read draft 1 there
                chain_acc = num_acc if took is None else torch.where(took, K1 - 1, num_acc)
                flow = carry_flow(block, out.taps[:, :K1], out.logits[:, :K1].argmax(-1), chain_acc,
                                  drafter.block_size)
        verify_s += time.perf_counter() - t1
        draft_s += t1 - t0

        acc, nxt_l, blk = num_acc.tolist(), nxt.tolist(), block.tolist()  # the round's tokens to the host
        proposed = [K1 - 1] * B if n_drafts is None else n_drafts.tolist()
        proposed_alts = [0] * B if alts is None else n_alts.tolist()
        took_l = [False] * B if took is None else took.tolist()
        replaced_upto = None if replaced is None else replaced.long().cumsum(1).tolist()  # [B][K]: among drafts 1..k
        committed: list[list[int]] = [[] for _ in range(B)]
        for b in range(B):
            if done[b]:
                continue
            accept_lens[b].append(acc[b] + 1)
            verified += proposed[b] + proposed_alts[b]
            alts_taken += took_l[b]
            if replaced_upto is not None:  # counted like `verified`: the drafts this row sent
                hints += replaced_upto[b][proposed[b] - 1]
            for t in blk[b][1:acc[b] + 1] + [nxt_l[b]]:
                committed[b].append(t)
                tokens[b].append(t)
                if t in stop or len(tokens[b]) >= max_new_tokens:
                    done[b], reasons[b] = True, "stop" if t in stop else "length"
                    break
        anchor, anchor_pos = nxt, anchor_pos + num_acc + 1
        if on_round is not None and on_round(RoundEvent(rounds, committed)):
            break
    return GenerationResult(token_ids=tokens, acceptance_lengths=accept_lens, prefill_s=prefill_s,
                            draft_s=draft_s, verify_s=verify_s, total_s=time.perf_counter() - t_start,
                            rounds=rounds, verified_drafts=verified, hints_taken=hints,
                            alternatives_taken=alts_taken, finish_reasons=reasons)



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


def _take_alternative(block: torch.Tensor, alts: torch.Tensor, which: torch.Tensor, logits: torch.Tensor,
                      num_acc: torch.Tensor, nxt: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Rows with which[b] >= 0 keep [anchor, that alternative] and the target's token after it.
    block [B, K1] (K1 >= 2), alts [B, A], logits [B, K1+A, V].
    Returns (rows that took one [B] bool, path [B, K1+A], the block as committed [B, K1], num_acc [B], nxt [B])."""
    B, K1 = block.shape
    rows = which >= 0
    slot = K1 + which.clamp(min=0)  # [B] the alternative's slot in the verified block
    path = torch.arange(K1 + alts.shape[1], device=block.device).repeat(B, 1)  # [B, K1+A]
    path[:, 1] = torch.where(rows, slot, path[:, 1])  # only a row's first num_acc+1 path slots are kept
    block = block.clone()
    block[:, 1] = torch.where(rows, alts.gather(1, which.clamp(min=0)[:, None])[:, 0], block[:, 1])
    after = logits.gather(1, slot[:, None, None].expand(B, 1, logits.shape[-1]))[:, 0].argmax(-1)  # [B]
    return rows, path, block, torch.where(rows, torch.ones_like(num_acc), num_acc), torch.where(rows, after, nxt)
