"""Training throughput: blocks/s and tokens/s of real trainer steps, and how much of this CPU's
own matmul FLOP/s they reach (issue 27: training throughput first).

A step here is the trainer's step (`Objective` forward, backward, clipping, AdamW) on the trainer's
own batches, target states read from a state cache as a long run reads them (`dflow-trt
cache-states`). Without a data set, `synthetic_data` writes one of seeded token ids shaped like the
shipped data (a ~104-token prompt, a 128-token response) and caches its states once.

Counting: a *block* is one anchor (the first prediction); DFlow also trains the self-conditioned
second round of `flow_anchors_per_seq` blocks per sequence, counted in `trained_blocks_per_s`.
*Tokens* are the draft positions a loss trains (S-1 per trained block). FLOPs are the matmul and
attention FLOPs torch's `FlopCounterMode` counts in one step (forward, backward and the frozen
target's self-conditioning pass); the peak is the best FLOP/s of a torch matmul microbenchmark of
the trainer's own shapes in the dtype the trainer computes in, so `fraction` says how close the
step is to what this machine's matmuls can do.

`dflow-trt bench training --json-out bench.json` prints the table and writes the JSON.
"""

from __future__ import annotations

import dataclasses
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch

from ..atomic import write_text
from ..errors import UserError

# The shipped drafters' training settings (dflow_trt/drafters/*/training_config.json) but the
# issue's batch: 2 sequences x 16 anchors, every block self-conditioned (flow_anchors_per_seq 0).
SHIPPED = {"target": "smollm2-135m", "seqs_per_step": 2, "anchors_per_seq": 16, "flow_anchors_per_seq": 0,
           "block_size": 16, "gamma": 1.5, "num_layers": 1, "num_taps": 3, "draft_vocab_size": 8192,
           "max_len": 320, "lr": 3e-4}
PROMPT_LEN, RESPONSE_LEN = 104, 128  # medians of the smollm2 data campaign's sequences


def cpu_flags() -> set[str]:
    """The CPU's feature flags (Linux /proc/cpuinfo; empty elsewhere)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def native_bf16() -> bool:
    """Whether this CPU multiplies bf16 natively (AVX512-BF16 or AMX): only then is bf16 autocast
    faster than fp32; on AVX2 it is emulated and slower."""
    return bool(cpu_flags() & {"avx512_bf16", "amx_bf16"})


def matmul_peak(shapes: list[tuple[int, int, int]], dtype: torch.dtype = torch.float32,
                seconds: float = 0.3) -> dict:
    """Best FLOP/s of `a @ b` over `shapes` (m, k, n), each timed for ~`seconds` after a warm-up."""
    per = {}
    for m, k, n in shapes:
        a, b = torch.randn(m, k, dtype=dtype), torch.randn(k, n, dtype=dtype)
        for _ in range(3):
            a @ b
        reps, t0 = 0, time.perf_counter()
        while (dt := time.perf_counter() - t0) < seconds:
            a @ b
            reps += 1
        per[f"{m}x{k}x{n}"] = 2 * m * k * n * reps / dt
    return {"peak_flops": max(per.values()), "per_shape": per, "dtype": str(dtype).replace("torch.", "")}


def trainer_shapes(cfg, hidden: int, features: int, intermediate: int, seq_len: int) -> list[tuple[int, int, int]]:
    """The matmuls that dominate a step: (rows, in, out) of the context projection, the layer's
    projections and MLP over all block rows, and the draft-vocabulary head."""
    rows = cfg.seqs_per_step * cfg.anchors_per_seq * cfg.block_size
    ctx = cfg.seqs_per_step * seq_len
    vd = cfg.draft_vocab_size or 49152
    return [(ctx, features, hidden), (rows, hidden, intermediate), (rows, intermediate, hidden),
            (rows - cfg.seqs_per_step * cfg.anchors_per_seq, hidden, vd)]


def synthetic_data(target, out: Path, num_seqs: int = 32, seed: int = 0, max_len: int = 320,
                   kv: bool = True) -> Path:
    """A data set of `num_seqs` seeded token sequences in the trainer's format, and its state cache
    (built once; reused when `out` already holds it)."""
    from ..targets.hf_target import tokenizer_fingerprint
    from .data import load_dataset
    from .states import DIRNAME, build_states

    out = Path(out)
    if not (out / DIRNAME / "manifest.json").is_file():
        g = random.Random(seed)
        V = target.info.vocab_size
        rows = [json.dumps({"id": i, "source": "synthetic", "prompt_ids": [g.randrange(V) for _ in range(PROMPT_LEN)],
                            "response_ids": [g.randrange(V) for _ in range(RESPONSE_LEN)]}) for i in range(1, num_seqs + 1)]
        write_text(out / "shard-0000.jsonl", "\n".join(rows) + "\n")
        write_text(out / "manifest.json", json.dumps({
            "format": 1, "target": target.info.name, "target_fingerprint": target.info.fingerprint,
            "tokenizer_fingerprint": tokenizer_fingerprint(target.tokenizer), "heldout_every": 10**9,
            "shards": ["shard-0000.jsonl"], "synthetic": True}))
        load_dataset(out, target)  # refuses a target mismatch before the build
        build_states(target, out, max_len, kv=kv)
    return out


def _config(overrides: dict):
    """A TrainConfig of SHIPPED + overrides, fields this version's TrainConfig lacks dropped (so the
    same benchmark runs on older trainers)."""
    from .trainer import TrainConfig

    known = {f.name for f in dataclasses.fields(TrainConfig)}
    return TrainConfig(**{k: v for k, v in {**SHIPPED, **overrides}.items() if k in known and v is not None})


def measure(overrides: dict | None = None, *, steps: int = 8, warmup: int = 2, threads: int | None = None,
            data_dir: str | Path | None = None, drafter: str | Path | None = None, peak: bool = True,
            flops: bool = True) -> dict:
    """Time `steps` trainer steps (after `warmup`) of TrainConfig(SHIPPED + overrides).

    Returns blocks_per_s, trained_blocks_per_s, tokens_per_s, step_s (median), flops_per_step,
    achieved_flops (per second), peak_flops (this machine's matmul best in the trainer's dtype),
    fraction, and the settings. `data_dir`: a data set with a state cache (default: a synthetic
    one in a temporary folder). `drafter`: start from a saved drafter's weights (a trained one
    accepts more drafts, which DFlow's self-conditioning pass skips; sizes come from it).
    `train_part="relay"` (DFlow): the relay alone on `drafter`'s frozen body, its first rounds
    cached once beforehand by `cache-flows`' code (that one-off cost: flows_s_per_seq).
    """
    from ..drafter.io import build_drafter, load_drafter
    from ..targets import load_target
    from .data import load_dataset
    from .states import StateCache
    from .trainer import Objective, _fits, untrained_config
    try:
        from .objective import collate
    except ImportError:  # older trainers kept it in trainer.py
        from .trainer import _collate as collate

    drafter_path, synthetic = drafter, not data_dir
    if steps < 1 or warmup < 0:
        raise UserError(f"--steps must be >= 1 and --warmup >= 0, got {steps} and {warmup}")
    overrides = dict(overrides or {})
    if overrides.get("train_part") == "relay":
        if drafter is None:
            raise UserError("train_part=relay trains the relay on a saved drafter's frozen body; pass --drafter")
        overrides["init_from"] = str(drafter)
    cfg = _config(overrides)
    if threads:
        torch.set_num_threads(threads)
    target = load_target(cfg.target, num_taps=cfg.num_taps)
    relay = getattr(cfg, "train_part", "all") == "relay"
    need_kv = cfg.objective == "dflow" and not relay
    with tempfile.TemporaryDirectory(prefix="dflow-throughput-") as tmp:
        data = Path(data_dir) if data_dir else Path(tmp) / "data"
        if not (data / "manifest.json").is_file():  # a new folder: the synthetic data set, kept there
            data, synthetic = synthetic_data(target, data, max_len=cfg.max_len), True
        train_seqs, _ = (_fits(x, cfg.max_len) for x in load_dataset(data, target))
        why = StateCache.usable(data, target, cfg.max_len, need_kv)
        if why is not None:
            raise UserError(f"{data} has no usable state cache ({why}); run `dflow-trt cache-states` on it")
        cache = StateCache(data, target, need_kv)
        flows, flows_s = None, None
        if relay:  # a DFlow drafter on the saved one's body (a DFlash one gets a silent relay), first rounds cached
            from .flows import FlowCache, build_flows, flows_dir
            from .trainer import _init_from, compute_dtype, freeze_body

            dcfg = untrained_config(target, flow=True, block_size=cfg.block_size, num_layers=cfg.num_layers)
            drafter = build_drafter(target, dataclasses.replace(dcfg, draft_vocab_size=cfg.draft_vocab_size,
                                                                relay=cfg.relay), seed=cfg.seed)
            _init_from(str(drafter_path), target, drafter, dataclasses.replace(cfg, steps=2**62))
            freeze_body(drafter)
            train_seqs = train_seqs[:32]  # enough to sample steps from; built in the temporary folder
            t0 = time.perf_counter()
            build_flows(target, drafter, Path(tmp), train_seqs, cfg.anchors_per_seq, cfg.max_len, seed=cfg.seed,
                        compute_dtype=compute_dtype(cfg.precision), precision=cfg.precision)
            flows_s = (time.perf_counter() - t0) / len(train_seqs)
            flows = FlowCache(flows_dir(Path(tmp), drafter), target, drafter, cfg.anchors_per_seq, cfg.max_len, cfg.seed,
                              cfg.precision)
        elif drafter is not None:
            drafter = load_drafter(drafter, target)
            if drafter.config.flow != need_kv or drafter.config.block_size != cfg.block_size:
                raise UserError(f"--drafter is a {'dflow' if drafter.config.flow else 'dflash'} drafter of block size "
                                f"{drafter.config.block_size}; the run is {cfg.objective} with block size {cfg.block_size}")
        else:
            dcfg = untrained_config(target, flow=need_kv, block_size=cfg.block_size, num_layers=cfg.num_layers)
            drafter = build_drafter(target, dataclasses.replace(dcfg, draft_vocab_size=cfg.draft_vocab_size),
                                    seed=cfg.seed)
        obj = Objective(drafter, target, cfg, cache, flows) if relay else Objective(drafter, target, cfg, cache)
        params = [p for p in drafter.parameters() if p.requires_grad]
        try:  # the trainer's own optimizer where it has one (older trainers built it inline)
            from .trainer import adamw
        except ImportError:
            adamw = lambda groups, c: torch.optim.AdamW(groups, lr=c.lr, weight_decay=c.weight_decay,
                                                        betas=(0.9, 0.95))
        opt = adamw([{"params": params}], cfg)
        rng, gen = random.Random(cfg.seed), torch.Generator().manual_seed(cfg.seed)

        def step():
            batch = collate(rng.sample(train_seqs, min(cfg.seqs_per_step, len(train_seqs))), cfg.max_len)
            loss, _, _ = obj(batch, gen)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
            opt.step()
            return batch, loss

        for _ in range(warmup):
            step()
        times, T = [], []
        for _ in range(steps):
            t0 = time.perf_counter()
            batch, loss = step()
            times.append(time.perf_counter() - t0)
            T.append(batch.ids.shape[1])
        flops_per_step = None
        if flops:
            from torch.utils.flop_counter import FlopCounterMode

            with FlopCounterMode(display=False) as fc:
                step()
            flops_per_step = fc.get_total_flops()
    N, nb, S = cfg.seqs_per_step, cfg.anchors_per_seq, cfg.block_size
    blocks = N * nb
    trained = blocks if relay else blocks + (N * min(cfg.flow_anchors_per_seq or nb, nb) if need_kv else 0)
    total = sum(times)
    dtype = getattr(obj, "compute_dtype", torch.float32)
    res = {"objective": cfg.objective + (" relay-only" if relay else ""), "drafter": str(drafter_path) if drafter_path else "untrained",
           "data": "synthetic" if synthetic else str(data), "config": {k: getattr(cfg, k) for k in SHIPPED | (overrides or {})
                                                  if hasattr(cfg, k)},
           "threads": torch.get_num_threads(), "steps": steps, "seq_len_median": statistics.median(T),
           "step_s": statistics.median(times), "blocks_per_s": blocks * steps / total,
           "trained_blocks_per_s": trained * steps / total, "tokens_per_s": trained * (S - 1) * steps / total,
           "compute_dtype": str(dtype).replace("torch.", ""), "native_bf16": native_bf16(),
           "loss_last": loss.item()}
    if flows_s is not None:
        res["flows_s_per_seq"] = flows_s
    if flops_per_step is not None:
        res.update(flops_per_step=flops_per_step, achieved_flops=flops_per_step * steps / total)
    if peak:
        c = drafter.config
        res["matmul"] = matmul_peak(trainer_shapes(cfg, c.hidden_size, c.feature_size, c.intermediate_size,
                                                   int(statistics.median(T))), dtype=dtype)
        res["peak_flops"] = res["matmul"]["peak_flops"]
        if flops_per_step is not None:
            res["fraction"] = res["achieved_flops"] / res["peak_flops"]
    return res
