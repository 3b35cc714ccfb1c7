"""Write a DFlow drafter that is a DFlash drafter with its relay branch silent (2026-12-07).

Relay-only training on cached first rounds (`cache-flows`, `train --train-part relay`) found no
relay that generalises at this drafter strength (2026-12-07-relay.md): ours lost 0.09 held-out τ
in its flow rounds, the paper's broke even. So the DFlow drafter is the DFlash drafter with the
relay adding exactly zero (`silence_flow`, what `--init-from` does to a DFlash drafter): its
drafts are the DFlash drafter's, and DFlow mode adds only the verifier hints (`take_hints`), the
part of the verifier's information that the measurements say pays here.

Usage (repository root): python docs/history/relay-2026-12-07/silent_relay_dflow.py DFLASH_DIR OUT_DIR
"""

import json
import sys
from pathlib import Path

from dflow_trt.drafter import train_log
from dflow_trt.drafter.defaults import untrained_config
from dflow_trt.drafter.io import build_drafter, load_drafter, save_drafter
from dflow_trt.targets import load_target
from dflow_trt.training.trainer import TrainConfig, _init_from

src_dir, out = Path(sys.argv[1]), Path(sys.argv[2])
target = load_target("smollm2-135m", num_taps=3)
src = load_drafter(src_dir, target)
cfg = untrained_config(target, flow=True, block_size=src.config.block_size, num_layers=src.config.num_layers)
cfg = type(cfg)(**{**cfg.__dict__, "draft_vocab_size": src.config.draft_vocab_size,
                   "extra": {"name": "smollm2-135m-dflow", "objective": "dflow"}})
drafter = build_drafter(target, cfg, seed=0)
log, base = _init_from(str(src_dir), target, drafter, TrainConfig(objective="dflow", steps=10**9))  # silences the relay
read = lambda name: (src_dir / name).read_text()  # noqa: E731
note = {"relay": "silent",
        "made_by": "docs/history/relay-2026-12-07/silent_relay_dflow.py from the DFlash drafter in this repository",
        "why": "relay-only training (cache-flows + train --train-part relay, 1,512 sequences, 1,500 steps each) "
               "left held-out teacher-forced flow-round tau below the same blocks without flow: ours 1.787 vs "
               "1.872, the paper's 1.870 vs 1.872 (docs/history/2026-12-07-relay.md)",
        "weights": f"the DFlash drafter's, trained {base} steps (training_config.json, train_log.jsonl); relay zero"}
files = {"training_config.json": read("training_config.json"), "train_log.jsonl": train_log.to_text(log),
         "data_manifest.json": read("data_manifest.json"), "relay.json": json.dumps(note, indent=1) + "\n"}
if (src_dir / "earlier_stages.json").is_file():  # a fine-tuned body: the stages before it (its lineage)
    files["earlier_stages.json"] = read("earlier_stages.json")
save_drafter(drafter, out, extra_files=files)
print(out)
