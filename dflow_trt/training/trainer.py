"""Drafter trainer: one loop for both objectives (`--objective dflash|dflow`), resumable.

AdamW with linear warm-up then cosine decay, gradient clipping, periodic held-out evaluation of
τ (teacher-forced: the data are the target's own greedy outputs, so a block's greedy acceptance
length against them is what decoding would accept), atomic checkpoints every `ckpt_every` steps.
Under `torchrun` each process trains on its own shard of sequences and DDP averages gradients
(gloo on CPU, NCCL on CUDA); rank 0 writes checkpoints and logs.
"""

from __future__ import annotations

import json
import math
import os
import random
import time
import warnings
from collections import Counter
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from tqdm import tqdm

from ..atomic import atomic_file, claim_dir
from ..drafter import train_log
from ..drafter.defaults import untrained_config
from ..drafter.io import build_drafter, load_drafter, save_drafter, shard_groups
from ..drafter.model import DFlowDrafter
from ..errors import UserError
from ..targets import load_target
from ..targets.hf_target import HFTarget
from .data import Sequence, load_dataset
from .flows import FlowCache, flows_dir
from .objective import (
    Batch,
    BlockStats,
    _labels,
    block_loss,
    collate,
    drafter_blocks,
    drafter_context,
    sample_anchors,
    target_states,
    verifier_flow,
)
from .states import StateCache


@dataclass
class TrainConfig:
    target: str = "smollm2-135m"
    data_dir: str = "runs/data-smollm2"
    out_dir: str = "runs/train-dflow"
    objective: str = "dflow"  # dflash | dflow
    steps: int = 2000
    seqs_per_step: int = 4
    anchors_per_seq: int = 16
    flow_anchors_per_seq: int = 0  # DFlow: blocks per sequence that get the self-conditioned round (0: all)
    relay: str = "ours"  # DFlow: ours | paper (the DFlow paper's relay, DrafterConfig.relay)
    flow_rounds: int = 0  # DFlow: reject-conditioned rounds after the masked one (0: the relay's own; ours 1, paper 2)
    block_size: int = 16
    gamma: float = 7.0  # block position k's loss weight is exp(-(k-1)/gamma): DFlash's 7; 1.5 did better for weak drafters (docs/history/2026-12-drafters.md, stage 4)
    num_layers: int = 1
    num_taps: int = 3
    draft_vocab_size: int | None = 8192
    max_len: int = 320
    lr: float = 6e-4
    flow_lr_mult: float = 1.0  # DFlow: the flow branch's learning rate is lr times this (a branch grown on a trained base)
    train_part: str = "all"  # DFlow: all | relay (the --init-from body frozen, only the relay branch trained, on first rounds cached by `dflow-trt cache-flows`)
    warmup_frac: float = 0.04
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    eval_every: int = 100
    eval_seqs: int = 24
    ckpt_every: int = 50
    seed: int = 0
    threads: int = 0  # 0: leave torch's default
    states: str = "auto"  # auto: read <data_dir>/states when it fits this run (`dflow-trt cache-states`); off
    precision: str = "auto"  # the drafter's passes: auto (bf16 autocast where the CPU/GPU has native bf16, else fp32) | fp32 | bf16
    init_from: str = ""  # a saved drafter to fine-tune (or a DFlash one to start a DFlow run): its weights and log; steps count on from its last step
    device: str = "auto"  # auto: a GPU per process where there are enough, else the CPU | cpu | cuda (refused without one)
    max_minutes: float = 0.0  # 0: none; else stop (and save the drafter) at the first step past this wall time
    max_shard_mb: float = 0.0  # 0: one model.safetensors; else weight shards of at most this many MiB each

    # each number's range, (least, most, least excluded): checked for flags and --config files alike,
    # before any work (a zero gamma or a NaN learning rate would train NaN weights; 0 steps, none)
    RANGES = {"steps": (1, None), "seqs_per_step": (1, None), "anchors_per_seq": (1, None),
              "flow_anchors_per_seq": (0, None), "flow_rounds": (0, None), "block_size": (2, None),
              "gamma": (0, None, True),
              "num_layers": (1, None), "num_taps": (1, None), "draft_vocab_size": (1, None), "max_len": (2, None),
              "lr": (0, 1, True), "flow_lr_mult": (0, None, True), "warmup_frac": (0, 1), "weight_decay": (0, 1),
              "grad_clip": (0, None, True), "eval_every": (1, None), "eval_seqs": (1, None), "ckpt_every": (1, None),
              "seed": (0, 2**32 - 1), "threads": (0, None), "max_minutes": (0, None), "max_shard_mb": (0, None)}

    def _check_types_and_ranges(self) -> None:
        for f in fields(self):
            v, kind = getattr(self, f.name), f.type.split(" ")[0]  # "int", "float" or "str" (| None)
            if v is None and f.type.endswith("None"):
                continue
            lo, hi, lo_open = (*self.RANGES.get(f.name, (None, None)), False)[:3]
            want = {"str": "a string", "int": "an integer", "float": "a finite number"}[kind]
            if lo is not None:
                want += f" in {'(' if lo_open else '['}{lo}, {hi}]" if hi is not None else f" {'>' if lo_open else '>='} {lo}"
            if kind == "str":
                ok = isinstance(v, str)
            else:
                ok = not isinstance(v, bool) and isinstance(v, int if kind == "int" else (int, float)) \
                    and (kind == "int" or math.isfinite(v)) and (lo is None or (v > lo if lo_open else v >= lo)) \
                    and (hi is None or v <= hi)
            if not ok:
                raise UserError(f"--{f.name.replace('_', '-')} must be {want}, got {v!r}")

    def __post_init__(self):
        self._check_types_and_ranges()
        if self.objective not in ("dflash", "dflow"):
            raise UserError(f"unknown objective {self.objective!r}; use dflash or dflow")
        check_precision(self.precision)
        if self.device not in ("auto", "cpu", "cuda"):
            raise UserError(f"--device must be auto, cpu or cuda, got {self.device!r}")
        if self.states not in ("auto", "off"):
            raise UserError(f"unknown states setting {self.states!r}; use auto or off")
        if self.flow_lr_mult != 1.0 and self.objective != "dflow":
            raise UserError("--flow-lr-mult applies to the flow branch, which only --objective dflow has")
        if self.relay not in ("ours", "paper"):
            raise UserError(f"unknown relay {self.relay!r}; use ours or paper")
        if (self.relay != "ours" or self.flow_rounds) and self.objective != "dflow":
            raise UserError("--relay and --flow-rounds apply to the flow rounds, which only --objective dflow has")
        if self.train_part not in ("all", "relay"):
            raise UserError(f"unknown --train-part {self.train_part!r}; use all or relay")
        if self.train_part == "relay" and (self.objective != "dflow" or not self.init_from or flow_rounds(self) != 1):
            raise UserError("--train-part relay trains a DFlow relay on a frozen body: it needs --objective dflow, "
                            "--init-from <the drafter whose body stays> and one flow round (--flow-rounds 1)")

    @classmethod
    def from_file(cls, path: str, **overrides) -> "TrainConfig":
        try:
            d = json.loads(Path(path).read_text())
        except (OSError, ValueError) as e:  # ValueError: not UTF-8, not JSON
            raise UserError(f"cannot read training config {path}: {e}") from None
        if not isinstance(d, dict):
            raise UserError(f"training config {path} must be a JSON object of TrainConfig fields")
        unknown = set(d) - set(cls.__dataclass_fields__)
        if unknown:
            raise UserError(f"unknown keys in {path}: {sorted(unknown)}")
        d.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**d)


class Objective(nn.Module):
    """Wraps the drafter so DDP sees one forward per step; the frozen target is not a submodule."""

    def __init__(self, drafter: DFlowDrafter, target: HFTarget, cfg: TrainConfig, cache: StateCache | None = None,
                 flows: FlowCache | None = None):
        super().__init__()
        self.drafter, self.target, self.cfg, self.cache, self.flows = drafter, target, cfg, cache, flows
        self.register_buffer("to_draft", _to_draft(drafter, target.info.vocab_size), persistent=False)
        self.compute_dtype = compute_dtype(getattr(cfg, "precision", "fp32"))
        self.flow_stats: list = []  # each flow round's BlockStats of the last forward (DFlow)
        self.measure_relay_off = False  # `evaluate` sets it: also draft the first flow round's blocks without flow
        self.flow_off_stats: BlockStats | None = None  # ... and their stats land here

    def forward(self, batch: Batch, gen: torch.Generator):
        """-> (loss, stats of the first prediction, stats of the first flow-conditioned one or None).

        DFlow unrolls `rounds` reject-conditioned rounds after the masked one (ours 1, the paper's
        relay 2): each verifies the previous round's proposals with the frozen target and starts
        after its first mismatch, with the verifier's states as flow; the losses are summed. No
        gradient crosses a round (proposals are argmax ids, the flow comes from the target under
        no_grad) or reaches the target. Every flow round's stats: `self.flow_stats`."""
        c, m = self.cfg, self.drafter
        if self.flows is not None:
            return self._relay_only(batch)
        dflow = c.objective == "dflow"
        taps, kv = target_states(self.target, batch, keep_cache=dflow, cache=self.cache)
        anchors = sample_anchors(batch, c.anchors_per_seq, c.block_size, gen)  # [N, nb]
        labels = _labels(batch, anchors, c.block_size)
        with self._autocast():
            ctx = drafter_context(m, taps)  # context K/V and head: once per step, both rounds read them
            logits = drafter_blocks(m, ctx, batch, anchors, None)
        first = block_loss(m, logits, labels, c.gamma, self.to_draft)
        if not dflow:
            self.flow_stats = []
            return first.loss, first, None
        k = c.flow_anchors_per_seq or anchors.shape[1]  # anchors are random: the first k are a random subset
        anchors, labels = anchors[:, :k], labels[:, :k]
        pred = first.pred if first.pred is not None else logits.argmax(-1)
        drafts = m.draft_vocab[pred[:, :k]]  # [N, k, S-1] what the drafter would propose
        loss, self.flow_stats = first.loss, []
        for r in range(flow_rounds(c)):
            flow, accepted = verifier_flow(self.target, kv, batch, anchors, drafts, labels)
            anchors = anchors + accepted + 1  # the next round's block starts after the bonus token
            labels = _labels(batch, anchors, c.block_size)
            with self._autocast():
                logits = drafter_blocks(m, ctx, batch, anchors, flow)
            st = block_loss(m, logits, labels, c.gamma, self.to_draft)
            loss = loss + st.loss
            self.flow_stats.append(st)
            if r == 0:
                self._relay_off(ctx, batch, anchors, labels)
            if r + 1 < flow_rounds(c):
                drafts = m.draft_vocab[st.pred if st.pred is not None else logits.argmax(-1)]
        return loss, first, self.flow_stats[0]

    def _relay_only(self, batch: Batch):
        """`--train-part relay`: the frozen body's first round and its verification come from the
        flow cache; the step is the flow-conditioned round alone."""
        c, m = self.cfg, self.drafter
        taps, _ = target_states(self.target, batch, keep_cache=False, cache=self.cache)
        anchors, accepted, flow = self.flows.batch(batch.seq_ids)  # [N, k], [N, k], flow over [N*k, S]
        first = BlockStats(loss=torch.zeros(()), accepted=accepted.flatten())
        anchors = anchors + accepted + 1  # the next round's block starts after the bonus token
        labels = _labels(batch, anchors, c.block_size)
        with self._autocast():
            ctx = drafter_context(m, taps)
            logits = drafter_blocks(m, ctx, batch, anchors, flow)
        st = block_loss(m, logits, labels, c.gamma, self.to_draft)
        self.flow_stats = [st]
        self._relay_off(ctx, batch, anchors, labels)
        return st.loss, first, st

    def _relay_off(self, ctx, batch: Batch, anchors: torch.Tensor, labels: torch.Tensor) -> None:
        """In evaluation (`measure_relay_off`), the same flow-round blocks drafted without flow: with
        the flow round's τ, the relay's own gain on equal blocks."""
        self.flow_off_stats = None
        if not self.measure_relay_off:
            return
        with self._autocast():
            logits = drafter_blocks(self.drafter, ctx, batch, anchors, None)
        self.flow_off_stats = block_loss(self.drafter, logits, labels, self.cfg.gamma, self.to_draft)

    def _autocast(self):
        """bf16 autocast of the drafter's passes where `compute_dtype` is bf16, else nothing."""
        on = self.compute_dtype == torch.bfloat16
        return torch.autocast(self.to_draft.device.type, dtype=torch.bfloat16, enabled=on)


def flow_rounds(cfg: TrainConfig) -> int:
    """Reject-conditioned rounds a DFlow step unrolls (`--flow-rounds`, 0: the relay's own)."""
    return getattr(cfg, "flow_rounds", 0) or (2 if getattr(cfg, "relay", "ours") == "paper" else 1)


PRECISIONS = ("auto", "fp32", "bf16")


def check_precision(precision: str) -> str:
    """`--precision` as the trainer and `cache-flows` take it (one message for both)."""
    if precision not in PRECISIONS:
        raise UserError(f"unknown --precision {precision!r}; use {', '.join(PRECISIONS[:-1])} or {PRECISIONS[-1]}")
    return precision


def compute_dtype(precision: str) -> torch.dtype:
    """The drafter's training dtype: bf16 autocast only where the CPU (or any GPU) multiplies bf16
    natively; on an AVX2-only CPU bf16 is emulated, slower than fp32, so `auto` keeps fp32 there."""
    if precision == "auto":
        from .throughput import native_bf16

        fast = torch.cuda.is_available() and torch.cuda.is_bf16_supported() or native_bf16()
        return torch.bfloat16 if fast else torch.float32
    return {"fp32": torch.float32, "bf16": torch.bfloat16}[precision]


def _draft_vocab(train: list[Sequence], size: int | None, vocab: int, always: tuple[int, ...]) -> torch.Tensor:
    """The `size` most frequent tokens of the target's own responses (EAGLE-3's reduced vocabulary)."""
    if size is None or size >= vocab:
        return torch.arange(vocab)
    counts = Counter(t for s in train for t in s.response_ids)
    ids = list(dict.fromkeys(list(always) + [t for t, _ in counts.most_common()]))[:size]
    rest = [t for t in range(vocab) if t not in set(ids)]
    return torch.tensor(sorted(ids + rest[: size - len(ids)]))


def _to_draft(drafter: DFlowDrafter, vocab: int) -> torch.Tensor:
    """Target token id -> draft-vocabulary index (-100, ignored by the loss, outside it)."""
    to_draft = torch.full((vocab,), -100, dtype=torch.long, device=drafter.draft_vocab.device)
    to_draft[drafter.draft_vocab] = torch.arange(drafter.draft_vocab.numel(), device=to_draft.device)
    return to_draft


def _state_cache(cfg: TrainConfig, target: HFTarget, seqs: list[Sequence], rank: int) -> StateCache | None:
    """The data's cached target states when they serve this run, else None (the target runs each step)."""
    if cfg.states == "off":
        return None
    need_kv = cfg.objective == "dflow" and cfg.train_part == "all"
    why = StateCache.usable(Path(cfg.data_dir), target, cfg.max_len, need_kv)
    cache = StateCache(Path(cfg.data_dir), target, need_kv) if why is None else None
    if cache is not None and not cache.covers([s.id for s in seqs]):
        why, cache = ("missing some sequences: build not finished, or the data set grew; run `dflow-trt "
                      "cache-states` again"), None
    if rank == 0:
        print(f"target states: {'cached in ' + str(cache.dir) if cache else 'computed each step (cache ' + why + ')'}")
    return cache


def _fits(seqs: list[Sequence], max_len: int) -> list[Sequence]:
    """Sequences with at least two response tokens inside `max_len` (an anchor and one label)."""
    return [s for s in seqs if min(len(s.ids), max_len) >= len(s.prompt_ids) + 2]


def _lr_at(step: int, cfg: TrainConfig, base: int = 0) -> float:
    """Warm-up then cosine over this run's own steps (from `base`, the step a fine-tune starts at)."""
    step, total = step - base, cfg.steps - base
    warm = max(1, int(cfg.warmup_frac * total))
    if step < warm:
        return cfg.lr * (step + 1) / warm
    t = (step - warm) / max(1, total - warm)
    return cfg.lr * 0.5 * (1 + math.cos(math.pi * min(1.0, t)))


def _param_groups(drafter: DFlowDrafter, params: list[nn.Parameter], cfg: TrainConfig) -> tuple[list[dict], list[float]]:
    """AdamW groups and each one's learning-rate multiplier: one group, or two when the flow
    branch gets its own learning rate (`flow_lr_mult`)."""
    if cfg.flow_lr_mult == 1.0:
        return [{"params": params}], [1.0]
    flow = {id(p) for p in drafter.flow_parameters()}
    groups = [([p for p in params if id(p) not in flow], 1.0), ([p for p in params if id(p) in flow], cfg.flow_lr_mult)]
    groups = [(ps, m) for ps, m in groups if ps]  # a frozen body (--train-part relay) leaves the first empty
    return [{"params": ps} for ps, _ in groups], [m for _, m in groups]


def adamw(groups: list[dict], cfg: TrainConfig) -> torch.optim.AdamW:
    """The trainer's AdamW, fused (one kernel per step over all weights, the same update up to
    rounding): the for-each-tensor default spends a 2-core CPU step's tenth on seven elementwise
    passes over every weight."""
    ps = [p for g in groups for p in g["params"]]
    fused = all(p.dtype in (torch.float32, torch.float64) and p.device.type in ("cpu", "cuda") for p in ps)
    return torch.optim.AdamW(groups, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95), fused=fused)


def _run_identity(cfg: dict) -> dict:
    """Settings a resumed run must share (steps may grow; logging cadence may change)."""
    cfg = {**cfg, "flow_lr_mult": cfg.get("flow_lr_mult", 1.0),  # checkpoints from before the fields existed
           "precision": cfg.get("precision", "auto"), "relay": cfg.get("relay", "ours"),
           "flow_rounds": cfg.get("flow_rounds", 0), "train_part": cfg.get("train_part", "all")}
    return {k: v for k, v in cfg.items() if k not in ("steps", "eval_every", "ckpt_every", "threads", "eval_seqs", "states",
                                                      "device", "max_minutes", "max_shard_mb")}


def _init_from(path: str, target: HFTarget, drafter: DFlowDrafter, cfg: TrainConfig) -> tuple[list, int]:
    """Copy a saved drafter's weights into `drafter`; -> (its training log, its last step).

    A DFlash drafter may start a DFlow run: its weights are the shared part, and the flow branch
    starts silent (`silence_flow`), so step 0 drafts exactly as the DFlash drafter does. A
    drafter may also start a run with more layers (`--num-layers`): its layers are the first
    ones, and the new ones on top start silent (`silence_layers`), again drafting as it did.
    """
    src = load_drafter(path, target)  # also checks it was trained for this target
    mine, theirs = (dict(vars(c), extra=None) for c in (drafter.config, src.config))
    upgrade = drafter.config.flow and not src.config.flow  # DFlash -> DFlow
    grow = drafter.config.num_layers > src.config.num_layers
    diff = sorted(k for k in mine if mine[k] != theirs[k]
                  and not (upgrade and k in ("flow", "relay")) and not (grow and k == "num_layers"))
    if diff:  # DFlow -> DFlash keeps "flow" in diff, fewer layers "num_layers"
        raise UserError(f"--init-from {path} is a drafter of another shape ({', '.join(diff)} differ "
                        f"from this run's --objective {cfg.objective}); fine-tune it with its own objective and "
                        f"sizes (a DFlash drafter may also start a DFlow run, and any drafter a run with "
                        f"more --num-layers)")
    missing, unexpected = drafter.load_state_dict(src.state_dict(), strict=not (upgrade or grow))
    new_layer = lambda k: k.startswith("layers.") and int(k.split(".")[1]) >= src.config.num_layers  # noqa: E731
    assert not unexpected and all(k.split(".")[0] in drafter.relay_branch() or new_layer(k) for k in missing), \
        (missing, unexpected)
    if upgrade:
        drafter.silence_flow()
    if grow:
        drafter.silence_layers(src.config.num_layers)
    log = train_log.read(path, required=False)
    base = log[-1]["step"] if log else 0
    if cfg.steps <= base:
        raise UserError(f"--init-from {path} has trained {base} steps already; --steps counts on from there, "
                        f"so pass more than {base}")
    return log, base


EARLIER = "earlier_stages.json"


def earlier_stages(src: Path) -> list[dict]:
    """The training configs and data manifests of a drafter and the drafters it started from,
    oldest first, so a fine-tuned drafter keeps the record of every data set it saw."""
    read = lambda name: json.loads((src / name).read_text()) if (src / name).is_file() else None  # noqa: E731
    return (read(EARLIER) or []) + [{"training_config": read("training_config.json"),
                                     "data_manifest": read("data_manifest.json")}]


def _out_of_time(cfg: TrainConfig, elapsed_s: float, distributed: bool) -> bool:
    """Whether `max_minutes` have passed, by rank 0's clock so that every rank stops at the same step."""
    over = torch.tensor([float(elapsed_s > 60 * cfg.max_minutes)])
    if distributed:
        dist.broadcast(over, 0)
    return bool(over.item())


def _gather_states(rng_state, gen_state, distributed: bool, world: int) -> list:
    if not distributed:
        return [(rng_state, gen_state)]
    out = [None] * world
    dist.all_gather_object(out, (rng_state, gen_state))
    return out


def _save_ckpt(path: Path, payload: dict) -> None:
    with atomic_file(path) as tmp:  # straight to disk: no second in-memory copy of the checkpoint
        torch.save(payload, tmp)


CKPT_KEYS = {"config", "world", "step", "log", "drafter", "optimizer", "rng", "gen"}


def _load_ckpt(path: Path) -> dict:
    """The resume state, unpickled without running code: `weights_only=True` admits tensors and plain
    containers only, so a planted `checkpoint.pt` carrying code is refused before any of it runs."""
    try:
        with warnings.catch_warnings():  # torch warns about foreign pickles before refusing them: one line is enough
            warnings.simplefilter("ignore")
            ck = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - any file torch will not read safely is the same user problem
        raise UserError(f"checkpoint {path} is not a readable dflow_trt checkpoint ({type(e).__name__}: it is "
                        f"corrupt, or holds objects other than tensors and plain data); delete it to start "
                        f"over or restore it from a backup") from None
    if not isinstance(ck, dict) or not CKPT_KEYS <= ck.keys():
        raise UserError(f"checkpoint {path} lacks the training state dflow_trt writes (want {sorted(CKPT_KEYS)}); "
                        f"delete it to start over or use another --out-dir")
    return ck


@torch.no_grad()
def evaluate(obj: Objective, heldout: list[Sequence], cfg: TrainConfig) -> dict:
    """Teacher-forced greedy τ on held-out sequences: without flow, and (DFlow) with flow."""
    if not heldout:
        return {}
    gen = torch.Generator().manual_seed(1234)
    acc1, accs, off = [], [], []
    obj.drafter.eval()
    obj.measure_relay_off = True
    for i in range(0, min(len(heldout), cfg.eval_seqs), cfg.seqs_per_step):
        _, first, second = obj(collate(heldout[i:i + cfg.seqs_per_step], cfg.max_len), gen)
        acc1.append(first.accepted)
        if second is not None:
            accs.append([st.accepted for st in obj.flow_stats])
            off.append(obj.flow_off_stats.accepted)
    obj.drafter.train()
    obj.measure_relay_off = False
    out = {"tau_noflow": 1 + torch.cat(acc1).float().mean().item()}
    for r, acc in enumerate(zip(*accs)):  # flow rounds: tau_flow, then tau_flow2, ...
        out[f"tau_flow{r + 1 if r else ''}"] = 1 + torch.cat(acc).float().mean().item()
    if off:  # the first flow round's blocks without flow: tau_flow - tau_flow_off is the relay's gain
        out["tau_flow_off"] = 1 + torch.cat(off).float().mean().item()
    return out


def freeze_body(drafter: DFlowDrafter) -> None:
    """`--train-part relay`: only the relay branch trains; `no_flow` stays 0 too, so rounds without
    flow draft exactly as the body does."""
    relay = set(drafter.relay_branch()) - {"no_flow"}
    for name, p in drafter.named_parameters():
        p.requires_grad_(name.split(".")[0] in relay)


def _on_gpu(device: str) -> bool:
    """One GPU per process (NCCL refuses two ranks on one GPU); with fewer GPUs than processes, CPU +
    gloo, unless `device` is cuda, which is then refused rather than quietly run on the CPU."""
    world = int(os.environ.get("WORLD_SIZE", 1))
    enough = torch.cuda.is_available() and world <= torch.cuda.device_count()
    if device == "cuda" and not enough:
        have = torch.cuda.device_count() if torch.cuda.is_available() else 0
        raise UserError(f"--device cuda needs a CUDA GPU per process ({world} asked, {have} here); run on a GPU "
                        f"host or pass --device cpu")
    return enough and device != "cpu"


def train(cfg: TrainConfig) -> Path:
    """Train (or resume) a drafter; returns the folder of the saved drafter."""
    distributed = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    on_gpu = _on_gpu(cfg.device)
    if distributed and not dist.is_initialized():
        dist.init_process_group("nccl" if on_gpu else "gloo")
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    device = f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if on_gpu else "cpu"
    if on_gpu:
        # bitwise-reproducible steps, so a resumed run equals an uninterrupted one (as on CPU)
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # read when cuBLAS starts: before any GPU work
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.set_default_device(device)  # the objective's index tensors live next to the target
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    out = claim_dir(cfg.out_dir, "training run", own=("checkpoint.pt", "drafter"))
    ckpt_path = out / "checkpoint.pt"
    ck = _load_ckpt(ckpt_path) if ckpt_path.exists() else None  # refused (no code run) before any work

    probe = load_target(cfg.target, num_taps=cfg.num_taps, device=device)
    train_seqs, heldout = (_fits(x, cfg.max_len) for x in load_dataset(Path(cfg.data_dir), probe))
    if not train_seqs:
        raise UserError(f"no training sequence in {cfg.data_dir} has a response within max_len={cfg.max_len} "
                        f"tokens; raise --max-len")
    if not heldout and rank == 0:
        print(f"warning: no held-out sequence fits max_len={cfg.max_len}; training runs without τ evaluation")
    dcfg = untrained_config(probe, flow=cfg.objective == "dflow", block_size=cfg.block_size, num_layers=cfg.num_layers)
    dcfg = type(dcfg)(**{**dcfg.__dict__, "draft_vocab_size": cfg.draft_vocab_size, "relay": cfg.relay,
                         "extra": {"name": f"{cfg.target}-{cfg.objective}", "objective": cfg.objective}})
    drafter = build_drafter(probe, dcfg, seed=cfg.seed)
    if cfg.max_shard_mb:  # a tensor too large for one shard is refused now, not after the training
        shard_groups(drafter.state_dict(), int(cfg.max_shard_mb * 2**20))
    out.mkdir(parents=True, exist_ok=True)
    step, log, base = 0, [], 0
    if ck is not None:
        if _run_identity(ck["config"]) != _run_identity(asdict(cfg)) or ck.get("world") != world:
            raise UserError(f"{ckpt_path} was written by a run with another config or process count; "
                            f"use another --out-dir or the same settings")
        drafter.load_state_dict(ck["drafter"])  # its draft vocabulary too: kept when the data set has grown since
    elif cfg.init_from:
        log, base = _init_from(cfg.init_from, probe, drafter, cfg)
        step = base
    else:
        drafter.draft_vocab.copy_(_draft_vocab(train_seqs, cfg.draft_vocab_size, probe.info.vocab_size,
                                               probe.info.eos_token_ids))
    flows = None
    if cfg.train_part == "relay":  # the body stays as --init-from left it; its first rounds are cached
        freeze_body(drafter)
        flows = FlowCache(flows_dir(Path(cfg.data_dir), drafter), probe, drafter, cfg.anchors_per_seq, cfg.max_len,
                          cfg.seed, cfg.precision)
        train_seqs, heldout = ([s for s in x if flows.covers(s.id)] for x in (train_seqs, heldout))
        if not train_seqs:
            raise UserError(f"the flows at {flows.dir} cover no training sequence; run `dflow-trt cache-flows` on "
                            f"{cfg.data_dir} with this drafter")
        if rank == 0:
            print(f"relay only: {len(train_seqs)} training and {len(heldout)} held-out sequences have cached first rounds")
    obj = Objective(drafter, probe, cfg, _state_cache(cfg, probe, train_seqs + heldout, rank), flows).to(device)
    params = [p for p in drafter.parameters() if p.requires_grad]
    groups, lr_mults = _param_groups(drafter, params, cfg)
    opt = adamw(groups, cfg)
    rng = random.Random(cfg.seed * 1000 + rank)  # which sequences each step trains on
    gen = torch.Generator().manual_seed(cfg.seed * 7919 + rank)  # where the anchors fall
    if ck is not None:
        opt.load_state_dict(ck["optimizer"])
        step, log, base = ck["step"], ck["log"], ck.get("base", 0)
        rng.setstate(ck["rng"][rank])
        gen.set_state(ck["gen"][rank])
        if rank == 0:
            print(f"resumed from step {step}")
    model = nn.parallel.DistributedDataParallel(obj, broadcast_buffers=False) if distributed else obj
    mine = train_seqs[rank::world]
    bar = tqdm(total=cfg.steps, initial=step, desc=f"train {cfg.objective}", disable=rank != 0)
    t0 = time.perf_counter()
    out_of_time = False
    while step < cfg.steps and not out_of_time:
        for g, mult in zip(opt.param_groups, lr_mults):
            g["lr"] = _lr_at(step, cfg, base) * mult
        batch = collate(rng.sample(mine, min(cfg.seqs_per_step, len(mine))), cfg.max_len)
        loss, first, second = model(batch, gen)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
        opt.step()
        step += 1
        rec = {"step": step, "loss": loss.item(), "lr": opt.param_groups[0]["lr"], "grad_norm": float(gnorm),
               "train_tau_noflow": 1 + first.accepted.float().mean().item(), "elapsed_s": time.perf_counter() - t0}
        if second is not None:
            for r, st in enumerate(obj.flow_stats):
                rec[f"train_tau_flow{r + 1 if r else ''}"] = 1 + st.accepted.float().mean().item()
        out_of_time = bool(cfg.max_minutes) and _out_of_time(cfg, rec["elapsed_s"], distributed)
        if out_of_time:
            rec["stopped"] = f"max_minutes {cfg.max_minutes:g} passed at step {step} of {cfg.steps}"
        if rank == 0 and (step % cfg.eval_every == 0 or step == cfg.steps or out_of_time):
            rec.update({f"eval_{k}": v for k, v in evaluate(obj, heldout, cfg).items()}, train_seqs=len(train_seqs))
            bar.write(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in rec.items()}))
        log.append(rec)
        bar.update(1)
        bar.set_postfix(loss=f"{rec['loss']:.3f}", tau=f"{rec['train_tau_noflow']:.2f}")
        if step % cfg.ckpt_every == 0 or step == cfg.steps or out_of_time:
            states = _gather_states(rng.getstate(), gen.get_state(), distributed, world)
            if rank == 0:
                _save_ckpt(ckpt_path, {"config": asdict(cfg), "world": world, "step": step, "base": base, "log": log,
                                       "drafter": drafter.state_dict(), "optimizer": opt.state_dict(),
                                       "rng": [s[0] for s in states], "gen": [s[1] for s in states]})
    bar.close()
    final = out / "drafter"
    if rank == 0:
        logtxt = train_log.to_text(log)
        files = {"training_config.json": json.dumps(asdict(cfg), indent=2) + "\n", train_log.NAME: logtxt,
                 "data_manifest.json": (Path(cfg.data_dir) / "manifest.json").read_text()}
        if cfg.init_from:
            files[EARLIER] = json.dumps(earlier_stages(Path(cfg.init_from)), indent=1) + "\n"
        save_drafter(drafter, final, extra_files=files,
                     max_shard_bytes=int(cfg.max_shard_mb * 2**20) if cfg.max_shard_mb else None)
    if distributed:
        dist.barrier()
        dist.destroy_process_group()
    return final
