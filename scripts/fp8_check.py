"""FP8 versus full precision on held-out prompts: a pass/fail table, JSON, exit 1 if a threshold fails.

    python scripts/fp8_check.py [--target T] [--drafter PATH]... [--out DIR] [--json-out FILE]

Runs (or reuses, by input hash) the FP8 stages of the build in build/<name>/ and its check.
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from dflow_trt.errors import UserError  # noqa: E402
from dflow_trt.export.cli import add_build_args, cmd_fp8_check  # noqa: E402


def main(argv=None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_build_args(ap)
    ap.add_argument("--json-out", default=None)
    try:
        return cmd_fp8_check(ap.parse_args(argv))
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
