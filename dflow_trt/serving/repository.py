"""The Triton model repository: writes `config.pbtxt` for the decoding, target and drafter models.

`triton_repo/` is checked in as written by `write_repository()` with the defaults below (the
embedded smollm2-135m and its shipped drafters); tests and deployments write variants of it
(another target, `backend=onnxruntime` with `build_dir`, BLS orchestration) the same way.
"""

from __future__ import annotations

from pathlib import Path

from ..atomic import atomic_dir
from .requests import REQUEST

MODELS = ("dflow", "dflow_bls", "target", "drafter")

_TRITON_TYPES = {"object": "TYPE_STRING", "int32": "TYPE_INT32", "int64": "TYPE_INT64", "float32": "TYPE_FP32",
                 "bool": "TYPE_BOOL"}
_DFLOW_IO = "input [\n" + ",\n".join(
    f'  {{ name: "{i.name}", data_type: {_TRITON_TYPES[i.dtype]}, dims: [ {", ".join(map(str, i.dims))} ]'
    + ("" if i.required else ", optional: true") + " }" for i in REQUEST) + """
]
output [
  { name: "token_ids", data_type: TYPE_INT32, dims: [ -1 ] },
  { name: "text_output", data_type: TYPE_STRING, dims: [ 1 ] },
  { name: "stats", data_type: TYPE_STRING, dims: [ 1 ] }
]
model_transaction_policy { decoupled: true }"""

_TARGET_IO = """input [
  { name: "input_ids", data_type: TYPE_INT64, dims: [ -1, -1 ], optional: true },
  { name: "prompt_lens", data_type: TYPE_INT64, dims: [ -1 ], optional: true },
  { name: "num_last", data_type: TYPE_INT32, dims: [ 1 ], optional: true },
  { name: "num_logits", data_type: TYPE_INT32, dims: [ 1 ], optional: true },
  { name: "info_only", data_type: TYPE_BOOL, dims: [ 1 ], optional: true },
  { name: "op", data_type: TYPE_STRING, dims: [ 1 ], optional: true },
  { name: "session_id", data_type: TYPE_STRING, dims: [ 1 ], optional: true },
  { name: "session_key", data_type: TYPE_STRING, dims: [ 1 ], optional: true },
  { name: "num_kept", data_type: TYPE_INT64, dims: [ -1 ], optional: true },
  { name: "parents", data_type: TYPE_INT64, dims: [ -1 ], optional: true },
  { name: "path", data_type: TYPE_INT64, dims: [ -1, -1 ], optional: true }
]
output [
  { name: "logits", data_type: TYPE_FP32, dims: [ -1, -1, -1 ] },
  { name: "hidden_states", data_type: TYPE_FP32, dims: [ -1, -1, -1 ] },
  { name: "info", data_type: TYPE_STRING, dims: [ 1 ] }
]"""

_DRAFTER_IO = """input [
  { name: "info_only", data_type: TYPE_BOOL, dims: [ 1 ], optional: true },
  { name: "mode", data_type: TYPE_STRING, dims: [ 1 ], optional: true },
  { name: "block_size", data_type: TYPE_INT32, dims: [ 1 ], optional: true },
  { name: "context_taps", data_type: TYPE_FP32, dims: [ -1, -1, -1 ], optional: true },
  { name: "context_lens", data_type: TYPE_INT64, dims: [ -1 ], optional: true },
  { name: "anchor_ids", data_type: TYPE_INT64, dims: [ -1 ], optional: true },
  { name: "anchor_pos", data_type: TYPE_INT64, dims: [ -1 ], optional: true },
  { name: "temperature", data_type: TYPE_FP32, dims: [ 1 ], optional: true },
  { name: "top_p", data_type: TYPE_FP32, dims: [ 1 ], optional: true },
  { name: "top_k", data_type: TYPE_INT32, dims: [ 1 ], optional: true },
  { name: "seed", data_type: TYPE_INT64, dims: [ 1 ], optional: true },
  { name: "flow_taps", data_type: TYPE_FP32, dims: [ -1, -1, -1 ], optional: true },
  { name: "flow_token_ids", data_type: TYPE_INT64, dims: [ -1, -1 ], optional: true },
  { name: "flow_hint_ids", data_type: TYPE_INT64, dims: [ -1, -1 ], optional: true },
  { name: "flow_valid", data_type: TYPE_BOOL, dims: [ -1, -1 ], optional: true }
]
output [
  { name: "draft_ids", data_type: TYPE_INT64, dims: [ -1, -1 ] },
  { name: "draft_probs", data_type: TYPE_FP32, dims: [ -1, -1, -1 ] },
  { name: "draft_confidence", data_type: TYPE_FP32, dims: [ -1, -1 ] },
  { name: "alt_ids", data_type: TYPE_INT64, dims: [ -1, -1 ] },
  { name: "alt_confidence", data_type: TYPE_FP32, dims: [ -1, -1 ] },
  { name: "info", data_type: TYPE_STRING, dims: [ 1 ] }
]"""

DEFAULTS: dict[str, dict[str, str]] = {
    "dflow": {"target": "smollm2-135m", "backend": "torch", "build_dir": "", "dflash_drafter": "",
              "dflow_drafter": "", "orchestration": "inprocess", "max_tokens": "1024", "max_concurrency": "8",
              "max_batch": "8", "max_queue": "64", "verify_budget": "32", "trtllm_dflow": "0", "threads": "0"},
    "dflow_bls": {"target": "smollm2-135m", "orchestration": "bls", "max_tokens": "1024", "max_concurrency": "8"},
    "target": {"target": "smollm2-135m", "backend": "torch", "build_dir": "", "drafter": "", "threads": "0",
               "max_sessions": "64", "session_idle_s": "30", "max_response_mb": "64"},
    "drafter": {"target": "smollm2-135m", "dflash_drafter": "", "dflow_drafter": "", "threads": "0",
                "max_response_mb": "64"},
}
_IO = {"dflow": _DFLOW_IO, "dflow_bls": _DFLOW_IO, "target": _TARGET_IO, "drafter": _DRAFTER_IO}
_ABOUT = {
    "dflow": "decoding model: draft -> verify -> carry flow, in process (fast path on one host)",
    "dflow_bls": "decoding model orchestrating the `target` and `drafter` models through BLS calls",
    "target": "target: logits + tap hidden states; stateless, or KV sessions keyed by session_id (op)",
    "drafter": "stateless drafter: one block of drafts from the context features (+ flow)",
}
_ENTRY = {"dflow": "DFlowModel", "dflow_bls": "DFlowModel", "target": "TargetModel", "drafter": "DrafterModel"}


def config_text(model: str, params: dict[str, str], name: str | None = None) -> str:
    """`model`'s config.pbtxt (kind: one of MODELS), served under `name` (default: the kind's)."""
    ps = "\n".join(f'parameters: {{ key: "{k}", value: {{ string_value: "{v}" }} }}' for k, v in params.items())
    return (f"# {_ABOUT[model]}\n# written by dflow_trt.serving.repository; parameters documented in docs/serving.md\n"
            f'name: "{name or model}"\nbackend: "python"\nmax_batch_size: 0\n{_IO[model]}\n'
            f"instance_group [ {{ kind: KIND_CPU, count: 1 }} ]\n{ps}\n")


def write_repository(dest: str | Path, overrides: dict[str, dict[str, str]] | None = None,
                     models: tuple[str, ...] = MODELS, variants: dict[str, tuple[str, dict[str, str]]] | None = None
                     ) -> Path:
    """Write a complete repository at dest (atomically: built aside, then renamed into place).
    `variants`: more models, {name: (kind, parameter overrides)}, e.g. an unbatched `dflow` beside
    the batched one for a load comparison in one server."""
    overrides = overrides or {}
    every = [(m, m, overrides.get(m, {})) for m in models]
    every += [(name, kind, {**overrides.get(kind, {}), **over}) for name, (kind, over) in (variants or {}).items()]
    with atomic_dir(dest) as tmp:
        for name, kind, over in every:
            (tmp / name / "1").mkdir(parents=True)
            (tmp / name / "config.pbtxt").write_text(config_text(kind, {**DEFAULTS[kind], **over}, name))
            (tmp / name / "1" / "model.py").write_text(
                f'"""Triton Python-backend entry for the `{name}` model; the logic lives in dflow_trt.serving."""\n\n'
                f"from dflow_trt.serving.triton_python import {_ENTRY[kind]} as TritonPythonModel  # noqa: F401\n")
    return Path(dest)
