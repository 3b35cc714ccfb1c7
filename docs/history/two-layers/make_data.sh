cd /work/main
set -e
.venv/bin/python scripts/make_data.py --num-prompts 1024 --first-prompt 4352 --batch-size 32 --data-dir runs/data-fresh2
.venv/bin/dflow-trt cache-states --data-dir runs/data-fresh2
echo DATADONE
