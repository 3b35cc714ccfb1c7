"""Save and load drafters: `model.safetensors` (drafter weights only) + `config.json`.

The target's embeddings and LM head are shared and never stored. Files are written into a
temporary folder and renamed, so a half-written drafter is never loaded.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from ..errors import UserError
from ..targets.hf_target import HFTarget
from .config import DrafterConfig
from .model import DFlowDrafter
from .runtime import TorchDrafter

CONFIG, WEIGHTS = "config.json", "model.safetensors"


def build_drafter(target: HFTarget, config: DrafterConfig, seed: int | None = 0) -> DFlowDrafter:
    """A freshly initialised drafter sharing `target`'s embeddings and LM head."""
    config.check_target(target.info)
    if seed is not None:
        g = torch.get_rng_state()
        torch.manual_seed(seed)
    model = DFlowDrafter(config, target.input_embeddings, target.lm_head).to(target.device)
    if seed is not None:
        torch.set_rng_state(g)
    return model


def save_drafter(model: DFlowDrafter, path: str | Path, extra_files: dict[str, str] | None = None) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}-", dir=path.parent))
    try:
        state = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
        save_file(state, tmp / WEIGHTS, metadata={"format": "pt", "kind": "dflow_trt-drafter"})
        (tmp / CONFIG).write_text(json.dumps(model.config.to_dict(), indent=2) + "\n")
        for name, text in (extra_files or {}).items():
            (tmp / name).write_text(text)
        if path.exists():
            shutil.rmtree(path)
        os.replace(tmp, path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path


def read_config(path: str | Path) -> DrafterConfig:
    path = Path(path)
    cfg = path / CONFIG
    if not cfg.is_file():
        raise UserError(f"no drafter at {path} (missing {CONFIG}); train one with `dflow-trt train` or omit --drafter")
    try:
        return DrafterConfig.from_dict(json.loads(cfg.read_text()))
    except (json.JSONDecodeError, TypeError, KeyError) as e:
        raise UserError(f"{cfg} is not a dflow_trt drafter config ({e}); re-export the drafter") from None


def load_drafter(path: str | Path, target: HFTarget) -> DFlowDrafter:
    """Load a drafter and check it belongs to `target` (same fingerprint and tap layers)."""
    path = Path(path)
    config = read_config(path)
    config.check_target(target.info)
    if tuple(target.info.tap_layers) != config.tap_layers:
        target_taps = target.info.tap_layers
        raise UserError(f"drafter reads target layers {list(config.tap_layers)} but the target taps "
                        f"{list(target_taps)}; load the target with the drafter's tap layers")
    model = DFlowDrafter(config, target.input_embeddings, target.lm_head).to(target.device)
    try:
        state = load_file(path / WEIGHTS, device=str(target.device))
    except (FileNotFoundError, SafetensorError, OSError) as e:
        raise UserError(f"cannot read drafter weights {path / WEIGHTS} ({e}); re-train or re-copy the drafter") from None
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise UserError(f"drafter weights {path / WEIGHTS} do not match its config "
                        f"(missing {missing[:3]}, unexpected {unexpected[:3]}); re-train the drafter")
    return model


def as_backend(model: DFlowDrafter) -> TorchDrafter:
    return TorchDrafter(model)
