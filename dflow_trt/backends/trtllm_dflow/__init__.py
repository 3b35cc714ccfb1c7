"""DFlow for TensorRT-LLM: an out-of-tree plug-in to the PyTorch back end's DFlash mode.

TensorRT-LLM's `DFlashWorker` already holds, in the same forward, the verifier's tap states at every
verified slot (rejected ones included), the verified tokens and the target's tokens; it then
builds the next block's input embeddings. DFlow needs no new mode there, only the relay added to
those embeddings (`drafter/relay.py`, the arithmetic our PyTorch drafter runs). A new speculative
mode cannot be added from outside, so the plug-in rides on DFlash:

- `pins`: the TensorRT-LLM release and the signatures of everything hooked, and the check that
  refuses any other release (pure Python: tested without TensorRT-LLM);
- `relay_io`: the worker's tensors -> `FlowState`, and the flow branch's side file (pure torch);
- `plugin`: importing it installs the drafter class, the worker subclass and the factory wrap into
  the running TensorRT-LLM (needs TensorRT-LLM; refuses a release it was not written for).

See docs/tensorrt_llm_dflow.md.
"""

PLUGIN_MODULE = "dflow_trt.backends.trtllm_dflow.plugin"
