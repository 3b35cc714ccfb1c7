#!/bin/bash
# after make-data ends: stop the 1-thread run right after a checkpoint, resume it on 2 threads, then bench
cd /work/main
P=docs/history/more-data-2-2026-12-07/pipeline.sh  # run from runs/more-dflash-2/ in the session
while pgrep -f "dflow-trt make-data" >/dev/null; do sleep 10; done
date; echo "make-data done"
C=runs/more-dflash-2/dflash/checkpoint.pt
m0=$(stat -c %Y $C)
while [ "$(stat -c %Y $C)" = "$m0" ]; do sleep 1; done
sleep 3  # the checkpoint is renamed into place; let the rename settle
pkill -f "dflow-trt train" ; while pgrep -f "dflow-trt train" >/dev/null; do sleep 1; done
date; echo "phase 1 stopped"
MIN=$(( ($(date -d "2026-12-08 01:29" +%s) - $(date +%s)) / 60 ))
echo "phase 2 for at most $MIN minutes"
STEPS=30000 MINUTES=$MIN $P train2
date; echo "phase 2 done"
$P bench
date; echo "bench done"
