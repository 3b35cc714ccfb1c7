# Stage 4 (2026-12-05): the position weighting gamma. Each run starts from its stage-2 drafter (shipped then) and
# trains 1,200 more steps (13,200 -> 14,400) on stage 3's fresh prompts (../two-layers/make_data.sh),
# lr 3e-4, 5% warm-up, cosine: the budget of stage 3's 1-layer DFlash control (gamma 7), which is the baseline.
cd /work/main
mkdir -p /tmp/stage2
git archive f3d614c dflow_trt/drafters | tar -x -C /tmp/stage2 || exit 1   # the stage-2 drafters (shipped until stage 4)
D=/tmp/stage2/dflow_trt/drafters; F="--data-dir runs/data-fresh2 --steps 14400 --lr 3e-4 --warmup-frac 0.05 --eval-every 200"
.venv/bin/dflow-trt train --config $D/smollm2-135m-dflash/training_config.json --out-dir runs/g-dflash $F --init-from $D/smollm2-135m-dflash --threads 2 --gamma 1.5
# then side by side at 1 thread each:
.venv/bin/dflow-trt train --config $D/smollm2-135m-dflow/training_config.json --out-dir runs/g-dflow $F --init-from $D/smollm2-135m-dflow --threads 1 --gamma 1.5 &
.venv/bin/dflow-trt train --config $D/smollm2-135m-dflash/training_config.json --out-dir runs/g07-dflash $F --init-from $D/smollm2-135m-dflash --threads 1 --gamma 0.7
wait
