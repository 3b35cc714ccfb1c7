"""Exports shared by the ONNX tests of one session (exporting takes seconds on tiny targets and
minutes on smollm2, so each graph is exported once per session into a temporary folder)."""

from __future__ import annotations

import atexit
import functools
import shutil
import tempfile
from pathlib import Path

_ROOT = Path(tempfile.mkdtemp(prefix="dflow-onnx-tests-"))
atexit.register(shutil.rmtree, _ROOT, True)


def untrained_drafter(target, flow: bool, block_size: int = 8, num_layers: int = 1):
    from dflow_trt.drafter.defaults import untrained_config
    from dflow_trt.drafter.io import build_drafter

    return build_drafter(target, untrained_config(target, flow=flow, block_size=block_size, num_layers=num_layers))


@functools.lru_cache(maxsize=None)
def exported_target(target) -> Path:
    from dflow_trt.export.onnx_target import export_target

    return export_target(target, _ROOT / f"{target.info.name}-{target.info.fingerprint}-target")


@functools.lru_cache(maxsize=None)
def exported_drafter(target, flow: bool, num_layers: int = 1):
    """(torch model, export folder) of a seeded untrained drafter for `target`."""
    from dflow_trt.export.onnx_drafter import export_drafter

    model = untrained_drafter(target, flow, num_layers=num_layers)
    return model, export_drafter(model, _ROOT / f"{target.info.name}-drafter-flow{int(flow)}-L{num_layers}")
