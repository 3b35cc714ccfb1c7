"""The drafter's context cache: a right-padded ragged append, one implementation for every back end.

Each round a row commits a different number of positions; its context keeps them in its first
lens[b] slots. Appending writes only those, and the buffer grows geometrically so a long decode
appends in amortised constant time (no re-concatenation of the whole context each round).
"""

from __future__ import annotations

import torch


def append_slots(buf: torch.Tensor, lens: torch.Tensor, new: torch.Tensor, n: torch.Tensor,
                 dim: int) -> torch.Tensor:
    """Write row b's first n[b] slots of `new` right after its first lens[b] slots of `buf`.

    buf [B, ..., cap, ...] and new [B, ..., N, ...] have their slot axis at `dim`; lens, n [B].
    Returns `buf`, or a larger copy of it when it had too few slots.
    """
    if new.shape[dim] == 0:
        return buf
    need = int((lens + n).max())
    if buf.shape[dim] < need:  # grow geometrically
        shape = list(buf.shape)
        shape[dim] = max(need, 2 * buf.shape[dim])
        grown = buf.new_zeros(shape)
        grown.narrow(dim, 0, buf.shape[dim]).copy_(buf)
        buf = grown
    rows, cols = (torch.arange(new.shape[dim], device=n.device)[None, :] < n[:, None]).nonzero(as_tuple=True)
    buf.movedim(dim, 1)[rows, lens[rows] + cols] = new.movedim(dim, 1)[rows, cols].to(buf.dtype)
    return buf
