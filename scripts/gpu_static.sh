#!/usr/bin/env bash
# The static back end on a lent GPU (issue 28, item 3), one short call: eager vs static vs
# static + CUDA graphs (and torch.compile with COMPILE=1) at Qwen3-8B size, random init, bf16
# (`dflow-trt bench static --size qwen3-8b`), then the static back end's tests on CUDA.
# SIZE=smoke DEVICE=cpu checks the script itself on a CPU in a minute (no graphs there).
# Logs and JSON go to $OUT (default build/gpu).
set -uo pipefail
OUT=${OUT:-build/gpu}
SIZE=${SIZE:-qwen3-8b}
DEVICE=${DEVICE:-cuda}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY=${PYTHON:-python3}
EXTRA=()
[ "$DEVICE" = cuda ] && EXTRA+=(--cuda-graphs)
[ "${COMPILE:-0}" = 1 ] && EXTRA+=(--compile)
timeout "${BENCH_TIMEOUT:-300}" $PY -m dflow_trt.cli bench static --size "$SIZE" --device "$DEVICE" \
  --context "${CONTEXT:-1024}" --repeats "${REPEATS:-20}" --new-tokens "${NEW_TOKENS:-32}" "${EXTRA[@]}" \
  --json-out "$OUT/bench_static_$SIZE.json" 2>&1 | tee "$OUT/static.log"
echo "bench exit ${PIPESTATUS[0]}"
if [ "$DEVICE" = cuda ]; then
  DFLOW_TRT_TEST_DEVICE=cuda timeout "${PYTEST_TIMEOUT:-240}" $PY -m pytest -q -m "not slow" -p no:cacheprovider \
    tests/test_static_backend.py 2>&1 | tee "$OUT/pytest_static.log"
  echo "pytest exit ${PIPESTATUS[0]}"
fi
