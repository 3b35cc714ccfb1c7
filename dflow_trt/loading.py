"""The one loader: a target spec, a back end and drafter folders -> each mode's (target, drafter).

Every entry point loads through here (`generate`, the benchmarks, the served models), so a mode's
target always taps what its drafter reads and a drafter is always checked against its target.
Back ends: `torch` (the Hugging Face target and the PyTorch drafter), `static` (the same weights
through `backends/static.py`'s preallocated-KV forward, with the PyTorch drafter) and `onnxruntime`
(the graphs of a build folder; `build=True` exports them first when missing or stale). TensorRT-LLM and the
remote (BLS) back end load in the serving layer: they draft or verify inside a server.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .backends.static import static_target
from .decoding.interfaces import Drafter, Target
from .decoding.options import MODES
from .drafter.defaults import load_target_and_drafter, resolve_drafter_path
from .drafter.runtime import TorchDrafter
from .errors import UserError
from .targets import load_tokenizer

BACKENDS = ("torch", "onnxruntime", "static")


@dataclass
class ModeModels:
    target: Target
    drafter: Drafter | None  # None for ar


def open_build(build_dir: str | Path, target_spec: str) -> tuple[Path, dict]:
    """A build folder (`scripts/build_engines.py`) and its manifest, refused if built for another target."""
    from .export.manifest import read_manifest

    bdir = Path(build_dir)
    man = read_manifest(bdir)
    if man["target"]["name"] != target_spec:
        raise UserError(f"build folder {bdir} was built for target {man['target']['name']!r}, not {target_spec!r}; "
                        f"point at a build of {target_spec} or rebuild")
    return bdir, man


def load_modes(target_spec: str, backend: str = "torch", drafters: dict[str, str | None] | None = None,
               modes: tuple[str, ...] = MODES, build_dir: str | None = None, build: bool = False,
               target: Any = None, log=lambda m: print(m, file=sys.stderr)) -> dict[str, ModeModels]:
    """Each mode's target and drafter. `drafters`: mode -> folder (missing or None: the shipped one,
    else a seeded untrained one on torch). `target` (torch): an already loaded `target_spec`
    whose weights every mode shares. onnxruntime: a mode whose drafter the build lacks is skipped
    with a warning, unless it is the only mode asked for."""
    drafters = drafters or {}
    if backend not in BACKENDS:
        raise UserError(f"unknown backend {backend!r}; use one of {', '.join(BACKENDS)}")
    if backend in ("torch", "static"):
        base = target if target is not None else load_target_and_drafter(target_spec, None, "ar", warn=log)[0]
        out = {}
        for mode in modes:
            t, model = load_target_and_drafter(target_spec, drafters.get(mode), mode, warn=log, target=base)
            out[mode] = ModeModels(t, TorchDrafter(model) if model is not None else None)
        if backend == "static":
            out = {m: ModeModels(static_target(mm.target), mm.drafter) for m, mm in out.items()}
        return out
    return _load_onnxruntime(target_spec, drafters, modes, build_dir, build, log)


def _load_onnxruntime(target_spec, drafters, modes, build_dir, build, log) -> dict[str, ModeModels]:
    from .backends.onnxruntime import OrtDrafter, OrtTarget

    if build:  # export what is missing or stale (cached by input hash); ar taps what the dflow drafter reads
        from .export.build import Build, BuildSpec

        paths = []
        for mode in [m for m in modes if m != "ar"] or ["dflow"]:
            path = resolve_drafter_path(target_spec, mode, drafters.get(mode))
            paths += [str(path)] if path else []
        res = Build(BuildSpec(target=target_spec, drafters=tuple(dict.fromkeys(paths)), out=build_dir,
                              onnx_only=True), log=log).run()
        target = OrtTarget(res["onnx_target"], tokenizer=res["target"].tokenizer)
        folders = res["onnx_drafters"]
    else:
        if not build_dir:
            raise UserError("backend onnxruntime needs a build folder (written by `python scripts/build_engines.py`)")
        bdir, _ = open_build(build_dir, target_spec)
        target = OrtTarget(bdir / "onnx" / "target", tokenizer=load_tokenizer(target_spec))
        folders = {m: bdir / "onnx" / f"drafter-{m}" for m in ("dflash", "dflow")
                   if (bdir / "onnx" / f"drafter-{m}").is_dir()}
    out = {}
    for mode in modes:
        if mode == "ar":
            out[mode] = ModeModels(target, None)
            continue
        label = mode if mode in folders else (next(iter(folders)) if len(folders) == 1 and build else None)
        if label is None:
            if len(modes) == 1:
                raise UserError(f"the build has no {mode} drafter; pass --drafter or rebuild with one")
            log(f"warning: the build has no {mode} drafter; mode {mode} is not served")
            continue
        drafter = OrtDrafter(folders[label])
        drafter.check_target(target.info)
        out[mode] = ModeModels(target, drafter)
    return out


def load_backends(target_spec: str, drafter_path: str | None, mode: str, backend: str = "torch",
                  build_dir: str | None = None, log=lambda m: print(m, file=sys.stderr)):
    """One mode's (target, drafter) for `generate --backend`: onnxruntime exports the graphs into
    `build_dir` (default `build/<target>`) first if they are missing or stale."""
    m = load_modes(target_spec, backend, {mode: drafter_path}, (mode,), build_dir, build=True, log=log)[mode]
    return m.target, m.drafter
