"""Train a DFlash or DFlow drafter (resumable). Same as `dflow-trt train`; works under torchrun."""

import sys

from dflow_trt.cli import main

if __name__ == "__main__":
    sys.exit(main(["train", *sys.argv[1:]]))
