"""Generate (or resume) the target-generated training set. Same as `dflow-trt make-data`; see
dflow_trt/training/data.py."""

import sys

from dflow_trt.cli import main

if __name__ == "__main__":
    sys.exit(main(["make-data", *sys.argv[1:]]))
