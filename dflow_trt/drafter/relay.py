"""DFlow's relay as one pure function: the verifier's states at last round's rejected slots -> the next
block's input embeddings.

`DFlowDrafter.block_inputs` calls it, and so does the TensorRT-LLM plug-in
(`backends/trtllm_dflow.py`), which feeds it tensors an engine captured: both must compute the same
thing, and a second copy of the arithmetic would drift. It takes the flow branch as callables (a
PyTorch module, a packed CPU linear, an engine's linear layer all fit) and holds no state.

`relay_paper` is the DFlow paper's relay (`DrafterConfig.relay == "paper"`), a second drafter option
beside ours; only the PyTorch drafter runs it (the exports and the plug-in refuse it).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

Fn = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class FlowParams:
    """A drafter's flow branch (`DFlowDrafter.FLOW_BRANCH`) and the embedding it reads tokens with."""

    proj: Fn  # tap states [..., F] -> [..., H] (flow_proj)
    norm: Fn  # RMSNorm over H (flow_norm)
    tok_proj: Fn  # rejected-token embedding [..., H] -> [..., H] (flow_tok_proj)
    present: torch.Tensor  # [H] added where a slot carries flow (flow_present)
    absent: torch.Tensor  # [H] added where it does not (no_flow)
    hint_gate: torch.Tensor  # [1] scale of the shifted hint embedding
    embed: Fn  # token ids [...] -> [..., H], the target's input embedding
    tap_dtype: torch.dtype  # taps arrive fp32 (or the engine's dtype); `proj` runs in this one


def relay(x: torch.Tensor, taps: torch.Tensor, token_ids: torch.Tensor, hint_ids: torch.Tensor,
          valid: torch.Tensor, p: FlowParams, rows: int | None = None) -> torch.Tensor:
    """Block embeddings x [B, Q, H] plus flow conditioning -> [B, Q, H].

    Slot j of the next block gets, where `valid[b, j]`, the projected tap states taps [B, Q, F] and
    the embedding of the rejected token token_ids [B, Q] the verifier read there, plus `present`;
    elsewhere `absent`. The verifier's argmax hint_ids [B, Q] at slot j is its guess for slot j+1, so
    its embedding (scaled by `hint_gate`) lands one slot later; slot 0 never gets one. `rows`: no slot
    from there on is valid in any row, so the projections skip them (the result is the same).
    """
    m = valid[..., None].to(x.dtype)  # [B, Q, 1]
    n = x.shape[1] if rows is None else rows
    state = p.norm(p.proj(taps[:, :n].to(p.tap_dtype))) + p.tok_proj(p.embed(token_ids[:, :n]))  # [B, n, H]
    if n < x.shape[1]:
        state = torch.cat([state, state.new_zeros(state.shape[0], x.shape[1] - n, state.shape[2])], 1)  # [B, Q, H]
    hint = p.embed(hint_ids) * m  # [B, Q, H]
    hint = torch.cat([torch.zeros_like(hint[:, :1]), hint[:, :-1]], 1)  # slot j's guess sits at j+1
    return x + m * (state + p.present) + (1 - m) * p.absent + p.hint_gate * hint


@dataclass(frozen=True)
class PaperRelayParams:
    """The paper's relay (`DrafterConfig.relay == "paper"`): the drafter's own context projection and
    the scale/shift MLP, and the embedding it reads tokens with."""

    proj: Fn  # tap states [..., F] -> [..., H]: the drafter's context projection (ctx_proj)
    norm: Fn  # RMSNorm over H (ctx_norm)
    mlp: Fn  # [..., 3H] (correction token, first rejected token, relayed state) -> [..., 2H] (scale, shift)
    embed: Fn  # token ids [...] -> [..., H], the target's input embedding
    tap_dtype: torch.dtype  # `proj` runs in this dtype


def relay_paper(x: torch.Tensor, taps: torch.Tensor, token_ids: torch.Tensor, valid: torch.Tensor,
                p: PaperRelayParams, block: int | None = None, rows: int | None = None) -> torch.Tensor:
    """Block embeddings x [B, Q, H] (Q = blocks side by side, `block` slots each; None: one block)
    with the paper's relay of last round's verifier states -> [B, Q, H].

    Flow slot j of a block (`valid`, taps [B, Q, F], the rejected token token_ids [B, Q] the verifier
    read there) holds the verifier's state at the block's position j, which predicts position j + 1:
    it is projected as the context is (`proj`, `norm`) and shifted one slot, onto the unresolved
    (mask) slot j + 1. There an MLP over (the block's slot-0 embedding: the correction token the
    verifier committed; the embedding of the first rejected token, flow slot 0; the relayed state)
    gives a per-channel scale and shift: x <- x * (1 + scale) + shift. Slot 0 (the anchor) and slots
    with no relayed state keep x exactly, so no flow at all is plain DFlash. `rows`: no flow slot
    from there on is valid in any row, so the projection and the MLP skip them (the result is the same).
    """
    B, Q, H = x.shape
    S = block or Q
    n = S - 1 if rows is None else min(rows, S - 1)  # relayed source slots 0..n-1 -> slots 1..n
    if n <= 0:
        return x
    xb = x.view(B, Q // S, S, H)
    src = taps.reshape(B, Q // S, S, -1)[:, :, :n]  # [B, nb, n, F]
    state = p.norm(p.proj(src.to(p.tap_dtype)))  # [B, nb, n, H]
    first = p.embed(token_ids.reshape(B, Q // S, S)[:, :, :1])  # [B, nb, 1, H]
    cond = torch.cat([xb[:, :, :1].expand(-1, -1, n, -1).to(state.dtype), first.expand(-1, -1, n, -1).to(state.dtype),
                      state], -1)  # [B, nb, n, 3H]
    scale, shift = p.mlp(cond).chunk(2, -1)  # [B, nb, n, H] each
    slots = xb[:, :, 1:n + 1]  # [B, nb, n, H]: the mask slots the states land on
    on = valid.reshape(B, Q // S, S)[:, :, :n, None]  # [B, nb, n, 1]
    moved = torch.where(on, slots * (1 + scale) + shift, slots)
    return torch.cat([xb[:, :, :1], moved.to(x.dtype), xb[:, :, n + 1:]], 2).view(B, Q, H)
