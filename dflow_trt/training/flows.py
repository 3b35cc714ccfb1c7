"""Verifier flows of a frozen drafter body, computed once, so training only the relay branch
(`--train-part relay`) costs a drafter pass per step, not two target passes.

A DFlow step's cost is the frozen target: the prefix pass that gives its K/V, and the verify pass
over the drafter's proposals that gives the flow. Both depend on the drafter only through its
first-round proposals, and with the body frozen those never change: so each sequence's first
round (its anchors, the proposals' accepted lengths, and the flow the next round sees) is computed
here once and read back by the trainer. Same functions as the trainer's own DFlow step
(`drafter_blocks`, `verifier_flow`), so the cached flow is the one that step would compute.

Format of `<data_dir>/flows-<body fingerprint>/` (one folder per frozen body):
- `manifest.json`: settings (target fingerprint, body fingerprint, block size, anchors per
  sequence, seed, max_len, precision) and the parts written.
- `part-XXXX.safetensors`, 64 sequences each, for each sequence id: `anchors.<id>` [k],
  `accepted.<id>` [k], `taps.<id>` [k, S, F] (bf16, zero where not valid), `token_ids.<id>`,
  `hint_ids.<id>` [k, S] (int32), `valid.<id>` [k, S] (uint8).
Building is resumable per part (each written to a temp name, then renamed). Held-out sequences
(the first `eval_seqs`) come first so that a partial build can already be evaluated.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm import tqdm

from ..atomic import atomic_file, write_text
from ..decoding.interfaces import FlowState
from ..drafter.model import DFlowDrafter
from ..errors import UserError
from ..targets.hf_target import HFTarget
from .data import Sequence
from .objective import Batch, _labels, collate, drafter_blocks, sample_anchors, target_states, verifier_flow

FORMAT, PART = 1, 64


def body_fingerprint(drafter: DFlowDrafter) -> str:
    """SHA-256 over the drafter's weights outside the relay branch (and its config): what decides
    its first-round proposals."""
    h = hashlib.sha256(json.dumps({k: v for k, v in vars(drafter.config).items() if k not in ("extra", "flow", "relay")},
                                  sort_keys=True, default=str).encode())
    relay = set(drafter.relay_branch())
    for name, t in sorted(drafter.state_dict().items()):
        if name.split(".")[0] not in relay:
            h.update(name.encode())
            h.update(t.detach().float().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def flows_dir(data_dir: Path, drafter: DFlowDrafter) -> Path:
    return Path(data_dir) / f"flows-{body_fingerprint(drafter)[:16]}"


def seq_anchors(seq_id: int, batch: Batch, row: int, k: int, block_size: int, seed: int) -> torch.Tensor:
    """Anchors [k] of one sequence, fixed by (seed, id): the same on any machine, in any batch."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + seq_id)
    one = Batch(batch.ids[row:row + 1], batch.lens[row:row + 1], batch.prompt_lens[row:row + 1])
    return sample_anchors(one, k, block_size, gen)[0]


def _settings(target: HFTarget, drafter: DFlowDrafter, k: int, seed: int, max_len: int, precision: str) -> dict:
    return {"format": FORMAT, "target_fingerprint": target.info.fingerprint, "body_fingerprint": body_fingerprint(drafter),
            "block_size": drafter.config.block_size, "anchors_per_seq": k, "seed": seed, "max_len": max_len,
            "precision": precision}


@torch.no_grad()
def build_flows(target: HFTarget, drafter: DFlowDrafter, data_dir: Path, seqs: list[Sequence], anchors_per_seq: int,
                max_len: int, seed: int = 0, compute_dtype: torch.dtype = torch.float32, precision: str = "auto",
                batch_size: int = 8, max_seqs: int | None = None) -> Path:
    """First rounds of `seqs` (in order; the first `max_seqs`) through the frozen drafter and the
    target, stored under `flows_dir` (resumable per part of 64 sequences)."""
    out = flows_dir(data_dir, drafter)
    out.mkdir(parents=True, exist_ok=True)
    settings = _settings(target, drafter, anchors_per_seq, seed, max_len, precision)
    mpath = out / "manifest.json"
    if mpath.exists() and {k: v for k, v in json.loads(mpath.read_text()).items() if k in settings} != settings:
        raise UserError(f"{out} holds flows made with other settings (anchors per sequence, seed, max_len or "
                        f"precision); delete it to rebuild, or pass the settings it was made with")
    seqs = seqs[:max_seqs] if max_seqs else seqs
    parts = [seqs[i:i + PART] for i in range(0, len(seqs), PART)]
    todo = [i for i in range(len(parts)) if not (out / _part_file(i)).exists()]
    S, dev = drafter.config.block_size, target.device
    bar = tqdm(total=sum(len(parts[i]) for i in todo), desc="verifier flows", unit="seq")
    drafter.eval()
    for i in todo:
        tensors = {}
        group = sorted(parts[i], key=lambda s: len(s.ids))  # similar lengths share a batch
        for j in range(0, len(group), batch_size):
            batch = collate(group[j:j + batch_size], max_len)
            N = batch.ids.shape[0]
            taps, kv = target_states(target, batch, keep_cache=True)  # [N, T, F] and the prefix K/V
            anchors = torch.stack([seq_anchors(s, batch, b, anchors_per_seq, S, seed)
                                   for b, s in enumerate(batch.seq_ids)])  # [N, k]
            labels = _labels(batch, anchors, S)
            with torch.autocast(torch.device(dev).type, dtype=torch.bfloat16,
                                enabled=compute_dtype == torch.bfloat16):
                logits = drafter_blocks(drafter, taps, batch, anchors, None)
            drafts = drafter.draft_vocab[logits.argmax(-1)]  # [N, k, S-1]
            flow, accepted = verifier_flow(target, kv, batch, anchors, drafts, labels)
            k = anchors.shape[1]
            for b, sid in enumerate(batch.seq_ids):
                rows = slice(b * k, (b + 1) * k)
                tensors |= {f"anchors.{sid}": anchors[b], f"accepted.{sid}": accepted[b],
                            f"taps.{sid}": flow.taps[rows].to(torch.bfloat16),
                            f"token_ids.{sid}": flow.token_ids[rows].to(torch.int32),
                            f"hint_ids.{sid}": flow.hint_ids[rows].to(torch.int32),
                            f"valid.{sid}": flow.valid[rows].to(torch.uint8)}
            bar.update(N)
        with atomic_file(out / _part_file(i)) as tmp:
            save_file({k: v.cpu().contiguous() for k, v in tensors.items()}, tmp)
        done = sorted(p.name for p in out.glob("part-*.safetensors"))
        write_text(mpath, json.dumps({**settings, "parts": done}, indent=1))
    bar.close()
    if not mpath.exists():
        write_text(mpath, json.dumps({**settings, "parts": []}, indent=1))
    return out


class FlowCache:
    """Read side: a batch's cached first rounds for the trainer."""

    def __init__(self, path: Path, target: HFTarget, drafter: DFlowDrafter, anchors_per_seq: int, max_len: int,
                 seed: int, precision: str):
        self.dir = Path(path)
        mpath = self.dir / "manifest.json"
        if not mpath.is_file():
            raise UserError(f"no verifier flows for this drafter body at {self.dir}; build them with `dflow-trt "
                            f"cache-flows --drafter <the --init-from drafter> --data-dir <data>` first")
        m = json.loads(mpath.read_text())
        want = _settings(target, drafter, anchors_per_seq, seed, max_len, precision)
        bad = [k for k in want if m.get(k) != want[k]]
        if bad:
            raise UserError(f"the flows at {self.dir} were built with other {', '.join(bad)}; pass the settings "
                            f"they were built with, or build them again with these")
        self.where: dict[int, safe_open] = {}
        for p in sorted(self.dir.glob("part-*.safetensors")):
            f = safe_open(str(p), framework="pt")
            self.where.update({int(k.split(".")[1]): f for k in f.keys() if k.startswith("anchors.")})
        self.target = target

    def covers(self, seq_id: int) -> bool:
        return seq_id in self.where

    def batch(self, seq_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor, FlowState]:
        """-> anchors [N, k], accepted [N, k], the next round's flow over [N*k, S]."""
        dev, dt = self.target.device, self.target.model.dtype
        get = lambda kind: torch.stack([self.where[i].get_tensor(f"{kind}.{i}") for i in seq_ids]).to(dev)  # noqa: E731
        anchors, accepted = get("anchors"), get("accepted")
        flow = FlowState(taps=get("taps").flatten(0, 1).to(dt), token_ids=get("token_ids").flatten(0, 1).long(),
                         hint_ids=get("hint_ids").flatten(0, 1).long(), valid=get("valid").flatten(0, 1).bool())
        return anchors, accepted, flow


def _part_file(i: int) -> str:
    return f"part-{i:04d}.safetensors"
