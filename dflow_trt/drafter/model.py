"""The block-diffusion drafter (DFlash architecture) with DFlow's flow conditioning as a switch.

How it works. The block is [anchor, mask, ..., mask] at absolute positions L..L+S-1, embedded with
the target's own (frozen) input embeddings. Context features (the target's tap hidden states at
committed positions, concatenated) go through `ctx_proj` + RMSNorm and then through every layer's
k/v projections, so block queries attend [context K/V ; block K/V]: the context strictly before the
anchor, both ways inside the block. The output at block position k predicts the token at L+k
through the target's (frozen) LM head, restricted to a draft vocabulary if one is configured.

DFlow (`flow=True`) adds, at block positions the previous verify pass already covered with a
rejected draft, the projected verifier states there plus the embedding of the rejected token and a
learned "flow present" vector; other positions get a learned "no flow" vector. The verifier's
argmax at flow slot j is its guess for the token at slot j+1, so its embedding (scaled by a
learned gate) is added one position later; with tied embeddings that is nearly a free draft the
drafter learns when to trust. With `flow=False` none of these parameters exist: plain DFlash.

`relay="paper"` (with `flow=True`) is the DFlow paper's relay instead (`relay.relay_paper`): the
verifier states go through the drafter's own context projection, shifted one slot onto the mask
slots, where `relay_mlp` turns (correction token, first rejected token, relayed state) into a
per-channel scale and shift of the mask embedding. Its last layer starts at zero, so a new paper
drafter drafts exactly as its DFlash weights do; slots without flow are plain DFlash inputs.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from .. import kernels
from ..decoding.interfaces import FlowState
from .config import DrafterConfig
from .relay import FlowParams, PaperRelayParams, relay, relay_paper


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


def rope(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary embedding of x [B, H, N, D] at absolute positions pos [B, N]."""
    D = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, D, 2, device=x.device, dtype=torch.float32) / D))  # [D/2]
    ang = pos.to(torch.float32)[:, None, :, None] * inv  # [B, 1, N, D/2]
    cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)  # [B, 1, N, D]
    x1, x2 = x[..., : D // 2], x[..., D // 2:]
    return (x * cos + torch.cat([-x2, x1], -1) * sin).to(x.dtype)  # angles in fp32, result in x's dtype


class Attention(nn.Module):
    def __init__(self, c: DrafterConfig):
        super().__init__()
        self.h, self.hkv, self.d, self.theta = c.num_heads, c.num_kv_heads, c.head_dim, c.rope_theta
        self.q_proj = nn.Linear(c.hidden_size, c.num_heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(c.hidden_size, c.num_kv_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(c.hidden_size, c.num_kv_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.num_heads * c.head_dim, c.hidden_size, bias=False)
        self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps)
        self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps)

    def kv(self, x: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys/values of x [B, N, H] at positions [B, N] -> two [B, Hkv, N, D]."""
        B, N, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(B, N, self.hkv, self.d)).transpose(1, 2)
        v = self.v_proj(x).view(B, N, self.hkv, self.d).transpose(1, 2)
        return rope(k, pos, self.theta), v

    def forward(self, x, pos, ctx_k, ctx_v, mask, rows: slice = slice(None)):
        """x [B, Q, H] at pos [B, Q]; ctx_k/v [B, Hkv, C, D]; mask [B, Q, C+Q] bool (True: attend).

        Keys and values come from every row of x, queries only from `rows` -> [B, R, H]: a caller
        that needs the output at a few block positions skips the rest's queries, not their keys.
        """
        k, v = self.kv(x, pos)
        k, v = torch.cat([ctx_k, k], 2), torch.cat([ctx_v, v], 2)  # [B, Hkv, C+Q, D]
        x, pos, mask = x[:, rows], pos[:, rows], mask[:, rows]
        B, R, _ = x.shape
        q = rope(self.q_norm(self.q_proj(x).view(B, R, self.h, self.d)).transpose(1, 2), pos, self.theta)
        rep = self.h // self.hkv
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)  # [B, H, C+Q, D]
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None])  # [B, H, R, D]
        return self.o_proj(o.transpose(1, 2).reshape(B, R, self.h * self.d))


class Layer(nn.Module):
    def __init__(self, c: DrafterConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = Attention(c)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x, pos, ctx_k, ctx_v, mask, rows: slice = slice(None)):
        """x [B, Q, H] -> the layer's output at `rows` [B, R, H] (see `Attention.forward`)."""
        x = x[:, rows] + self.self_attn(self.input_layernorm(x), pos, ctx_k, ctx_v, mask, rows)
        h = self.post_attention_layernorm(x)
        return x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))


class DFlowDrafter(nn.Module):
    """Block drafter. Embeddings and LM head are the target's, frozen, and never saved with it."""

    def __init__(self, config: DrafterConfig, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor):
        super().__init__()
        c = self.config = config
        assert embed_weight.shape == (c.target.vocab_size, c.hidden_size), embed_weight.shape
        # Shared target weights: buffers (not parameters) so they are neither trained nor saved.
        self.register_buffer("embed_weight", embed_weight.detach(), persistent=False)
        self.register_buffer("lm_head_weight", lm_head_weight.detach(), persistent=False)
        self.ctx_proj = nn.Linear(c.feature_size, c.hidden_size, bias=False)
        self.ctx_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.layers = nn.ModuleList(Layer(c) for _ in range(c.num_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        if c.flow and c.relay == "paper":
            H = c.hidden_size
            self.relay_mlp = nn.Sequential(nn.Linear(3 * H, H, bias=False), nn.SiLU(), nn.Linear(H, 2 * H, bias=False))
        elif c.flow:
            self.flow_proj = nn.Linear(c.feature_size, c.hidden_size, bias=False)
            self.flow_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
            self.flow_tok_proj = nn.Linear(c.hidden_size, c.hidden_size, bias=False)
            self.flow_present = nn.Parameter(torch.zeros(c.hidden_size))
            self.no_flow = nn.Parameter(torch.zeros(c.hidden_size))
            self.hint_gate = nn.Parameter(torch.ones(1))
        # Draft vocabulary: target ids the drafter may propose (all of them by default).
        vd = c.draft_vocab_size or c.target.vocab_size
        self.register_buffer("draft_vocab", torch.arange(vd), persistent=c.draft_vocab_size is not None)
        self.reset_parameters()

    def reset_parameters(self, std: float = 0.02) -> None:
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=std)
        if hasattr(self, "relay_mlp"):
            self.silence_flow()

    FLOW_BRANCH = ("flow_proj", "flow_norm", "flow_tok_proj", "flow_present", "no_flow", "hint_gate")
    PAPER_BRANCH = ("relay_mlp",)  # relay="paper": its own parameters (the projection is the context's)

    def relay_branch(self) -> tuple[str, ...]:
        """Names of this drafter's relay parameters (none for DFlash)."""
        return self.PAPER_BRANCH if self.config.relay == "paper" else self.FLOW_BRANCH

    def flow_parameters(self) -> list[nn.Parameter]:
        """The flow branch's own parameters (none for DFlash)."""
        return [p for n, p in self.named_parameters() if n.split(".")[0] in self.relay_branch()]

    @torch.no_grad()
    def silence_flow(self) -> None:
        """Make the flow branch add exactly zero, so this DFlow drafter computes what its DFlash
        weights alone do; training grows the branch from there (every piece still has a gradient:
        the norm's gain, the token projection and the hint gate start at zero, not the inputs).
        The paper's relay: the MLP's last layer starts at zero (scale and shift 0), its first keeps
        its random start."""
        if hasattr(self, "relay_mlp"):
            self.relay_mlp[-1].weight.zero_()
            return
        for t in (self.flow_norm.weight, self.flow_tok_proj.weight, self.hint_gate, self.flow_present, self.no_flow):
            t.zero_()

    @torch.no_grad()
    def silence_layers(self, first: int) -> None:
        """Make layers `first`.. add exactly zero to the residual stream (their output projections
        start at zero), so a drafter grown from a shallower one drafts as it did at step 0; their
        attention and MLP inputs keep a random start, so training grows them from there."""
        for layer in self.layers[first:]:
            layer.self_attn.o_proj.weight.zero_()
            layer.down_proj.weight.zero_()

    # ---- pieces used by inference (per round) and training (many blocks at once) ----

    def context_kv(self, ctx_taps: torch.Tensor, ctx_pos: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Context features [B, N, F] at positions [B, N] -> per layer (k, v), each [B, Hkv, N, D]."""
        x = self.ctx_norm(self.ctx_proj(ctx_taps.to(self.ctx_proj.weight.dtype)))  # [B, N, H]; taps arrive fp32
        return [layer.self_attn.kv(x, ctx_pos) for layer in self.layers]

    def block_inputs(self, block_ids: torch.Tensor, flow: FlowState | None = None,
                     flow_rows: int | None = None, block: int | None = None) -> torch.Tensor:
        """Embeddings of block tokens [B, Q] plus flow conditioning (fields [B, Q, ...]) -> [B, Q, H].

        Q may hold several blocks side by side (training), `block` slots each (None: one block):
        a block's last slot never carries flow, so shifting hints by one position never leaks into
        the next block. `flow_rows`: no slot from there on is valid in any row (decoding knows
        this), so the flow projections skip them.
        """
        x = F.embedding(block_ids, self.embed_weight)  # [B, Q, H]
        if not self.config.flow:
            return x
        if self.config.relay == "paper":
            if flow is None:
                return x
            return relay_paper(x, flow.taps, flow.token_ids, flow.valid, self.paper_relay_params(), block, flow_rows)
        if flow is None:
            return x + self.no_flow
        return relay(x, flow.taps, flow.token_ids, flow.hint_ids, flow.valid, self.flow_params(), flow_rows)

    def flow_params(self) -> FlowParams:
        """The flow branch as `relay` takes it (one arithmetic for this model and the TensorRT-LLM plug-in)."""
        return FlowParams(proj=self.flow_proj, norm=self.flow_norm, tok_proj=self.flow_tok_proj,
                          present=self.flow_present, absent=self.no_flow, hint_gate=self.hint_gate,
                          embed=functools.partial(F.embedding, weight=self.embed_weight),
                          tap_dtype=self.flow_proj.weight.dtype)

    def paper_relay_params(self) -> PaperRelayParams:
        """The paper's relay as `relay_paper` takes it: the context projection and `relay_mlp`."""
        return PaperRelayParams(proj=self.ctx_proj, norm=self.ctx_norm, mlp=self.relay_mlp,
                                embed=functools.partial(F.embedding, weight=self.embed_weight),
                                tap_dtype=self.ctx_proj.weight.dtype)

    def hidden(self, x: torch.Tensor, pos: torch.Tensor, ctx_kv, mask: torch.Tensor,
               rows: slice = slice(None)) -> torch.Tensor:
        """Run the layers: x [B, Q, H] at pos [B, Q], mask [B, Q, C+Q] -> normed hidden [B, R, H] at
        `rows`. Only the last layer is cut to `rows`: every earlier one feeds all rows' keys/values."""
        return self.last_layer(self.early_layers(x, pos, ctx_kv, mask), pos, ctx_kv, mask, rows)

    def early_layers(self, x: torch.Tensor, pos: torch.Tensor, ctx_kv, mask: torch.Tensor) -> torch.Tensor:
        """Every layer but the last, over all rows: x [B, Q, H] -> [B, Q, H]."""
        for layer, (k, v) in zip(self.layers[:-1], ctx_kv[:-1]):
            x = layer(x, pos, k, v, mask)
        return x

    def last_layer(self, x: torch.Tensor, pos: torch.Tensor, ctx_kv, mask: torch.Tensor,
                   rows: slice = slice(None)) -> torch.Tensor:
        """The last layer at `rows`, normed: `early_layers`' output [B, Q, H] -> [B, R, H]."""
        k, v = ctx_kv[-1]
        return self.norm(self.layers[-1](x, pos, k, v, mask, rows))

    def draft_head(self) -> torch.Tensor:
        """The LM head rows of the draft vocabulary [Vd, H]."""
        if self.config.draft_vocab_size is None:
            return self.lm_head_weight
        return self.lm_head_weight[self.draft_vocab]

    def draft_logits(self, h: torch.Tensor) -> torch.Tensor:
        """Hidden [..., H] -> logits over the draft vocabulary [..., Vd].

        Decoding (inference mode) keeps the gathered draft-vocabulary head between rounds, and
        packs it for the CPU when the drafter's layers are packed (`kernels.pack_linears`):
        gathering and multiplying it per call cost more than the drafter's layers on a CPU.
        Training and export gather each time, so autograd never meets an inference tensor and the
        export graph keeps the shared head.
        """
        if not torch.is_inference_mode_enabled() or self.config.draft_vocab_size is None:
            return F.linear(h, self.draft_head())
        sources = (self.lm_head_weight, self.draft_vocab)
        packed_layers = isinstance(self.ctx_proj, kernels.PackedLinear)
        key = getattr(self, "_head_key", None)
        if key is None or key[0] != packed_layers or not kernels.still_valid(key[1], *sources):
            head = self.draft_head()
            self._head, self._head_packed = head, kernels.pack(head) if packed_layers else None
            self._head_key = (packed_layers, kernels.cache_key(*sources))
        return kernels.linear(h, self._head, packed=self._head_packed)

    def __getstate__(self):  # copies and pickles: the decoding head cache is remade on use
        state = super().__getstate__()
        for k in ("_head", "_head_packed", "_head_key"):
            state.pop(k, None)
        return state
