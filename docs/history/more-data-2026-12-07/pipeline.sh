#!/bin/bash
# 2026-12-07 evening: the shipped DFlash body fine-tuned on every campaign sequence so far (states first),
# then a silent-relay DFlow from it, then the README bench in both settings.
set -e
cd /work/main && source .venv/bin/activate
R=runs/more-dflash
export OMP_NUM_THREADS=2
while pgrep -f "make-data" >/dev/null || pgrep -f "capacity_sweep.py data" >/dev/null; do sleep 15; done
date
python scripts/capacity_sweep.py data > $R/data-2.log 2>&1
date
C="--target smollm2-135m --data-dir runs/capacity/data --seqs-per-step 2 --anchors-per-seq 16 --block-size 16 --gamma 1.5 --max-len 320 --eval-seqs 24 --threads 2 --precision auto --num-layers 1 --draft-vocab-size 8192"
[ -f $R/dflash/drafter/config.json ] || dflow-trt train $C --objective dflash --out-dir $R/dflash \
    --init-from dflow_trt/drafters/smollm2-135m-dflash --steps $((16500 + ${STEPS:-22000})) --lr 1e-3 \
    --warmup-frac 0.04 --eval-every 1000 --ckpt-every 500 --max-minutes ${MINUTES:-56} > $R/dflash.log 2>&1
date
[ -f $R/dflow/config.json ] || python docs/history/relay-2026-12-07/silent_relay_dflow.py $R/dflash/drafter $R/dflow > $R/dflow.log 2>&1
date
B="--dataset humaneval,mtbench --num-prompts 48 --max-new-tokens 64 --chat --dflash-drafter $R/dflash/drafter --dflow-drafter $R/dflow"
dflow-trt bench decode $B --json-out $R/bench.json > $R/bench.log 2>&1
date
dflow-trt bench decode $B --verify-threshold 0.05 --alternatives 7 --json-out $R/bench_alternatives.json > $R/bench_alt.log 2>&1
date
