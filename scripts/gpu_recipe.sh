#!/usr/bin/env bash
# The GPU recipe, in one call on one GPU host (docs/gpu_recipe.md): from the target's GGUF and this
# repository to both drafters trained at GPU batch sizes, with their lineage and a held-out τ.
#   check    bad input (target, inputs, CUDA) is one `error:` line and exit 2, before any work
#   convert  join the GGUF's parts (sha256-pinned) and convert it once   (~1 min)
#   data     greedy target responses to the packed prompt pool, batched (DATA_MIN, then what is complete)
#   dflash   train the DFlash drafter                                      (TRAIN_MIN or STEPS)
#   dflow    train the DFlow drafter                                       (TRAIN_MIN or STEPS)
#   eval     held-out τ of both, whole block, block EVAL_BLOCK (HumanEval, MT-Bench; lossless check)
#   collect  $OUT: <objective>/config.json + weight shards (<= 16 MiB each), recipe.json (lineage), recipe.log
# Inputs come from `python -m dflow_trt.training.recipe pack` on the repository's machine (INPUTS).
# Runs from the repo root without installing the package. STAGES picks stages (a warm machine
# keeps RUN_DIR between calls, so a recipe may also be split over two calls).
set -uo pipefail
TARGET=${TARGET:-smollm2-135m}
DEVICE=${DEVICE:-cuda}
OUT=${OUT:-build/recipe-out}
RUN_DIR=${RUN_DIR:-build/recipe}
INPUTS=${INPUTS:-build/recipe-in}
STAGES=${STAGES:-convert data dflash dflow eval collect}
NUM_PROMPTS=${NUM_PROMPTS:-25371}   # at most what `pack` wrote; DATA_MIN decides how many get made
MAX_NEW_TOKENS=${MAX_NEW_TOKENS:-128}
GEN_BATCH=${GEN_BATCH:-256}         # prompts decoded together (also the data shard size)
GEN_BACKEND=${GEN_BACKEND:-torch}   # make-data's target forward: static is 1.3x eager on a CPU, not yet run on a GPU
DATA_MIN=${DATA_MIN:-1.5}
STEPS=${STEPS:-2000}                # the learning-rate schedule's length; TRAIN_MIN may stop a run before
TRAIN_MIN=${TRAIN_MIN:-2}
SEQS=${SEQS:-64}                    # sequences per step
ANCHORS=${ANCHORS:-16}              # blocks per sequence
FLOW_ANCHORS=${FLOW_ANCHORS:-8}     # dflow: blocks per sequence that get the self-conditioned round
BLOCK=${BLOCK:-16}
LAYERS=${LAYERS:-1}
DRAFT_VOCAB=${DRAFT_VOCAB:-8192}
MAX_LEN=${MAX_LEN:-320}
LR=${LR:-6e-4}
GAMMA=${GAMMA:-7}
EVAL_EVERY=${EVAL_EVERY:-250}
CKPT_EVERY=${CKPT_EVERY:-500}
SHARD_MB=${SHARD_MB:-16}
TRAIN_EXTRA=${TRAIN_EXTRA:-}        # more `dflow-trt train` flags for both objectives
EVAL_PROMPTS=${EVAL_PROMPTS:-12}    # per held-out set
EVAL_TOKENS=${EVAL_TOKENS:-64}
EVAL_BLOCK=${EVAL_BLOCK:-16}
EVAL_TIMEOUT=${EVAL_TIMEOUT:-240}
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TQDM_MININTERVAL=${TQDM_MININTERVAL:-15}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export DFLOW_TRT_CACHE=${DFLOW_TRT_CACHE:-$RUN_DIR/cache}

# the gguf package the GGUF conversion reads (absent from the GPU image): from the packed wheel
if compgen -G "$INPUTS/wheels/*.whl" >/dev/null && ! $PY -c "import gguf" 2>/dev/null; then
  $PY -m pip install -q --no-index --no-deps --no-compile --target /tmp/dflow_trt_site "$INPUTS"/wheels/*.whl \
    && export PYTHONPATH="$PYTHONPATH:/tmp/dflow_trt_site"
fi
$PY -m dflow_trt.training.recipe check --target "$TARGET" --device "$DEVICE" --inputs "$INPUTS" || exit $?

mkdir -p "$OUT" "$RUN_DIR"
exec > >(tee -a "$OUT/recipe.log") 2>&1
want() { [[ " $STAGES " == *" $1 "* ]]; }
# stage NAME LIMIT_S FATAL CMD...: run with a time limit, record seconds and exit code in stages.jsonl
stage() {
  local name=$1 limit=$2 fatal=$3; shift 3
  echo "== $(date -u +%H:%M:%S) $name (limit ${limit}s): $*"
  local t0; t0=$(date +%s%N)
  timeout -s INT -k 30 "$limit" "$@"; local rc=$?
  local ms=$(( ($(date +%s%N) - t0) / 1000000 ))
  printf '{"stage": "%s", "seconds": %d.%03d, "rc": %d}\n' "$name" $((ms / 1000)) $((ms % 1000)) "$rc" >> "$RUN_DIR/stages.jsonl"
  echo "== $name: exit $rc after $((ms / 1000)) s"
  if [ "$rc" -ne 0 ] && [ "$fatal" = 1 ]; then echo "recipe: stage $name failed (exit $rc); see $OUT/recipe.log"; exit "$rc"; fi
}
secs() { $PY -c "import sys; print(int(float(sys.argv[1]) * 60 + float(sys.argv[2])))" "$1" "$2"; }

{ date -u; command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
  $PY -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"; }
CLI="$PY -m dflow_trt.cli"
want convert && stage convert 300 1 $PY -m dflow_trt.training.recipe convert --target "$TARGET" --inputs "$INPUTS" --run-dir "$RUN_DIR"
want data && stage data "$(secs "$DATA_MIN" 180)" 1 $CLI make-data --target "$TARGET" --device "$DEVICE" \
  --data-dir "$RUN_DIR/data" --prompts-file "$INPUTS/prompts.jsonl.gz" --num-prompts "$NUM_PROMPTS" \
  --max-new-tokens "$MAX_NEW_TOKENS" --batch-size "$GEN_BATCH" --shard-size "$GEN_BATCH" --backend "$GEN_BACKEND" --max-minutes "$DATA_MIN"
for obj in dflash dflow; do
  flow=(); [ "$obj" = dflow ] && flow=(--flow-anchors-per-seq "$FLOW_ANCHORS")
  # shellcheck disable=SC2086  # TRAIN_EXTRA is a list of flags
  want $obj && stage $obj "$(secs "$TRAIN_MIN" 240)" 1 $CLI train --objective $obj --target "$TARGET" --device "$DEVICE" \
    --data-dir "$RUN_DIR/data" --out-dir "$RUN_DIR/train-$obj" --steps "$STEPS" --max-minutes "$TRAIN_MIN" \
    --seqs-per-step "$SEQS" --anchors-per-seq "$ANCHORS" "${flow[@]}" --block-size "$BLOCK" --num-layers "$LAYERS" \
    --draft-vocab-size "$DRAFT_VOCAB" --max-len "$MAX_LEN" --lr "$LR" --gamma "$GAMMA" --eval-every "$EVAL_EVERY" \
    --ckpt-every "$CKPT_EVERY" --max-shard-mb "$SHARD_MB" --states off $TRAIN_EXTRA
done
# not fatal: a mode that is not lossless exits 1, and its report still goes into recipe.json
want eval && stage eval "$EVAL_TIMEOUT" 0 $CLI bench decode --target "$TARGET" --device "$DEVICE" --modes ar,dflash,dflow \
  --dflash-drafter "$RUN_DIR/train-dflash/drafter" --dflow-drafter "$RUN_DIR/train-dflow/drafter" \
  --dataset "$INPUTS/heldout-humaneval.jsonl,$INPUTS/heldout-mtbench.jsonl" --num-prompts "$EVAL_PROMPTS" \
  --max-new-tokens "$EVAL_TOKENS" --block-size "$EVAL_BLOCK" --chat --json-out "$RUN_DIR/bench.json"
settings="{"
for v in TARGET DEVICE STAGES NUM_PROMPTS MAX_NEW_TOKENS GEN_BATCH GEN_BACKEND DATA_MIN STEPS TRAIN_MIN SEQS ANCHORS FLOW_ANCHORS \
         BLOCK LAYERS DRAFT_VOCAB MAX_LEN LR GAMMA EVAL_EVERY CKPT_EVERY SHARD_MB TRAIN_EXTRA EVAL_PROMPTS EVAL_TOKENS EVAL_BLOCK; do
  val=${!v}; settings+="\"$v\": \"${val//\"/\\\"}\", "
done
settings="${settings%, }}"
want collect && stage collect 120 1 $PY -m dflow_trt.training.recipe collect --run-dir "$RUN_DIR" --out "$OUT" \
  --inputs "$INPUTS" --settings "$settings"
echo "recipe: done; $OUT holds $(find "$OUT" -type f | wc -l) files"
