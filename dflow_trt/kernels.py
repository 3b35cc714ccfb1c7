"""PyTorch on the CPU: linear layers with weights pre-packed for oneDNN.

A verify pass multiplies a handful of rows (1 + drafts) by every weight matrix. PyTorch's default
CPU path (MKL GEMM) re-packs the whole weight on every call with more than one row, so verifying
2 tokens cost 1.7x an `ar` step on the 2-core CI machine although the weights are read once either
way. oneDNN with the weight packed once (what Inductor's weight freezing does) costs about the
same for 1 or 2 rows, and its result for a row does not depend on how many rows share the call.

`pack_linears(module)` switches every fp32 CPU `nn.Linear` in a module to `PackedLinear` in place:
same parameters (tied weights stay tied), same state dict. A packed copy is made on first use
and remade when the weight changes (another tensor, or an in-place update, which bumps the tensor
version; a write through `.data` does not, so call `unpack_linears` before editing weights that
way). Autograd, tracing, export, inference-mode weights and other devices or dtypes take the plain
`F.linear` path.

`grouped_attention(model)` does the same for attention: transformers' SDPA path copies each
layer's grouped K/V once per query head group whenever a mask is present, which is every verify
of more than one token and never an `ar` step; this path hands the groups to SDPA as they are.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

GROUPED_SDPA = "dflow_trt_grouped_sdpa"


def available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def pack(weight: torch.Tensor) -> torch.Tensor | None:
    """The oneDNN-packed copy of a [out, in] fp32 CPU weight, or None where it cannot be used."""
    if not available() or weight.device.type != "cpu" or weight.dtype != torch.float32:
        return None
    with torch.inference_mode(False), torch.no_grad():  # a normal tensor, usable in and out of inference mode
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous())


def _tracing() -> bool:
    return torch.jit.is_tracing() or torch.compiler.is_compiling() or torch.compiler.is_exporting()


def _plain_path(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (x.device.type != "cpu" or x.dtype != weight.dtype
            or (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)) or _tracing())


def _version(t: torch.Tensor) -> int:
    return -1 if t.is_inference() else t._version  # inference tensors keep no version counter


def cache_key(*tensors: torch.Tensor) -> tuple:
    """What a cache derived from `tensors` records: the tensors themselves (kept alive, so their
    identity cannot be reused) and their versions."""
    return tuple((t, _version(t)) for t in tensors)


def still_valid(key: tuple | None, *tensors: torch.Tensor) -> bool:
    """Whether a cache made under `key` still derives from exactly these, unmodified tensors."""
    return key is not None and len(key) == len(tensors) and all(
        t is k and _version(t) == v for t, (k, v) in zip(tensors, key))


def _packed_linear(x: torch.Tensor, packed: torch.Tensor | None, weight: torch.Tensor,
                   bias: torch.Tensor | None) -> torch.Tensor:
    """The multiply itself, once the caller has ruled out the plain path."""
    if packed is None:
        return F.linear(x, weight, bias)
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")  # [..., out]


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           packed: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)`, through `packed` (from `pack(weight)`) where that is safe."""
    if _plain_path(x, weight):
        return F.linear(x, weight, bias)
    return _packed_linear(x, packed, weight, bias)


class PackedLinear(nn.Linear):
    """`nn.Linear` that multiplies through a cached oneDNN-packed weight (see the module doc)."""

    _packed: tuple[tuple, torch.Tensor | None] | None = None  # (cache_key(weight), packed weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # an inference-mode weight has no version counter to tell when it changed: never cached
        if _plain_path(x, self.weight) or self.weight.is_inference():
            return F.linear(x, self.weight, self.bias)
        if self._packed is None or not still_valid(self._packed[0], self.weight):
            self._packed = (cache_key(self.weight), pack(self.weight))
        return _packed_linear(x, self._packed[1], self.weight, self.bias)  # checked once per call, above

    def __getstate__(self):  # copies and pickles: the packed weight is an opaque cache, remade on use
        state = super().__getstate__()
        state.pop("_packed", None)
        return state


def pack_linears(module: nn.Module) -> int:
    """Make every fp32 CPU `nn.Linear` in `module` a `PackedLinear` (in place); returns how many."""
    if not available():
        return 0
    n = 0
    for m in module.modules():
        if type(m) is nn.Linear and m.weight.device.type == "cpu" and m.weight.dtype == torch.float32:
            m.__class__ = PackedLinear
            n += 1
    return n


def unpack_linears(module: nn.Module) -> int:
    """Undo `pack_linears` (before export or quantization, which expect plain `nn.Linear`)."""
    n = 0
    for m in module.modules():
        if type(m) is PackedLinear:
            m.__class__ = nn.Linear
            m.__dict__.pop("_packed", None)
            n += 1
    return n


def _grouped_sdpa(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs):
    """transformers' attention-function signature: query [B, H, Q, D], key/value [B, Hkv, K, D]."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if (attention_mask is None or attention_mask.dtype != torch.bool or query.device.type != "cpu"
            or _tracing()):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, is_causal=is_causal, **kwargs)
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, dropout_p=dropout,
                                         scale=scaling, enable_gqa=key.shape[1] != query.shape[1])
    return out.transpose(1, 2).contiguous(), None  # [B, Q, H, D]


def grouped_attention(model) -> bool:
    """Switch a transformers model on SDPA attention to `_grouped_sdpa` (same masks, same numbers)."""
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import sdpa_mask

    if getattr(model.config, "_attn_implementation", None) != "sdpa":
        return False
    AttentionInterface.register(GROUPED_SDPA, _grouped_sdpa)
    AttentionMaskInterface.register(GROUPED_SDPA, sdpa_mask)
    model.set_attn_implementation(GROUPED_SDPA)
    return True
