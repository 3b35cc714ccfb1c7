"""Drafter capacity by measurement (issue 27, item 4): held-out τ per CPU-hour of depth, anchors and
draft vocabulary, each arm a DFlash drafter trained from scratch for the same wall time.

    python scripts/capacity_sweep.py data                  # runs/capacity/data: the committed campaign shards + states
    python scripts/capacity_sweep.py probe l1 l3 l5 a64    # seconds per step of each arm (a few steps, one thread)
    python scripts/capacity_sweep.py train l3 --minutes 25 --sec-per-step 1.4   # one arm; run two at once, one per core
    python scripts/capacity_sweep.py eval --json-out docs/capacity_sweep.json   # every trained arm, same held-out data
    python scripts/capacity_sweep.py plot                  # docs/capacity_sweep.png: τ against training minutes
    python scripts/capacity_sweep.py vocab --json-out docs/capacity_vocab.json  # shipped drafters cut to a smaller vocab

`train` sizes each arm's learning-rate schedule to its time (`steps` = minutes / measured seconds per
step, `--max-minutes` as the stop), so every arm ends its schedule: equal CPU time, not equal steps.
`eval` gives each arm's teacher-forced greedy τ (the trainer's own `evaluate`, one seed, the same
anchors for every arm) on three held-out sets: the target's greedy continuations of the first 48
HumanEval and 48 MT-Bench prompts, and the data's own held-out sequences; per-prompt pairs against
`l1`. `vocab` needs no training: the shipped drafters' draft vocabulary is cut to the K of their 8,192
draft tokens the target says most often (same weights), which shows what a smaller vocabulary would lose.
History and results: docs/history/2026-12-07-capacity.md.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import time
from dataclasses import replace
from pathlib import Path

import torch

from dflow_trt.drafter import train_log

SOURCES = ("data/smollm2-135m-p7658", "data/smollm2-135m-p5376")  # prompts the shipped drafters never saw
DATA = "runs/capacity/data"
RUNS = "runs/capacity"
SHIPPED = {"dflash": "dflow_trt/drafters/smollm2-135m-dflash", "dflow": "dflow_trt/drafters/smollm2-135m-dflow"}
# the shipped drafters' settings (γ 1.5, 2 sequences × 16 anchors, one layer, 8,192 draft tokens), then one change each
BASE = {"num_layers": 1, "anchors_per_seq": 16, "draft_vocab_size": 8192}
ARMS = {"l1": {}, "l2": {"num_layers": 2}, "l3": {"num_layers": 3}, "l5": {"num_layers": 5},
        "a64": {"anchors_per_seq": 64}, "v4k": {"draft_vocab_size": 4096}, "v16k": {"draft_vocab_size": 16384}}


def train_config(arm: str, steps: int, max_minutes: float = 0.0, out: str | None = None):
    from dflow_trt.training.trainer import TrainConfig

    return TrainConfig(target="smollm2-135m", data_dir=DATA, out_dir=out or f"{RUNS}/{arm}", objective="dflash",
                       steps=steps, seqs_per_step=2, block_size=16, gamma=1.5, lr=1e-3, warmup_frac=0.04,
                       max_len=320, eval_every=100, eval_seqs=24, ckpt_every=50, seed=0, threads=1,
                       states="auto", precision="fp32", max_minutes=max_minutes, **{**BASE, **ARMS[arm]})


def cmd_data(a) -> None:
    """One data folder of every committed campaign shard (renamed per source), then its tap states."""
    from dflow_trt.cli import main as cli
    from dflow_trt.training.data import shard_path

    out = Path(DATA)
    out.mkdir(parents=True, exist_ok=True)
    shards, manifest = [], None
    for src in map(Path, SOURCES):
        m = json.loads((src / "manifest.json").read_text())
        manifest = manifest or m
        for s in m["shards"]:
            f = shard_path(src, s)
            if f.exists():
                name = f"p{m['first_prompt']}-{s}"
                if not shard_path(out, name).exists():
                    shutil.copyfile(f, out / f"p{m['first_prompt']}-{f.name}")
                shards.append(name)
    (out / "manifest.json").write_text(json.dumps({**manifest, "shards": shards, "sources_dirs": SOURCES}, indent=1))
    print(f"{len(shards)} shards in {out}")
    cli(["cache-states", "--target", "smollm2-135m", "--data-dir", DATA, "--no-kv"])


def cmd_probe(a) -> None:
    from dflow_trt.training.trainer import train

    for arm in a.arms:
        out = f"{RUNS}/probe-{arm}"
        shutil.rmtree(out, ignore_errors=True)
        train(replace(train_config(arm, a.steps, out=out), eval_every=10**6))
        log = train_log.read(f"{out}/drafter")
        s = (log[-1]["elapsed_s"] - log[1]["elapsed_s"]) / (len(log) - 2)  # the first step loads and warms up
        print(json.dumps({"arm": arm, "sec_per_step": round(s, 3)}), flush=True)


def cmd_train(a) -> None:
    from dflow_trt.training.trainer import train

    steps = max(1, int(60 * a.minutes / a.sec_per_step))
    t0 = time.perf_counter()
    train(train_config(a.arm, steps, max_minutes=a.minutes * 1.1))
    print(json.dumps({"arm": a.arm, "steps": steps, "wall_s": round(time.perf_counter() - t0, 1)}))


def _mean_se(xs: list[float]) -> tuple[float, float]:
    from dflow_trt.benchmarks.report import standard_error

    return statistics.fmean(xs), standard_error(xs)


def heldout_sets(target, n: int, tokens: int) -> dict[str, list]:
    """The target's greedy continuations of held-out prompts, as training `Sequence`s (ids -1, -2, ...)."""
    from dflow_trt.decoding.loop import generate
    from dflow_trt.decoding.options import DecodeOptions
    from dflow_trt.evalsets import humaneval_prompts, mtbench_prompts
    from dflow_trt.prompting import encode_prompt
    from dflow_trt.training.data import Sequence, load_dataset
    from dflow_trt.training.trainer import _fits

    sets = {}
    for name, texts in (("humaneval", humaneval_prompts()[:n]), ("mtbench", mtbench_prompts()[:n])):
        ps = [encode_prompt(target.tokenizer, t, chat=True)[:256] for t in texts]  # as `bench decode` encodes them
        rs = generate(target, None, ps, DecodeOptions(mode="ar", max_new_tokens=tokens)).token_ids
        sets[name] = [Sequence(-1 - i, p, r) for i, (p, r) in enumerate(zip(ps, rs))]
    sets["data"] = load_dataset(Path(DATA), target)[1]
    return {k: _fits(v, 320) for k, v in sets.items()}


def per_sequence_tau(obj, seqs: list, cfg) -> list[float]:
    """Teacher-forced τ of each sequence alone (the trainer's `evaluate`, same seed for every drafter)."""
    from dflow_trt.training.trainer import evaluate

    return [evaluate(obj, [s], replace(cfg, seqs_per_step=1, eval_seqs=1))["tau_noflow"] for s in seqs]


def _evaluate_all(target, drafters: dict, sets: dict, cfg, base: str) -> dict:
    from dflow_trt.training.trainer import Objective

    report = {}
    for name, seqs in sets.items():
        per = {}
        for k, m in drafters.items():
            with torch.no_grad():
                per[k] = per_sequence_tau(Objective(m, target, cfg), seqs, cfg)
        rows = {}
        for k, v in per.items():
            mean, se = _mean_se(v)
            rows[k] = {"tau": round(mean, 4), "se": round(se, 4)}
            if k != base:
                dm, dse = _mean_se([x - y for x, y in zip(v, per[base])])
                rows[k][f"minus_{base}"] = {"mean": round(dm, 4), "se": round(dse, 4)}
        report[name] = {"sequences": len(seqs), "drafters": rows}
        print(name, json.dumps(rows), flush=True)
    return report


def cmd_eval(a) -> None:
    from dflow_trt.drafter.io import load_drafter, read_config
    from dflow_trt.targets import load_target

    torch.set_num_threads(a.threads)
    target = load_target("smollm2-135m", tap_layers=read_config(SHIPPED["dflash"]).tap_layers)
    sets = heldout_sets(target, a.prompts, a.tokens)
    arms = [arm for arm in ARMS if Path(f"{RUNS}/{arm}/drafter/config.json").exists()]
    drafters = {arm: load_drafter(f"{RUNS}/{arm}/drafter", target) for arm in arms}
    drafters["shipped"] = load_drafter(SHIPPED["dflash"], target)  # 14,400 steps on other prompts: a yardstick
    cfg = replace(train_config("l1", 1), anchors_per_seq=a.anchors)  # the same anchors for every drafter
    report = {"settings": {"prompts_per_set": a.prompts, "tokens": a.tokens, "eval_anchors_per_seq": a.anchors,
                           "teacher_forced": True, "greedy": True, "block_size": 16},
              "arms": {}, "heldout": _evaluate_all(target, drafters, sets, cfg, "l1")}
    for arm in arms:
        log = train_log.read(f"{RUNS}/{arm}/drafter")
        tcfg = json.loads(Path(f"{RUNS}/{arm}/drafter/training_config.json").read_text())
        report["arms"][arm] = {"change": ARMS[arm], "steps": log[-1]["step"], "scheduled_steps": tcfg["steps"],
                               "wall_s": round(log[-1]["elapsed_s"], 1),
                               "params": sum(p.numel() for p in drafters[arm].parameters() if p.requires_grad),
                               "curve": [(r["step"], round(r["elapsed_s"], 1), r["eval_tau_noflow"])
                                         for r in log if "eval_tau_noflow" in r]}
    _write(report, a.json_out)


def cmd_vocab(a) -> None:
    """The shipped drafters with their draft vocabulary cut to its K most frequent tokens (K < 8,192)."""
    from dflow_trt.drafter.io import load_drafter, read_config
    from dflow_trt.targets import load_target
    from dflow_trt.training.data import load_dataset

    torch.set_num_threads(a.threads)
    target = load_target("smollm2-135m", tap_layers=read_config(SHIPPED["dflash"]).tap_layers)
    sets = heldout_sets(target, a.prompts, a.tokens)
    report = {"settings": {"prompts_per_set": a.prompts, "tokens": a.tokens, "eval_anchors_per_seq": a.anchors},
              "coverage": {}, "objectives": {}}
    # the draft vocabulary is stored sorted by token id; rank its entries by how often the target says them
    # in the training data here (the shipped drafters' own data is not committed: same target, other prompts)
    counts = torch.bincount(torch.tensor([t for s in load_dataset(Path(DATA), target)[0] for t in s.response_ids]),
                            minlength=target.info.vocab_size)
    vocab = load_drafter(SHIPPED["dflash"], target).draft_vocab  # [8192] token ids, the same for both drafters
    order = counts[vocab].argsort(descending=True, stable=True)  # draft indices, most frequent first
    for objective in a.objectives:
        path, drafters = SHIPPED[objective], {}
        for k in a.sizes:
            m = load_drafter(path, target)
            assert torch.equal(m.draft_vocab, vocab)
            if k < vocab.numel():  # the same weights over the k most frequent: a k-token draft vocabulary
                m.draft_vocab = vocab[order[:k]].sort().values
                assert m.draft_head().shape[0] == k
            drafters[f"k{k}"] = m
        cfg = replace(train_config("l1", 1), anchors_per_seq=a.anchors)
        report["objectives"][objective] = _evaluate_all(target, drafters, sets, cfg, f"k{max(a.sizes)}")
    for name, seqs in sets.items():  # how many response tokens each cut vocabulary holds at all
        toks = torch.tensor([t for s in seqs for t in s.response_ids])
        report["coverage"][name] = {f"k{k}": round(torch.isin(toks, vocab[order[:k]]).float().mean().item(), 4)
                                    for k in a.sizes}
    print(json.dumps(report["coverage"]))
    _write(report, a.json_out)


def cmd_plot(a) -> None:
    """τ on the trainer's 24 held-out sequences against CPU-seconds, one line per arm (from `eval`'s JSON)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rep = json.loads(Path(a.json_in).read_text())
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for arm, v in rep["arms"].items():
        _, secs, taus = zip(*v["curve"])
        he = rep["heldout"]["humaneval"]["drafters"][arm]["tau"]
        change = ", ".join(f"{k.replace('_', ' ')} {x}" for k, x in v["change"].items()) or "the shipped settings"
        ax.plot([x / 60 for x in secs], taus, marker=".", label=f"{arm} ({change}): HumanEval {he:.3f}")
    ax.set_xlabel("training minutes, one core of a 2-core AMD EPYC (AVX2)")
    ax.set_ylabel("teacher-forced τ, 24 held-out sequences")
    ax.set_title("DFlash drafters from scratch, same data and time (block 16)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(a.plot_out, dpi=110)
    print(f"wrote {a.plot_out}")


def _write(report: dict, path: str | None) -> None:
    from dflow_trt.benchmarks.report import write_json

    print(f"wrote {write_json(path, report)}" if path else json.dumps(report, indent=1))


def main() -> None:
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("data")
    pr = sub.add_parser("probe")
    pr.add_argument("arms", nargs="+", choices=list(ARMS))
    pr.add_argument("--steps", type=int, default=8)
    t = sub.add_parser("train")
    t.add_argument("arm", choices=list(ARMS))
    t.add_argument("--minutes", type=float, required=True)
    t.add_argument("--sec-per-step", type=float, required=True, help="from `probe`")
    for name in ("eval", "vocab"):
        e = sub.add_parser(name)
        e.add_argument("--prompts", type=int, default=48)
        e.add_argument("--tokens", type=int, default=64)
        e.add_argument("--anchors", type=int, default=16)
        e.add_argument("--threads", type=int, default=1)
        e.add_argument("--json-out", default=None)
    pl = sub.add_parser("plot")
    pl.add_argument("--json-in", default="docs/capacity_sweep.json")
    pl.add_argument("--plot-out", default="docs/capacity_sweep.png")
    sub.choices["vocab"].add_argument("--sizes", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    sub.choices["vocab"].add_argument("--objectives", nargs="+", choices=list(SHIPPED), default=["dflash"])
    a = p.parse_args()
    {"data": cmd_data, "probe": cmd_probe, "train": cmd_train, "eval": cmd_eval, "vocab": cmd_vocab,
     "plot": cmd_plot}[a.cmd](a)


if __name__ == "__main__":
    main()
