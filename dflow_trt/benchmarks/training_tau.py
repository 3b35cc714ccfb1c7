"""`dflow-trt bench training-tau`: τ against training steps for drafters' train_log.jsonl (held-out,
teacher-forced), as a PNG: how a run's drafters learned, without decoding anything."""

from __future__ import annotations

import json
from pathlib import Path

from ..atomic import atomic_file
from ..errors import UserError

SHIPPED = ("smollm2-135m-dflash", "smollm2-135m-dflow")


def shipped_drafters() -> list[Path]:
    return [Path(__file__).resolve().parent.parent / "drafters" / name for name in SHIPPED]


def _log(folder: Path) -> list[dict]:
    path = folder / "train_log.jsonl"
    if not path.is_file():
        raise UserError(f"{folder} has no train_log.jsonl; pass a drafter folder written by `dflow-trt train`")
    rows = []
    for i, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                raise UserError(f"{path}:{i} is not JSON; pass a log written by `dflow-trt train`") from None
    return rows


def run(drafters: list[str] | None = None, plot_out: str = "docs/training_tau.png") -> int:
    folders = [Path(d) for d in drafters] if drafters else shipped_drafters()
    logs = {d: _log(d) for d in folders}  # every log read before the plot starts
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    marked = set()
    for d, log in logs.items():
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
    with atomic_file(plot_out) as tmp:
        fig.savefig(tmp, dpi=110, format="png")
    plt.close(fig)
    print(plot_out)
    return 0
