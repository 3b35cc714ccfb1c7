# tau of each gamma run on prompts 1-48 of HumanEval and MT-Bench (greedy tau does not depend on timing, so
# these ran at 1 thread beside training); paired per prompt with ../two-layers' 1-layer control (gamma 7).
cd /work/main
B="--dataset humaneval,mtbench --num-prompts 48 --max-new-tokens 64 --chat"
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 COLUMNS=200
.venv/bin/dflow-trt bench $B --modes dflash --dflash-drafter runs/g-dflash/drafter --json-out runs/bg_dflash.json > runs/bg_dflash.txt 2>&1
.venv/bin/dflow-trt bench $B --modes dflash --dflash-drafter runs/g07-dflash/drafter --json-out runs/bg07_dflash.json > runs/bg07_dflash.txt 2>&1
