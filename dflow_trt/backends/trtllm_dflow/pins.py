"""The TensorRT-LLM release the DFlow plug-in was written against, and the check that refuses others.

The plug-in subclasses and wraps private TensorRT-LLM code (`tensorrt_llm._torch`), which changes
between release candidates; a silent mismatch would draft with wrong inputs and only show as a
lower acceptance rate. So before anything is patched, `check_release` compares the installed
version and the signature of every hooked callable with what was read when the plug-in was written.

Where the pins come from: TensorRT-LLM's sources at main@PINNED_COMMIT (the newest stored
snapshot of `_torch/speculative/dflash.py`; the mirror of the whole repository was too large to
fetch here, so which release tag holds that commit could not be resolved). PINNED_RELEASE is the
newest release on TensorRT-LLM's docs site when this was written. On a GPU host,
`python -m dflow_trt.backends.trtllm_dflow.pins` prints the installed signatures next to the
pinned ones: re-pin both constants and HOOKS from that output after reading the hooked code.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass

from ...errors import UserError

PINNED_RELEASE = "1.4.0rc4"
PINNED_COMMIT = "00679c66c3e38f6d2651ad0a5bef0f94d862e36c"

_DFLASH = "tensorrt_llm._torch.speculative.dflash"
_SPEC_UTILS = "tensorrt_llm._torch.speculative.utils"
_SPEC_MODES = "tensorrt_llm._torch.speculative.interface"
_MODELING_SPEC = "tensorrt_llm._torch.models.modeling_speculative"
_MODELING_UTILS = "tensorrt_llm._torch.models.modeling_utils"
_MODELING_DFLASH = "tensorrt_llm._torch.models.modeling_dflash"
_FACTORY = "(spec_config, model_config, mapping, use_separate_draft_kv_cache=False)"


@dataclass(frozen=True)
class Hook:
    """One thing the plug-in relies on: `qualname` in `module`, with this signature (None: it must
    only exist, e.g. an enum member)."""

    module: str
    qualname: str
    signature: str | None


HOOKS = (
    # the worker subclass: built like DFlashWorker, overrides the method that builds the next block
    Hook(_DFLASH, "DFlashWorker.__init__", "(self, spec_config, mapping, use_separate_draft_kv_cache=False)"),
    Hook(_DFLASH, "DFlashWorker.prepare_1st_drafter_inputs",
         "(self, input_ids, position_ids, hidden_states, accepted_tokens, num_accepted_tokens, attn_metadata, "
         "spec_metadata, draft_model, total_target_tokens=0)"),
    Hook(_DFLASH, "DFlashWorker._draft_tokens_per_req", None),  # K+1 verified slots per request
    # the verified slots' tap states, rejected ones included: [num_tokens, hidden * layers]
    Hook(_DFLASH, "DFlashSpecMetadata.get_hidden_states", "(self, num_tokens)"),
    # the spec-worker factory has no registry: the one-engine model calls the name it imported
    Hook(_SPEC_UTILS, "get_spec_worker", _FACTORY),
    Hook(_MODELING_SPEC, "get_spec_worker", _FACTORY),
    Hook(_SPEC_MODES, "SpeculativeDecodingMode.DFLASH", None),
    Hook(_SPEC_MODES, "SpeculativeDecodingMode.is_dflash", "(self)"),
    # the drafter: a DFlash drafter class plus the flow branch, built by a registered builder
    Hook(_MODELING_UTILS, "register_draft_model", "(mode)"),
    Hook(_MODELING_UTILS, "get_registered_draft_model_builder", "(mode)"),
    Hook(_MODELING_DFLASH, "DFlashForCausalLM.__init__", "(self, draft_config, *, dflash_attention_backend='VANILLA')"),
    Hook(_MODELING_DFLASH, "_build_dflash_draft", "(model_config, draft_config, lm_head, model)"),
)


def signature_text(obj) -> str:
    """Parameter names, kinds and defaults of a callable (annotations left out: they render
    differently across Python versions and postponed evaluation, and do not change a call)."""
    sig = inspect.signature(obj)
    params = [p.replace(annotation=inspect.Parameter.empty) for p in sig.parameters.values()]
    return str(sig.replace(parameters=params, return_annotation=inspect.Signature.empty))


def _resolve(module, qualname: str):
    obj = module
    for part in qualname.split("."):
        obj = inspect.getattr_static(obj, part) if inspect.isclass(obj) else getattr(obj, part)
    if isinstance(obj, (staticmethod, classmethod)):
        obj = obj.__func__
    if isinstance(obj, property):
        obj = obj.fget
    return obj


def installed_hooks(import_module: Callable = importlib.import_module) -> dict[Hook, str]:
    """What each hook is in the installed package: its signature text, '' for a present
    signature-less hook, or 'missing (...)'."""
    found = {}
    for h in HOOKS:
        try:
            obj = _resolve(import_module(h.module), h.qualname)
        except (ImportError, AttributeError) as e:
            found[h] = f"missing ({type(e).__name__})"
            continue
        found[h] = "" if h.signature is None else signature_text(obj)
    return found


def check_release(version: str, import_module: Callable = importlib.import_module) -> None:
    """Refuse (one-line UserError naming the fix) a TensorRT-LLM whose version or hooked signatures
    differ from the pins; `import_module` resolves the hooked modules (tests pass fake ones)."""
    problems = []
    if version != PINNED_RELEASE:
        problems.append(f"version {version} is not {PINNED_RELEASE}")
    for h, got in installed_hooks(import_module).items():
        want = "" if h.signature is None else h.signature
        if got != want:
            problems.append(f"{h.qualname}: expected {want or 'present'}, found {got or 'present'}")
    if problems:
        raise UserError(f"the DFlow plug-in is pinned to TensorRT-LLM {PINNED_RELEASE} (main@{PINNED_COMMIT[:10]}) "
                        f"and this install differs ({'; '.join(problems)}); install tensorrt_llm=={PINNED_RELEASE}, "
                        f"or re-pin dflow_trt/backends/trtllm_dflow/pins.py after reading the changed code")


def main() -> None:  # pragma: no cover - run on a host with TensorRT-LLM
    import tensorrt_llm

    print(f"installed {tensorrt_llm.__version__}, pinned {PINNED_RELEASE} (main@{PINNED_COMMIT})")
    for h, got in installed_hooks().items():
        mark = "ok " if got == (h.signature or "") else "DIFF"
        print(f"{mark} {h.module}.{h.qualname}\n     pinned    {h.signature}\n     installed {got or 'present'}")


if __name__ == "__main__":  # pragma: no cover
    main()
