"""TensorRT-LLM artefacts: checkpoints (with tensor-parallel shards), the LLM-API config, the engine build.

A TensorRT-LLM checkpoint is a folder with `config.json` (architecture, dtype, `mapping`
{world_size, tp_size, pp_size}, `quantization` {quant_algo}) and one `rank{r}.safetensors` per
rank. Tensor parallelism splits each Linear across ranks: column-parallel layers (q/k/v, the MLP's
up/gate, embedding and LM head) by output rows (dim 0), row-parallel layers (attention output,
MLP down) by input columns (dim 1); norms and per-tensor FP8 scales are replicated. A fused qkv
is split per part: rank r holds [q_r; k_r; v_r].

- target: ModelOpt's `export_tensorrt_llm_checkpoint` (names `transformer.layers.{i}.attention.qkv`
  etc., FP8 `weights_scaling_factor` / `activation_scaling_factor`), sharded by ModelOpt;
- drafter: TensorRT-LLM has no DFlow architecture, so its checkpoint is written here in the same
  layout (architecture `DFlowDrafterForCausalLM`, our tensor names, same sharding rules) and
  records taps, block size, mask token and the target it belongs to;
- flow-off drafters are served natively by TensorRT-LLM's PyTorch back end from z-lab's DFlash HF
  layout (written by `hf_drafter.py`); `llm_api_config` writes the LLM-API options for that;
- `build_engines` runs `trtllm-build` where `tensorrt_llm` and a GPU exist, else raises
  `EngineBuildUnavailable` naming the command to run on a GPU host.
"""

from __future__ import annotations

import copy
import json
import shlex
import subprocess
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from ..atomic import atomic_dir
from ..backends.tensorrt_llm import engine_build_available
from ..backends.trtllm_dflow import PLUGIN_MODULE
from ..drafter.model import DFlowDrafter
from ..errors import UserError
from ..targets.hf_target import HFTarget
from .fp8 import drafter_fp8_state_dict

TRTLLM_DTYPE = torch.float16

# ---------------------------------------------------------------- target


def decoder_type(model) -> str:
    from modelopt.torch.export.model_utils import get_model_type

    t = get_model_type(model)
    if t is None:
        raise UserError(f"ModelOpt cannot export {type(model).__name__} to TensorRT-LLM; use a Llama or Qwen target")
    return t


def export_target_checkpoint(qtarget: HFTarget, out_dir: str | Path, tp_size: int = 1) -> Path:
    """TensorRT-LLM checkpoint of the FP8 target, split into tp_size ranks, written atomically."""
    from modelopt.torch.export import export_tensorrt_llm_checkpoint

    if tp_size < 1:
        raise UserError(f"--tp-size must be >= 1, got {tp_size}")
    c = qtarget.model.config
    for what, n in (("attention heads", c.num_attention_heads), ("KV heads", c.num_key_value_heads)):
        if n % tp_size:
            raise UserError(f"--tp-size {tp_size} does not divide the target's {n} {what}; pick a divisor of {n}")
    with atomic_dir(out_dir) as tmp:
        model = copy.deepcopy(qtarget.model)
        export_tensorrt_llm_checkpoint(model, decoder_type(model), TRTLLM_DTYPE, export_dir=tmp,
                                       inference_tensor_parallel=tp_size)
    return Path(out_dir)


CONFIG_KEYS = ("architecture", "dtype", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
               "hidden_size", "intermediate_size", "vocab_size", "max_position_embeddings", "hidden_act",
               "norm_epsilon", "position_embedding_type", "mapping", "quantization")


def expected_target_names(config: dict) -> set[str]:
    """Tensor names TensorRT-LLM's LLaMA/Qwen checkpoint loader reads (`tensorrt_llm.models.llama`,
    `.qwen`), FP8 per-tensor scales included."""
    linears = ["attention.qkv", "attention.dense", "mlp.fc", "mlp.gate", "mlp.proj"]
    quant = config.get("quantization", {}).get("quant_algo") == "FP8"
    names = {"transformer.vocab_embedding.weight", "transformer.ln_f.weight", "lm_head.weight"}
    for i in range(config["num_hidden_layers"]):
        p = f"transformer.layers.{i}."
        names |= {p + "input_layernorm.weight", p + "post_layernorm.weight"}
        if config["architecture"].startswith("Qwen3"):
            names |= {p + "attention.q_layernorm.weight", p + "attention.k_layernorm.weight"}
        for lin in linears:
            names.add(p + lin + ".weight")
            if quant:
                names |= {p + lin + ".weights_scaling_factor", p + lin + ".activation_scaling_factor"}
    return names


def read_checkpoint(path: str | Path) -> tuple[dict, list[dict[str, torch.Tensor]]]:
    """(config, [rank state dicts]) of a TensorRT-LLM checkpoint folder."""
    path = Path(path)
    if not (path / "config.json").is_file():
        raise UserError(f"{path} is not a TensorRT-LLM checkpoint (no config.json); run scripts/build_engines.py")
    config = json.loads((path / "config.json").read_text())
    tp = config["mapping"]["tp_size"]
    return config, [load_file(path / f"rank{r}.safetensors") for r in range(tp)]


def _cat_bits(parts: list[torch.Tensor], dim: int) -> torch.Tensor:
    """Concatenate exactly (fp8 tensors as raw bytes)."""
    if parts[0].dtype == torch.float8_e4m3fn:
        return torch.cat([p.view(torch.uint8) for p in parts], dim).view(torch.float8_e4m3fn)
    return torch.cat(parts, dim)


def _replicated(parts: list[torch.Tensor], name: str) -> torch.Tensor:
    for p in parts[1:]:
        assert torch.equal(p.view(torch.uint8) if p.dtype == torch.float8_e4m3fn else p,
                           parts[0].view(torch.uint8) if p.dtype == torch.float8_e4m3fn else parts[0]), name
    return parts[0]


def merge_target_shards(config: dict, ranks: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Reassemble the full (tp 1) tensors from a target checkpoint's rank shards."""
    tp = len(ranks)
    hd = config.get("head_size") or config["hidden_size"] // config["num_attention_heads"]
    nq, nkv = config["num_attention_heads"] // tp * hd, config["num_key_value_heads"] // tp * hd
    full = {}
    for name in ranks[0]:
        parts = [r[name] for r in ranks]
        if tp == 1 or parts[0].dim() < 2:
            full[name] = _replicated(parts, name)
        elif name.endswith("attention.qkv.weight"):
            q, k, v = zip(*[(p[:nq], p[nq:nq + nkv], p[nq + nkv:]) for p in parts])
            full[name] = _cat_bits([_cat_bits(list(q), 0), _cat_bits(list(k), 0), _cat_bits(list(v), 0)], 0)
        elif name.endswith(("attention.dense.weight", "mlp.proj.weight")):
            full[name] = _cat_bits(parts, 1)
        elif name.endswith(("vocab_embedding.weight", "lm_head.weight", "mlp.fc.weight", "mlp.gate.weight")):
            full[name] = _cat_bits(parts, 0)
        else:
            full[name] = _replicated(parts, name)
    return full


# ---------------------------------------------------------------- drafter

COLUMN = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "gate_proj.weight", "up_proj.weight")
ROW = ("o_proj.weight", "down_proj.weight")


def shard_drafter(sd: dict[str, torch.Tensor], tp: int, rank: int) -> dict[str, torch.Tensor]:
    """Rank `rank`'s part of a drafter state dict: column-parallel by rows, row-parallel by columns."""
    out = {}
    for name, t in sd.items():
        if name.endswith(COLUMN):
            t = t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t
            part = t.chunk(tp, 0)[rank]
        elif name.endswith(ROW):
            t = t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t
            part = t.chunk(tp, 1)[rank]
        else:
            out[name] = t.clone()
            continue
        part = part.contiguous()
        out[name] = part.view(torch.float8_e4m3fn) if sd[name].dtype == torch.float8_e4m3fn else part
    return out


def merge_drafter_shards(ranks: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    full = {}
    for name in ranks[0]:
        parts = [r[name] for r in ranks]
        if name.endswith(COLUMN):
            full[name] = _cat_bits(parts, 0)
        elif name.endswith(ROW):
            full[name] = _cat_bits(parts, 1)
        else:
            full[name] = _replicated(parts, name)
    return full


def drafter_record(drafter: DFlowDrafter) -> dict:
    """What any exported drafter records: taps, block size, mask token, the target it belongs to."""
    c = drafter.config
    return {"tap_layers": list(c.tap_layers), "block_size": c.block_size, "mask_token_id": c.mask_token_id,
            "flow": c.flow, "target": {"name": c.target.name, "fingerprint": c.target.fingerprint,
                                       "num_layers": c.target.num_layers, "hidden_size": c.target.hidden_size,
                                       "vocab_size": c.target.vocab_size},
            "draft_vocab_size": c.draft_vocab_size}


def export_drafter_checkpoint(qdrafter: DFlowDrafter, out_dir: str | Path, tp_size: int = 1) -> Path:
    """TensorRT-LLM-layout checkpoint of the FP8 drafter, split into tp_size ranks, written atomically."""
    c = qdrafter.config
    for what, n in (("heads", c.num_heads), ("KV heads", c.num_kv_heads), ("MLP width", c.intermediate_size)):
        if n % tp_size:
            raise UserError(f"--tp-size {tp_size} does not divide the drafter's {n} {what}")
    sd = drafter_fp8_state_dict(qdrafter)
    if "draft_vocab" in sd:
        sd["draft_vocab"] = qdrafter.draft_vocab.detach().clone()
    config = {"producer": {"name": "dflow_trt"}, "architecture": "DFlowDrafterForCausalLM", "dtype": "float32",
              "num_hidden_layers": c.num_layers, "num_attention_heads": c.num_heads,
              "num_key_value_heads": c.num_kv_heads, "head_size": c.head_dim, "hidden_size": c.hidden_size,
              "intermediate_size": c.intermediate_size, "vocab_size": c.target.vocab_size,
              "norm_epsilon": c.rms_norm_eps, "rotary_base": c.rope_theta, "hidden_act": "silu",
              "position_embedding_type": "rope_gpt_neox",
              "mapping": {"world_size": tp_size, "tp_size": tp_size, "pp_size": 1},
              "quantization": {"quant_algo": "FP8", "kv_cache_quant_algo": None, "exclude_modules": ["lm_head"]},
              "dflow": drafter_record(qdrafter), "drafter_config": c.to_dict()}
    with atomic_dir(out_dir) as tmp:
        for r in range(tp_size):
            save_file(shard_drafter(sd, tp_size, r), tmp / f"rank{r}.safetensors")
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return Path(out_dir)


# ---------------------------------------------------------------- LLM API config and engines


# the fields of tensorrt_llm.llmapi.DFlashDecodingConfig that we set
DFLASH_SPEC_FIELDS = ("decoding_type", "max_draft_len", "speculative_model", "mask_token_id", "target_layer_ids")


def llm_api_config(target_hf_dir: str, dflash_dir: str | None, block_size: int, tap_layers: list[int],
                   tp_size: int = 1, mask_token_id: int | None = None, dflow: bool = False) -> dict:
    """TensorRT-LLM LLM-API options (PyTorch back end, FP8 target, DFlash drafting with our taps).

    Feed to `trtllm-serve <model> --backend pytorch --extra_llm_api_options llm_api.yaml` or
    `LLM(model=..., speculative_config=DFlashDecodingConfig(**options["speculative_config"]))`.
    Without a z-lab-layout drafter (`dflash_dir` None) the target is served without drafting. `dflow`:
    DFlash mode with DFlow's relay, through the plug-in (`backends/trtllm_dflow`); `dflow_plugin` is
    our key, read by `backends.tensorrt_llm.load_llm`, not an `LLM(...)` argument."""
    opts = {"model": target_hf_dir, "backend": "pytorch", "tensor_parallel_size": tp_size,
            "disable_overlap_scheduler": True, "kv_cache_config": {"enable_block_reuse": False}}
    if dflash_dir is not None:
        spec = {"decoding_type": "DFlash", "max_draft_len": block_size - 1, "speculative_model": dflash_dir,
                "mask_token_id": mask_token_id, "target_layer_ids": list(tap_layers)}
        opts["speculative_config"] = {k: v for k, v in spec.items() if v is not None}
        if dflow:  # our loader imports the plug-in before building the LLM (the folder needs its flow file)
            opts["dflow_plugin"] = PLUGIN_MODULE
    return opts


def to_yaml(obj, indent: int = 0) -> str:
    """Minimal YAML for nested dicts of scalars and lists (no PyYAML dependency)."""
    pad, lines = "  " * indent, []
    for k, v in obj.items():
        if isinstance(v, dict):
            lines.append(f"{pad}{k}:")
            lines.append(to_yaml(v, indent + 1))
        else:
            lines.append(f"{pad}{k}: {json.dumps(v)}")
    return "\n".join(lines)


class EngineBuildUnavailable(RuntimeError):
    """tensorrt_llm or a GPU is missing; the message names what to run on a GPU host."""


def engine_build_commands(ckpt_dir: Path, engine_dir: Path, block_size: int, tp_size: int,
                          max_batch_size: int = 8, max_seq_len: int = 4096) -> list[list[str]]:
    """trtllm-build for the target with speculative-verify settings: draft tokens fed in from outside
    (max draft length = block - 1), and the logits of every context and verified position gathered
    (`--gather_*_logits`). The engine returns no tap hidden states: those flags gather logits only."""
    return [["trtllm-build", "--checkpoint_dir", str(ckpt_dir), "--output_dir", str(engine_dir),
             "--gemm_plugin", "auto", "--use_paged_context_fmha", "enable",
             "--speculative_decoding_mode", "draft_tokens_external", "--max_draft_len", str(block_size - 1),
             "--gather_generation_logits", "--gather_context_logits",
             "--max_batch_size", str(max_batch_size), "--max_seq_len", str(max_seq_len),
             "--workers", str(tp_size)]]


def build_engines(commands: list[list[str]]) -> None:
    ok, why = engine_build_available()
    if not ok:
        cmd = "\n  ".join(shlex.join(c) for c in commands)
        raise EngineBuildUnavailable(
            f"TensorRT-LLM engines not built: {why}. On a GPU host with TensorRT-LLM installed run:\n  {cmd}")
    for c in commands:
        subprocess.run(c, check=True)
