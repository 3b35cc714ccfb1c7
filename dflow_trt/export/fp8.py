"""FP8 post-training quantization (PTQ) of target and drafter with NVIDIA ModelOpt.

How FP8 PTQ works. FP8 E4M3 stores a number in 8 bits: sign, 4 exponent bits, 3 mantissa bits.
It covers about ±448 with ~2 significant decimal digits, so a tensor is first divided by a scale
that maps its largest magnitude (`amax`) onto 448:  x_fp8 = round_e4m3(x / s),  s = amax / 448.
Every nn.Linear gets two such per-tensor scales:
- the weight scale, from the weight itself (known ahead of time);
- the input (activation) scale, *static*: ModelOpt inserts quantizers, runs calibration forward
  passes (`forward_loop`) over prompts from the training distribution, records the max |x| seen at
  each Linear's input (MaxCalibrator), and freezes s_in = amax / 448. Never calibrate on the
  evaluation sets: the scales would be tuned to the very text we then measure on.
On H100/H200 the GEMM then runs on FP8 tensor cores: y = (x_q @ W_q^T) * s_in * s_w, fp32 accumulate.
On CPU ModelOpt simulates it ("fake quant": quantize then dequantize in fp32) — numerically the same
rounding, which is what `fp8_check` measures. Embeddings, the LM head, norms and attention itself
stay in high precision (ModelOpt's FP8_DEFAULT_CFG skips `lm_head`; our drafter's head is a matmul
with the target's LM head, not a Linear, so it stays unquantized too).

Exports: the target as ModelOpt's HF FP8 checkpoint (`export_hf_checkpoint`: e4m3 `weight`, fp32
`weight_scale` / `input_scale`, `hf_quant_config.json`); the drafter, which is no HF model, in the
same tensor format written here (`drafter_fp8_state_dict`).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch
from torch import nn

from ..atomic import atomic_dir
from .. import kernels
from ..decoding.loop import generate
from ..decoding.options import DecodeOptions
from ..drafter.model import DFlowDrafter
from ..drafter.runtime import TorchDrafter
from ..targets.hf_target import HFTarget

E4M3_MAX = 448.0


def calibration_prompts(target: HFTarget, n: int = 32, seed: int = 1234, max_len: int = 256) -> list[list[int]]:
    """Token ids of n training-distribution prompts (eval sets excluded), chat-formatted when possible."""
    from ..training.prompts import build_prompts

    tok = target.tokenizer
    out = []
    for p in build_prompts(n, seed=seed):
        if tok is None:
            g = torch.Generator().manual_seed(len(out))
            out.append(torch.randint(0, target.info.vocab_size, (48,), generator=g).tolist())
        elif getattr(tok, "chat_template", None):
            out.append(tok.apply_chat_template([{"role": "user", "content": p["prompt"]}], add_generation_prompt=True,
                                               tokenize=True, return_dict=True)["input_ids"][:max_len])
        else:
            out.append(tok(p["prompt"], add_special_tokens=False)["input_ids"][:max_len])
    return out


def _quantize(module: nn.Module, forward_loop) -> nn.Module:
    import modelopt.torch.quantization as mtq

    kernels.unpack_linears(module)  # ModelOpt quantizes plain nn.Linear modules
    return mtq.quantize(module, copy.deepcopy(mtq.FP8_DEFAULT_CFG), forward_loop)


def quantize_target(target: HFTarget, calib_ids: list[list[int]], batch_size: int = 8) -> HFTarget:
    """A fake-quantized FP8 copy of the target (same interface; embeddings unchanged, so drafters fit)."""
    model = copy.deepcopy(target.model).eval()
    if not model.config.architectures:  # ModelOpt's export reads it
        model.config.architectures = [type(model).__name__]

    @torch.no_grad()
    def loop(m):
        for i in range(0, len(calib_ids), batch_size):
            rows = calib_ids[i:i + batch_size]
            T = max(len(r) for r in rows)
            ids = torch.zeros(len(rows), T, dtype=torch.long)
            mask = torch.zeros(len(rows), T, dtype=torch.long)
            for b, r in enumerate(rows):
                ids[b, T - len(r):], mask[b, T - len(r):] = torch.tensor(r), 1
            m(input_ids=ids.to(m.device), attention_mask=mask.to(m.device))

    _quantize(model, loop)
    q = HFTarget(model, target.info.name, target.info.tap_layers, target.tokenizer, target.info.eos_token_ids)
    assert q.info.fingerprint == target.info.fingerprint
    return q


def quantize_drafter(drafter: DFlowDrafter, target: HFTarget, calib_ids: list[list[int]],
                     max_new_tokens: int = 24, batch_size: int = 8) -> DFlowDrafter:
    """A fake-quantized FP8 copy of the drafter, calibrated on real drafting rounds against `target`
    (so activations include context features, flow states and block inputs as inference sees them)."""
    model = copy.deepcopy(drafter).eval()
    mode = "dflow" if model.config.flow else "dflash"

    def loop(m):
        for i in range(0, len(calib_ids), batch_size):
            generate(target, TorchDrafter(m), calib_ids[i:i + batch_size],
                     DecodeOptions(mode=mode, max_new_tokens=max_new_tokens, stop_token_ids=()))

    _quantize(model, loop)
    return model


# ---------------------------------------------------------------- checkpoints


def export_target_hf_fp8(qtarget: HFTarget, out_dir: str | Path) -> Path:
    """ModelOpt's HF FP8 checkpoint of a quantized target (+ tokenizer), written atomically."""
    from modelopt.torch.export import export_hf_checkpoint

    with atomic_dir(out_dir) as tmp:
        export_hf_checkpoint(copy.deepcopy(qtarget.model), export_dir=tmp)
        if qtarget.tokenizer is not None:
            qtarget.tokenizer.save_pretrained(tmp)
    return Path(out_dir)


def quantized_linears(model: nn.Module):
    """(name, module) of every Linear whose weight quantizer is on."""
    for name, m in model.named_modules():
        wq = getattr(m, "weight_quantizer", None)
        if isinstance(m, nn.Linear) and wq is not None and wq.is_enabled:
            yield name, m


def fp8_weight(module: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 weight [out, in], fp32 scale []) of a quantized Linear: W ≈ W_q * scale."""
    amax = module.weight_quantizer.amax.detach().float().reshape(())
    scale = amax / E4M3_MAX
    w = (module.weight.detach().float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return w, scale


def input_scale(module: nn.Module) -> torch.Tensor:
    return (module.input_quantizer.amax.detach().float().reshape(()) / E4M3_MAX)


def drafter_fp8_state_dict(qdrafter: DFlowDrafter) -> dict[str, torch.Tensor]:
    """The drafter's weights in ModelOpt's HF FP8 format: quantized Linears as e4m3 `weight` +
    `weight_scale` + `input_scale`; everything else (norms, flow vectors) fp32. No shared weights."""
    sd = {k: v.detach().float().contiguous() for k, v in qdrafter.state_dict().items()
          if "_quantizer" not in k and k not in ("embed_weight", "lm_head_weight")}
    for name, m in quantized_linears(qdrafter):
        w, s = fp8_weight(m)
        sd[f"{name}.weight"], sd[f"{name}.weight_scale"], sd[f"{name}.input_scale"] = w, s, input_scale(m)
    return sd


def dequantize_state_dict(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """FP8 `weight` * `weight_scale` -> fp32 `weight`; scales dropped."""
    out = {}
    for k, v in sd.items():
        if k.endswith((".weight_scale", ".input_scale")):
            continue
        if v.dtype == torch.float8_e4m3fn:
            v = v.float() * sd[k[: -len("weight")] + "weight_scale"].float()
        out[k] = v
    return out


HF_QUANT_CONFIG = {"producer": {"name": "dflow_trt"},
                   "quantization": {"quant_algo": "FP8", "kv_cache_quant_algo": None,
                                    "exclude_modules": ["lm_head", "embed_tokens"]}}


def write_json(path: Path, obj) -> None:
    path.write_text(json.dumps(obj, indent=2) + "\n")


def load_target_hf_fp8(path: str | Path):
    """Load an HF FP8 checkpoint back as a plain float32 model with dequantized weights (W_q * scale).

    (transformers' own loader would cast the e4m3 weights to float and drop the scales.)"""
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    path = Path(path)
    config = AutoConfig.from_pretrained(path)
    config.__dict__.pop("quantization_config", None)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    sd = {}
    for f in sorted(path.glob("*.safetensors")):
        sd.update(load_file(f))
    model.load_state_dict(dequantize_state_dict(sd), strict=False, assign=True)
    model.tie_weights()
    missing = [n for n, p in model.named_parameters() if p.is_meta]
    if missing:
        raise ValueError(f"{path} lacks {missing[:3]}")
    return model.float().eval()
