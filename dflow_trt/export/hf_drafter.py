"""HF-style FP8 checkpoints of a drafter: our own layout, and z-lab's DFlash layout for flow-off drafters.

- `dflow` layout: `model.safetensors` with our tensor names in ModelOpt's FP8 format, `config.json`
  = our `DrafterConfig` plus a `dflow_config` record (taps, block size, mask token, target),
  `hf_quant_config.json`. `load_drafter_hf_fp8` reads it back as a plain (dequantized) drafter.
- `dflash` layout (flow off only): what z-lab's `DFlashDraftModel`, TensorRT-LLM's
  `DFlashDecodingConfig`, vLLM (`method: dflash`) and SGLang (`DFLASH`) load: a Qwen3-style HF
  config with `dflash_config` {target_layer_ids, mask_token_id, ...} and `block_size`, tensors named
  `fc`, `hidden_norm`, `layers.{i}.self_attn.*`, `layers.{i}.mlp.*`, `norm`. No embeddings or LM
  head (the target's are used). A reduced draft vocabulary is dropped there: the drafter then
  drafts over the full LM head (recorded in `dflow_config.draft_vocab_size`).
- `dflash+flow` layout (flow on): the TensorRT-LLM DFlow plug-in's folder. A DFlow drafter's DFlash
  part in the `dflash` layout, so TensorRT-LLM's loader reads it as any DFlash drafter, and its flow
  branch beside it in `dflow_flow.safetensors` (`backends/trtllm_dflow/relay_io.py`), full precision.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from ..atomic import atomic_dir
from ..backends.trtllm_dflow.relay_io import save_flow_branch
from ..drafter.config import DrafterConfig
from ..drafter.model import DFlowDrafter
from ..errors import UserError
from .fp8 import HF_QUANT_CONFIG, dequantize_state_dict, drafter_fp8_state_dict, write_json
from .trtllm import drafter_record

_ZLAB = [(r"^ctx_proj\.", "fc."), (r"^ctx_norm\.", "hidden_norm."),
         (r"^layers\.(\d+)\.(gate_proj|up_proj|down_proj)\.", r"layers.\1.mlp.\2.")]


def zlab_name(name: str) -> str:
    for pat, rep in _ZLAB:
        name = re.sub(pat, rep, name)
    return name


def zlab_unsupported(c) -> str | None:
    """Why a drafter config has no z-lab DFlash form (None: it has one)."""
    if c.flow:
        return "it is flow-conditioned (DFlow); that layout has no flow input"
    return None


def zlab_vocab_note(c) -> str | None:
    """A reduced draft vocabulary does not survive z-lab's layout, which drafts over the target's full
    LM head; proposals differ only where a token outside the reduced set would win (on smollm2's
    shipped drafter: none of 1,920 held-out positions)."""
    if c.draft_vocab_size is None:
        return None
    return (f"trained over a reduced vocabulary ({c.draft_vocab_size} tokens); in z-lab's layout it drafts over "
            f"the target's full LM head ({c.target.vocab_size})")


def dflash_config(drafter: DFlowDrafter, dtype: str = "float32") -> dict:
    c = drafter.config
    return {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "block_size": c.block_size,
            "dflash_config": {"mask_token_id": c.mask_token_id, "target_layer_ids": list(c.tap_layers),
                              "causal": False},
            "hidden_size": c.hidden_size, "num_hidden_layers": c.num_layers, "num_attention_heads": c.num_heads,
            "num_key_value_heads": c.num_kv_heads, "head_dim": c.head_dim, "intermediate_size": c.intermediate_size,
            "hidden_act": "silu", "rms_norm_eps": c.rms_norm_eps, "vocab_size": c.target.vocab_size,
            "rope_theta": c.rope_theta, "rope_scaling": None, "attention_bias": False, "attention_dropout": 0.0,
            "tie_word_embeddings": False, "torch_dtype": dtype, "num_target_layers": c.target.num_layers,
            "layer_types": ["full_attention"] * c.num_layers, "max_position_embeddings": 32768,
            "dflow_config": drafter_record(drafter)}


def export_drafter_hf(drafter: DFlowDrafter, out_dir: str | Path, layout: str = "dflow") -> Path:
    """FP8 (if `drafter` is ModelOpt-quantized) or full-precision HF checkpoint, written atomically."""
    if layout not in ("dflow", "dflash", "dflash+flow"):
        raise ValueError(layout)
    c = drafter.config
    why = zlab_unsupported(c) if layout == "dflash" else None
    if why:
        raise UserError(f"z-lab's DFlash layout cannot hold this drafter: {why}; the DFlow plug-in's folder "
                        f"(layout dflash+flow) can")
    if layout == "dflash+flow":
        if not c.flow:
            raise UserError("layout dflash+flow is a DFlow drafter's; this one has no flow branch: use layout dflash")
        c.check_exportable("the DFlow plug-in's drafter folder")
    quantized = any(hasattr(m, "weight_quantizer") for m in drafter.modules())
    if quantized:
        sd = drafter_fp8_state_dict(drafter)
    else:
        sd = {k: v.detach().float().contiguous() for k, v in drafter.state_dict().items()
              if k not in ("embed_weight", "lm_head_weight")}
    with atomic_dir(out_dir) as tmp:
        if layout != "dflow":  # the DFlash part: what TensorRT-LLM's loader has modules for
            sd = {zlab_name(k): v for k, v in sd.items()
                  if k != "draft_vocab" and k.split(".")[0] not in DFlowDrafter.FLOW_BRANCH}
            config = dflash_config(drafter)
            if layout == "dflash+flow":
                save_flow_branch(drafter, tmp)
        else:
            config = {**c.to_dict(), "architectures": ["DFlowDrafter"], "dflow_config": drafter_record(drafter)}
        if quantized:
            config["quantization_config"] = {"quant_method": "modelopt", "quant_algo": "FP8",
                                             "ignore": ["lm_head", "embed_tokens"]}
            write_json(tmp / "hf_quant_config.json", HF_QUANT_CONFIG)
        save_file(sd, tmp / "model.safetensors", metadata={"format": "pt"})
        write_json(tmp / "config.json", config)
    return Path(out_dir)


def load_drafter_hf_fp8(path: str | Path, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor) -> DFlowDrafter:
    """Read a `dflow`-layout checkpoint back into a (dequantized, unquantized-module) drafter."""
    path = Path(path)
    config = json.loads((path / "config.json").read_text())
    config = {k: v for k, v in config.items() if k in DrafterConfig.__dataclass_fields__}
    model = DFlowDrafter(DrafterConfig.from_dict(config), embed_weight, lm_head_weight)
    missing, unexpected = model.load_state_dict(dequantize_state_dict(load_file(path / "model.safetensors")), strict=False)
    if missing or unexpected:
        raise UserError(f"{path} does not match its config (missing {missing[:3]}, unexpected {unexpected[:3]})")
    return model
