# Stage 3 (2026-12-05): 1,024 more fresh prompts (4352-5375). DFlash 1 layer vs DFlash grown to 2 layers,
# then DFlow grown to 2 layers; each from its stage-2 drafter (shipped then), same data, steps and lr.
cd /work/main
set -e
while ! grep -q DATADONE runs/data2.log; do sleep 20; done
mkdir -p /tmp/stage2
git archive f3d614c dflow_trt/drafters | tar -x -C /tmp/stage2 || exit 1   # the stage-2 drafters (shipped until stage 4)
D=/tmp/stage2/dflow_trt/drafters; F="--data-dir runs/data-fresh2 --steps 14400 --lr 3e-4 --warmup-frac 0.05 --eval-every 200"
.venv/bin/dflow-trt train --config $D/smollm2-135m-dflash/training_config.json --out-dir runs/s3-dflash1 $F --init-from $D/smollm2-135m-dflash --threads 1 > runs/s3-dflash1.log 2>&1 &
P1=$!
.venv/bin/dflow-trt train --config $D/smollm2-135m-dflash/training_config.json --out-dir runs/s3-dflash2 $F --init-from $D/smollm2-135m-dflash --num-layers 2 --threads 1 > runs/s3-dflash2.log 2>&1 &
P2=$!
wait $P1
G="--config $D/smollm2-135m-dflow/training_config.json --out-dir runs/s3-dflow2 $F --init-from $D/smollm2-135m-dflow --num-layers 2"
.venv/bin/dflow-trt train $G --threads 1 > runs/s3-dflow2.log 2>&1 &
P3=$!
wait $P2
echo DFLASHDONE
kill $P3; wait $P3 || true
.venv/bin/dflow-trt train $G --threads 2 >> runs/s3-dflow2.log 2>&1
echo TRAINDONE
