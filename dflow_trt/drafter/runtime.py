"""PyTorch drafter back end: the `Drafter` interface over `DFlowDrafter`, with a context KV cache.

Per request the state holds each layer's context K/V, right-padded: row b's first `lens[b]` slots
are its committed positions 0..lens[b]-1. Each round appends only the newly committed positions.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..decoding.interfaces import MAX_ALTERNATIVES, FlowState, Proposal
from ..decoding.policy import verify_lengths
from ..decoding.sampling import SamplingParams, propose
from .context import append_slots
from .model import DFlowDrafter


@dataclass
class DrafterState:
    k: list[torch.Tensor]  # per layer [B, Hkv, cap, D]
    v: list[torch.Tensor]
    lens: torch.Tensor  # [B] valid context slots per row
    block_size: int  # anchor + drafts, this request's
    generator: torch.Generator | None = None


class TorchDrafter:
    joins_rows = True

    def __init__(self, model: DFlowDrafter):
        self.model = model.eval()
        self.config = model.config
        self.block_size = model.config.block_size  # the default; a request may ask for another
        self.uses_flow = model.config.flow

    @property
    def device(self):
        return self.model.embed_weight.device

    def new_state(self, batch_size: int, generator: torch.Generator | None = None,
                  block_size: int | None = None) -> DrafterState:
        c = self.config
        empty = lambda: torch.zeros(batch_size, c.num_kv_heads, 0, c.head_dim, device=self.device,  # noqa: E731
                                    dtype=self.model.ctx_proj.weight.dtype)  # the cache holds what context_kv makes
        return DrafterState(k=[empty() for _ in range(c.num_layers)], v=[empty() for _ in range(c.num_layers)],
                            lens=torch.zeros(batch_size, dtype=torch.long, device=self.device),
                            block_size=block_size or self.block_size, generator=generator)

    def join(self, state: DrafterState, other: DrafterState) -> DrafterState:
        """`state`'s rows then `other`'s (their context caches padded to the longer)."""
        C = max(state.k[0].shape[2], other.k[0].shape[2])
        pad = lambda t: torch.nn.functional.pad(t, (0, 0, 0, C - t.shape[2]))  # noqa: E731  [B, Hkv, C, D]
        return DrafterState(k=[torch.cat([pad(a), pad(b)]) for a, b in zip(state.k, other.k)],
                            v=[torch.cat([pad(a), pad(b)]) for a, b in zip(state.v, other.v)],
                            lens=torch.cat([state.lens, other.lens]), block_size=state.block_size,
                            generator=state.generator)

    def keep(self, state: DrafterState, rows: torch.Tensor) -> DrafterState:
        rows = rows.to(self.device)
        return DrafterState(k=[t[rows] for t in state.k], v=[t[rows] for t in state.v], lens=state.lens[rows],
                            block_size=state.block_size, generator=state.generator)

    def append(self, st: DrafterState, taps: torch.Tensor, lens: torch.Tensor) -> None:
        """Take committed context taps [B, N, F] (row b's first lens[b]) into the state now; `draft`
        does this itself, a joining row does it before it joins (its prompt only, not padded to)."""
        N = taps.shape[1]
        if N == 0:
            return
        pos = st.lens[:, None] + torch.arange(N, device=self.device)  # [B, N]
        for i, (k, v) in enumerate(self.model.context_kv(taps.to(self.device), pos)):  # [B, Hkv, N, D] each
            st.k[i] = append_slots(st.k[i], st.lens, k, lens, dim=2)
            st.v[i] = append_slots(st.v[i], st.lens, v, lens, dim=2)
        st.lens = st.lens + lens

    @torch.inference_mode()
    def draft(self, state: DrafterState, context_taps: torch.Tensor, context_lens: torch.Tensor,
              anchor_ids: torch.Tensor, anchor_pos: torch.Tensor, flow: FlowState | None,
              sampler: SamplingParams, verify_threshold: float = 0.0) -> Proposal:
        self.append(state, context_taps, context_lens.to(self.device))
        assert torch.equal(state.lens, anchor_pos.to(self.device)), "drafter context must end right before the anchor"
        B, S, m = anchor_ids.shape[0], state.block_size, self.model
        block = torch.full((B, S), self.config.mask_token_id, dtype=torch.long, device=self.device)
        block[:, 0] = anchor_ids
        pos = state.lens[:, None] + torch.arange(S, device=self.device)  # [B, S]
        flow = flow if self.uses_flow else None
        x = m.block_inputs(block, flow, None if flow is None else flow.prefix())
        C = int(state.lens.max())
        ctx_mask = torch.arange(C, device=self.device)[None, :] < state.lens[:, None]  # [B, C]
        mask = torch.cat([ctx_mask[:, None, :].expand(B, S, C), ctx_mask.new_ones(B, S, S)], -1)  # [B, S, C+S]
        kv = [(k[:, :, :C], v[:, :, :C]) for k, v in zip(state.k, state.v)]
        x = m.early_layers(x, pos, kv, mask)  # once: only the last layer is cut to each span's rows
        parts: list[Proposal] = []
        for lo, hi in draft_spans(S, verify_threshold):
            logits = m.draft_logits(m.last_layer(x, pos, kv, mask, slice(lo, hi)))  # [B, hi-lo, Vd]
            parts.append(propose(logits, m.draft_vocab, self.config.target.vocab_size, sampler, state.generator,
                                 MAX_ALTERNATIVES if lo == 1 else 0))
            conf = torch.cat([p.confidence for p in parts], 1)  # [B, hi-1]
            if verify_threshold > 0 and (verify_lengths(conf, verify_threshold) < conf.shape[1]).all():
                break  # the loop's own rule: no row verifies past here, so later drafts are never read
        if len(parts) == 1:
            return parts[0]
        probs = None if parts[0].draft_probs is None else torch.cat([p.draft_probs for p in parts], 1)
        return Proposal(draft_ids=torch.cat([p.draft_ids for p in parts], 1), draft_probs=probs, confidence=conf,
                        alt_ids=parts[0].alt_ids, alt_conf=parts[0].alt_conf)


def draft_spans(block_size: int, verify_threshold: float) -> list[tuple[int, int]]:
    """The block positions drafted per step, as [lo, hi) spans of 1..S-1 (position 0 is the anchor).

    Without a threshold: all at once. With one: 4, then 8, 16, ... positions, stopping once every
    row's estimated chance of acceptance has fallen below the threshold; on a CPU most rounds then
    stop after the first span and skip the rest's queries, MLP rows and draft-head rows. Spans are
    at least 4 long: PyTorch's CPU attention takes another path for 1-3 queries whose sums can
    differ in the last bit, and the drafts should not depend on the threshold.
    """
    if verify_threshold <= 0:
        return [(1, block_size)]
    spans, lo, n = [], 1, 4
    while lo < block_size:
        hi = lo + n if block_size - (lo + n) >= 4 else block_size
        spans.append((lo, hi))
        lo, n = hi, 2 * n
    return spans
