"""Training objectives: DFlash (one prediction per block) and self-conditioned DFlow.

Both train many blocks per sequence in one drafter pass. For a sequence of length T with the
target's tap states at every position, blocks at anchors L_i are laid side by side as queries
[nb * S]; a block-sparse mask lets block i see context positions < L_i and itself (both ways),
never another block. Output k of a block predicts the token at L_i + k (k >= 1), weighted
exp(-(k-1)/gamma).

Self-conditioned DFlow: (1) the drafter predicts each block without flow; (2) the
frozen target runs on [x_L, d_1..d_{S-1}] against the cached prefix K/V — every block in one
batched pass with a 4D mask (prefix < L_i, causal inside the block) — which gives the verifier's
states at the predicted positions and the accepted length a; (3) the next round's block starts at
L + a + 1 with those verifier states at the rejected slots as flow (`carry_flow`, the same
function inference uses); the loss covers both predictions. The paper's relay (`--relay paper`)
unrolls one more such round by default (`trainer.flow_rounds`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import DynamicCache

from ..decoding.flow import carry_flow
from ..decoding.interfaces import FlowState
from ..drafter.model import DFlowDrafter
from ..targets.hf_target import HFTarget
from .data import Sequence

IGNORE = -100


@dataclass
class Batch:
    ids: torch.Tensor  # [N, T] right-padded token ids
    lens: torch.Tensor  # [N] sequence lengths
    prompt_lens: torch.Tensor  # [N]
    seq_ids: list[int] | None = None  # dataset ids (keys of the state cache)


@dataclass
class BlockStats:
    loss: torch.Tensor
    accepted: torch.Tensor  # [num_valid_blocks] greedy accepted drafts per block (teacher-forced context)
    pred: torch.Tensor | None = None  # [N, nb, S-1] greedy draft-vocabulary indices


def collate(seqs: list[Sequence], max_len: int) -> Batch:
    """Right-padded batch of the sequences, cut at max_len."""
    T = min(max_len, max(len(s.ids) for s in seqs))
    ids = torch.zeros(len(seqs), T, dtype=torch.long)
    lens, plens = [], []
    for i, s in enumerate(seqs):
        x = s.ids[:T]
        ids[i, : len(x)] = torch.tensor(x)
        lens.append(len(x))
        plens.append(min(len(s.prompt_ids), len(x) - 1))
    return Batch(ids=ids, lens=torch.tensor(lens), prompt_lens=torch.tensor(plens), seq_ids=[s.id for s in seqs])


def sample_anchors(batch: Batch, num_anchors: int, block_size: int, gen: torch.Generator) -> torch.Tensor:
    """Anchors [N, nb] uniformly inside each response, leaving room for a full block where possible."""
    lo = batch.prompt_lens
    hi = torch.maximum(lo, batch.lens - block_size)  # inclusive
    u = torch.rand(batch.ids.shape[0], num_anchors, generator=gen, device=gen.device).to(lo.device)
    return lo[:, None] + (u * (hi - lo + 1)[:, None]).long().clamp(max=(hi - lo)[:, None])


def target_states(target: HFTarget, batch: Batch, keep_cache: bool, cache=None):
    """Tap states [N, T, F] of the data (and the K/V cache of every position if keep_cache).

    `cache` (a `StateCache` holding every sequence of the batch) replaces the target forward.
    """
    N, T = batch.ids.shape
    if cache is not None:
        return cache.batch(batch.seq_ids, T)
    mask = torch.arange(T)[None, :] < batch.lens[:, None]
    kv = DynamicCache(config=target.model.config) if keep_cache else None
    with torch.no_grad():
        out = target.model.model(input_ids=batch.ids, attention_mask=mask.long(), past_key_values=kv,
                                 use_cache=keep_cache, output_hidden_states=True)
    taps = torch.cat([out.hidden_states[i + 1] for i in target.info.tap_layers], -1)
    return taps, kv


def _labels(batch: Batch, anchors: torch.Tensor, S: int) -> torch.Tensor:
    """Tokens at L+1..L+S-1 for each block: [N, nb, S-1] (IGNORE past the sequence end)."""
    pos = anchors[..., None] + torch.arange(1, S)  # [N, nb, S-1]
    valid = pos < batch.lens[:, None, None]
    lab = batch.ids.gather(1, pos.clamp(max=batch.ids.shape[1] - 1).flatten(1)).view_as(pos)
    return lab.masked_fill(~valid, IGNORE)


@dataclass
class DrafterContext:
    """What every drafter pass of one step shares: the context K/V of the tap states and the
    draft-vocabulary head, computed once per step (DFlow's second round reuses them; the autograd
    graph is the same as computing them twice, the work is not)."""

    taps: torch.Tensor  # [N, T, F]
    kv: list  # per layer (k, v), each [N, Hkv, T, D]
    head: torch.Tensor  # [Vd, H]

    @property
    def shape(self):
        return self.taps.shape


def drafter_context(model: DFlowDrafter, taps: torch.Tensor) -> DrafterContext:
    N, T, _ = taps.shape
    return DrafterContext(taps, model.context_kv(taps, torch.arange(T).expand(N, T)), model.draft_head())


GROUP_ROWS = 128  # block rows per attention group (see drafter_blocks)


def attention_group(nb: int, S: int) -> int:
    """Blocks per attention group: the largest divisor of nb with at most GROUP_ROWS rows (>= 1)."""
    g = max(1, min(nb, GROUP_ROWS // S))
    while nb % g:
        g -= 1
    return g


def drafter_blocks(model: DFlowDrafter, taps: torch.Tensor | DrafterContext, batch: Batch, anchors: torch.Tensor,
                   flow: FlowState | None) -> torch.Tensor:
    """Logits [N, nb, S-1, Vd] for blocks at anchors [N, nb] (flow: FlowState over [N*nb, S] or None).

    `taps`: the tap states [N, T, F], or a `DrafterContext` of them shared by several passes.
    """
    ctx = taps if isinstance(taps, DrafterContext) else drafter_context(model, taps)
    N, T, _ = ctx.shape
    nb, S = anchors.shape[1], model.config.block_size
    block = torch.full((N, nb, S), model.config.mask_token_id, dtype=torch.long)
    block[..., 0] = batch.ids.gather(1, anchors.clamp(max=T - 1))
    pos = (anchors[..., None] + torch.arange(S)).flatten(1)  # [N, nb*S]
    if flow is not None:  # [N*nb, S] -> [N, nb*S], the blocks side by side
        flow = FlowState(taps=flow.taps.view(N, nb * S, -1), token_ids=flow.token_ids.view(N, -1),
                         hint_ids=flow.hint_ids.view(N, -1), valid=flow.valid.view(N, -1))
    x = model.block_inputs(block.flatten(1), flow, block=S)  # [N, nb*S, H]
    # Attention in groups of g blocks, each group a batch row of its own with the context K/V: a
    # block sees only the context and itself, so keys of other groups are masked out anyway, and
    # the scores shrink from nb*S x (T + nb*S) to nb*S x (T + g*S) per sequence.
    g = attention_group(nb, S)
    G, R = nb // g, g * S
    L = anchors.reshape(N * G, g).repeat_interleave(S, 1)  # [N*G, R]
    mask = torch.arange(T)[None, None, :] < L[..., None]  # [N*G, R, T]: strictly before the anchor
    blk = torch.arange(g).repeat_interleave(S)
    same = (blk[:, None] == blk[None, :]).expand(N * G, -1, -1)  # [N*G, R, R]
    kv = [tuple(t.repeat_interleave(G, 0) for t in layer) for layer in ctx.kv] if G > 1 else ctx.kv  # [N*G, Hkv, T, D]
    h = model.hidden(x.reshape(N * G, R, -1), pos.reshape(N * G, R), kv, torch.cat([mask, same], -1))
    h = h.view(N, nb, S, -1)
    # one 2-D multiply over the rows that predict: a strided 4-D input sends F.linear to a batched
    # matmul with the head copied per batch (4x slower on a CPU)
    h = h[:, :, 1:].reshape(N * nb * (S - 1), -1)  # [N*nb*(S-1), H]
    return F.linear(h, ctx.head).view(N, nb, S - 1, -1)  # [N, nb, S-1, Vd]


class _WeightedCE(torch.autograd.Function):
    """sum_i w_i * CE(logits_i, target_i) over rows [M, V] (target IGNORE: weight 0), fused: the
    forward keeps only the log-sum-exp [M] beside the logits, the backward writes the gradient in
    one [M, V] tensor (softmax minus one-hot, scaled), where log_softmax + nll_loss make four.
    Rows go in chunks so each chunk's temporaries stay in cache."""

    CHUNK = 256

    @staticmethod
    def forward(ctx, logits, target, w):
        lse = torch.cat([torch.logsumexp(c.float(), -1) for c in logits.split(_WeightedCE.CHUNK)])  # [M]
        t = target.clamp(min=0)
        picked = logits.gather(1, t[:, None])[:, 0].float()  # [M]
        ctx.save_for_backward(logits, t, w, lse)
        return ((lse - picked) * w).sum()

    @staticmethod
    def backward(ctx, g):
        logits, t, w, lse = ctx.saved_tensors
        scale = w * g  # [M]
        grad = torch.empty(logits.shape, dtype=torch.float32, device=logits.device)  # [M, V]
        for c, lg, ls, sc in zip(grad.split(_WeightedCE.CHUNK), logits.split(_WeightedCE.CHUNK),
                                 lse.split(_WeightedCE.CHUNK), scale.split(_WeightedCE.CHUNK)):
            torch.sub(lg, ls[:, None], out=c).exp_().mul_(sc[:, None])  # w * softmax, in place
        grad.scatter_add_(1, t[:, None], -scale[:, None])  # minus w at the label
        return grad.to(logits.dtype), None, None


def block_loss(model: DFlowDrafter, logits: torch.Tensor, labels: torch.Tensor, gamma: float,
               to_draft: torch.Tensor) -> BlockStats:
    """Position-weighted cross-entropy; labels outside the draft vocabulary count as misses.
    `pred` [N, nb, S-1]: the drafter's greedy draft-vocabulary indices (its proposals)."""
    S1 = labels.shape[-1]
    lab_d = to_draft[labels.clamp(min=0)].masked_fill(labels == IGNORE, IGNORE)  # [N, nb, S-1] draft ids or IGNORE
    w = torch.exp(-torch.arange(S1, dtype=torch.float32) / gamma)  # position k=1.. -> exp(-(k-1)/gamma)
    wmask = (lab_d != IGNORE).float() * w  # [N, nb, S-1]
    loss = _WeightedCE.apply(logits.flatten(0, -2), lab_d.flatten(), wmask.flatten()) / wmask.sum().clamp(min=1)
    with torch.no_grad():
        pred = logits.argmax(-1)
        hit = (model.draft_vocab[pred] == labels).long()
        valid = labels[..., 0] != IGNORE
        accepted = hit.cumprod(-1).sum(-1)[valid]
    return BlockStats(loss=loss, accepted=accepted, pred=pred)


def block_loss_reference(model: DFlowDrafter, logits: torch.Tensor, labels: torch.Tensor, gamma: float,
                         to_draft: torch.Tensor) -> BlockStats:
    """`block_loss` written with torch's own cross-entropy: what the fused loss is tested against."""
    S1 = labels.shape[-1]
    lab_d = to_draft[labels.clamp(min=0)].masked_fill(labels == IGNORE, IGNORE)
    w = torch.exp(-torch.arange(S1, dtype=torch.float32) / gamma)
    ce = F.cross_entropy(logits.flatten(0, -2).float(), lab_d.flatten(), ignore_index=IGNORE,
                         reduction="none").view_as(lab_d)
    wmask = (lab_d != IGNORE).float() * w
    loss = (ce * wmask).sum() / wmask.sum().clamp(min=1)
    with torch.no_grad():
        pred = logits.argmax(-1)
        accepted = (model.draft_vocab[pred] == labels).long().cumprod(-1).sum(-1)[labels[..., 0] != IGNORE]
    return BlockStats(loss=loss, accepted=accepted, pred=pred)


def verifier_flow(target: HFTarget, kv: DynamicCache, batch: Batch, anchors: torch.Tensor,
                  drafts: torch.Tensor, labels: torch.Tensor) -> tuple[FlowState, torch.Tensor]:
    """Verify [x_L, d_1..d_{S-1}] with the target for every block at once.

    Returns the flow the next round sees (over [N*nb, S]) and the accepted count a [N, nb].
    Only the rows the flow reads run: slots a+1..S-1 (the rejected draft and what follows). Slots
    0..a hold the data's own tokens (the anchor and the accepted drafts), whose K/V the prefix
    cache `kv` already holds, teacher-forced, at positions L..L+a: the run rows attend to those,
    so nothing the cached states hold is computed again, and the LM head runs on run rows only.
    """
    N, T = batch.ids.shape
    nb, S = anchors.shape[1], drafts.shape[-1] + 1
    block = torch.cat([batch.ids.gather(1, anchors.clamp(max=T - 1))[..., None], drafts], -1)  # [N, nb, S]
    accepted = (drafts == labels).long().cumprod(-1).sum(-1)  # [N, nb]
    run = (torch.arange(S) > accepted[..., None]).flatten(1)  # [N, nb*S] rows to verify
    count = run.sum(1)  # [N]
    R = int(count.max())
    taps = torch.zeros(N, nb * S, _tap_width(target), dtype=target.model.dtype)  # [N, nb*S, F]; rows 0..a stay 0: unread
    target_ids = torch.zeros(N, nb * S, dtype=torch.long)
    if R:
        idx = torch.sort((~run).to(torch.int8), dim=1, stable=True).indices[:, :R]  # [N, R] run rows first, in order
        pad = torch.arange(R) >= count[:, None]  # [N, R] rows beyond this sequence's count
        b, j = idx // S, idx % S  # block and slot of each row
        L, a = anchors.gather(1, b), accepted.gather(1, b)  # [N, R]
        t = torch.arange(T)[None, None, :]
        ctx = t < (L + a + 1)[..., None]  # [N, R, T]: the prefix through the accepted slots (data, cached)
        own = (b[:, :, None] == b[:, None, :]) & (j[:, None, :] <= j[:, :, None]) & ~pad[:, None, :]  # [N, R, R]
        mask = torch.cat([ctx, own], -1)[:, None]  # [N, 1, R, T+R]
        with torch.no_grad():
            out = target.model.model(input_ids=block.flatten(1).gather(1, idx), attention_mask=mask,
                                     position_ids=L + j, past_key_values=kv, use_cache=True, output_hidden_states=True)
            kv.crop(-R)  # the prefix cache serves the next step's blocks unchanged
            keep = (~pad)[..., None]
            tap_r = torch.cat([out.hidden_states[i + 1] for i in target.info.tap_layers], -1) * keep  # [N, R, F]
            ids_r = target.model.lm_head(out.last_hidden_state).argmax(-1) * keep[..., 0]  # [N, R]
        taps = taps.to(tap_r.dtype).scatter(1, idx[..., None].expand(-1, -1, tap_r.shape[-1]), tap_r)
        target_ids = target_ids.scatter(1, idx, ids_r)
    flow = carry_flow(block.view(N * nb, S), taps.view(N * nb, S, -1), target_ids.view(N * nb, S), accepted.flatten())
    return flow, accepted


def _tap_width(target: HFTarget) -> int:
    return len(target.info.tap_layers) * target.model.config.hidden_size
