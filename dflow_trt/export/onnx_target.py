"""ONNX export of a target that emits logits *and* its concatenated tap hidden states, with KV cache.

How it works. `TargetGraph` wraps the Hugging Face model in one forward pass over a block:

    inputs   input_ids      [B, S]      int64   tokens of the block (prompt at prefill)
             position_ids   [B, S]      int64   their absolute positions
             valid          [B, P+S]    bool    which cache slots (past and new) hold real tokens
             past.{i}.key   [B, Hkv, P, D] float32, one key and one value per layer
             past.{i}.value [B, Hkv, P, D]
    outputs  logits         [B, S, V]
             taps           [B, S, F]   outputs of the tap layers, concatenated (F = K * H)
             present.{i}.key / .value   [B, Hkv, P+S, D]  the cache with the block appended

So verifying a block runs the block through every layer against cached K/V: its cost grows with
S (and linearly with P only inside attention), never with a re-run of the whole sequence. The
4D mask (slot j visible to block query i iff valid[b, j] and j <= P + i) is built inside the graph
as an additive float mask, so rows with no visible slot (left padding) stay finite instead of
turning into NaNs that would poison the cache. P must be >= 1 (torch.export cannot keep a
dimension that is 0 in one call dynamic): the back end passes one masked dummy slot at prefill.
Batch, block length and past length are all dynamic; the example batch is 2 so batch is not
frozen to 1 (torch.export specializes a dimension whose example size is 1).
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn
from transformers import DynamicCache

from ..backends.onnx_io import TARGET_GRAPH as GRAPH
from ..backends.onnx_io import TARGET_KIND as KIND
from ..backends.onnx_io import TARGET_META as META
from ..backends.onnx_io import target_io_names as io_names
from ..targets.hf_target import HFTarget
from .onnx_graph import save_graph


def kv_geometry(model) -> tuple[int, int, int]:
    """(num_layers, num_kv_heads, head_dim) of a transformers causal LM."""
    c = model.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    return c.num_hidden_layers, c.num_key_value_heads, head_dim


class TargetGraph(nn.Module):
    """The exported computation: one block through the target against a past KV cache."""

    def __init__(self, model, tap_layers: tuple[int, ...]):
        super().__init__()
        self.model, self.tap_layers = model, tuple(tap_layers)
        self.num_layers = model.config.num_hidden_layers

    def forward(self, input_ids, position_ids, valid, *past):
        B, S = input_ids.shape
        P = past[0].shape[2]
        slot = torch.arange(P + S, device=input_ids.device)  # [P+S]
        query = P + torch.arange(S, device=input_ids.device)  # [S]
        allowed = valid[:, None, None, :] & (slot[None, :] <= query[:, None])[None, None]  # [B, 1, S, P+S]
        neg = torch.finfo(torch.float32).min
        mask = torch.where(allowed, torch.zeros((), dtype=torch.float32), torch.full((), neg))  # [B, 1, S, P+S]
        cache = DynamicCache(ddp_cache_data=[(past[2 * i], past[2 * i + 1]) for i in range(self.num_layers)])
        out = self.model(input_ids=input_ids, attention_mask=mask, position_ids=position_ids,
                         past_key_values=cache, use_cache=True, output_hidden_states=True)
        taps = torch.cat([out.hidden_states[i + 1] for i in self.tap_layers], dim=-1)  # [B, S, F]
        present = []
        for layer in out.past_key_values.layers:
            present += [layer.keys, layer.values]  # [B, Hkv, P+S, D] each
        return (out.logits.float(), taps.float(), *present)


def example_inputs(model, B: int = 2, S: int = 3, P: int = 4) -> tuple[torch.Tensor, ...]:
    """Small random inputs with distinct sizes, so no dimension is specialised at export."""
    n, hkv, d = kv_geometry(model)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (B, S), generator=g)
    pos = P + torch.arange(S)[None].expand(B, S)
    valid = torch.ones(B, P + S, dtype=torch.bool)
    valid[0, 0] = False
    past = [torch.randn(B, hkv, P, d, generator=g) for _ in range(2 * n)]
    return (ids, pos.contiguous(), valid, *past)


def export_target(target: HFTarget, out_dir: str | Path, opset: int = 18) -> Path:
    """Write `target.onnx` (+ external data) and `target_meta.json` into out_dir, atomically."""
    model = target.model.eval()
    n, hkv, d = kv_geometry(model)
    graph = TargetGraph(model, target.info.tap_layers).eval()
    inputs = example_inputs(model)
    in_names, out_names = io_names(n)
    # AUTO lets export derive the relations (valid has P+S slots); none of these sizes is frozen
    A = torch.export.Dim.AUTO
    dyn = ({0: A, 1: A}, {0: A, 1: A}, {0: A, 1: A}, tuple({0: A, 2: A} for _ in range(2 * n)))  # *past: one group
    meta = {"kind": KIND, "target": target.info.name, "fingerprint": target.info.fingerprint,
            "tap_layers": list(target.info.tap_layers), "num_layers": n, "num_kv_heads": hkv, "head_dim": d,
            "hidden_size": target.info.hidden_size, "vocab_size": target.info.vocab_size,
            "eos_token_ids": list(target.info.eos_token_ids), "max_context": target.info.max_context}
    return save_graph(graph, inputs, dyn, (in_names, out_names), out_dir, opset, (GRAPH, META), meta)
