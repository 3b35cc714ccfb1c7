"""ONNX export of the block drafter, with its context KV cache.

How it works. One graph does what `TorchDrafter.draft` does in two steps (append the newly
committed context, then run the block):

    inputs   ctx_taps        [B, N, F]  float32  newly committed context features (first n_b valid)
             ctx_pos         [B, N]     int64    their absolute positions
             past.{i}.key    [B, Hkv, C, D]      the cached context K/V of layer i (C >= 1)
             past.{i}.value  [B, Hkv, C, D]
             block_ids       [B, S]     int64    [anchor, mask, ..., mask]
             block_pos       [B, S]     int64    absolute positions of the block
             attn_mask       [B, S, C+N+S] bool  visible keys: [past ; new context ; block]
           (flow drafters only)
             flow_taps [B, S, F], flow_token_ids [B, S], flow_hint_ids [B, S], flow_valid [B, S] bool
    outputs  logits          [B, S-1, Vd]        draft-vocabulary logits for block positions 1..S-1
             new.{i}.key / new.{i}.value [B, Hkv, N, D]  K/V of the new context, for the host's cache

Keys are [past ; new ; block] with holes masked out: attention does not care where a key sits
(rotary positions were applied before caching), so this equals the compact right-padded cache of
`TorchDrafter`; the host scatters `new.*` into that same compact cache afterwards. A flow drafter
always gets flow inputs: "no flow" is `flow_valid` all False, which the model maps to exactly the
same block inputs as `flow=None`. The target's embeddings and LM head are baked into the graph.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from ..backends.onnx_io import DRAFTER_GRAPH as GRAPH
from ..backends.onnx_io import DRAFTER_KIND as KIND
from ..backends.onnx_io import DRAFTER_META as META
from ..backends.onnx_io import drafter_io_names as io_names
from ..decoding.interfaces import FlowState
from ..drafter.model import DFlowDrafter
from .onnx_graph import save_graph


class DrafterGraph(nn.Module):
    """The exported computation: context append + one block pass of a `DFlowDrafter`."""

    def __init__(self, model: DFlowDrafter):
        super().__init__()
        self.model, self.flow = model, model.config.flow
        self.num_layers = model.config.num_layers

    def forward(self, ctx_taps, ctx_pos, block_ids, block_pos, attn_mask, *rest):
        m = self.model
        flow = None
        if self.flow:
            taps, tok, hint, valid = rest[:4]
            rest = rest[4:]
            flow = FlowState(taps=taps, token_ids=tok, hint_ids=hint, valid=valid)
        new_kv = m.context_kv(ctx_taps, ctx_pos)  # per layer ([B, Hkv, N, D], [B, Hkv, N, D])
        kv = [(torch.cat([rest[2 * i], k], 2), torch.cat([rest[2 * i + 1], v], 2))  # [B, Hkv, C+N, D]
              for i, (k, v) in enumerate(new_kv)]
        x = m.block_inputs(block_ids, flow)  # [B, S, H]
        logits = m.draft_logits(m.hidden(x, block_pos, kv, attn_mask)[:, 1:])  # [B, S-1, Vd]
        out = [logits]
        for k, v in new_kv:
            out += [k, v]
        return tuple(out)


def example_inputs(model: DFlowDrafter, B: int = 2, N: int = 3, C: int = 4, S: int = 5) -> tuple:
    c = model.config
    g = torch.Generator().manual_seed(0)
    F = c.feature_size
    ctx_taps = torch.randn(B, N, F, generator=g)
    ctx_pos = C + torch.arange(N)[None].expand(B, N).contiguous()
    block_ids = torch.randint(0, c.target.vocab_size, (B, S), generator=g)
    block_pos = (C + N + torch.arange(S))[None].expand(B, S).contiguous()
    mask = torch.ones(B, S, C + N + S, dtype=torch.bool)
    mask[0, :, 0] = False
    args = [ctx_taps, ctx_pos, block_ids, block_pos, mask]
    if c.flow:
        valid = torch.zeros(B, S, dtype=torch.bool)
        valid[:, : S // 2] = True
        args += [torch.randn(B, S, F, generator=g), block_ids.clone(), block_ids.flip(1).contiguous(), valid]
    past = tuple(torch.randn(B, c.num_kv_heads, C, c.head_dim, generator=g) for _ in range(2 * c.num_layers))
    return (*args, *past)


def export_drafter(model: DFlowDrafter, out_dir: str | Path, opset: int = 18) -> Path:
    """Write `drafter.onnx` (+ external data) and `drafter_meta.json` into out_dir, atomically."""
    c = model.config
    c.check_exportable("the ONNX drafter export")
    graph = DrafterGraph(model.eval()).eval()
    inputs = example_inputs(model)
    in_names, out_names = io_names(c.num_layers, c.flow)
    A = torch.export.Dim.AUTO  # every size dynamic; export derives the relations (mask has C+N+S keys)
    fixed = ({0: A, 1: A}, {0: A, 1: A}, {0: A, 1: A}, {0: A, 1: A}, {0: A, 1: A, 2: A})
    rest = [{0: A, 1: A}] * (4 if c.flow else 0) + [{0: A, 2: A}] * (2 * c.num_layers)
    dyn = (*fixed, tuple(rest))  # *rest (flow inputs, then past K/V) is one group
    meta = {"kind": KIND, "config": c.to_dict(),
            "draft_vocab": model.draft_vocab.tolist() if c.draft_vocab_size is not None else None}
    return save_graph(graph, inputs, dyn, (in_names, out_names), out_dir, opset, (GRAPH, META), meta)
