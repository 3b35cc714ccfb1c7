"""What an exported ONNX graph folder holds, shared by the exporters (`export/onnx_target.py`,
`export/onnx_drafter.py`) and the ONNX Runtime back end (`onnxruntime.py`), so that loading a graph
needs no exporter: file names, the meta file's `kind`, and the graphs' input and output names (their
shapes are documented in the exporters).
"""

from __future__ import annotations

TARGET_GRAPH, TARGET_META, TARGET_KIND = "target.onnx", "target_meta.json", "dflow_trt-target-onnx"
DRAFTER_GRAPH, DRAFTER_META, DRAFTER_KIND = "drafter.onnx", "drafter_meta.json", "dflow_trt-drafter-onnx"


def _kv(prefix: str, num_layers: int) -> list[str]:
    return [f"{prefix}.{i}.{kv}" for i in range(num_layers) for kv in ("key", "value")]


def target_io_names(num_layers: int) -> tuple[list[str], list[str]]:
    return ["input_ids", "position_ids", "valid", *_kv("past", num_layers)], ["logits", "taps", *_kv("present", num_layers)]


def drafter_io_names(num_layers: int, flow: bool) -> tuple[list[str], list[str]]:
    flow_in = ["flow_taps", "flow_token_ids", "flow_hint_ids", "flow_valid"] if flow else []
    return (["ctx_taps", "ctx_pos", "block_ids", "block_pos", "attn_mask", *flow_in, *_kv("past", num_layers)],
            ["logits", *_kv("new", num_layers)])
