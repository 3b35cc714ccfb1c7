"""Save and load drafters: `model.safetensors` (drafter weights only) + `config.json`.

The target's embeddings and LM head are shared and never stored. Files are written into a
temporary folder and renamed (`atomic.atomic_dir`), so a half-written drafter is never loaded.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from ..atomic import atomic_dir
from ..errors import UserError
from ..targets.hf_target import HFTarget
from .config import DrafterConfig
from .model import DFlowDrafter

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
    with atomic_dir(path) as tmp:
        state = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
        save_file(state, tmp / WEIGHTS, metadata={"format": "pt", "kind": "dflow_trt-drafter"})
        (tmp / CONFIG).write_text(json.dumps(model.config.to_dict(), indent=2) + "\n")
        for name, text in (extra_files or {}).items():
            (tmp / name).write_text(text)
    return Path(path)


def read_config(path: str | Path) -> DrafterConfig:
    path = Path(path)
    cfg = path / CONFIG
    if not cfg.is_file():
        raise UserError(f"no drafter at {path} (missing {CONFIG}); train one with `dflow-trt train` or omit --drafter")
    try:
        return DrafterConfig.from_dict(json.loads(cfg.read_text()))
    except (ValueError, TypeError, KeyError, AttributeError, UserError) as e:  # ValueError: not UTF-8 or JSON
        why = f"{type(e).__name__}: {e}" if isinstance(e, KeyError) else str(e)
        raise UserError(f"{cfg} is not a usable dflow_trt drafter config ({why}); restore the drafter's own "
                        f"{CONFIG} or re-train it") from None


def _read_weights(path: Path, config: DrafterConfig, target: HFTarget) -> dict[str, torch.Tensor]:
    """The drafter's weights, refused when unreadable, not finite, or shaped other than `config` says
    (checked against a model without memory: an edited config.json could ask for any amount)."""
    try:
        state = load_file(path / WEIGHTS, device=str(target.device))
    except (SafetensorError, OSError) as e:
        raise UserError(f"cannot read drafter weights {path / WEIGHTS} ({e}); re-train or re-copy the drafter") from None
    with torch.device("meta"):
        want = {k: tuple(v.shape) for k, v in
                DFlowDrafter(config, target.input_embeddings, target.lm_head).state_dict().items()}
    have = {k: tuple(v.shape) for k, v in state.items()}
    bad = sorted(k for k in have.keys() | want.keys() if have.get(k) != want.get(k))
    if bad:
        raise UserError(f"drafter {path}: {CONFIG} disagrees with {WEIGHTS} ({len(bad)} tensors, e.g. {bad[0]}: "
                        f"config {want.get(bad[0], 'none')}, weights {have.get(bad[0], 'none')}); restore the "
                        f"drafter's own {CONFIG} or re-train it")
    nonfinite = [k for k, v in state.items() if v.is_floating_point() and not torch.isfinite(v).all()]
    if nonfinite:
        raise UserError(f"drafter weights {path / WEIGHTS} hold NaN or infinite values ({nonfinite[:3]}): its "
                        f"training diverged; re-train it (a lower --lr, a larger --gamma)")
    return state


def load_drafter(path: str | Path, target: HFTarget) -> DFlowDrafter:
    """Load a drafter and check it belongs to `target` (same fingerprint and tap layers)."""
    path = Path(path)
    config = read_config(path)
    config.check_target(target.info)
    if tuple(target.info.tap_layers) != config.tap_layers:
        target_taps = target.info.tap_layers
        raise UserError(f"drafter reads target layers {list(config.tap_layers)} but the target taps "
                        f"{list(target_taps)}; load the target with the drafter's tap layers")
    state = _read_weights(path, config, target)
    model = DFlowDrafter(config, target.input_embeddings, target.lm_head).to(target.device)
    model.load_state_dict(state)
    return model
