"""Build everything deployable from a target and its drafters into build/<name>/ (see dflow_trt/export/build.py).

    python scripts/build_engines.py [--target T] [--drafter PATH]... [--name NAME] [--tp-size N] [--out DIR]

On a CPU machine it writes the ONNX graphs, FP8 checkpoints, TensorRT-LLM checkpoints, LLM-API
config, FP8 report and manifest, reports that the engines need a GPU host with TensorRT-LLM
(naming the command), and exits 0. Same as `dflow-trt build` (same checks, one-line errors).
"""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from dflow_trt.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["build", *sys.argv[1:]]))
