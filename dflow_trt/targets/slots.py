"""The slot bookkeeping every target back end keeps beside its padded KV cache.

Rows of a batch accept different numbers of drafts, so instead of ragged caches a target keeps one
padded cache and a per-row validity mask over its slots: a verify appends the block's slots, a
commit masks the rejected ones for good, and the trailing slots no row uses are cropped. With one
row this is an exact crop (no holes ever). A cache object carries `valid` [B, P] bool, `next_pos`
[B] (each row's next absolute position) and `pending` (slots of the last block awaiting commit).
"""

from __future__ import annotations

import torch

from ..errors import UserError


def prompt_slots(prompt_lens: torch.Tensor, T: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded prompts of true lengths [B] in T slots -> (valid [B, T], positions [B, T])."""
    if (prompt_lens < 1).any() or (prompt_lens > T).any():
        raise UserError("every prompt needs at least one token")
    valid = torch.arange(T, device=prompt_lens.device)[None, :] >= (T - prompt_lens)[:, None]  # [B, T]
    return valid, (valid.long().cumsum(-1) - 1).clamp(min=0)


def open_block(cache, S: int) -> torch.Tensor:
    """Append S slots for a block being verified; return their chain positions [B, S]."""
    assert cache.pending == 0, "commit() the previous block before verifying the next"
    B = cache.valid.shape[0]
    cache.valid = torch.cat([cache.valid, cache.valid.new_ones(B, S)], dim=1)  # [B, P+S]
    cache.pending = S
    return cache.next_pos[:, None] + torch.arange(S, device=cache.valid.device)


def close_block(cache, num_kept: torch.Tensor) -> int:
    """Keep each row's first num_kept[b] (>= 1) slots of the pending block; return how many
    trailing slots no row uses any more, for the caller to crop from its KV cache (0: none)."""
    S = cache.pending
    assert S > 0, "verify a block before committing it"  # num_kept in 1..S is the loop's to keep (no host read)
    cache.valid[:, -S:] = torch.arange(S, device=num_kept.device)[None, :] < num_kept[:, None]  # [B, S]
    cache.next_pos = cache.next_pos + num_kept
    cache.pending = 0
    used = int(cache.valid.any(dim=0).nonzero().max()) + 1
    drop = cache.valid.shape[1] - used
    cache.valid = cache.valid[:, :used]
    return drop
