"""Load the stateless `target` and `drafter` services from their Triton config parameters."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from ..errors import UserError
from ..loading import load_modes
from .lifecycle import session_key
from .sessions import DrafterService, ServiceLimits, TargetService

TARGET_PARAMS = ("target", "backend", "build_dir", "drafter", "threads", "max_sessions", "session_idle_s",
                 "max_response_mb")
DRAFTER_PARAMS = ("target", "dflash_drafter", "dflow_drafter", "threads", "max_response_mb")


def _check(params: dict[str, str], known: tuple[str, ...], model: str) -> None:
    unknown = set(params) - set(known)
    if unknown:
        raise UserError(f"{model}: unknown parameters {sorted(unknown)}; known: {list(known)}")
    if int(params.get("threads") or 0) > 0:
        import torch

        torch.set_num_threads(int(params["threads"]))


def _number(params: dict[str, str], name: str, default: float, model: str) -> float:
    try:
        v = float(params.get(name) or default)
    except ValueError:
        raise UserError(f"{model}: parameter {name} must be a number, got {params[name]!r}") from None
    if not v > 0:
        raise UserError(f"{model}: parameter {name} must be > 0, got {v}")
    return v


def _limits(params: dict[str, str], model: str) -> ServiceLimits:
    return ServiceLimits(max_response_bytes=int(_number(params, "max_response_mb", 64, model) * 2**20))


def _target_service(target, params: dict[str, str], log: Callable[[str], None]) -> TargetService:
    key = session_key()
    if key is None:
        log("target: warning: DFLOW_TRT_SESSION_KEY is not set, so any client may open KV sessions "
            "(only the budget and the idle timeout bound them); start with scripts/serve.py or set it")
    return TargetService(target, max_sessions=int(_number(params, "max_sessions", 64, "target")),
                         idle_s=_number(params, "session_idle_s", 30, "target"), session_key=key,
                         limits=_limits(params, "target"))


def resolve_path(p: str, repo: Path | None) -> str | None:
    """A path parameter: relative ones resolve from the repository's parent folder; "" means unset."""
    if not p:
        return None
    return str((repo / p).resolve()) if repo is not None and not Path(p).is_absolute() else p


def load_target_service(params: dict[str, str], repo: Path, log: Callable[[str], None] = print) -> TargetService:
    """The target, tapping the layers its drafter reads (`drafter`, default: the shipped DFlow one)."""
    _check(params, TARGET_PARAMS, "target")
    spec, backend = params.get("target", "smollm2-135m"), params.get("backend", "torch")
    if backend not in ("torch", "onnxruntime"):
        raise UserError(f"target: backend={backend!r}; use torch or onnxruntime (tensorrt_llm: GPU hosts, see docs/serving.md)")
    bdir = resolve_path(params.get("build_dir", ""), repo)
    if backend == "onnxruntime" and not bdir:
        raise UserError("target: backend=onnxruntime needs parameter build_dir (scripts/build_engines.py output)")
    # the target taps what the dflow drafter reads (an ONNX target: what it was exported with)
    mode = "dflow" if backend == "torch" else "ar"
    target = load_modes(spec, backend, {"dflow": resolve_path(params.get("drafter", ""), repo)}, (mode,), bdir,
                        log=log)[mode].target
    log(f"target model ready: {spec} taps {list(target.info.tap_layers)}")
    return _target_service(target, params, log)


def load_drafter_service(params: dict[str, str], repo: Path, log: Callable[[str], None] = print) -> DrafterService:
    _check(params, DRAFTER_PARAMS, "drafter")
    spec, modes = params.get("target", "smollm2-135m"), ("dflash", "dflow")
    loaded = load_modes(spec, "torch", {m: resolve_path(params.get(f"{m}_drafter", ""), repo) for m in modes}, modes,
                        log=log)
    log(f"drafter model ready: {spec} modes {list(modes)}")
    return DrafterService({m: loaded[m].drafter for m in modes}, _limits(params, "drafter"))
