"""TensorRT-LLM back end for serving: its LLM API runs the whole draft/verify loop (flow off).

TensorRT-LLM's PyTorch back end drafts natively with `DFlashDecodingConfig` (a drafter in z-lab's
DFlash layout, written by `scripts/build_engines.py` with `trtllm/llm_api.json`). It does not hand
back the verifier's hidden states at rejected positions, so DFlow's flow cannot be carried through
it: this back end serves `dflash` (and `ar` when the build has no z-lab drafter). DFlow on GPU
hosts goes through the BLS layout instead, or, where llm_api.json names the DFlow plug-in
(`dflow_plugin`, see `trtllm_dflow/` and docs/tensorrt_llm_dflow.md), through TensorRT-LLM's DFlash
mode with the relay added: that build serves `dflow`.

`generate_llmapi` maps TensorRT-LLM's streamed outputs onto our `GenerationResult`: in streaming
mode each iteration delivers the tokens one target forward committed, so the per-iteration token
counts are the acceptance lengths.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import time
from pathlib import Path
from typing import Callable

import torch

from ..decoding.loop import GenerationResult, RoundEvent
from ..decoding.sampling import SamplingParams
from ..errors import UserError
from .trtllm_dflow import PLUGIN_MODULE


def llm_api_options(build_dir: str | Path, dflow: bool = False) -> dict:
    """The LLM-API options the build wrote, checked for what we need: trtllm/llm_api.json (DFlash),
    or with `dflow` trtllm/llm_api_dflow.json (the DFlow drafter through the plug-in)."""
    p = Path(build_dir) / "trtllm" / ("llm_api_dflow.json" if dflow else "llm_api.json")
    if not p.is_file():
        raise UserError(f"{p} is missing; write it with `python scripts/build_engines.py --out {build_dir}`"
                        + (" with a DFlow drafter" if dflow else ""))
    opts = json.loads(p.read_text())
    if not Path(opts.get("model", "")).is_dir():
        raise UserError(f"{p} names target checkpoint {opts.get('model')!r}, which does not exist; rebuild "
                        f"the build folder on this host (paths are absolute)")
    spec = opts.get("speculative_config")
    if spec is not None and not Path(spec.get("speculative_model", "")).is_dir():
        raise UserError(f"{p} names drafter {spec.get('speculative_model')!r}, which does not exist; rebuild")
    return opts


def served_modes(opts: dict) -> tuple[str, ...]:
    if "speculative_config" not in opts:
        return ("ar",)
    return ("dflow",) if opts.get("dflow_plugin") else ("dflash",)


def engine_build_available() -> tuple[bool, str]:
    """(whether TensorRT-LLM, a GPU and `trtllm-build` are all here, what is missing)."""
    if importlib.util.find_spec("tensorrt_llm") is None:
        return False, "tensorrt_llm is not installed"
    if not torch.cuda.is_available():
        return False, "no CUDA GPU is visible"
    if shutil.which("trtllm-build") is None:
        return False, "trtllm-build is not on PATH"
    return True, ""


def load_llm(opts: dict):
    """Build a `tensorrt_llm.LLM` from the options; a clear error where TensorRT-LLM or a GPU is missing.

    With `dflow_plugin` the plug-in is imported first, so DFlash's drafter builder and worker are
    DFlow's when the model is built (in this process: see docs/tensorrt_llm_dflow.md for workers)."""
    plugin = opts.get("dflow_plugin")
    if plugin is not None and plugin != PLUGIN_MODULE:
        raise UserError(f"llm_api.json names dflow_plugin {plugin!r}; the only plug-in this back end loads is "
                        f"{PLUGIN_MODULE!r}: fix the file or rebuild it")
    ok, why = engine_build_available()
    if not ok and why != "trtllm-build is not on PATH":  # the LLM API needs no trtllm-build
        raise UserError(f"backend=tensorrt_llm needs a GPU host with TensorRT-LLM ({why}); install "
                        f"tensorrt_llm there, or use backend=torch or onnxruntime")
    if plugin is not None:
        importlib.import_module(PLUGIN_MODULE)  # checks the release, then installs DFlow into DFlash
    from tensorrt_llm import LLM
    from tensorrt_llm.llmapi import DFlashDecodingConfig, KvCacheConfig

    kw = {k: v for k, v in opts.items() if k not in ("model", "speculative_config", "kv_cache_config", "dflow_plugin")}
    if "kv_cache_config" in opts:
        kw["kv_cache_config"] = KvCacheConfig(**opts["kv_cache_config"])
    if "speculative_config" in opts:
        spec = {k: v for k, v in opts["speculative_config"].items() if k != "decoding_type"}
        kw["speculative_config"] = DFlashDecodingConfig(**spec)
    return LLM(model=opts["model"], **kw)


def _sampling_params(max_tokens: int, s: SamplingParams):
    from tensorrt_llm import SamplingParams as TrtSampling

    kw = {"max_tokens": max_tokens, "temperature": s.temperature}
    if s.temperature > 0:
        kw.update(top_p=s.top_p, top_k=s.top_k or None, seed=s.seed)
    return TrtSampling(**{k: v for k, v in kw.items() if v is not None})


def generate_llmapi(llm, prompt_ids: list[int], max_tokens: int, sampling: SamplingParams,
                    on_round: Callable[[RoundEvent], bool] | None = None,
                    make_params: Callable = _sampling_params) -> GenerationResult:
    """Stream one request through `llm.generate_async(..., streaming=True)`.

    `on_round` returning True stops the request (stop word, cancellation) and aborts it in
    TensorRT-LLM so its KV cache is freed.
    """
    t0 = time.perf_counter()
    req = llm.generate_async(prompt_ids, make_params(max_tokens, sampling), streaming=True)
    tokens: list[int] = []
    acc: list[int] = []
    reason, first_s = "length", None
    for out in req:
        o = out.outputs[0]
        new = list(o.token_ids)[len(tokens):]
        if not new:
            continue
        if first_s is None:
            first_s = time.perf_counter() - t0  # prefill (its token is not a verify round)
        else:
            acc.append(len(new))
        tokens += new
        if on_round is not None and on_round(RoundEvent(round=len(acc), new_tokens=[new])):
            req.abort()
            reason = "stopped"
            break
        if getattr(o, "finish_reason", None) == "stop":
            reason = "stop"
    total = time.perf_counter() - t0
    return GenerationResult(token_ids=[tokens], acceptance_lengths=[acc], prefill_s=first_s or 0.0,
                            verify_s=total - (first_s or 0.0), total_s=total, rounds=len(acc),
                            finish_reasons=[reason])
