"""Importing this module installs DFlow into the running TensorRT-LLM's DFlash mode.

It needs TensorRT-LLM (a GPU host) and refuses, before patching anything, a release other than the
pinned one (`pins.check_release`). Then, in this process:

- `DFlowDrafterForCausalLM`: TensorRT-LLM's `DFlashForCausalLM` plus our flow branch, read from
  `dflow_flow.safetensors` beside the z-lab-layout drafter. The branch is kept outside the module
  tree, so TensorRT-LLM's weight loader and its module walks never see it.
- a draft-model builder registered for `SpeculativeDecodingMode.DFLASH` (an external registration
  overrides the built-in one): a drafter folder with the flow file gets the DFlow class, any other
  goes to the built-in builder unchanged.
- `DFlowWorker(DFlashWorker)`: after DFlash built the next block's input embeddings, adds the
  relay (`drafter/relay.py`) from the rejected slots of the block just verified. With a drafter
  that has no flow branch it changes nothing.
- the spec-worker factory has no registry: `modeling_speculative` calls the `get_spec_worker` it
  imported by name, so that name is wrapped there to build `DFlowWorker` for DFlash.

Every op the worker adds is fixed-shape and stays on the device (no host sync), as CUDA graphs need.
"""

from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path

from ...errors import UserError
from .pins import PINNED_RELEASE, check_release

if importlib.util.find_spec("tensorrt_llm") is None:
    raise UserError(f"TensorRT-LLM is not installed; install tensorrt_llm=={PINNED_RELEASE} on a GPU host to use "
                    f"the DFlow plug-in (or serve DFlow with backend=torch or the BLS layout)")

import tensorrt_llm

check_release(getattr(tensorrt_llm, "__version__", "unknown"))

import torch
from tensorrt_llm._torch.models import (
    modeling_dflash,
    modeling_speculative,
    modeling_utils,
)
from tensorrt_llm._torch.speculative.dflash import DFlashWorker
from tensorrt_llm._torch.speculative.interface import SpeculativeDecodingMode

from ...drafter.relay import relay
from .relay_io import FLOW_FILE, engine_flow, load_flow_branch


class DFlowDrafterForCausalLM(modeling_dflash.DFlashForCausalLM):
    """A DFlash drafter carrying DFlow's flow branch (`dflow_flow`, outside the module tree)."""

    def __init__(self, draft_config, *, dflash_attention_backend: str = "VANILLA", flow_path: str | Path):
        super().__init__(draft_config, dflash_attention_backend=dflash_attention_backend)
        self.__dict__["dflow_flow"] = load_flow_branch(flow_path)


def _drafter_dir(spec_config) -> Path | None:
    d = getattr(spec_config, "speculative_model_dir", None) or getattr(spec_config, "speculative_model", None)
    return None if d is None else Path(d)


_builtin_builder = modeling_utils.get_registered_draft_model_builder(SpeculativeDecodingMode.DFLASH)
if getattr(_builtin_builder, "__module__", None) == __name__:  # a re-import must not wrap itself
    _builtin_builder = modeling_dflash._build_dflash_draft


def build_dflow_draft(model_config, draft_config, lm_head, model):
    """DFLASH drafter builder: the DFlow class where the drafter folder has the flow file."""
    d = _drafter_dir(model_config.spec_config)
    if d is None or not (d / FLOW_FILE).is_file():
        return _builtin_builder(model_config, draft_config, lm_head, model)
    return DFlowDrafterForCausalLM(draft_config, dflash_attention_backend=model_config.spec_config.attention_backend,
                                   flow_path=d / FLOW_FILE)


class DFlowWorker(DFlashWorker):
    """DFlash's worker plus the relay into the next block's input embeddings."""

    _dflow_drafted = None  # [slots] bool: the slot's last verified block held real drafts

    def prepare_1st_drafter_inputs(self, input_ids, position_ids, hidden_states, accepted_tokens,
                                   num_accepted_tokens, attn_metadata, spec_metadata, draft_model,
                                   total_target_tokens=0):
        inputs = super().prepare_1st_drafter_inputs(
            input_ids=input_ids, position_ids=position_ids, hidden_states=hidden_states,
            accepted_tokens=accepted_tokens, num_accepted_tokens=num_accepted_tokens,
            attn_metadata=attn_metadata, spec_metadata=spec_metadata, draft_model=draft_model,
            total_target_tokens=total_target_tokens)
        branch = getattr(draft_model, "dflow_flow", None)
        if branch is None:
            return inputs
        nc, bs = attn_metadata.num_contexts, attn_metadata.num_seqs
        if self._dflow_drafted is None:  # one flag per context slot (dummy slot included)
            self._dflow_drafted = torch.zeros(self._ctx_len.shape[0], dtype=torch.bool, device=self._ctx_len.device)
        slots = self._batch_to_slot[:bs]
        captured = spec_metadata.get_hidden_states(total_target_tokens)
        if bs > nc and captured is not None:
            S, start, ng = self._draft_tokens_per_req, attn_metadata.num_ctx_tokens, bs - nc
            x = inputs["noise_embedding"]  # [G, Q, H]
            rows = slice(start, start + ng * S)
            flow = engine_flow(input_ids[rows], captured[rows], accepted_tokens[nc:bs], num_accepted_tokens[nc:bs],
                               S, x.shape[1], eligible=self._dflow_drafted[slots[nc:bs]])
            branch.to(device=x.device, dtype=x.dtype)  # a no-op after the first call
            table = draft_model.draft_model_full.model.embed_tokens  # TP-aware, as DFlash's own block embedding

            def embed(ids):  # [G, Q] -> [G, Q, H]; DFlash itself only feeds the table flat ids
                return table(ids.reshape(-1)).reshape(*ids.shape, -1)

            inputs["noise_embedding"] = relay(x, flow.taps, flow.token_ids, flow.hint_ids, flow.valid,
                                              branch.params(embed))
            self._dflow_drafted[slots[nc:bs]] = True
        if nc > 0:  # a prefill step: the next verify checks the worker's placeholder drafts
            self._dflow_drafted[slots[:nc]] = False
        return inputs


_builtin_get_spec_worker = getattr(modeling_speculative.get_spec_worker, "__wrapped__",
                                   modeling_speculative.get_spec_worker)  # unwrapped, even on a re-import


def get_spec_worker(spec_config, model_config, mapping, use_separate_draft_kv_cache=False):
    """`get_spec_worker` with DFlash served by `DFlowWorker` (the same as DFlashWorker for a drafter
    without a flow branch)."""
    if spec_config.spec_dec_mode.is_dflash():
        return DFlowWorker(spec_config, mapping, use_separate_draft_kv_cache)
    return _builtin_get_spec_worker(spec_config, model_config, mapping, use_separate_draft_kv_cache)


get_spec_worker.__wrapped__ = _builtin_get_spec_worker
modeling_speculative.get_spec_worker = get_spec_worker
modeling_utils.register_draft_model(SpeculativeDecodingMode.DFLASH)(build_dflow_draft)
