# DFlow stage 2 with the flow branch at 3x the learning rate; same base, data, steps and lr as runs/up.sh
cd /work/main
D=dflow_trt/drafters; S1=/tmp/s1/dflow_trt/drafters/smollm2-135m-dflash
.venv/bin/dflow-trt train --config $D/smollm2-135m-dflow/training_config.json --out-dir runs/up-dflow-x3 \
  --data-dir runs/data-fresh --steps 13200 --lr 3e-4 --warmup-frac 0.05 --eval-every 200 --init-from $S1 \
  --objective dflow --flow-anchors-per-seq 8 --flow-lr-mult 3 --threads ${THREADS:-2} > runs/up-dflow-x3.log 2>&1
echo TRAINDONE
