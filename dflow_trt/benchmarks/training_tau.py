"""`dflow-trt bench training-tau`: τ against training steps for drafters' training logs (held-out,
teacher-forced), as a PNG: how a run's drafters learned, without decoding anything."""

from __future__ import annotations

import json
from pathlib import Path

from ..atomic import atomic_file
from ..drafter import train_log
from ..errors import UserError

SHIPPED = ("smollm2-135m-dflash", "smollm2-135m-dflow")


def shipped_drafters() -> list[Path]:
    return [Path(__file__).resolve().parent.parent / "drafters" / name for name in SHIPPED]


def run(drafters: list[str] | None = None, plot_out: str = "docs/training_tau.png") -> int:
    folders = [Path(d) for d in drafters] if drafters else shipped_drafters()
    logs = {d: train_log.read(d) for d in folders}  # every log read before the plot starts
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


# An H100's dense bf16 peak, and the fraction of it a small-model trainer is assumed to reach: used
# only to turn an extrapolated FLOP count into GPU hours (a planning figure, not a measurement).
H100_BF16_FLOPS, H100_FRACTION = 989e12, 0.3


def compute_curve(drafters: list[str] | None = None, throughput: str = "docs/training_throughput.json",
                  plot_out: str = "docs/training_tau_compute.png", json_out: str = "docs/training_tau_compute.json",
                  targets: tuple[float, ...] = (2.0, 2.5), fit_from: float = 0.1, min_decades: float = 1.0) -> int:
    """Held-out τ against cumulative training FLOPs, with a log-linear fit of each curve's last
    (1 - fit_from) of evaluations (curves spanning at least `min_decades` of compute; the first
    points are warm-up) and the compute it puts at each τ target.

    A step's FLOPs are the trainer's own count at the shipped size (`dflow-trt bench training`,
    FlopCounterMode), DFlash or DFlow by whether the step logged a flow round. Time: at the
    lineage's own pace (its FLOPs over its logged wall time, summed over stages), and at this CPU's
    FLOP/s measured by that benchmark (`cpu_hours_here`, a figure from one run of it). τ here is teacher-forced on held-out training
    sources: decoding HumanEval/MT-Bench gives less (README), so read the targets as lower bounds."""
    import math

    import numpy as np

    folders = [Path(d) for d in drafters] if drafters else shipped_drafters()
    logs = {d: train_log.read(d) for d in folders}
    try:
        summary = json.loads(Path(throughput).read_text())["summary"]
        per = {o: summary[k] for o, k in (("dflash", "new/dflash"), ("dflow", "new_real/dflow"))}
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise UserError(f"{throughput} has no shipped-size FLOP counts ({type(e).__name__}: {e}); pass the JSON "
                        f"`dflow-trt bench training` wrote (docs/training_throughput.json)") from None
    flops = {o: float(v["flops_per_step"]) for o, v in per.items()}
    cpu_rate = {o: float(v["achieved_flops"]) for o, v in per.items()}
    curves, fits = {}, {}
    for d, log in logs.items():
        total, wall, pts = 0.0, train_log.wall_seconds(log), {"no flow": [], "with verifier flow": []}
        for r in log:
            total += flops["dflow" if "train_tau_flow" in r else "dflash"]
            if "eval_tau_noflow" in r:
                pts["no flow"].append((total, r["eval_tau_noflow"]))
            if "eval_tau_flow" in r:
                pts["with verifier flow"].append((total, r["eval_tau_flow"]))
        for kind, xy in pts.items():
            if len(xy) < 4:
                continue
            name = f"{d.name}: {kind}"
            curves[name] = xy
            tail = xy[int(len(xy) * fit_from):]
            if math.log10(tail[-1][0] / tail[0][0]) < min_decades:
                continue  # too short a span to extrapolate from (drawn, not fitted)
            x, y = np.log10([p[0] for p in tail]), np.array([p[1] for p in tail])
            b, a = np.polyfit(x, y, 1)  # τ ≈ a + b log10(FLOPs)
            resid = y - (a + b * x)
            own = total / wall if wall > 0 else None  # this lineage's own pace, on whatever machines it ran
            fit = {"tau_per_decade": float(b), "intercept": float(a), "fit_points": len(tail),
                   "residual_sd": float(resid.std(ddof=2)) if len(tail) > 2 else None,
                   "flops_so_far": total, "tau_last": xy[-1][1], "train_hours": wall / 3600, "own_flops_per_s": own}
            obj = "dflow" if "flow" in kind and "no flow" not in kind else "dflash"
            for t in targets:
                need = 10 ** ((t - a) / b) if b > 0 else math.inf
                fit[f"tau_{t:g}"] = {"flops": need, "times_so_far": need / total,
                                     "cpu_hours_here": need / cpu_rate[obj] / 3600,
                                     "hours_at_own_pace": need / own / 3600 if own else None,
                                     "h100_hours": need / (H100_BF16_FLOPS * H100_FRACTION) / 3600}
            fits[name] = fit
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    for name, xy in curves.items():
        (line,) = ax.plot([p[0] for p in xy], [p[1] for p in xy], marker=".", lw=0.8, label=name)
        f = fits.get(name)
        if f is None:
            continue
        hi = max(f[f"tau_{t:g}"]["flops"] for t in targets)
        if math.isfinite(hi):
            xs = np.logspace(math.log10(xy[int(len(xy) * fit_from)][0]), math.log10(hi), 50)
            ax.plot(xs, f["intercept"] + f["tau_per_decade"] * np.log10(xs), ls=":", color=line.get_color())
    for t in targets:
        ax.axhline(t, color="grey", lw=0.6, ls="--")
    ax.set_xscale("log")
    ax.set_xlabel("cumulative training FLOPs (trainer's count at the shipped size)")
    ax.set_ylabel("held-out τ (teacher-forced, block 16)")
    ax.set_title("τ against training compute; dotted: log-linear fit, extrapolated", fontsize=9)
    ax.legend(loc="upper left", fontsize=7)
    fig.tight_layout()
    with atomic_file(plot_out) as tmp:
        fig.savefig(tmp, dpi=110, format="png")
    plt.close(fig)
    with atomic_file(json_out) as tmp:
        Path(tmp).write_text(json.dumps({"flops_per_step": flops, "cpu_flops_per_s": cpu_rate,
                                         "h100_assumed_flops_per_s": H100_BF16_FLOPS * H100_FRACTION,
                                         "fit_from": fit_from, "fits": fits,
                                         "curves": {k: [[x, y] for x, y in v] for k, v in curves.items()}}, indent=1))
    for name, f in fits.items():
        got = ", ".join(f"τ {t:g}: {f[f'tau_{t:g}']['times_so_far']:.3g}× so far "
                        f"({f[f'tau_{t:g}']['h100_hours']:.2g} H100-h, "
                        f"{f[f'tau_{t:g}']['hours_at_own_pace'] or math.nan:.3g} h at its own pace)" for t in targets)
        print(f"{name}: +{f['tau_per_decade']:.3f} τ per decade of compute; {got}")
    print(plot_out, json_out)
    return 0
