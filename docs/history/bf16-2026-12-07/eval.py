"""Teacher-forced held-out τ of the fp32 and bf16 arms (and the shipped DFlash), paired per sequence."""
import json, sys
from dataclasses import replace
sys.path.insert(0, "scripts")
import torch
import capacity_sweep as cs
from dflow_trt.drafter.io import load_drafter, read_config
from dflow_trt.targets import load_target

cs.DATA = "runs/bf16/data"
torch.set_num_threads(2)
target = load_target("smollm2-135m", tap_layers=read_config(cs.SHIPPED["dflash"]).tap_layers)
sets = cs.heldout_sets(target, 48, 128)
drafters = {p: load_drafter(f"runs/bf16/train-{p}/drafter", target) for p in ("fp32", "bf16")}
drafters["shipped"] = load_drafter(cs.SHIPPED["dflash"], target)
cfg = replace(cs.train_config("l1", 1), anchors_per_seq=16)
rep = cs._evaluate_all(target, drafters, sets, cfg, "fp32")
logs = {p: [json.loads(x) for x in open(f"runs/bf16/train-{p}/drafter/train_log.jsonl")] for p in ("fp32", "bf16")}
out = {"settings": {"data": "data/smollm2-135m-p7658 shards 0-15 (1,024 sequences), taps-only state cache",
                    "train": "DFlash from scratch, 2,000 steps, 2 seqs x 16 anchors, 1 layer, vocab 8192, gamma 1.5, lr 1e-3, seed 0, 1 thread each, the two arms side by side",
                    "eval": "teacher-forced tau per sequence, 48 HumanEval + 48 MT-Bench greedy continuations (128 tokens) and the data's held-out sequences, 16 anchors"},
       "heldout": rep,
       "train": {p: {"wall_s": round(l[-1]["elapsed_s"], 1), "last_loss_mean_50": round(sum(r["loss"] for r in l[-50:]) / 50, 4),
                     "curve": [(r["step"], r["eval_tau_noflow"]) for r in l if "eval_tau_noflow" in r]} for p, l in logs.items()}}
from dflow_trt.benchmarks.report import write_json
print(write_json("docs/history/bf16-2026-12-07/tau_fp32_vs_bf16.json", out))
