"""Generate (or resume) the target-generated training set. See dflow_trt/training/data.py."""

import argparse
import sys

from dflow_trt.errors import UserError
from dflow_trt.targets import load_target
from dflow_trt.training.data import generate_dataset


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--data-dir", default="runs/data-smollm2")
    ap.add_argument("--num-prompts", type=int, default=1024)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--first-prompt", type=int, default=0,
                    help="start this far down the prompt order (fresh prompts for a fine-tune)")
    a = ap.parse_args()
    try:
        target = load_target(a.target, num_taps=0)
        print(generate_dataset(target, a.data_dir, a.num_prompts, a.max_new_tokens, a.batch_size,
                               first_prompt=a.first_prompt))
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
