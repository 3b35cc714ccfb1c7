#!/bin/bash
# 2026-12-07, late: the shipped DFlash body (38,500 steps) fine-tuned again on every campaign sequence
# with states (220 shards), restarting at a lower rate (3e-4; 1e-3 cost ~6,000 steps last time).
# Phase 1 ran on one thread beside the data campaign; phase 2 resumed the same run on two threads
# once the campaign finished (a resumed run equals an uninterrupted one; only --threads changed).
# Then the silent-relay DFlow from it and the README bench in both settings.
set -e
cd /work/main && source .venv/bin/activate
R=runs/more-dflash-2
C="--target smollm2-135m --data-dir runs/capacity/data --seqs-per-step 2 --anchors-per-seq 16 --block-size 16 --gamma 1.5 --max-len 320 --eval-seqs 24 --precision auto --num-layers 1 --draft-vocab-size 8192"
T="--objective dflash --out-dir $R/dflash --init-from dflow_trt/drafters/smollm2-135m-dflash --steps $((38500 + STEPS)) --lr 3e-4 --warmup-frac 0.04 --eval-every 1000 --ckpt-every 500"
case "$1" in
  train1) OMP_NUM_THREADS=1 dflow-trt train $C $T --threads 1 --max-minutes ${MINUTES:-60} >> $R/dflash.log 2>&1 ;;
  train2) OMP_NUM_THREADS=2 dflow-trt train $C $T --threads 2 --max-minutes ${MINUTES:-60} >> $R/dflash.log 2>&1 ;;
  bench)
    export OMP_NUM_THREADS=2
    python docs/history/relay-2026-12-07/silent_relay_dflow.py $R/dflash/drafter $R/dflow > $R/dflow.log 2>&1
    B="--dataset humaneval,mtbench --num-prompts 48 --max-new-tokens 64 --chat --dflash-drafter $R/dflash/drafter --dflow-drafter $R/dflow"
    dflow-trt bench decode $B --json-out $R/bench.json > $R/bench.log 2>&1
    dflow-trt bench decode $B --verify-threshold 0.05 --alternatives 7 --json-out $R/bench_alternatives.json > $R/bench_alt.log 2>&1 ;;
  ship)  # the README's bench files to history, the new ones in; the drafters in, their logs compressed
    H=docs/history/bench-2026-12-07-evening && mkdir -p $H
    git mv docs/bench.json docs/bench.png docs/bench_alternatives.json docs/bench_alternatives.png $H/
    cp $R/bench.json $R/bench.png $R/bench_alternatives.json $R/bench_alternatives.png docs/
    for o in dflash dflow; do
      src=$R/$o; [ $o = dflash ] && src=$R/dflash/drafter
      dst=dflow_trt/drafters/smollm2-135m-$o
      git rm -rq $dst && mkdir -p $dst && cp $src/* $dst/
      python -c "from dflow_trt.drafter import train_log as t; import sys; t.write(sys.argv[1], t.read(sys.argv[1]), compress=True)" $dst
    done ;;
esac
