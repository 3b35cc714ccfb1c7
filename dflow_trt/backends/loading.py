"""One entry point for `generate --backend torch|onnxruntime`: (target, drafter back end) for a mode."""

from __future__ import annotations

import sys
from pathlib import Path

from ..errors import UserError

BACKENDS = ("torch", "onnxruntime")


def load_backends(target_spec: str, drafter_path: str | None, mode: str, backend: str = "torch",
                  build_dir: str | None = None,
                  log=lambda m: print(m, file=sys.stderr)):
    """Return (target, drafter) implementing the decoding interfaces on `backend` (drafter None for ar).

    onnxruntime: the ONNX graphs come from `build_dir` (default `build/<target>`), exported there
    first if missing or stale (the ONNX stages of `scripts/build_engines.py`, cached by input hash).
    """
    from ..drafter.defaults import load_target_and_drafter
    from ..drafter.runtime import TorchDrafter

    if backend not in BACKENDS:
        raise UserError(f"unknown backend {backend!r}; use one of {', '.join(BACKENDS)}")
    if backend == "torch":
        target, model = load_target_and_drafter(target_spec, drafter_path, mode, warn=log)
        return target, (TorchDrafter(model) if model is not None else None)

    from ..drafter.defaults import shipped_drafter_path
    from ..export.build import Build, BuildSpec
    from .onnxruntime import OrtDrafter, OrtTarget

    # ar needs no drafter, but the target graph taps what the build's drafter reads: use the dflow one
    path = drafter_path or shipped_drafter_path(target_spec, "dflow" if mode == "ar" else mode)
    if path is not None and not Path(path).exists():
        raise UserError(f"drafter {path} does not exist; pass a folder written by `dflow-trt train` or omit --drafter")
    spec = BuildSpec(target=target_spec, drafters=(str(path),) if path else (), out=build_dir, onnx_only=True)
    res = Build(spec, log=log).run()
    torch_target = res["target"]
    target = OrtTarget(res["onnx_target"], tokenizer=torch_target.tokenizer)
    if mode == "ar":
        return target, None
    label = "dflow" if mode == "dflow" else "dflash"
    if label not in res["onnx_drafters"]:
        if len(res["onnx_drafters"]) != 1:
            raise UserError(f"the build has no {mode} drafter; pass --drafter")
        label = next(iter(res["onnx_drafters"]))
    drafter = OrtDrafter(res["onnx_drafters"][label])
    drafter.check_target(target.info)
    return target, drafter
