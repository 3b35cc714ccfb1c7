"""The one thin layer that imports Triton: Python-backend models over `engine` and `bls`.

`triton_repo/<model>/1/model.py` re-exports these classes as `TritonPythonModel`. Requests are
turned into `{input name: ndarray}`, and engine chunks into responses; nothing else lives here.
Errors go back as one line: a bad request as INVALID_ARG (HTTP 400), a spent budget or a server
that is stopping as UNAVAILABLE, anything else as "internal error" with its traceback in the
server log only (never a traceback or a file path to the client).
"""

from __future__ import annotations

import json
import threading
import time
import traceback
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils

from ..errors import UserError
from .lifecycle import stopping
from .requests import BUSY_WORDS, REQUEST, Busy

DFLOW_INPUTS = tuple(i.name for i in REQUEST)
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
        msg = resp.error().message()
        # a spent budget, not a bad request; a BLS response's error code always reads INTERNAL, so
        # the target's Busy is told by its wording
        raise (Busy if BUSY_WORDS in msg else UserError)(f"BLS call to {model!r} failed: {msg}")
    return {n: pb_utils.get_output_tensor_by_name(resp, n).as_numpy() for n in outputs}


def _error(msg: str, code: str = "INVALID_ARG"):
    msg = " ".join(str(msg).split())  # one line
    err = pb_utils.TritonError(msg, getattr(pb_utils.TritonError, code))
    return pb_utils.InferenceResponse(output_tensors=[], error=err)


def _failure(model: str, e: Exception):
    """The error response for any exception: named for the client, the traceback in the log only."""
    if stopping():  # e.g. a BLS call refused because the server stopped taking requests mid-round
        return _error(f"{model}: the server is shutting down; the request was cancelled", "UNAVAILABLE")
    if isinstance(e, Busy):
        return _error(f"{model}: {e}", "UNAVAILABLE")
    if isinstance(e, UserError):
        return _error(f"{model}: {e}")
    log.log_error(f"{model}: request failed: {traceback.format_exc()}")
    return _error(f"{model}: internal error ({type(e).__name__}); the server log has the details", "INTERNAL")


class DFlowModel:
    """Decoupled decoding model: one thread per request, a response per round, stats at the end."""

    def initialize(self, args):
        from .engine import DecodingEngine, ServeConfig

        params, repo = _parameters(args)
        self.name = args["model_name"]
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
            elif stats["finish_reason"] == "shutdown":
                sender.send(_error(f"{self.name}: the server is shutting down; the request was cancelled after "
                                   f"{stats['num_tokens']} tokens", "UNAVAILABLE"), flags=FINAL)
        except Exception as e:  # noqa: BLE001 - a bug must not take the server down: answer and log it
            sender.send(_failure(self.name, e), flags=FINAL)
        finally:
            self.threads.discard(threading.current_thread())

    def execute(self, requests):
        for request in requests:
            t = threading.Thread(target=self._serve, args=(request, request.get_response_sender()), daemon=True)
            self.threads.add(t)
            t.start()
        return None

    def finalize(self):
        # running requests were cancelled (client gone or the server stopping: lifecycle.stopping);
        # give their threads a moment to answer, never block the unload for long (they are daemons)
        deadline = time.monotonic() + 3
        for t in list(self.threads):
            t.join(timeout=max(0.0, deadline - time.monotonic()))
        self.engine.close()


class _StatelessModel:
    """Shared request handling of `target` and `drafter`: `info_only` answers, errors as responses."""

    NAMES: tuple[str, ...] = ()

    def load(self, params, repo):
        raise NotImplementedError

    def compute(self, x: dict) -> dict[str, np.ndarray]:
        raise NotImplementedError

    def initialize(self, args):
        params, repo = _parameters(args)
        self.name = args["model_name"]
        try:
            self.service = self.load(params, repo)
        except UserError as e:
            _fail_load(args["model_name"], e)

    def _answer(self, request):
        x = _inputs(request, self.NAMES)
        try:
            if "info_only" in x and bool(x["info_only"].reshape(-1)[0]):
                out = {"info": np.array([self.service.info_json()], dtype=object)}
            else:
                out = self.compute(x)
            self.service.check_response(out)
        except KeyError as e:
            return _error(f"{self.name}: bad request: missing input {e}")
        except Exception as e:  # noqa: BLE001 - named for the client, logged for the operator
            return _failure(self.name, e)
        return pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor(k, v) for k, v in out.items()])

    def execute(self, requests):
        return [self._answer(r) for r in requests]


class TargetModel(_StatelessModel):
    """Target: logits and tap hidden states, statelessly or in KV sessions (`op`, `session_id`)."""

    NAMES = ("input_ids", "prompt_lens", "num_last", "num_logits", "info_only", "op", "session_id", "session_key",
             "num_kept", "parents", "path")

    def load(self, params, repo):
        from .services import load_target_service

        return load_target_service(params, repo, log=log.log_info)

    def compute(self, x):
        if "op" in x:
            return self.service.session_request(x)
        return self.service.forward_request(x)


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
