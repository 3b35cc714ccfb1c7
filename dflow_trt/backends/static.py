"""Static back end (`--backend static`): a lean target forward over preallocated KV pools.

The eager target (`targets/hf_target.py`) grows a transformers cache and crops it every round, and
its forward rebuilds masks and position tables through transformers' generic machinery. Here the
same Hugging Face weights (borrowed, not copied: the fingerprint is the same) run through a short
forward written for the Llama and Qwen3 families, and each layer's K/V live in one pool
[B, Hkv, slots, D] allocated at prefill: row b's slot i holds position i, `fill[b]` counts its
committed slots. A verify writes its block at slots fill..fill+S-1 (a scatter, no concatenation),
commit moves the pointer (for a token tree it first moves the kept branch's K/V into place); nothing
is cropped. Every verify of block S has the same shapes when the attention reads the whole pool
(`fixed_window`), which is what `torch.compile` without recompiles and CUDA-graph capture need; in
eager mode the attention reads only the slots in use (one host read per commit, free on a CPU).
A decode step of a small model is a chain of small ops, so the forward also does once what
transformers does per layer: the attention mask is made additive once per call (not converted by
every layer's attention), and each RMSNorm is one op (`F.rms_norm`, the same arithmetic in fp32).

A decode step on a CPU streams every weight once for one row, and the BLAS behind `F.linear` reads a
[out, in] matrix for one row at about half the memory bandwidth that `x @ W_t` reaches on the same
weights stored [in, out] (measured 14 vs 27 GB/s for the 113 MB head on 2 AVX2 cores; the eager
target's oneDNN-packed linears, `kernels.py`, reached 18 GB/s over the layers). So on a CPU
the static target keeps a second, transposed copy of the weights (`DecodeWeights`: q|k|v and
gate|up fused, the head) and uses it for calls of at most `DECODE_ROWS` rows (B·S: `ar` steps and
small batches); wider verifies are compute-bound and run on the borrowed weights, where the BLAS is
faster. The copy costs the weights' size again in memory, once per model (shared by every static
target over it), and is a snapshot taken when a static target is made (weights written in place
afterwards are not seen by that target; a new one copies them again).

Shapes: B rows, S block slots, T prompt length, W attended slots, H/Hkv query/KV heads, D head size.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from .. import kernels
from ..decoding.interfaces import TargetOutput
from ..errors import UserError
from ..targets.hf_target import HFTarget, tree_ancestors
from ..targets.slots import prompt_slots

FAMILIES = ("llama", "qwen3")
# Pool slots past max_len: room for one block of a row at the end of its budget (and for finished
# rows of a batch, which the loop keeps verifying with their pointer held at max_len).
BLOCK_HEADROOM = 64
DEFAULT_MAX_LEN = 2048
STATIC_ROPE = ("default", "linear", "llama3", "yarn")  # position tables that do not change with length
DECODE_ROWS = 8  # B·S at most this many rows run on the transposed decode weights (measured: faster to 8, slower at 16)


@dataclass
class StaticCache:
    k: list[torch.Tensor]  # per layer [B, Hkv, slots, D]
    v: list[torch.Tensor]
    fill: torch.Tensor  # [B] long: committed slots per row == the row's next position
    hi: int  # host copy of max(fill): bounds the eager attention window
    pending: int = 0  # slots of the last verified block awaiting commit()

    @property
    def next_pos(self) -> torch.Tensor:
        return self.fill


@dataclass
class DecodeWeights:
    """The target's linear weights stored [in, out] for one-row calls on a CPU (`x @ w`)."""

    qkv: list[torch.Tensor]  # per layer [hidden, (H + 2·Hkv)·D]
    o: list[torch.Tensor]  # [H·D, hidden]
    gate_up: list[torch.Tensor]  # [hidden, 2·inter]
    down: list[torch.Tensor]  # [inter, hidden]
    head: torch.Tensor  # [hidden, V]

    key: tuple = ()  # kernels.cache_key of the source weights when copied

    @staticmethod
    def of(model) -> DecodeWeights | None:
        """Made once per model and kept while it lives, remade if its weights were written in place
        since. None where a projection is not a plain bias-free `nn.Linear` (or its oneDNN-packed
        form, `kernels.PackedLinear`, as loaded targets have): a ModelOpt-quantized layer computes
        more than its weight, so it keeps its own forward."""
        layers = model.model.layers
        mods = [m for layer in layers for m in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj,
                                                 layer.self_attn.o_proj, layer.mlp.gate_proj, layer.mlp.up_proj,
                                                 layer.mlp.down_proj)] + [model.lm_head]
        if any(type(m) not in (torch.nn.Linear, kernels.PackedLinear) or m.bias is not None for m in mods):
            return None
        weights = [m.weight for m in mods]
        if model in _DECODE_WEIGHTS and kernels.still_valid(_DECODE_WEIGHTS[model].key, *weights):
            return _DECODE_WEIGHTS[model]
        with torch.no_grad():
            t = lambda *ms: torch.cat([m.weight for m in ms]).t().contiguous()
            dw = DecodeWeights(qkv=[t(a.q_proj, a.k_proj, a.v_proj) for a in (layer.self_attn for layer in layers)],
                               o=[t(layer.self_attn.o_proj) for layer in layers],
                               gate_up=[t(layer.mlp.gate_proj, layer.mlp.up_proj) for layer in layers],
                               down=[t(layer.mlp.down_proj) for layer in layers], head=t(model.lm_head),
                               key=kernels.cache_key(*weights))
        _DECODE_WEIGHTS[model] = dw
        return dw


_DECODE_WEIGHTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class StaticTarget:
    """Target interface over a Llama/Qwen3 `HFTarget`'s weights with static KV pools.

    `max_len`: positions a row may hold (prompt + output); the loop refuses longer requests up
    front through `info.max_context`. `prefill_logits`: "last" returns prefill logits [B, 1, V]
    (all the loop reads: `out.logits[:, -1]`), "all" [B, T, V] like the eager target. `compile`:
    `torch.compile` the verify forward (fixed shapes). `cuda_graphs`: capture each verify shape
    once and replay it (CUDA only). `decode_weights`: the transposed copy for calls of at most
    `DECODE_ROWS` rows (None: on a CPU, where it pays). `pad_block`: verify every block, an `ar`
    step's single token included, as this many slots (the real ones first, then filler the real ones
    never attend), so a position's logits come from the same kernels whichever block it sits in:
    greedy drafting then equals `ar` bit for bit in bf16, where a 16-row and a 1-row matmul round
    differently. It costs an `ar` step a block's compute: for a GPU, where both stream the same bytes."""

    supports_tree = True
    joins_rows = True

    def __init__(self, hf: HFTarget, max_len: int | None = None, prefill_logits: str = "last",
                 compile: bool = False, cuda_graphs: bool = False, decode_weights: bool | None = None,
                 pad_block: int = 0):
        model, c = hf.model, hf.model.config
        if c.model_type not in FAMILIES:
            raise UserError(f"the static back end runs {', '.join(FAMILIES)} targets, not {c.model_type!r}; "
                            f"use --backend torch")
        rope = (getattr(c, "rope_parameters", None) or getattr(c, "rope_scaling", None) or {})
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in STATIC_ROPE or getattr(c, "use_sliding_window", False) or any(
                t != "full_attention" for t in (getattr(c, "layer_types", None) or ["full_attention"])):
            raise UserError(f"the static back end needs full attention and a fixed RoPE table (rope type "
                            f"{rope_type!r}, sliding window: {getattr(c, 'use_sliding_window', False)}); "
                            f"use --backend torch")
        if prefill_logits not in ("last", "all"):
            raise ValueError(f"prefill_logits must be 'last' or 'all', got {prefill_logits!r}")
        if cuda_graphs and hf.device.type != "cuda":
            raise UserError("CUDA graphs need a CUDA target (load it with --device cuda); drop --cuda-graphs on "
                            "a CPU")
        if not 0 <= pad_block <= BLOCK_HEADROOM:
            raise UserError(f"pad_block {pad_block} must be between 0 (off) and the pool's headroom of "
                            f"{BLOCK_HEADROOM} slots; use the block size")
        self.pad_block = pad_block
        ctx = getattr(c, "max_position_embeddings", None)
        self.max_len = int(max_len or min(ctx or DEFAULT_MAX_LEN, DEFAULT_MAX_LEN))
        if ctx and self.max_len > ctx:
            raise UserError(f"max_len {self.max_len} exceeds the target's context of {ctx} positions; ask for fewer")
        self.slots = self.max_len + BLOCK_HEADROOM
        self.hf, self.model, self.tokenizer = hf, model, hf.tokenizer
        self.info = replace(hf.info, max_context=self.max_len)  # same fingerprint and taps
        self.prefill_logits, self.fixed_window = prefill_logits, bool(compile or cuda_graphs)
        self.cuda_graphs = cuda_graphs
        inner = model.model
        self.embed, self.layers, self.norm, self.head = inner.embed_tokens, inner.layers, inner.norm, model.lm_head
        self.qk_norm = c.model_type == "qwen3"
        self.head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        self.num_kv_heads, self.scale = c.num_key_value_heads, self.head_dim ** -0.5
        self.tap_layers = set(self.info.tap_layers)
        with torch.inference_mode():  # [slots, D] each: HF's own rotary module, every position once
            pos = torch.arange(self.slots, device=hf.device)[None]
            dummy = torch.zeros(1, device=hf.device, dtype=self.embed.weight.dtype)
            cos, sin = inner.rotary_emb(dummy, pos)
        self.cos, self.sin = cos[0], sin[0]
        if decode_weights is None:
            decode_weights = hf.device.type == "cpu"
        self.decode = DecodeWeights.of(model) if decode_weights else None
        self._verify = torch.compile(self._verify_core, dynamic=False) if compile else self._verify_core
        self._chains: dict = {}

    # ------------------------------------------------------------------ what the loop and drafters see

    @property
    def device(self) -> torch.device:
        return self.hf.device

    @property
    def input_embeddings(self) -> torch.Tensor:
        return self.hf.input_embeddings

    @property
    def lm_head(self) -> torch.Tensor:
        return self.hf.lm_head  # [V, H], what a drafter shares

    def with_taps(self, tap_layers: tuple[int, ...]) -> StaticTarget:
        return StaticTarget(self.hf.with_taps(tap_layers), self.max_len, self.prefill_logits,
                            self._verify is not self._verify_core, self.cuda_graphs, self.decode is not None,
                            self.pad_block)

    # ------------------------------------------------------------------ the forward

    def _layers(self, x: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor, attend, store):
        """x [B, S, hidden] at positions pos [B, S]; mask [B, 1, S, W]. `store(i, k, v)` writes layer
        i's new K/V [B, Hkv, S, D]; `attend(i, k, v)` returns the keys/values [B, Hkv, W, D] attended.
        Returns (final hidden [B, S, hidden], taps [B, S, F])."""
        B, S, _ = x.shape
        dw = self._decode_for(B * S)
        kv = self.num_kv_heads * self.head_dim
        cos, sin = self.cos[pos][:, None], self.sin[pos][:, None]  # [B, 1, S, D]
        if mask.dtype == torch.bool:  # additive once, not converted by every layer's attention
            mask = torch.zeros(mask.shape, dtype=x.dtype, device=x.device).masked_fill_(~mask, float("-inf"))
        taps = []
        for i, layer in enumerate(self.layers):
            a, h = layer.self_attn, _rms(layer.input_layernorm, x)
            if dw is not None:
                q, k, v = (h @ dw.qkv[i]).split([dw.qkv[i].shape[1] - 2 * kv, kv, kv], -1)
            else:
                q, k, v = a.q_proj(h), a.k_proj(h), a.v_proj(h)
            q = q.view(B, S, -1, self.head_dim)  # [B, S, H, D]
            k = k.view(B, S, -1, self.head_dim)  # [B, S, Hkv, D]
            v = v.view(B, S, -1, self.head_dim).transpose(1, 2)  # [B, Hkv, S, D]
            if self.qk_norm:
                q, k = a.q_norm(q), a.k_norm(k)
            q, k = q.transpose(1, 2), k.transpose(1, 2)
            q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
            store(i, k, v)
            kk, vv = attend(i, k, v)
            o = F.scaled_dot_product_attention(q, kk, vv, attn_mask=mask, scale=self.scale,
                                               enable_gqa=kk.shape[1] != q.shape[1])  # [B, H, S, D]
            o = o.transpose(1, 2).reshape(B, S, -1)
            x = x + (o @ dw.o[i] if dw is not None else a.o_proj(o))
            h = _rms(layer.post_attention_layernorm, x)
            if dw is not None:  # the Llama/Qwen3 MLP: down(act(gate(h)) * up(h))
                gate, up = (h @ dw.gate_up[i]).chunk(2, -1)
                x = x + (layer.mlp.act_fn(gate) * up) @ dw.down[i]
            else:
                x = x + layer.mlp(h)
            if i in self.tap_layers:
                taps.append(x)
        order = sorted(self.tap_layers)  # taps concatenate in info.tap_layers order
        t = (torch.cat([taps[order.index(j)] for j in self.info.tap_layers], -1) if taps
             else x.new_zeros(B, S, 0))
        return x, t

    def _decode_for(self, rows: int) -> DecodeWeights | None:
        """The decode copy where a call of `rows` rows uses it: a shape-static choice (no sync, no recompiles)."""
        return self.decode if rows <= DECODE_ROWS else None

    def _head(self, x: torch.Tensor) -> torch.Tensor:
        h, dw = self.norm(x), self._decode_for(x.shape[0] * x.shape[1])
        return (h @ dw.head if dw is not None else self.head(h)).float()  # [B, S, V]

    def _verify_core(self, ks: list, vs: list, ids: torch.Tensor, fill: torch.Tensor, anc: torch.Tensor,
                     depth: torch.Tensor, W: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One block: ids [B, S] at slots fill..fill+S-1, positions fill + depth [S]; slot i attends
        the committed slots and the block slots anc [S, S] marks. Writes the pools; returns (logits, taps)."""
        B, S = ids.shape
        col = torch.arange(W, device=ids.device)[None, :]  # [1, W]
        rel = col - fill[:, None]  # [B, W] slot relative to the block start
        inblock = (rel >= 0) & (rel < S)
        tree = anc[:, rel.clamp(0, S - 1)].permute(1, 0, 2) & inblock[:, None, :]  # [B, S, W]
        mask = ((col < fill[:, None])[:, None, :] | tree)[:, None]  # [B, 1, S, W]
        slot = fill[:, None] + torch.arange(S, device=ids.device)  # [B, S]
        pos = fill[:, None] + depth[None, :]  # [B, S]
        idx = slot[:, None, :, None].expand(B, self.num_kv_heads, S, self.head_dim)

        def store(i, k, v):
            ks[i].scatter_(2, idx, k.to(ks[i].dtype))
            vs[i].scatter_(2, idx, v.to(vs[i].dtype))

        x, taps = self._layers(self.embed(ids), pos, mask, lambda i, k, v: (ks[i][:, :, :W], vs[i][:, :, :W]), store)
        return self._head(x), taps.float()

    # ------------------------------------------------------------------ Target interface

    @torch.inference_mode()
    def prefill(self, input_ids: torch.Tensor, prompt_lens: torch.Tensor) -> tuple[StaticCache, TargetOutput]:
        B, T = input_ids.shape
        if T > self.max_len:
            raise UserError(f"prompt of {T} tokens exceeds the static KV pool of {self.max_len} positions; "
                            f"shorten it or load the static target with a larger max_len")
        ids, lens = input_ids.to(self.device), prompt_lens.to(self.device)
        valid, pos = prompt_slots(lens, T)  # [B, T] each
        dt = self.embed.weight.dtype
        shape = (B, self.num_kv_heads, self.slots, self.head_dim)
        cache = StaticCache(k=[torch.zeros(shape, dtype=dt, device=self.device) for _ in self.layers],
                            v=[torch.zeros(shape, dtype=dt, device=self.device) for _ in self.layers],
                            fill=lens.clone(), hi=int(lens.max()))
        eye = torch.eye(T, dtype=torch.bool, device=self.device)
        causal = torch.ones(T, T, dtype=torch.bool, device=self.device).tril()
        mask = ((causal[None] & valid[:, None, :]) | eye)[:, None]  # [B, 1, T, T]; padding attends itself
        slot = torch.where(valid, pos, self.slots - 1)  # padding goes to a slot never read before it is rewritten
        idx = slot[:, None, :, None].expand(B, self.num_kv_heads, T, self.head_dim)

        def store(i, k, v):
            cache.k[i].scatter_(2, idx, k.to(dt))
            cache.v[i].scatter_(2, idx, v.to(dt))

        x, taps = self._layers(self.embed(ids), pos, mask, lambda i, k, v: (k, v), store)
        logits = self._head(x if self.prefill_logits == "all" else x[:, -1:])  # [B, T or 1, V]
        return cache, TargetOutput(logits=logits, taps=taps.float())

    @torch.inference_mode()
    def verify(self, cache: StaticCache, block_ids: torch.Tensor, parents: torch.Tensor | None = None) -> TargetOutput:
        assert cache.pending == 0, "commit() the previous block before verifying the next"
        S = block_ids.shape[1]
        if S > BLOCK_HEADROOM:
            raise UserError(f"block of {S} slots exceeds the static pool's headroom of {BLOCK_HEADROOM}; "
                            f"use a block size of at most {BLOCK_HEADROOM}")
        P = max(S, self.pad_block)  # slots verified: the block, then filler continuing its last branch
        if parents is None:
            anc, depth = self._chain(P)
        else:
            if parents.shape != (S,):
                raise ValueError(f"parents needs one entry per block slot ({S}), got {list(parents.shape)}")
            anc = tree_ancestors(parents.tolist() + list(range(S - 1, P - 1)), self.device)  # [P, P]
            depth = anc.sum(-1) - 1  # [P]
        W = self.slots if self.fixed_window else min(self.slots, cache.hi + P)
        ids = block_ids.to(self.device)
        if P > S:
            ids = torch.cat([ids, ids[:, -1:].expand(-1, P - S)], 1)  # [B, P]
        if self.cuda_graphs:
            logits, taps = self._replay(cache, ids, anc, depth)
        else:
            logits, taps = self._verify(cache.k, cache.v, ids, cache.fill, anc, depth, W)
        cache.pending = S
        return TargetOutput(logits=logits[:, :S], taps=taps[:, :S])

    @torch.inference_mode()
    def commit(self, cache: StaticCache, num_kept: torch.Tensor, path: torch.Tensor | None = None) -> None:
        S, num_kept = cache.pending, num_kept.to(self.device)
        assert S > 0, "verify() a block before committing it"
        if path is not None:  # the kept branch's K/V move to the block's first slots, in order
            B = path.shape[0]
            start = cache.fill[:, None] + torch.arange(S, device=self.device)  # [B, S]
            src = (cache.fill[:, None] + path.to(self.device))[:, None, :, None].expand(
                B, self.num_kv_heads, S, self.head_dim)
            dst = start[:, None, :, None].expand_as(src)
            for t in (*cache.k, *cache.v):
                t.scatter_(2, dst, t.gather(2, src))
        # a finished row the loop keeps verifying stays at max_len (its output is never read)
        cache.fill = (cache.fill + num_kept).clamp(max=self.max_len)
        cache.pending = 0
        if not self.fixed_window:
            cache.hi = int(cache.fill.max())

    def join(self, cache: StaticCache, other: StaticCache) -> StaticCache:
        """`cache`'s rows then `other`'s: the pools stacked (same slot count, so no padding)."""
        assert cache.pending == 0 and other.pending == 0, "join committed caches only"
        return StaticCache(k=[torch.cat(p) for p in zip(cache.k, other.k)], v=[torch.cat(p) for p in zip(cache.v, other.v)],
                           fill=torch.cat([cache.fill, other.fill]), hi=max(cache.hi, other.hi))

    def keep(self, cache: StaticCache, rows: torch.Tensor) -> StaticCache:
        assert cache.pending == 0, "keep rows of a committed cache only"
        rows = rows.to(self.device)
        fill = cache.fill[rows]
        return StaticCache(k=[t[rows] for t in cache.k], v=[t[rows] for t in cache.v], fill=fill,
                           hi=int(fill.max()) if len(rows) else 0)

    def _chain(self, S: int) -> tuple[torch.Tensor, torch.Tensor]:
        if S not in self._chains:  # [S, S] lower triangle, depths [S]
            self._chains[S] = (torch.ones(S, S, dtype=torch.bool, device=self.device).tril(),
                               torch.arange(S, device=self.device))
        return self._chains[S]

    # ------------------------------------------------------------------ CUDA graphs

    def _replay(self, cache: StaticCache, ids, anc, depth):
        """Capture the verify of this (cache, shape) once, then replay it with new inputs copied into
        its static buffers. A graph binds the pools' addresses, so each request's cache captures its
        own graphs (per block size and chain/tree), kept on the cache."""
        graphs = cache.__dict__.setdefault("graphs", {})
        S = ids.shape[1]
        g = graphs.get(S)
        if g is None:
            bufs = {"ids": ids.clone(), "fill": cache.fill.clone(), "anc": anc.clone(), "depth": depth.clone()}
            args = lambda: (cache.k, cache.v, bufs["ids"], bufs["fill"], bufs["anc"], bufs["depth"],
                            self.slots)
            # warm up on a side stream (lazy inits), then capture; the warm-up's writes land in the
            # block's own slots, which the capture and every replay rewrite before reading
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                self._verify_core(*args())
            torch.cuda.current_stream().wait_stream(s)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = self._verify_core(*args())
            g = graphs[S] = (graph, bufs, out)
        graph, bufs, out = g
        bufs["ids"].copy_(ids)
        bufs["fill"].copy_(cache.fill)
        bufs["anc"].copy_(anc)
        bufs["depth"].copy_(depth)
        graph.replay()
        return out[0].clone(), out[1].clone()  # the graph's outputs are overwritten by the next replay


def _rms(norm: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The model's RMSNorm as one op where that is the same arithmetic (fp32); its own forward otherwise."""
    eps = getattr(norm, "variance_epsilon", None)
    if x.dtype != torch.float32 or norm.weight.dtype != torch.float32 or eps is None:
        return norm(x)
    return F.rms_norm(x, norm.weight.shape, norm.weight, eps)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


def static_target(target: HFTarget, **kwargs) -> StaticTarget:
    """The static back end over a loaded eager target (same weights)."""
    if isinstance(target, StaticTarget):
        return target
    return StaticTarget(target, **kwargs)
