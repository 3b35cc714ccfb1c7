"""Writing one exported graph folder (the graph, its external weights, its meta file), atomically:
the one export step the target and drafter exporters share."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ..atomic import atomic_dir


def save_graph(graph: torch.nn.Module, inputs: tuple, dynamic_shapes, names: tuple[list[str], list[str]],
               out_dir: str | Path, opset: int, files: tuple[str, str], meta: dict) -> Path:
    """torch.export the module on `inputs` with every listed size dynamic; write `files` (graph,
    meta) into out_dir. `meta` gains the input and output names and the opset."""
    (in_names, out_names), (graph_file, meta_file) = names, files
    out_dir = Path(out_dir)
    with atomic_dir(out_dir) as tmp:
        with torch.no_grad():
            prog = torch.onnx.export(graph, inputs, dynamo=True, dynamic_shapes=dynamic_shapes, input_names=in_names,
                                     output_names=out_names, opset_version=opset, optimize=True, verbose=False)
        prog.save(str(tmp / graph_file), external_data=True)
        meta = {**meta, "inputs": in_names, "outputs": out_names, "opset": opset}
        (tmp / meta_file).write_text(json.dumps(meta) + "\n")
    return out_dir
