"""Equal-budget comparison of the two relays (docs/history/2026-12-07-paper-relay.md).

    python scripts/compare_relays.py train ours  --steps N     # then: train paper --steps N
    python scripts/compare_relays.py eval  --decode-prompts 12 --json-out docs/relay_compare.json
    # equal wall time instead of equal steps: each arm's steps sized to the budget, --max-minutes as a stop
    python scripts/compare_relays.py train ours --steps 1100 --lr 1e-4 --max-minutes 62 --tag _t62

`train`: a DFlow drafter with --relay <ours|paper>, started from the shipped DFlash drafter (its
weights; the relay starts silent, so step 0 drafts exactly as that drafter), on the committed data
data/smollm2-135m-p5376 (prompts the shipped drafters never saw), the shipped drafters' settings,
one thread; runs/relay-<relay>. `eval`: on that data's held-out sequences, teacher-forced greedy τ of
each drafter's rounds (the trainer's own `evaluate`, same seed: the same first-round anchors), and
decode τ (`generate`, greedy, block 16, hints off so only the relay differs) of the DFlash start and
both trained drafters on the held-out prompts, paired per prompt.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import replace
from pathlib import Path

import torch

from dflow_trt.drafter import train_log

DATA = "data/smollm2-135m-p5376"
START = "dflow_trt/drafters/smollm2-135m-dflash"
SHIPPED = "dflow_trt/drafters/smollm2-135m-dflow"
BASE = 14400  # the shipped DFlash drafter's last step (--init-from counts on from there)


def train_config(relay: str, steps: int, out: str, lr: float = 3e-4, max_minutes: float = 0.0):
    from dflow_trt.training.trainer import TrainConfig

    return TrainConfig(target="smollm2-135m", data_dir=DATA, out_dir=out, objective="dflow", relay=relay,
                       steps=BASE + steps, seqs_per_step=2, anchors_per_seq=16, flow_anchors_per_seq=8, block_size=16,
                       gamma=1.5, lr=lr, flow_lr_mult=10.0, warmup_frac=0.05, max_len=320,
                       eval_every=10**6, eval_seqs=4, ckpt_every=25, seed=0, threads=1, states="off",
                       init_from=START, max_minutes=max_minutes)


def cmd_train(a) -> None:
    from dflow_trt.training.trainer import train

    t0 = time.perf_counter()
    train(train_config(a.relay, a.steps, f"runs/relay-{a.relay}{a.tag}", a.lr, a.max_minutes))
    print(json.dumps({"relay": a.relay, "steps": a.steps, "lr": a.lr, "wall_s": round(time.perf_counter() - t0, 1)}))


def _mean_se(xs: list[float]) -> tuple[float, float]:
    from dflow_trt.benchmarks.report import standard_error

    return statistics.fmean(xs), standard_error(xs)


def cmd_eval(a) -> None:
    from dflow_trt.decoding.loop import generate
    from dflow_trt.decoding.options import DecodeOptions
    from dflow_trt.drafter.io import build_drafter, load_drafter, read_config
    from dflow_trt.drafter.runtime import TorchDrafter
    from dflow_trt.targets import load_target
    from dflow_trt.training.data import load_dataset
    from dflow_trt.training.trainer import Objective, _fits, _init_from, evaluate

    torch.set_num_threads(1)
    taps = read_config(START).tap_layers
    target = load_target("smollm2-135m", tap_layers=taps)
    _, heldout = load_dataset(Path(DATA), target)
    heldout = _fits(heldout, 320)
    report = {"heldout_seqs": len(heldout), "teacher_forced": {}, "decode": {}}
    drafters = {}
    for relay in ("ours", "paper"):
        cfg = replace(train_config(relay, 1, "unused"), eval_seqs=len(heldout))
        run = f"runs/relay-{relay}{a.tag}"
        start = build_drafter(target, read_config(f"{run}/drafter"), seed=0)
        _init_from(START, target, start, replace(cfg, steps=BASE + 1))  # the step-0 drafter (relay silent)
        final = load_drafter(f"{run}/drafter", target)
        for name, m in (("start", start), ("trained", final)):
            t0 = time.perf_counter()
            report["teacher_forced"][f"{relay}-{name}"] = {**evaluate(Objective(m, target, cfg), heldout, cfg),
                                                          "s": round(time.perf_counter() - t0, 1)}
            print(relay, name, report["teacher_forced"][f"{relay}-{name}"], flush=True)
        drafters[f"dflow-{relay}"] = final
        log = train_log.read(f"{run}/drafter")
        mine = [r for r in log if r["step"] > BASE]
        report[f"train_{relay}"] = {"steps": len(mine), "wall_s": round(train_log.wall_seconds(mine), 1),
            "loss_first10": sum(r["loss"] for r in mine[:10]) / 10, "loss_last10": sum(r["loss"] for r in mine[-10:]) / 10}
    drafters = {"dflash-start": load_drafter(START, target), **drafters}
    if a.with_shipped:  # the shipped DFlow drafter (its own lineage and data; hints off like the others)
        drafters["dflow-shipped"] = load_drafter(SHIPPED, target)
    prompts = [s.prompt_ids for s in heldout[:a.decode_prompts]]
    per = {k: [] for k in drafters}
    for i, p in enumerate(prompts):  # drafters interleaved prompt by prompt
        for k, m in drafters.items():
            mode = "dflash" if k.startswith("dflash") else "dflow"
            r = generate(target, TorchDrafter(m), [p], DecodeOptions(mode=mode, block_size=16, max_new_tokens=a.max_new,
                                                                    hint_trust=0.0))
            per[k].append(r.tau)
        print(i, {k: round(v[-1], 3) for k, v in per.items()}, flush=True)
    for k, v in per.items():
        m, se = _mean_se(v)
        report["decode"][k] = {"tau_mean_over_prompts": round(m, 4), "se": round(se, 4), "per_prompt": v}
    pairs = [("dflow-paper", "dflow-ours"), ("dflow-ours", "dflash-start"), ("dflow-paper", "dflash-start")]
    if a.with_shipped:
        pairs += [("dflow-shipped", "dflash-start"), ("dflow-paper", "dflow-shipped")]
    for x, y in pairs:
        m, se = _mean_se([a_ - b_ for a_, b_ in zip(per[x], per[y])])
        report["decode"][f"{x} - {y}"] = {"mean": round(m, 4), "se": round(se, 4)}
    report["decode_settings"] = {"prompts": len(prompts), "max_new_tokens": a.max_new, "block_size": 16,
                                 "greedy": True, "hint_trust": 0.0, "threads": 1}
    text = json.dumps(report, indent=1)
    print(text)
    if a.json_out:
        Path(a.json_out).write_text(text + "\n")


def main() -> None:
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("train")
    t.add_argument("relay", choices=["ours", "paper"])
    t.add_argument("--steps", type=int, default=150)
    t.add_argument("--lr", type=float, default=3e-4)
    t.add_argument("--max-minutes", type=float, default=0.0, help="stop (and save) at the first step past this")
    t.add_argument("--tag", default="", help="run folder suffix: runs/relay-<relay><tag>")
    e = sub.add_parser("eval")
    e.add_argument("--tag", default="")
    e.add_argument("--with-shipped", action="store_true", help="also decode with the shipped DFlow drafter")
    e.add_argument("--decode-prompts", type=int, default=12)
    e.add_argument("--max-new", type=int, default=64)
    e.add_argument("--json-out", default=None)
    a = p.parse_args()
    {"train": cmd_train, "eval": cmd_eval}[a.cmd](a)


if __name__ == "__main__":
    main()
