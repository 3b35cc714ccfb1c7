"""Save and load drafters: `model.safetensors` (drafter weights only) + `config.json`.

The target's embeddings and LM head are shared and never stored. Files are written into a
temporary folder and renamed (`atomic.atomic_dir`), so a half-written drafter is never loaded.
With `max_shard_bytes` the weights are split into `model-00001-of-0000N.safetensors` files of
at most that size each (whole tensors), so a drafter passes size limits on files (the GPU
device tool returns files of at most 16 MiB); the loader reads either layout.
"""

from __future__ import annotations

import json
import re
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
SHARD = "model-{:05d}-of-{:05d}.safetensors"
_SHARD_RE = re.compile(r"model-(\d{5})-of-(\d{5})\.safetensors")
_META = {"format": "pt", "kind": "dflow_trt-drafter"}


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


def _header_bytes(names) -> int:
    """An upper bound on a safetensors header: 8-byte length, metadata, and per tensor its name,
    dtype, shape and offsets as JSON (under 100 bytes beside the name for a 2-D tensor)."""
    return 256 + sum(len(k) + 128 for k in names)


def shard_groups(state: dict[str, torch.Tensor], max_bytes: int) -> list[dict[str, torch.Tensor]]:
    """Tensors in name order, packed into consecutive groups whose files stay within `max_bytes`."""
    groups: list[dict[str, torch.Tensor]] = [{}]
    for k in sorted(state):
        n = state[k].numel() * state[k].element_size()
        if n + _header_bytes([k]) > max_bytes:
            raise UserError(f"drafter tensor {k} alone is {n / 2**20:.3g} MiB, over the weight shard limit of "
                            f"{max_bytes / 2**20:.3g} MiB; raise --max-shard-mb")
        g = groups[-1]
        if g and sum(v.numel() * v.element_size() for v in g.values()) + n + _header_bytes([*g, k]) > max_bytes:
            groups.append(g := {})
        g[k] = state[k]
    return groups


def save_drafter(model: DFlowDrafter, path: str | Path, extra_files: dict[str, str] | None = None,
                 max_shard_bytes: int | None = None) -> Path:
    """Write the drafter; with `max_shard_bytes`, weights over that size go into numbered shards."""
    with atomic_dir(path) as tmp:
        state = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
        total = sum(v.numel() * v.element_size() for v in state.values())
        if max_shard_bytes is None or total + _header_bytes(state) <= max_shard_bytes:
            save_file(state, tmp / WEIGHTS, metadata=_META)
        else:
            groups = shard_groups(state, max_shard_bytes)
            for i, g in enumerate(groups):
                f = tmp / SHARD.format(i + 1, len(groups))
                save_file(g, f, metadata=_META)
                assert f.stat().st_size <= max_shard_bytes, (f.name, f.stat().st_size)  # the header bound held
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


def weight_files(path: str | Path) -> list[Path]:
    """The drafter's weight files: `model.safetensors`, or every shard of one complete numbered set."""
    path = Path(path)
    shards = sorted(p for p in path.glob("model-*-of-*.safetensors") if _SHARD_RE.fullmatch(p.name))
    if not shards:
        return [path / WEIGHTS]
    if (path / WEIGHTS).exists():
        raise UserError(f"drafter {path} holds both {WEIGHTS} and {shards[0].name}...: two copies of its weights; "
                        f"keep one layout (re-copy the drafter folder)")
    counts = {_SHARD_RE.fullmatch(p.name).group(2) for p in shards}
    n = int(next(iter(counts)))
    want = [path / SHARD.format(i + 1, n) for i in range(n)]
    if len(counts) > 1 or shards != want:
        missing = sorted(p.name for p in set(want) - set(shards)) or sorted(p.name for p in shards)
        raise UserError(f"drafter {path} has an incomplete or mixed set of weight shards ({missing[0]} is missing "
                        f"or foreign); re-copy every model-*-of-{n:05d}.safetensors file of the drafter")
    return want


def _load_weights(path: Path, device: torch.device) -> dict[str, torch.Tensor]:
    state: dict[str, torch.Tensor] = {}
    for f in weight_files(path):
        try:
            part = load_file(f, device=str(device))
        except (SafetensorError, OSError) as e:
            raise UserError(f"cannot read drafter weights {f} ({e}); re-train or re-copy the drafter") from None
        twice = state.keys() & part.keys()
        if twice:
            raise UserError(f"drafter {path}: tensor {sorted(twice)[0]} is in two shards; re-copy the drafter")
        state.update(part)
    return state


def _read_weights(path: Path, config: DrafterConfig, target: HFTarget) -> dict[str, torch.Tensor]:
    """The drafter's weights, refused when unreadable, not finite, or shaped other than `config` says
    (checked against a model without memory: an edited config.json could ask for any amount)."""
    state = _load_weights(path, target.device)
    files = weight_files(path)
    what = WEIGHTS if len(files) == 1 else f"its {len(files)} weight shards"
    with torch.device("meta"):
        want = {k: tuple(v.shape) for k, v in
                DFlowDrafter(config, target.input_embeddings, target.lm_head).state_dict().items()}
    have = {k: tuple(v.shape) for k, v in state.items()}
    bad = sorted(k for k in have.keys() | want.keys() if have.get(k) != want.get(k))
    if bad:
        raise UserError(f"drafter {path}: {CONFIG} disagrees with {what} ({len(bad)} tensors, e.g. {bad[0]}: "
                        f"config {want.get(bad[0], 'none')}, weights {have.get(bad[0], 'none')}); restore the "
                        f"drafter's own {CONFIG} or re-train it")
    nonfinite = [k for k, v in state.items() if v.is_floating_point() and not torch.isfinite(v).all()]
    if nonfinite:
        raise UserError(f"drafter weights of {path} ({what}) hold NaN or infinite values ({nonfinite[:3]}): its "
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
