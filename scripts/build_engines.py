"""Build everything deployable from a target and its drafters into build/<name>/ (see dflow_trt/export/build.py).

    python scripts/build_engines.py [--target T] [--drafter PATH]... [--name NAME] [--tp-size N] [--out DIR]

On a CPU machine it writes the ONNX graphs, FP8 checkpoints, TensorRT-LLM checkpoints, LLM-API
config, FP8 report and manifest, reports that the engines need a GPU host with TensorRT-LLM
(naming the command), and exits 0.
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from dflow_trt.errors import UserError  # noqa: E402
from dflow_trt.export.cli import add_build_args, cmd_build  # noqa: E402


def main(argv=None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_build_args(ap)
    try:
        return cmd_build(ap.parse_args(argv))
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
