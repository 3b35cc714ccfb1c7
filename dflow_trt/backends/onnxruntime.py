"""ONNX Runtime back ends: the `Target` and `Drafter` interfaces over the exported graphs.

`OrtTarget` keeps HFTarget's cache semantics: one padded KV cache per request with a per-row
validity mask over its slots; rejected slots of the last block are masked for good and trailing
slots no row uses are cropped (an exact crop with one row). `OrtDrafter` keeps TorchDrafter's:
a compact, right-padded context K/V cache per row (row b's first lens[b] slots), appended with
only the newly committed positions each round. Tensors cross the interface as torch tensors
(what the decoding loop uses); the caches live as numpy arrays next to the sessions.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnxruntime as ort
import torch

from ..atomic import read_json
from ..decoding.interfaces import FlowState, Proposal, TargetInfo, TargetOutput
from ..decoding.sampling import SamplingParams, propose
from ..targets.slots import close_block, open_block, prompt_slots
from ..drafter.config import DrafterConfig
from ..drafter.context import append_slots
from ..errors import UserError
from . import onnx_io


def _session(path: Path, threads: int | None = None) -> ort.InferenceSession:
    if not path.is_file():
        raise UserError(f"no ONNX graph at {path}; export it with `python scripts/build_engines.py`")
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads or torch.get_num_threads()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.log_severity_level = 3
    return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])


def _read_meta(path: Path, kind: str) -> dict:
    return read_json(path, "kind", kind, "re-export with `python scripts/build_engines.py`")


# ---------------------------------------------------------------- target


@dataclass
class OrtCache:
    kv: list[np.ndarray]  # 2 * layers arrays [B, Hkv, P, D] (key, value, key, value, ...)
    valid: torch.Tensor  # [B, P] bool: slot holds a committed (or just verified) token
    next_pos: torch.Tensor  # [B] long: absolute position of each row's next token
    pending: int = 0  # slots of the last verified block still awaiting commit()


class OrtTarget:
    """Target interface over `target.onnx` (exported by `export.onnx_target`)."""

    supports_tree = False  # the graph takes a slot-validity mask, not a tree's: chains only

    def __init__(self, onnx_dir: str | Path, tokenizer=None, threads: int | None = None):
        d = Path(onnx_dir)
        self.meta = m = _read_meta(d / onnx_io.TARGET_META, onnx_io.TARGET_KIND)
        self.session = _session(d / onnx_io.TARGET_GRAPH, threads)
        self.tokenizer = tokenizer
        self.num_layers, self.num_kv_heads, self.head_dim = m["num_layers"], m["num_kv_heads"], m["head_dim"]
        self.info = TargetInfo(name=m["target"], fingerprint=m["fingerprint"], vocab_size=m["vocab_size"],
                               hidden_size=m["hidden_size"], num_layers=m["num_layers"],
                               tap_layers=tuple(m["tap_layers"]), eos_token_ids=tuple(m["eos_token_ids"]),
                               max_context=m.get("max_context"))
        self.input_names, _ = onnx_io.target_io_names(self.num_layers)

    def _run(self, ids: torch.Tensor, pos: torch.Tensor, valid: torch.Tensor,
             kv: list[np.ndarray]) -> tuple[TargetOutput, list[np.ndarray]]:
        feeds = dict(zip(self.input_names, [ids.numpy(), pos.numpy(), valid.numpy(),
                                            *[np.ascontiguousarray(x) for x in kv]]))
        logits, taps, *present = self.session.run(None, feeds)
        return TargetOutput(logits=torch.from_numpy(logits), taps=torch.from_numpy(taps)), present

    def prefill(self, input_ids: torch.Tensor, prompt_lens: torch.Tensor) -> tuple[OrtCache, TargetOutput]:
        B, T = input_ids.shape
        input_ids, prompt_lens = input_ids.cpu().long(), prompt_lens.cpu().long()
        valid, pos = prompt_slots(prompt_lens, T)  # [B, T], [B, T]
        # the graph needs P >= 1: one masked dummy slot, dropped from the cache afterwards
        dummy = [np.zeros((B, self.num_kv_heads, 1, self.head_dim), np.float32)] * (2 * self.num_layers)
        out, present = self._run(input_ids, pos, torch.cat([valid.new_zeros(B, 1), valid], 1), dummy)
        cache = OrtCache(kv=[x[:, :, 1:] for x in present], valid=valid, next_pos=prompt_lens.clone())
        return cache, out

    def verify(self, cache: OrtCache, block_ids: torch.Tensor, parents: torch.Tensor | None = None) -> TargetOutput:
        if parents is not None:
            raise UserError("the ONNX Runtime target verifies chains only, not token trees; "
                            "set alternatives to 0 or use the PyTorch target")
        pos = open_block(cache, block_ids.shape[1])  # [B, S]
        out, cache.kv = self._run(block_ids.cpu().long(), pos, cache.valid, cache.kv)
        return out

    def commit(self, cache: OrtCache, num_kept: torch.Tensor, path: torch.Tensor | None = None) -> None:
        assert path is None, "chains only (see verify)"
        drop = close_block(cache, num_kept.cpu())
        if drop > 0:
            cache.kv = [x[:, :, :-drop] for x in cache.kv]


# ---------------------------------------------------------------- drafter


@dataclass
class OrtDrafterState:
    k: list[torch.Tensor]  # per layer [B, Hkv, cap, D]; row b's first lens[b] slots are its context
    v: list[torch.Tensor]
    lens: torch.Tensor  # [B] valid context slots per row
    block_size: int  # anchor + drafts, this request's
    generator: torch.Generator | None = None


class OrtDrafter:
    """Drafter interface over `drafter.onnx` (exported by `export.onnx_drafter`)."""

    def __init__(self, onnx_dir: str | Path, threads: int | None = None):
        d = Path(onnx_dir)
        self.meta = m = _read_meta(d / onnx_io.DRAFTER_META, onnx_io.DRAFTER_KIND)
        self.config = c = DrafterConfig.from_dict(m["config"])
        self.session = _session(d / onnx_io.DRAFTER_GRAPH, threads)
        self.block_size = c.block_size  # the default; a request may ask for another
        self.uses_flow = c.flow
        vd = m["draft_vocab"]
        self.draft_vocab = torch.tensor(vd) if vd is not None else torch.arange(c.target.vocab_size)  # [Vd]
        self.input_names, _ = onnx_io.drafter_io_names(c.num_layers, c.flow)

    def check_target(self, info: TargetInfo) -> None:
        """Refuse a target other than the one this drafter was exported for (or other taps)."""
        self.config.check_target(info)
        if tuple(info.tap_layers) != self.config.tap_layers:
            raise UserError(f"drafter reads target layers {list(self.config.tap_layers)} but the target taps "
                            f"{list(info.tap_layers)}; export the target with the drafter's tap layers")

    def new_state(self, batch_size: int, generator: torch.Generator | None = None,
                  block_size: int | None = None) -> OrtDrafterState:
        c = self.config
        empty = lambda: torch.zeros(batch_size, c.num_kv_heads, 1, c.head_dim)  # noqa: E731
        return OrtDrafterState(k=[empty() for _ in range(c.num_layers)], v=[empty() for _ in range(c.num_layers)],
                               lens=torch.zeros(batch_size, dtype=torch.long), block_size=block_size or self.block_size,
                               generator=generator)

    def _store(self, st: OrtDrafterState, new: list[np.ndarray], lens: torch.Tensor) -> None:
        """Append row b's first lens[b] new K/V slots ([B, Hkv, N, D] per layer, key then value)."""
        for i in range(self.config.num_layers):
            st.k[i] = append_slots(st.k[i], st.lens, torch.from_numpy(new[2 * i]), lens, dim=2)
            st.v[i] = append_slots(st.v[i], st.lens, torch.from_numpy(new[2 * i + 1]), lens, dim=2)
        st.lens = st.lens + lens

    @torch.inference_mode()
    def draft(self, state: OrtDrafterState, context_taps: torch.Tensor, context_lens: torch.Tensor,
              anchor_ids: torch.Tensor, anchor_pos: torch.Tensor, flow: FlowState | None,
              sampler: SamplingParams, verify_threshold: float = 0.0) -> Proposal:
        # one graph call drafts the whole block; `verify_threshold` (may stop early) is not needed
        c, S = self.config, state.block_size
        context_taps, context_lens = context_taps.cpu().float(), context_lens.cpu().long()
        B, N = context_taps.shape[:2]
        if N == 0:  # the graph needs N >= 1: one masked dummy row
            context_taps, N = context_taps.new_zeros(B, 1, context_taps.shape[2]), 1
        st = state
        assert torch.equal(st.lens + context_lens, anchor_pos.cpu()), "drafter context must end right before the anchor"
        C = max(1, int(st.lens.max()))
        ctx_pos = st.lens[:, None] + torch.arange(N)  # [B, N]
        block = torch.full((B, S), c.mask_token_id, dtype=torch.long)
        block[:, 0] = anchor_ids.cpu()
        block_pos = (st.lens + context_lens)[:, None] + torch.arange(S)  # [B, S]
        past_ok = torch.arange(C)[None, :] < st.lens[:, None]  # [B, C]
        new_ok = torch.arange(N)[None, :] < context_lens[:, None]  # [B, N]
        keys_ok = torch.cat([past_ok, new_ok, past_ok.new_ones(B, S)], 1)  # [B, C+N+S]
        feeds = [context_taps.numpy(), ctx_pos.numpy(), block.numpy(), block_pos.numpy(),
                 keys_ok[:, None, :].expand(B, S, C + N + S).contiguous().numpy()]
        if c.flow:
            if flow is None:
                flow = FlowState(taps=torch.zeros(B, S, c.feature_size), token_ids=torch.zeros(B, S, dtype=torch.long),
                                 hint_ids=torch.zeros(B, S, dtype=torch.long), valid=torch.zeros(B, S, dtype=torch.bool))
            feeds += [flow.taps.cpu().float().contiguous().numpy(), flow.token_ids.cpu().long().numpy(),
                      flow.hint_ids.cpu().long().numpy(), flow.valid.cpu().bool().numpy()]
        for k, v in zip(st.k, st.v):
            feeds += [k[:, :, :C].contiguous().numpy(), v[:, :, :C].contiguous().numpy()]
        logits, *new = self.session.run(None, dict(zip(self.input_names, feeds)))
        self._store(st, new, context_lens)
        return propose(torch.from_numpy(logits), self.draft_vocab, c.target.vocab_size, sampler, st.generator)
