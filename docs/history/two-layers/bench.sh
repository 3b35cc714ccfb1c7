cd /work/main
while ! grep -q TRAINDONE runs/deep.log; do sleep 15; done
B="--dataset humaneval,mtbench --num-prompts 48 --max-new-tokens 64 --chat"
COLUMNS=200 .venv/bin/dflow-trt bench $B --modes ar,dflash,dflow --dflash-drafter runs/s3-dflash2/drafter --dflow-drafter runs/s3-dflow2/drafter --json-out runs/b3_final.json > runs/b3_final.txt 2>&1
echo B2DONE
# the 1-layer control, afterwards on the idle machine:
COLUMNS=200 .venv/bin/dflow-trt bench $B --modes ar,dflash --dflash-drafter runs/s3-dflash1/drafter --json-out runs/b3_dflash1.json > runs/b3_dflash1.txt 2>&1
