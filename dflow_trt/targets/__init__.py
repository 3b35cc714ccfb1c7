"""Named targets and local checkpoints, loaded as `HFTarget`s.

- `smollm2-135m`: the embedded real default (see `smollm2.py`).
- `tiny-qwen3`, `tiny-llama`: seeded random-init models for tests.
- any local Hugging Face checkpoint folder, by path.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import UserError
from .hf_target import HFTarget, default_tap_layers

SHIPPED_DRAFTERS = Path(__file__).resolve().parent.parent / "drafters"


@dataclass(frozen=True)
class TargetPreset:
    mask_token_id: int | None  # a reserved id the drafter uses for masked block positions
    default_drafters: dict[str, str]  # mode -> drafter folder name under dflow_trt/drafters/


PRESETS = {
    "smollm2-135m": TargetPreset(mask_token_id=16,  # <empty_output>, unused in chat
                                 default_drafters={"dflash": "smollm2-135m-dflash", "dflow": "smollm2-135m-dflow"}),
    "tiny-qwen3": TargetPreset(mask_token_id=257, default_drafters={}),  # <|mask|>
    "tiny-llama": TargetPreset(mask_token_id=257, default_drafters={}),
}
TARGET_NAMES = tuple(PRESETS)


def _eos_ids(model, tokenizer) -> tuple[int, ...]:
    ids: list[int] = []
    for src in (getattr(model, "generation_config", None), model.config):
        e = getattr(src, "eos_token_id", None) if src is not None else None
        ids += list(e) if isinstance(e, (list, tuple)) else ([e] if e is not None else [])
    return tuple(dict.fromkeys(ids))


def _read(load, what: str, fix: str):
    """`load()`, with any failure to read the files (bad config.json, truncated or mismatched weights,
    a tokenizer_config.json without its tokenizer.json) as one user error naming `what` and `fix`."""
    try:
        return load()
    except Exception as e:  # noqa: BLE001 - whatever transformers raises, the files are the problem
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise UserError(f"cannot load the {what} ({first}); {fix}") from None


def _from_folder(path: Path, fix: str):
    """(model, tokenizer or None) of a Hugging Face checkpoint folder; `fix` says how to repair its model."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    def load_model():
        # safetensors only, no remote code: a checkpoint folder never runs code (a pickled .bin could)
        model, info = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, output_loading_info=True,
                                                           use_safetensors=True, trust_remote_code=False)
        if info["missing_keys"]:  # transformers would fill them with random values
            raise ValueError(f"the weights lack {sorted(info['missing_keys'])[:3]}")
        return model

    model = _read(load_model, f"model in {path}", fix)
    if not any((path / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
        return model, None
    return model, _read(lambda: AutoTokenizer.from_pretrained(path), f"tokenizer in {path}",
                        f"put the model's own tokenizer.json and tokenizer_config.json in {path}")


def load_target(spec: str, tap_layers: tuple[int, ...] | None = None, num_taps: int = 1,
                cache_dir: Path | None = None, seed: int = 0, device: str = "cpu") -> HFTarget:
    """Load a target by name or path, tapping `tap_layers` (default: DFlash's spread of num_taps)."""
    if spec == "smollm2-135m":
        from .smollm2 import ensure_checkpoint

        path = ensure_checkpoint(cache_dir)
        model, tokenizer = _from_folder(path, f"delete {path} to convert the embedded model again")
    elif spec in ("tiny-qwen3", "tiny-llama"):
        from .tiny import build_tiny

        model, tokenizer = build_tiny(spec.split("-", 1)[1], seed=seed)
    elif Path(spec).is_dir():
        if not (Path(spec) / "config.json").is_file():
            raise UserError(f"{spec} has no config.json; point --target at a Hugging Face checkpoint folder")
        model, tokenizer = _from_folder(Path(spec), "restore the checkpoint's config.json and weights")
    else:
        raise UserError(f"unknown target {spec!r}; use one of {', '.join(TARGET_NAMES)} or a checkpoint folder")
    if tokenizer is not None and len(tokenizer) > model.config.vocab_size:
        raise UserError(f"the tokenizer of {spec} has {len(tokenizer)} tokens but the model's vocabulary has "
                        f"{model.config.vocab_size}: they belong to different models; put the model's own "
                        f"tokenizer files next to its config.json")
    model = model.to(device)
    n = model.config.num_hidden_layers
    taps = tuple(tap_layers) if tap_layers is not None else default_tap_layers(n, num_taps)
    return HFTarget(model, name=spec, tap_layers=taps, tokenizer=tokenizer, eos_token_ids=_eos_ids(model, tokenizer))


def check_device(device: str) -> str:
    """`device` (cpu or cuda) when this machine has it; cuda without a GPU is one user error, never a traceback."""
    if device == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda but torch sees no CUDA GPU here; run on a GPU host or pass --device cpu")
    return device


def preset(name: str) -> TargetPreset | None:
    return PRESETS.get(name)


def load_tokenizer(target_spec: str):
    """The target's tokenizer alone (for BLS orchestration, where the weights live elsewhere)."""
    from transformers import AutoTokenizer

    if target_spec == "smollm2-135m":
        from .smollm2 import ensure_checkpoint

        return AutoTokenizer.from_pretrained(ensure_checkpoint(None))
    if target_spec in ("tiny-qwen3", "tiny-llama"):
        from .tiny import byte_tokenizer

        return byte_tokenizer()
    if Path(target_spec, "tokenizer_config.json").is_file():
        return AutoTokenizer.from_pretrained(target_spec)
    raise UserError(f"no tokenizer for target {target_spec!r}")
