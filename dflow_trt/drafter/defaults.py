"""Which drafter a mode uses when none is given: the shipped one, else a seeded untrained one."""

from __future__ import annotations

import sys
from pathlib import Path

from .. import kernels
from ..errors import UserError
from ..targets import SHIPPED_DRAFTERS, load_target, preset
from ..targets.hf_target import HFTarget
from .config import DrafterConfig
from .io import build_drafter, load_drafter, read_config
from .model import DFlowDrafter

DEFAULT_NUM_TAPS = 3


def untrained_config(target: HFTarget, flow: bool, block_size: int = 16, num_layers: int = 1) -> DrafterConfig:
    """Drafter sized like DFlash's: attention geometry and MLP width of the target."""
    c = target.model.config
    p = preset(target.info.name)
    mask = p.mask_token_id if p and p.mask_token_id is not None else c.vocab_size - 1
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    return DrafterConfig.for_target(
        target.info, mask_token_id=mask, block_size=block_size, num_layers=num_layers,
        num_heads=c.num_attention_heads, num_kv_heads=c.num_key_value_heads, head_dim=head_dim,
        intermediate_size=c.intermediate_size, rms_norm_eps=c.rms_norm_eps,
        rope_theta=float((getattr(c, "rope_parameters", None) or {}).get("rope_theta", 1e4)), flow=flow)


def shipped_drafter_path(target_name: str, mode: str) -> Path | None:
    p = preset(target_name)
    if p is None or mode not in p.default_drafters:
        return None
    path = SHIPPED_DRAFTERS / p.default_drafters[mode]
    return path if (path / "config.json").is_file() else None


def resolve_drafter_path(target_spec: str, mode: str, drafter_path: str | None) -> Path | None:
    """The drafter folder a mode uses: the one given (which must exist), else the shipped one, else None."""
    path = Path(drafter_path) if drafter_path else shipped_drafter_path(target_spec, mode)
    if path is not None and not path.exists():
        raise UserError(f"drafter {path} does not exist; pass a folder written by `dflow-trt train` or omit --drafter")
    return path


def load_target_and_drafter(target_spec: str, drafter_path: str | None, mode: str,
                            device: str = "cpu", warn=lambda m: print(m, file=sys.stderr),
                            target: HFTarget | None = None,
                            packed: bool = True) -> tuple[HFTarget, DFlowDrafter | None]:
    """Resolve --target/--drafter/--mode into a target tapping what the drafter reads, and the drafter.

    For decoding: with `packed`, the linear layers of a target loaded here and of the drafter run
    on oneDNN-packed weights on a CPU, and the target's attention skips a K/V copy
    (`kernels.py`). `target`, when given, is an already
    loaded `target_spec` whose weights are reused as they are.
    """
    from ..targets.hf_target import default_tap_layers

    def _load(tap_layers=None, num_taps=0):
        if target is None:
            t = load_target(target_spec, tap_layers=tap_layers, num_taps=num_taps, device=device)
            if packed and t.device.type == "cpu":
                kernels.pack_linears(t.model)
                kernels.grouped_attention(t.model)
            return t
        taps = tap_layers if tap_layers is not None else default_tap_layers(target.info.num_layers, num_taps)
        return target.with_taps(tuple(taps))

    def _packed(model: DFlowDrafter) -> DFlowDrafter:
        if packed:
            kernels.pack_linears(model)
        return model

    if mode == "ar":
        return _load(), None
    path = resolve_drafter_path(target_spec, mode, drafter_path)
    if path is not None:
        cfg = read_config(path)
        t = _load(tap_layers=cfg.tap_layers)
        return t, _packed(load_drafter(path, t))
    t = _load(num_taps=DEFAULT_NUM_TAPS)  # first, so a bad --target is the error, not this warning
    warn(f"warning: no trained {mode} drafter for {target_spec}; using a seeded untrained drafter "
         f"(expect tau ~ 1); train one with `dflow-trt train --target {target_spec}`")
    return t, _packed(build_drafter(t, untrained_config(t, flow=(mode == "dflow")), seed=0))
