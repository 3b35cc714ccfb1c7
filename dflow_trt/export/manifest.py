"""The build manifest: what was built from what (source hashes, taps, block size, dtypes, tool
versions, every artefact's path), and the check loaders run against it."""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import platform
from pathlib import Path

import torch

from ..atomic import read_json, write_text

MANIFEST = "manifest.json"
FORMAT = 1
TOOLS = ("torch", "transformers", "onnx", "onnxruntime", "onnxscript", "nvidia-modelopt", "safetensors", "tensorrt_llm")


def tool_versions() -> dict[str, str | None]:
    out = {"python": platform.python_version()}
    for name in TOOLS:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


def hash_files(paths: list[Path]) -> str:
    """sha256 over the files' relative names and bytes (folders: every file inside, sorted)."""
    h = hashlib.sha256()
    for p in paths:
        files = sorted(f for f in Path(p).rglob("*") if f.is_file()) if Path(p).is_dir() else [Path(p)]
        for f in files:
            h.update(f.name.encode())
            with open(f, "rb") as fh:
                for chunk in iter(lambda: fh.read(1 << 20), b""):
                    h.update(chunk)
    return h.hexdigest()


def hash_state_dict(module: torch.nn.Module) -> str:
    """sha256 over a module's tensors (names, dtypes, shapes, bytes), sorted by name."""
    h = hashlib.sha256()
    for k, v in sorted(module.state_dict().items()):
        t = v.detach().cpu().contiguous()
        h.update(f"{k}:{t.dtype}:{tuple(t.shape)}".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def write_manifest(build_dir: Path, manifest: dict) -> Path:
    path = build_dir / MANIFEST
    return write_text(path, json.dumps({"format": FORMAT, **manifest}, indent=2) + "\n")


def read_manifest(build_dir: str | Path) -> dict:
    return read_json(Path(build_dir) / MANIFEST, "format", FORMAT,
                     f"no build at {build_dir}? (re)build it with `python scripts/build_engines.py`")
