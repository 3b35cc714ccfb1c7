"""Flow bookkeeping: which verifier states of this round become the next round's flow.

A round verifies the block [x_L, d_1..d_{S-1}] at positions L..L+S-1 and accepts a drafts. The
committed positions L..L+a become drafter context. Positions L+a+1..L+S-1 held rejected drafts;
the target still computed states there. The next block starts at L' = L+a+1, so the state at
L+a+1+j lines up with next-block position j, for j < S-1-a. A full acceptance carries nothing.
"""

from __future__ import annotations

import torch

from .interfaces import FlowState


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


def right_align(x: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
    """Left-padded x [B, T, ...] with true lengths [B] -> right-padded (row b's tokens first)."""
    B, T = x.shape[:2]
    src = (torch.arange(T, device=x.device)[None, :] + (T - lens)[:, None]).clamp(max=T - 1)  # [B, T]
    return x.gather(1, src.view(B, T, *([1] * (x.dim() - 2))).expand_as(x))
