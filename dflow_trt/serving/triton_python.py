"""The one thin layer that imports Triton: Python-backend models over `engine` and `bls`.

`triton_repo/<model>/1/model.py` re-exports these classes as `TritonPythonModel`. Requests are
turned into `{input name: ndarray}`, and engine chunks into responses; nothing else lives here.
"""

from __future__ import annotations

import json
import threading
import traceback
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils

from ..errors import UserError

DFLOW_INPUTS = ("text_input", "input_ids", "max_tokens", "mode", "temperature", "top_p", "top_k", "seed",
                "stop_words", "block_size", "chat", "verify_threshold", "hint_trust",
                "alternatives")
FINAL = 1  # TRITONSERVER_RESPONSE_COMPLETE_FINAL


class log:
    """pb_utils.Logger exists only once the stub runs a model, not when it imports this module."""

    @staticmethod
    def log_info(msg: str) -> None:
        pb_utils.Logger.log_info(msg)

    @staticmethod
    def log_error(msg: str) -> None:
        pb_utils.Logger.log_error(msg)


def _parameters(args) -> tuple[dict[str, str], Path]:
    cfg = json.loads(args["model_config"])
    params = {k: v["string_value"] for k, v in cfg.get("parameters", {}).items()}
    model_dir = Path(args["model_repository"])  # triton_repo/<model>
    return params, model_dir.parent


def _inputs(request, names) -> dict[str, np.ndarray]:
    out = {}
    for n in names:
        t = pb_utils.get_input_tensor_by_name(request, n)
        if t is not None:
            out[n] = t.as_numpy()
    return out


def _fail_load(model: str, e: Exception):
    msg = f"{model}: failed to load: {e}"
    log.log_error(msg)
    raise RuntimeError(msg) from None


def _bls(model: str, inputs: dict, outputs: list[str]) -> dict:
    tensors = [pb_utils.Tensor(k, v) for k, v in inputs.items()]
    resp = pb_utils.InferenceRequest(model_name=model, inputs=tensors, requested_output_names=outputs).exec()
    if resp.has_error():
        raise UserError(f"BLS call to {model!r} failed: {resp.error().message()}")
    return {n: pb_utils.get_output_tensor_by_name(resp, n).as_numpy() for n in outputs}


def _error(msg: str):
    return pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.TritonError(msg))


class DFlowModel:
    """Decoupled decoding model: one thread per request, a response per round, stats at the end."""

    def initialize(self, args):
        from .engine import DecodingEngine, ServeConfig

        params, repo = _parameters(args)
        try:
            self.engine = DecodingEngine(ServeConfig.from_parameters(params, repo), log=log.log_info, remote=_bls)
        except UserError as e:
            _fail_load(args["model_name"], e)
        self.threads: set[threading.Thread] = set()

    def _serve(self, request, sender):
        cancelled = getattr(sender, "is_cancelled", None) or getattr(request, "is_cancelled", lambda: False)
        try:
            req = self.engine.parse(_inputs(request, DFLOW_INPUTS))

            def emit(chunk):
                outs = [pb_utils.Tensor("token_ids", np.asarray(chunk.token_ids, dtype=np.int32)),
                        pb_utils.Tensor("text_output", np.array([chunk.text.encode()], dtype=object)),
                        pb_utils.Tensor("stats", np.array([json.dumps(chunk.stats).encode() if chunk.stats else b""],
                                                          dtype=object))]
                sender.send(pb_utils.InferenceResponse(output_tensors=outs), flags=FINAL if chunk.final else 0)

            stats = self.engine.run(req, emit, cancelled)
            if stats["finish_reason"] == "cancelled":
                sender.send(flags=FINAL)
        except UserError as e:
            sender.send(_error(str(e)), flags=FINAL)
        except Exception as e:  # a bug must not take the server down: answer and log it
            log.log_error(f"dflow: request failed: {traceback.format_exc()}")
            sender.send(_error(f"internal error: {e}"), flags=FINAL)
        finally:
            self.threads.discard(threading.current_thread())

    def execute(self, requests):
        for request in requests:
            t = threading.Thread(target=self._serve, args=(request, request.get_response_sender()), daemon=True)
            self.threads.add(t)
            t.start()
        return None

    def finalize(self):
        for t in list(self.threads):
            t.join(timeout=30)


class _StatelessModel:
    """Shared request handling of `target` and `drafter`: `info_only` answers, errors as responses."""

    NAMES: tuple[str, ...] = ()

    def load(self, params, repo):
        raise NotImplementedError

    def compute(self, x: dict) -> dict[str, np.ndarray]:
        raise NotImplementedError

    def initialize(self, args):
        params, repo = _parameters(args)
        try:
            self.service = self.load(params, repo)
        except UserError as e:
            _fail_load(args["model_name"], e)

    def execute(self, requests):
        responses = []
        for request in requests:
            x = _inputs(request, self.NAMES)
            try:
                if "info_only" in x and bool(x["info_only"].reshape(-1)[0]):
                    out = {"info": np.array([self.service.info_json()], dtype=object)}
                else:
                    out = self.compute(x)
                responses.append(pb_utils.InferenceResponse(
                    output_tensors=[pb_utils.Tensor(k, v) for k, v in out.items()]))
            except (UserError, KeyError) as e:
                responses.append(_error(f"{type(self).__name__}: bad request: {e}"))
        return responses


class TargetModel(_StatelessModel):
    """Target: logits and tap hidden states, statelessly or in KV sessions (`op`, `session_id`)."""

    NAMES = ("input_ids", "prompt_lens", "num_last", "info_only", "op", "session_id", "num_kept", "parents", "path")

    def load(self, params, repo):
        from .services import load_target_service

        return load_target_service(params, repo, log=log.log_info)

    def compute(self, x):
        if "op" in x:
            op, sid = (bytes(x[k].reshape(-1)[0]).decode() for k in ("op", "session_id"))
            return self.service.session(op, sid, x)
        missing = [n for n in ("input_ids", "prompt_lens", "num_last") if n not in x]
        if missing:
            raise UserError(f"missing inputs {missing}")
        logits, hidden = self.service.forward(x["input_ids"], x["prompt_lens"], int(x["num_last"].reshape(-1)[0]))
        return {"logits": logits, "hidden_states": hidden}


class DrafterModel(_StatelessModel):
    """Stateless drafter: one block of drafts (and their distribution when sampling) per call."""

    NAMES = ("info_only", "mode", "block_size", "context_taps", "context_lens", "anchor_ids", "anchor_pos",
             "temperature", "top_p", "top_k", "seed", "flow_taps", "flow_token_ids", "flow_hint_ids", "flow_valid")

    def load(self, params, repo):
        from .services import load_drafter_service

        return load_drafter_service(params, repo, log=log.log_info)

    def compute(self, x):
        scalars = {k: x[k].reshape(-1)[0] for k in ("mode", "block_size", "temperature", "top_p", "top_k", "seed")
                   if k in x}
        if isinstance(scalars.get("mode"), (bytes, np.bytes_)):
            scalars["mode"] = scalars["mode"].decode()
        return self.service.draft({**x, **scalars})
