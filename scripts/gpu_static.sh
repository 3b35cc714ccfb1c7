#!/usr/bin/env bash
# The static back end on a lent GPU (issue 28, item 3), one short call: eager vs static vs
# static padded to the block vs static + CUDA graphs (padded; torch.compile too with COMPILE=1) at
# Qwen3-8B size, random init, bf16, at contexts 512 and 2048 (`dflow-trt bench static --size
# qwen3-8b --pad-block`): ar step, verify 1+15, drafter pass, a round, generate() with whether each
# back end's dflow equals its own ar in bf16, every figure beside the bandwidth floor; then the
# static back end's tests on CUDA.
# SIZE=smoke DEVICE=cpu CONTEXTS="32 64" checks the script itself on a CPU in seconds (no graphs
# there; tests/test_static_backend.py runs it so). Logs and JSON go to $OUT (default build/gpu).
set -uo pipefail
OUT=${OUT:-build/gpu}
SIZE=${SIZE:-qwen3-8b}
DEVICE=${DEVICE:-cuda}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY=${PYTHON:-python3}
EXTRA=(--pad-block)
[ "$DEVICE" = cuda ] && EXTRA+=(--cuda-graphs)
[ "${COMPILE:-0}" = 1 ] && EXTRA+=(--compile)
[ -n "${THREADS:-}" ] && EXTRA+=(--threads "$THREADS")
status=0
for ctx in ${CONTEXTS:-512 2048}; do
  timeout "${BENCH_TIMEOUT:-300}" $PY -m dflow_trt.cli bench static --size "$SIZE" --device "$DEVICE" \
    --context "$ctx" --repeats "${REPEATS:-20}" --new-tokens "${NEW_TOKENS:-32}" "${EXTRA[@]}" \
    --json-out "$OUT/bench_static_${SIZE}_ctx$ctx.json" 2>&1 | tee "$OUT/static_ctx$ctx.log"
  rc=${PIPESTATUS[0]}
  echo "bench context $ctx exit $rc"
  [ "$rc" = 0 ] || status=$rc
done
if [ "$DEVICE" = cuda ]; then
  DFLOW_TRT_TEST_DEVICE=cuda timeout "${PYTEST_TIMEOUT:-240}" $PY -m pytest -q -m "not slow" -p no:cacheprovider \
    tests/test_static_backend.py 2>&1 | tee "$OUT/pytest_static.log"
  rc=${PIPESTATUS[0]}
  echo "pytest exit $rc"
  [ "$rc" = 0 ] || status=$rc
fi
exit $status
