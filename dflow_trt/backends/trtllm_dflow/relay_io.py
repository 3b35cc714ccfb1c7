"""From what TensorRT-LLM's `DFlashWorker` holds to the relay's inputs (pure torch, no TensorRT-LLM).

A gen request's target forward verified S = K+1 slots: the previous bonus token (the anchor) and K
drafts. The worker then knows, per request, the verified tokens, their captured tap states, the
target's token at every slot and `num_accepted_tokens` (drafts accepted + 1: TensorRT-LLM counts
the bonus). DFlow's relay needs the rejected slots among them, aligned with the next block: that is
`carry_flow` with our count (drafts accepted) = theirs - 1.

The flow branch's weights travel beside a z-lab-layout DFlash drafter as `dflow_flow.safetensors`
(our tensor names, `DFlowDrafter.FLOW_BRANCH`), so TensorRT-LLM's loader reads the DFlash part as
usual and never meets a tensor it has no module for.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from ...decoding.flow import carry_flow
from ...decoding.interfaces import FlowState
from ...drafter.model import DFlowDrafter, RMSNorm
from ...drafter.relay import FlowParams
from ...errors import UserError

FLOW_FILE = "dflow_flow.safetensors"


def engine_flow(input_ids: torch.Tensor, captured: torch.Tensor, target_tokens: torch.Tensor,
                num_accepted_tokens: torch.Tensor, verified_width: int, block_width: int,
                eligible: torch.Tensor | None = None) -> FlowState:
    """The worker's gen-request tensors -> FlowState over the next block [G, block_width].

    input_ids [G*S] and captured [G*S, F]: the verified tokens and their tap states, request-major
    (S = verified_width); target_tokens [G, >=S]: the target's token per verified slot (its argmax
    under greedy acceptance); num_accepted_tokens [G]: drafts accepted + 1. eligible [G] bool: the
    verified block held real drafts (False for a request whose previous step was its prefill: its
    "drafts" were the worker's zero placeholders, off what the drafter was trained on).
    """
    G, S = num_accepted_tokens.shape[0], verified_width
    ids = input_ids.reshape(G, S).long()  # [G, S]
    taps = captured.reshape(G, S, -1)  # [G, S, F]
    flow = carry_flow(ids, taps, target_tokens[:, :S].long(), num_accepted_tokens.long() - 1, next_size=block_width)
    if eligible is None:
        return flow
    valid = flow.valid & eligible[:, None].to(torch.bool)  # [G, Q]
    return dataclasses.replace(flow, valid=valid, taps=flow.taps * valid[..., None],
                               token_ids=flow.token_ids * valid, hint_ids=flow.hint_ids * valid)


class FlowBranch(nn.Module):
    """The flow branch alone, as it ships beside a DFlash drafter (the TensorRT-LLM drafter holds it)."""

    def __init__(self, feature_size: int, hidden_size: int, eps: float):
        super().__init__()
        self.flow_proj = nn.Linear(feature_size, hidden_size, bias=False)
        self.flow_norm = RMSNorm(hidden_size, eps)
        self.flow_tok_proj = nn.Linear(hidden_size, hidden_size, bias=False)
        self.flow_present = nn.Parameter(torch.zeros(hidden_size))
        self.no_flow = nn.Parameter(torch.zeros(hidden_size))
        self.hint_gate = nn.Parameter(torch.ones(1))

    def params(self, embed: Callable[[torch.Tensor], torch.Tensor]) -> FlowParams:
        """The branch as `relay` takes it, reading tokens through `embed` (the engine's embedding)."""
        return FlowParams(proj=self.flow_proj, norm=self.flow_norm, tok_proj=self.flow_tok_proj,
                          present=self.flow_present, absent=self.no_flow, hint_gate=self.hint_gate,
                          embed=embed, tap_dtype=self.flow_proj.weight.dtype)


def flow_state_dict(drafter: DFlowDrafter) -> dict[str, torch.Tensor]:
    """The flow branch's tensors of a DFlow drafter, under our names (what FLOW_FILE holds)."""
    if not drafter.config.flow:
        raise UserError("this drafter has no flow branch (flow off: plain DFlash); the DFlow plug-in needs a "
                        "flow-conditioned drafter")
    drafter.config.check_exportable("the DFlow plug-in's flow branch")
    # parameters only: a ModelOpt-quantized drafter's quantizer buffers stay out (the branch ships full precision)
    return {k: v.detach().float().cpu().contiguous() for k, v in drafter.named_parameters()
            if k.split(".")[0] in DFlowDrafter.FLOW_BRANCH}


def save_flow_branch(drafter: DFlowDrafter, dflash_dir: str | Path) -> Path:
    """Write FLOW_FILE into a z-lab-layout drafter folder (the DFlash part is `export_drafter_hf`'s)."""
    path = Path(dflash_dir) / FLOW_FILE
    save_file(flow_state_dict(drafter), path, metadata={"format": "pt", "kind": "dflow_trt-flow-branch",
                                                        "rms_norm_eps": repr(drafter.config.rms_norm_eps)})
    return path


def load_flow_branch(path: str | Path) -> FlowBranch:
    """Read FLOW_FILE back as a FlowBranch (shapes from the tensors themselves)."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{path} is missing; write it next to the DFlash drafter with "
                        f"dflow_trt.backends.trtllm_dflow.relay_io.save_flow_branch")
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        eps = float((f.metadata() or {}).get("rms_norm_eps", "1e-6"))
    sd = load_file(str(path))
    names = {f"{n}.weight" for n in ("flow_proj", "flow_norm", "flow_tok_proj")} | {"flow_present", "no_flow", "hint_gate"}
    if set(sd) != names:
        raise UserError(f"{path} holds {sorted(sd)}, not the flow branch {sorted(names)}; rewrite it with save_flow_branch")
    hidden, feature = sd["flow_proj.weight"].shape
    branch = FlowBranch(feature, hidden, eps)
    branch.load_state_dict(sd)
    return branch
