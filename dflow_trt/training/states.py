"""Target states computed once per data set, so a training step costs the drafter, not the target.

Format of `<data_dir>/states/`:
- `manifest.json`: target fingerprint, tap layers, `max_len`, whether K/V are stored, shard list.
- `shard-XXXX.safetensors`, one per data shard: for each sequence id, `taps.<id>` [T, F] (the tap
  states, concatenated) and, with K/V, `kv.<id>` [layers, 2, Hkv, T, D] (the target's K/V cache,
  which DFlow's verifier pass attends to), T = min(len, max_len). Stored in bf16: half the disk and
  page cache, and the drafter reads its inputs in bf16 anyway.
Building is resumable per shard (each is written to a temp name, then renamed); each states file
records the SHA-256 of its data shard, and one whose shard has changed since (a data set that grew
regenerates its short last shard) is rebuilt, and not read by the trainer until then.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm import tqdm
from transformers import DynamicCache

from ..atomic import atomic_file, write_text
from ..errors import UserError
from ..targets.hf_target import HFTarget
from .data import load_dataset, read_shard, shard_bytes, shard_path

DIRNAME, FORMAT, DTYPE = "states", 1, torch.bfloat16


def _settings(target: HFTarget, max_len: int, kv: bool) -> dict:
    return {"format": FORMAT, "target_fingerprint": target.info.fingerprint,
            "tap_layers": list(target.info.tap_layers), "max_len": max_len, "kv": kv}


@torch.no_grad()
def build_states(target: HFTarget, data_dir: Path, max_len: int, kv: bool = True, batch_size: int = 8) -> Path:
    """Run the target once over every sequence of `data_dir` and store its states (resumable)."""
    data_dir = Path(data_dir)
    train, heldout = load_dataset(data_dir, target)
    shards = json.loads((data_dir / "manifest.json").read_text())["shards"]
    out = data_dir / DIRNAME
    out.mkdir(exist_ok=True)
    mpath = out / "manifest.json"
    settings = _settings(target, max_len, kv)
    if mpath.exists() and {k: v for k, v in json.loads(mpath.read_text()).items() if k in settings} != settings:
        raise UserError(f"{out} holds states made with other settings (target, tap layers, max_len or K/V); "
                        f"delete it to rebuild")
    write_text(mpath, json.dumps({**settings, "shards": [_states_file(s) for s in shards]}, indent=1))
    by_shard: dict[str, list] = {}
    for s in train + heldout:
        by_shard.setdefault(s.shard, []).append(s)
    todo = [s for s in shards if s in by_shard and not _current(out / _states_file(s), shard_path(data_dir, s))]
    bar = tqdm(total=sum(len(by_shard[s]) for s in todo), desc="target states", unit="seq")
    for shard in todo:
        tensors = {}
        seqs = sorted(by_shard[shard], key=lambda s: len(s.ids))  # similar lengths share a batch
        for i in range(0, len(seqs), batch_size):  # right-padded batches: padding never reaches real positions
            group = seqs[i:i + batch_size]
            lens = [min(len(s.ids), max_len) for s in group]
            ids = torch.zeros(len(group), max(lens), dtype=torch.long, device=target.device)  # [b, T]
            for b, s in enumerate(group):
                ids[b, : lens[b]] = torch.tensor(s.ids[: lens[b]], device=target.device)
            mask = (ids.new_tensor(lens)[:, None] > torch.arange(ids.shape[1], device=target.device)).long()  # [b, T]
            cache = DynamicCache(config=target.model.config) if kv else None
            o = target.model.model(input_ids=ids, attention_mask=mask, past_key_values=cache, use_cache=kv,
                                   output_hidden_states=True)
            taps = torch.cat([o.hidden_states[j + 1] for j in target.info.tap_layers], -1)  # [b, T, F]
            for b, s in enumerate(group):
                tensors[f"taps.{s.id}"] = taps[b, : lens[b]]
                if kv:  # [layers, 2, Hkv, T, D]
                    tensors[f"kv.{s.id}"] = torch.stack([torch.stack([la.keys[b, :, : lens[b]], la.values[b, :, : lens[b]]])
                                                         for la in cache.layers])
            bar.update(len(group))
        with atomic_file(out / _states_file(shard)) as tmp:
            save_file({k: v.to(DTYPE).cpu().contiguous() for k, v in tensors.items()}, tmp,
                      metadata={"data_sha256": _digest(shard_path(data_dir, shard))})
    bar.close()
    return out


class StateCache:
    """Read side: padded batches of cached taps (and a K/V cache) for the trainer."""

    def __init__(self, data_dir: Path, target: HFTarget, need_kv: bool):
        self.dir, self.target = Path(data_dir) / DIRNAME, target
        m = _manifest(self.dir / "manifest.json", target)
        self.where: dict[int, str] = {}
        self._files = {}
        for name in m["shards"]:
            p = self.dir / name
            if _current(p, shard_path(data_dir, name.replace(".safetensors", ".jsonl"))):  # else: those ids run live
                f = self._files[name] = safe_open(str(p), framework="pt")
                self.where.update({int(k.split(".")[1]): name for k in f.keys() if k.startswith("taps.")})
        self.need_kv = need_kv

    @staticmethod
    def usable(data_dir: Path, target: HFTarget, max_len: int, need_kv: bool) -> str | None:
        """None when the cache at `data_dir` serves this run, else why not (or that there is none)."""
        mpath = Path(data_dir) / DIRNAME / "manifest.json"
        if not mpath.is_file():
            return "none built"
        m = _manifest(mpath, target)
        want = _settings(target, max_len, need_kv)
        bad = [k for k in ("format", "tap_layers", "max_len") if m.get(k) != want[k]]
        if need_kv and not m.get("kv"):
            bad.append("kv")
        return f"built with other {', '.join(bad)}" if bad else None

    def covers(self, ids: list[int]) -> bool:
        return all(i in self.where for i in ids)

    def batch(self, seq_ids: list[int], T: int):
        """Taps [N, T, F] (zero past each sequence) and, if needed, a DynamicCache of length T."""
        dev, dt = self.target.device, self.target.model.dtype
        get = lambda kind, i: self._files[self.where[i]].get_tensor(f"{kind}.{i}")  # noqa: E731
        taps = [get("taps", i) for i in seq_ids]
        out = torch.zeros(len(seq_ids), T, taps[0].shape[-1], dtype=dt, device=dev)
        for b, t in enumerate(taps):
            out[b, : t.shape[0]] = t[:T].to(device=dev, dtype=dt)
        if not self.need_kv:
            return out, None
        kvs = [get("kv", i) for i in seq_ids]  # each [layers, 2, Hkv, T_i, D]
        full = torch.zeros(len(seq_ids), *kvs[0].shape[:-2], T, kvs[0].shape[-1], dtype=dt, device=dev)
        for b, x in enumerate(kvs):
            full[b, ..., : x.shape[-2], :] = x[..., :T, :].to(device=dev, dtype=dt)
        cache = DynamicCache(config=self.target.model.config)
        for layer in range(full.shape[1]):
            cache.update(full[:, layer, 0], full[:, layer, 1], layer)
        return out, cache


def _manifest(path: Path, target: HFTarget) -> dict:
    """A states manifest, refused when it was made by another target."""
    m = json.loads(path.read_text())
    if m.get("target_fingerprint") != target.info.fingerprint:
        raise UserError(f"{path.parent} holds states of another target; delete it and rebuild with "
                        f"`dflow-trt cache-states --target {target.info.name}`")
    return m


def _digest(data_shard: Path) -> str:
    return hashlib.sha256(shard_bytes(data_shard)).hexdigest()  # of the JSONL: the same compressed or not


def _current(states: Path, data_shard: Path) -> bool:
    """Whether `states` was built from `data_shard` as it is now (it may have been regenerated since)."""
    if not states.exists() or not data_shard.exists():
        return False
    with safe_open(str(states), framework="pt") as f:
        sha = (f.metadata() or {}).get("data_sha256")
        if sha is not None:
            return sha == _digest(data_shard)
        ids = {int(k.split(".")[1]) for k in f.keys() if k.startswith("taps.")}  # built before digests were stored
    return ids == {r["id"] for r in read_shard(data_shard)}


def _states_file(data_shard: str) -> str:
    """The states file of a data shard: shard-0003.jsonl -> shard-0003.safetensors."""
    return data_shard.replace(".jsonl", ".safetensors")
