"""Sampling parameters and the processed distribution both target and drafter sample from.

The target's distribution *is* the processed one (temperature, top-k, top-p), so plain sampling
and speculative sampling agree on what "lossless" means. No model is called here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..errors import UserError
from .interfaces import Proposal


MIN_TEMPERATURE = 1e-3  # below it logits / T overflows float32 for ordinary logit gaps
MAX_TEMPERATURE = 100.0  # above it the distribution is uniform to float32 precision
MAX_SEED = 2**63 - 1  # torch.Generator.manual_seed's range


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0  # 0: no top-k cut
    seed: int | None = None

    def __post_init__(self):
        # refused before any work: NaN/inf or a denormal temperature would turn the processed
        # distribution into NaN (a traceback) or into uniform noise (silently wrong text)
        t, p, k, seed = self.temperature, self.top_p, self.top_k, self.seed
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or not (
                t == 0 or MIN_TEMPERATURE <= t <= MAX_TEMPERATURE):
            raise UserError(f"temperature must be 0 (greedy) or between {MIN_TEMPERATURE} and {MAX_TEMPERATURE}, "
                            f"got {t!r}")
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not (0 < p <= 1):  # NaN fails too
            raise UserError(f"top-p must be in (0, 1], got {p!r}")
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            raise UserError(f"top-k must be an integer >= 0 (0: no cut), got {k!r}")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= MAX_SEED):
            raise UserError(f"seed must be an integer in [0, 2**63 - 1], got {seed!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def generator(self, device) -> torch.Generator | None:
        if self.seed is None:
            return None
        return torch.Generator(device=device).manual_seed(self.seed)


def processed_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Logits [..., V] -> probabilities [..., V] after temperature, top-k and top-p."""
    assert not params.greedy
    x = logits.float() / params.temperature
    if params.top_k and params.top_k < x.shape[-1]:
        kth = x.topk(params.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    probs = torch.softmax(x, dim=-1)
    if params.top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        # keep the smallest prefix whose mass reaches top_p (the first token always stays)
        drop_sorted = (sorted_p.cumsum(-1) - sorted_p) >= params.top_p
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """Draw one id per row from probs [..., V] -> [...]."""
    flat = probs.reshape(-1, probs.shape[-1])
    return torch.multinomial(flat, 1, generator=generator).view(probs.shape[:-1])


def pick(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> torch.Tensor:
    """Greedy argmax or a sample from the processed distribution: logits [..., V] -> ids [...]."""
    if params.greedy:
        return logits.argmax(-1)
    return sample(processed_probs(logits, params), generator)


def propose(logits: torch.Tensor, draft_vocab: torch.Tensor, vocab_size: int, params: SamplingParams,
            generator: torch.Generator | None, alternatives: int = 0) -> Proposal:
    """Drafter logits over its draft vocabulary [B, S-1, Vd] -> a Proposal in target ids.

    `confidence` is the drafter's top probability at each position (the verify-length policy
    reads it). It must not depend on which token was sampled: choosing how many drafts to verify
    from the sampled tokens' own probabilities would skew the proposal distribution that rejection
    sampling corrects for. Sampled drafts also carry their full distribution.
    Greedy with `alternatives` > 0: the runner-up tokens of the first position, best first, and
    their probabilities (`alt_ids`, `alt_conf`).
    """
    if params.greedy:
        probs = logits.float().softmax(-1)  # [B, S-1, Vd]
        conf, ids_d = probs.max(-1)  # [B, S-1]
        alt_ids = alt_conf = None
        if alternatives > 0:
            top = probs[:, 0].topk(min(alternatives + 1, probs.shape[-1]), -1)  # [B, A+1], [0] is draft 1
            alt_ids, alt_conf = draft_vocab[top.indices[:, 1:]], top.values[:, 1:]
        return Proposal(draft_ids=draft_vocab[ids_d], draft_probs=None, confidence=conf, alt_ids=alt_ids,
                        alt_conf=alt_conf)
    probs_d = processed_probs(logits, params)  # [B, S-1, Vd]
    ids_d = sample(probs_d, generator)
    probs = probs_d.new_zeros(*probs_d.shape[:-1], vocab_size)
    probs[..., draft_vocab] = probs_d
    return Proposal(draft_ids=draft_vocab[ids_d], draft_probs=probs, confidence=probs_d.amax(-1))
