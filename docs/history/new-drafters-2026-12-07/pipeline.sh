#!/bin/bash
# DFlash from scratch (bf16, every cached campaign sequence) -> DFlow from it -> README bench, both settings.
# Defaults are the values the 2026-12-07 run used (steps sized to the minutes on its 2-core EPYC).
set -e
cd "$(git rev-parse --show-toplevel)" && source .venv/bin/activate
R=runs/train-2026-12-07b
mkdir -p $R
export OMP_NUM_THREADS=2
python scripts/capacity_sweep.py data > $R/data.log 2>&1   # resumable per shard
date
C="--target smollm2-135m --data-dir runs/capacity/data --seqs-per-step 2 --anchors-per-seq 16 --block-size 16 --gamma 1.5 --max-len 320 --eval-seqs 24 --threads 2 --precision auto"
[ -f runs/next-dflash/drafter/config.json ] || dflow-trt train $C --objective dflash --out-dir runs/next-dflash \
    --steps ${DFLASH_STEPS:-16500} --lr 1e-3 --warmup-frac 0.04 --eval-every 1000 --ckpt-every 500 \
    --max-minutes ${DFLASH_MIN:-42} > $R/dflash.log 2>&1
date
BASE=$(python -c "import json;print(json.loads(open('runs/next-dflash/drafter/train_log.jsonl').read().splitlines()[-1])['step'])")
[ -f runs/next-dflow/drafter/config.json ] || dflow-trt train $C --objective dflow --init-from runs/next-dflash/drafter \
    --out-dir runs/next-dflow --flow-anchors-per-seq 8 --flow-lr-mult 10 --steps $((BASE + ${DFLOW_STEPS:-700})) \
    --lr 3e-4 --warmup-frac 0.02 --eval-every 250 --ckpt-every 100 --max-minutes ${DFLOW_MIN:-20} > $R/dflow.log 2>&1
date
B="--dataset humaneval,mtbench --num-prompts 48 --max-new-tokens 64 --chat --dflash-drafter runs/next-dflash/drafter --dflow-drafter runs/next-dflow/drafter"
dflow-trt bench decode $B --json-out $R/bench.json > $R/bench.log 2>&1
date
dflow-trt bench decode $B --verify-threshold 0.05 --alternatives 7 --json-out $R/bench_alternatives.json > $R/bench_alt.log 2>&1
date
