"""PyTorch target: any Hugging Face causal LM, verifying blocks against its own KV cache.

Rows of a batch accept different numbers of drafts, so each row's KV cache has its own length.
We keep one padded KV cache (a `DynamicCache` growing in place, `kv_cache.py`) and a per-row
validity mask over its slots instead of ragged caches: rejected slots of the last block are masked
out for good and the trailing slots no row uses are cropped. With one row this is an exact crop (no holes ever).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

import torch
from transformers import DynamicCache, PreTrainedModel

from ..kernels import GROUPED_SDPA
from ..decoding.interfaces import TargetInfo, TargetOutput
from .slots import close_block, open_block, prompt_slots
from ..errors import UserError
from .kv_cache import GrowingLayer, join_kv, keep_kv, new_kv_cache, reorder_last_slots


def default_tap_layers(num_target_layers: int, num_taps: int) -> tuple[int, ...]:
    """z-lab DFlash's choice: spread evenly over layers [1, L-3] (`[L // 2]` for one tap)."""
    if num_taps <= 0:
        return ()
    if num_taps == 1:
        return (num_target_layers // 2,)
    span = num_target_layers - 4
    return tuple(int(round(1 + i * span / (num_taps - 1))) for i in range(num_taps))


def tree_ancestors(parents: list[int], device=None) -> torch.Tensor:
    """parents [S] (parents[0] = -1, parents[i] < i) -> [S, S] bool: slot j is slot i or its ancestor."""
    S = len(parents)
    if not parents or parents[0] != -1 or any(not 0 <= p < i for i, p in enumerate(parents) if i):
        raise ValueError(f"parents must start at -1 (the anchor) and point to earlier slots, got {parents}")
    anc = torch.eye(S, dtype=torch.bool)
    for i in range(1, S):
        anc[i] |= anc[parents[i]]
    return anc.to(device)


def target_fingerprint(model: PreTrainedModel) -> str:
    """Hash of the architecture and the input embeddings the drafter shares with the target."""
    c = model.config
    arch = {k: getattr(c, k, None) for k in (
        "model_type", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
        "num_key_value_heads", "intermediate_size")}
    h = hashlib.sha256(json.dumps(arch, sort_keys=True).encode())
    emb = model.get_input_embeddings().weight.detach().to(device="cpu", dtype=torch.float32).contiguous()
    h.update(emb.numpy().tobytes())
    return h.hexdigest()[:16]


def tokenizer_fingerprint(tokenizer) -> str | None:
    """Hash of what turns text into ids (vocabulary, special tokens, chat template); None without one."""
    if tokenizer is None:
        return None
    d = {"vocab": sorted(tokenizer.get_vocab().items()), "specials": sorted(map(str, tokenizer.all_special_tokens)),
         "chat_template": getattr(tokenizer, "chat_template", None)}
    return hashlib.sha256(json.dumps(d, sort_keys=True, default=str).encode()).hexdigest()[:16]


@dataclass
class HFCache:
    kv: DynamicCache
    valid: torch.Tensor  # [B, P] bool: slot holds a committed (or just verified) token
    next_pos: torch.Tensor  # [B] long: absolute position of each row's next token
    pending: int = 0  # slots of the last verified block still awaiting commit()


class HFTarget:
    """Target interface over a transformers causal LM (Llama, Qwen3, ...)."""

    def __init__(self, model: PreTrainedModel, name: str, tap_layers: tuple[int, ...],
                 tokenizer=None, eos_token_ids: tuple[int, ...] = ()):
        n = model.config.num_hidden_layers
        bad = [t for t in tap_layers if not 0 <= t < n - 1]
        if bad:
            raise UserError(f"tap layers {bad} out of range for a {n}-layer target; use layers 0..{n - 2}")
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.info = TargetInfo(
            name=name, fingerprint=target_fingerprint(model), vocab_size=model.config.vocab_size,
            hidden_size=model.config.hidden_size, num_layers=n, tap_layers=tuple(tap_layers),
            eos_token_ids=tuple(eos_token_ids),
            max_context=getattr(model.config, "max_position_embeddings", None))

    @property
    def supports_tree(self) -> bool:
        """Whether `verify` takes a token tree: the attention must read a 4D bool mask as "True =
        attend" (SDPA; eager attention would add it), and every layer must keep every cached slot
        (no sliding window), since a branch commit reorders them in place."""
        c = self.model.config
        return (getattr(c, "_attn_implementation", None) in ("sdpa", GROUPED_SDPA)
                and all(t == "full_attention" for t in (getattr(c, "layer_types", None) or ["full_attention"])))

    @property
    def joins_rows(self) -> bool:
        """Rows can join and leave a running batch (`join`/`keep`) when every layer is a plain
        full-attention cache (a sliding window's ring buffer cannot be padded)."""
        return all(t == "full_attention" for t in (getattr(self.model.config, "layer_types", None) or ["full_attention"]))

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def input_embeddings(self) -> torch.Tensor:
        return self.model.get_input_embeddings().weight  # [V, H]

    @property
    def lm_head(self) -> torch.Tensor:
        return self.model.get_output_embeddings().weight  # [V, H]

    def with_taps(self, tap_layers: tuple[int, ...]) -> "HFTarget":
        """Same weights, other tap layers (a drafter decides which layers it reads)."""
        t = object.__new__(HFTarget)
        t.__dict__.update(self.__dict__)
        n = self.info.num_layers
        bad = [x for x in tap_layers if not 0 <= x < n - 1]
        if bad:
            raise UserError(f"tap layers {bad} out of range for a {n}-layer target; use layers 0..{n - 2}")
        t.info = TargetInfo(**{**self.info.__dict__, "tap_layers": tuple(tap_layers)})
        return t

    @torch.inference_mode()
    def _forward(self, ids: torch.Tensor, mask: torch.Tensor, pos: torch.Tensor,
                 kv: DynamicCache) -> TargetOutput:
        # a 2D mask marks valid slots (transformers adds causality); a 4D bool one is used as is
        out = self.model(input_ids=ids, attention_mask=mask if mask.dim() == 4 else mask.long(), position_ids=pos,
                         past_key_values=kv, use_cache=True,
                         output_hidden_states=bool(self.info.tap_layers))
        if self.info.tap_layers:
            # hidden_states[i + 1] is the output of decoder layer i
            taps = torch.cat([out.hidden_states[i + 1] for i in self.info.tap_layers], dim=-1)
        else:
            taps = ids.new_zeros((*ids.shape, 0), dtype=torch.float32)
        return TargetOutput(logits=out.logits.float(), taps=taps.float())  # [B,S,V], [B,S,F]

    def prefill(self, input_ids: torch.Tensor, prompt_lens: torch.Tensor) -> tuple[HFCache, TargetOutput]:
        B, T = input_ids.shape
        input_ids, prompt_lens = input_ids.to(self.device), prompt_lens.to(self.device)
        valid, pos = prompt_slots(prompt_lens, T)  # [B, T], [B, T]
        cache = HFCache(kv=new_kv_cache(self.model.config), valid=valid, next_pos=prompt_lens.clone())
        return cache, self._forward(input_ids, valid, pos, cache.kv)

    def verify(self, cache: HFCache, block_ids: torch.Tensor, parents: torch.Tensor | None = None) -> TargetOutput:
        """Chain, or a tree when `parents` [S] is given (see `Target.verify`)."""
        B, S = block_ids.shape
        if parents is not None:  # checked before the cache changes, so a refused tree leaves it usable
            if not self.supports_tree:
                raise UserError("this target's attention or cache cannot verify a token tree (it needs SDPA "
                                "attention and full-attention layers); verify chains (no --alternatives)")
            if parents.shape != (S,):
                raise ValueError(f"parents needs one entry per block slot ({S}), got {list(parents.shape)}")
            anc = tree_ancestors(parents.tolist(), self.device)  # [S, S]
        past = cache.valid  # [B, P]
        pos = open_block(cache, S)  # [B, S]
        if parents is None:
            mask = cache.valid
        else:
            pos = cache.next_pos[:, None] + anc.sum(-1)[None, :] - 1  # [B, S]: next_pos + depth
            mask = torch.cat([past[:, None, None, :].expand(B, 1, S, past.shape[1]),
                              anc[None, None].expand(B, 1, S, S)], -1)  # [B, 1, S, P+S]
        return self._forward(block_ids.to(self.device), mask, pos, cache.kv)

    def commit(self, cache: HFCache, num_kept: torch.Tensor, path: torch.Tensor | None = None) -> None:
        S, num_kept = cache.pending, num_kept.to(self.device)
        if path is not None:  # the kept branch's slots move to the front of the block, in order
            assert path.shape == (num_kept.shape[0], S), (tuple(path.shape), S)
            reorder_last_slots(cache.kv, path.to(self.device))
        drop = close_block(cache, num_kept)
        if drop > 0:
            cache.kv.crop(-drop)

    def join(self, cache: HFCache, other: HFCache) -> HFCache:
        """`cache`'s rows then `other`'s, in one padded cache (slots past a row's own are masked)."""
        assert cache.pending == 0 and other.pending == 0, "join committed caches only"
        assert all(isinstance(la, GrowingLayer) for la in (*cache.kv.layers, *other.kv.layers))
        cache = self.keep(cache, torch.arange(cache.valid.shape[0], device=self.device))  # squeezed first
        Pa, Pb = cache.valid.shape[1], other.valid.shape[1]
        P = max(Pa, Pb)
        join_kv(cache.kv, other.kv, Pa, Pb)
        pad = lambda v: torch.nn.functional.pad(v, (0, P - v.shape[1]))  # noqa: E731  [B, P] False
        return HFCache(kv=cache.kv, valid=torch.cat([pad(cache.valid), pad(other.valid)]),
                       next_pos=torch.cat([cache.next_pos, other.next_pos]))

    def keep(self, cache: HFCache, rows: torch.Tensor) -> HFCache:
        """Only these rows, each row's committed slots moved to the front in order. Rows accept
        different amounts each round, so the padded cache gathers holes; in a batch that lives on
        while requests come and go they would grow without bound, so every change of rows squeezes
        them out (a copy of the cache, which dropping rows makes anyway). Attention is unchanged:
        a slot's position is in its rotated key, and every kept slot stays before the next block."""
        assert cache.pending == 0, "keep rows of a committed cache only"
        rows = rows.to(self.device)
        valid = cache.valid[rows]  # [R, P]
        n = valid.sum(1)  # [R]
        width = int(n.max()) if len(rows) else 0
        slots = torch.argsort((~valid).to(torch.int8), dim=1, stable=True)[:, :width]  # each row's valid slots first
        return HFCache(kv=keep_kv(cache.kv, rows, slots),
                       valid=torch.arange(width, device=self.device)[None, :] < n[:, None],
                       next_pos=cache.next_pos[rows])
