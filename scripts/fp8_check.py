"""FP8 versus full precision on held-out prompts: a pass/fail table, JSON, exit 1 if a threshold fails.

    python scripts/fp8_check.py [--target T] [--drafter PATH]... [--out DIR] [--json-out FILE]

Runs (or reuses, by input hash) the FP8 stages of the build in build/<name>/ and its check.
Same as `dflow-trt fp8-check` (same checks, one-line errors).
"""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from dflow_trt.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["fp8-check", *sys.argv[1:]]))
