"""What the relayed verifier states could tell the next round, and what the relay-only runs learned
(2026-12-07). Reads the cached first rounds of the DFlash drafter (`cache-flows`) and the state cache.

Usage (repository root): python docs/history/relay-2026-12-07/analyse.py DATA_DIR OUT.json [RELAY_DRAFTER ...]
- per flow-round slot: the DFlash drafter's accuracy, the verifier hint's (the target's argmax
  at the slot before, read under the rejected token), the hint's where the drafter is wrong, and
  both where the verifier read the true token at the slot before (a consistent hint);
- per relay drafter: flow-round CE loss and teacher-forced τ with and without flow, on 24 held-out
  and 48 training sequences (the first of each with cached first rounds).
"""

import json
import sys
from pathlib import Path

import torch

from dflow_trt.drafter.io import load_drafter
from dflow_trt.targets import load_target
from dflow_trt.training.data import load_dataset
from dflow_trt.training.flows import FlowCache, flows_dir
from dflow_trt.training.objective import _labels, block_loss, collate, drafter_blocks, drafter_context
from dflow_trt.training.states import StateCache
from dflow_trt.training.trainer import _fits, _to_draft

torch.set_num_threads(2)
data, out = Path(sys.argv[1]), Path(sys.argv[2])
target = load_target("smollm2-135m", num_taps=3)
dflash = load_drafter("dflow_trt/drafters/smollm2-135m-dflash", target)
train, heldout = (_fits(x, 320) for x in load_dataset(data, target))
flows = FlowCache(flows_dir(data, dflash), target, dflash, 16, 320, 0, "auto")
states = StateCache(data, target, False)
ho = [s for s in heldout if flows.covers(s.id)][:24]
tr = [s for s in train if flows.covers(s.id)][:48]


def batches(seqs):
    for i in range(0, len(seqs), 4):
        b = collate(seqs[i:i + 4], 320)
        taps, _ = states.batch(b.seq_ids, b.ids.shape[1])
        anchors, accepted, flow = flows.batch(b.seq_ids)
        anchors = anchors + accepted + 1  # the flow round's blocks
        yield b, taps, anchors, flow, _labels(b, anchors, 16)


def slots():
    D, H, V, C = [], [], [], []
    for b, taps, anchors, flow, lab in batches(ho):
        lab = lab.flatten(0, 1)  # [M, 15] tokens at slots 1..15
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            pred = dflash.draft_vocab[drafter_blocks(dflash, taps, b, anchors, None).argmax(-1)].flatten(0, 1)
        valid = flow.valid[:, :15] & (lab != -100)
        cons = torch.zeros_like(valid)
        cons[:, 1:] = flow.token_ids[:, 1:15] == lab[:, :14]  # the verifier read the true token one slot before
        D.append(pred == lab), H.append(flow.hint_ids[:, :15] == lab), V.append(valid), C.append(cons & valid)
    D, H, V, C = (torch.cat(x) for x in (D, H, V, C))
    rows, ok = [], torch.ones(D.shape[0], dtype=torch.bool)
    mean = lambda x: round(x.float().mean().item(), 3) if x.numel() else None  # noqa: E731
    for j in range(6):
        v, c = V[:, j], C[:, j]
        rows.append({"slot": j + 1, "n": int(v.sum()), "drafter_right": mean(D[v, j]), "hint_right": mean(H[v, j]),
                     "hint_right_where_drafter_wrong": mean(H[v & ~D[:, j], j]),
                     "reached": round(float((ok & v).sum()) / max(1, int(v.sum())), 3),
                     "consistent": int(c.sum()), "hint_right_consistent": mean(H[c, j]),
                     "drafter_right_consistent": mean(D[c, j])})
        ok = ok & D[:, j]
    return rows


def relay(path):
    d = load_drafter(path, target)
    to_draft = _to_draft(d, target.info.vocab_size)
    res = {}
    for name, seqs in (("heldout", ho), ("train", tr)):
        acc, loss = {"on": [], "off": []}, {"on": [], "off": []}
        for b, taps, anchors, flow, lab in batches(seqs):
            with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
                ctx = drafter_context(d, taps)
                for k, f in (("on", flow), ("off", None)):
                    st = block_loss(d, drafter_blocks(d, ctx, b, anchors, f), lab, 1.5, to_draft)
                    acc[k].append(st.accepted), loss[k].append(st.loss.item())
        res[name] = {f"tau_{k}": round(1 + torch.cat(v).float().mean().item(), 4) for k, v in acc.items()} | \
                    {f"loss_{k}": round(sum(v) / len(v), 4) for k, v in loss.items()}
    return res


report = {"heldout_seqs": len(ho), "train_seqs": len(tr), "slots": slots(),
          "relays": {p: relay(p) for p in sys.argv[3:]}}
out.write_text(json.dumps(report, indent=1) + "\n")
print(json.dumps(report, indent=1))
