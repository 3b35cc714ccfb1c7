"""τ against training steps for drafters' train_log.jsonl (held-out, teacher-forced), as a PNG.

    python scripts/plot_training.py [DRAFTER_DIR ...] [--out docs/training_tau.png]
"""

import argparse
import json
import os
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
DEFAULT = [ROOT / "dflow_trt/drafters/smollm2-135m-dflash", ROOT / "dflow_trt/drafters/smollm2-135m-dflow"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("drafters", nargs="*", type=Path, default=DEFAULT)
    ap.add_argument("--out", type=Path, default=ROOT / "docs/training_tau.png")
    a = ap.parse_args()
    fig, ax = plt.subplots(figsize=(7, 4))
    marked = set()
    for d in a.drafters:
        log = [json.loads(x) for x in (d / "train_log.jsonl").read_text().splitlines() if x.strip()]
        ev = [r for r in log if "eval_tau_noflow" in r]
        ax.plot([r["step"] for r in ev], [r["eval_tau_noflow"] for r in ev], marker="o", label=f"{d.name}: no flow")
        fl = [r for r in ev if "eval_tau_flow" in r]  # a DFlow run started from a DFlash drafter has it later
        if fl:
            ax.plot([r["step"] for r in fl], [r["eval_tau_flow"] for r in fl], marker="s",
                    label=f"{d.name}: with verifier flow")
        prev = None  # where a run went on with a grown data set (logs record train_seqs since)
        for i, r in enumerate(ev):
            n = r.get("train_seqs")
            x = ev[i - 1]["step"] if i else 0  # the data changed after the previous evaluation
            if n is not None and n != prev and (n, x) not in marked:
                marked.add((n, x))
                ax.axvline(x, color="grey", ls="--", lw=0.8)
                ax.annotate(f"{n} train seqs from here", (x, 0.03), xycoords=("data", "axes fraction"), rotation=90,
                            va="bottom", ha="right", fontsize=8, color="grey")
            prev = n if n is not None else prev
    ax.set_xlabel("training step")
    ax.set_ylabel("held-out τ (teacher-forced, block 16)")
    ax.legend(loc="upper left")
    fig.tight_layout()
    a.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = a.out.with_name(a.out.stem + ".tmp.png")
    fig.savefig(tmp, dpi=110)
    os.replace(tmp, a.out)
    print(a.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
