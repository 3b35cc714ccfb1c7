"""Client of the `dflow` decoding model: gRPC streaming over tritonclient, or HTTP streaming over
Triton's generate extension (`POST /v2/models/<model>/generate_stream`, server-sent events).

Triton's HTTP `/infer` refuses decoupled models, and `/generate` wants exactly one response, so
`generate_stream` is Triton's one HTTP route for a model that answers once per round.
"""

from __future__ import annotations

import json
import queue
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from ..errors import UserError
from .requests import request_array


@dataclass
class ClientResult:
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    stats: dict = field(default_factory=dict)
    chunk_times: list[float] = field(default_factory=list)  # seconds from send to each token-bearing response
    chunk_sizes: list[int] = field(default_factory=list)

    def as_dict(self) -> dict:
        return {"token_ids": self.token_ids, "text": self.text, "tau": self.stats.get("tau"),
                "acceptance_lengths": self.stats.get("acceptance_lengths"), "rounds": self.stats.get("rounds"),
                "finish_reason": self.stats.get("finish_reason"), "stats": self.stats,
                "ttft_s": self.chunk_times[0] if self.chunk_times else None}


def request_arrays(prompt: str | None = None, input_ids: list[int] | None = None, max_tokens: int = 64,
                   mode: str = "dflow", temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0,
                   seed: int | None = None, stop_words: list[str] | None = None, block_size: int | None = None,
                   chat: bool = False, verify_threshold: float = 0.0,
                   hint_trust: float | None = None, alternatives: int = 0) -> dict[str, np.ndarray]:
    sent = {"max_tokens": max_tokens, "mode": mode, "temperature": temperature, "top_p": top_p, "top_k": top_k,
            "chat": chat, "text_input": prompt, "input_ids": input_ids, "seed": seed,
            # sent only when given, so the server's defaults apply and older repositories still serve
            "stop_words": stop_words or None, "block_size": block_size or None,
            "verify_threshold": verify_threshold or None, "hint_trust": hint_trust, "alternatives": alternatives or None}
    return {k: request_array(k, v) for k, v in sent.items() if v is not None}


def _dtype(a: np.ndarray) -> str:
    return {"object": "BYTES", "int32": "INT32", "int64": "INT64", "float32": "FP32", "bool": "BOOL"}[a.dtype.name]


def _inputs(mod, arrays: dict[str, np.ndarray]):
    out = []
    for k, v in arrays.items():
        i = mod.InferInput(k, list(v.shape), _dtype(v))
        i.set_data_from_numpy(v)
        out.append(i)
    return out


def _absorb(res: ClientResult, r, t0: float, on_tokens: Callable[[list[int], str], None] | None) -> bool:
    """Add one response; return True when it was the final one."""
    ids = r.as_numpy("token_ids")
    ids = [] if ids is None else ids.reshape(-1).tolist()
    text = r.as_numpy("text_output")
    text = bytes(text.reshape(-1)[0]).decode("utf-8", "replace") if text is not None and text.size else ""
    stats = r.as_numpy("stats")
    stats = bytes(stats.reshape(-1)[0]) if stats is not None and stats.size else b""
    if ids:
        res.chunk_times.append(time.perf_counter() - t0)
        res.chunk_sizes.append(len(ids))
        res.token_ids += ids
    res.text += text
    if on_tokens and (ids or text):
        on_tokens(ids, text)
    if stats:
        res.stats = json.loads(stats)
        return True
    return False


def generate_grpc(url: str, model: str = "dflow", on_tokens=None, timeout_s: float = 600, client=None,
                  **request) -> ClientResult:
    """Stream one request over gRPC; raise UserError with the server's message on an error response."""
    import tritonclient.grpc as grpcclient

    c = client or grpcclient.InferenceServerClient(url)
    q: queue.Queue = queue.Queue()
    c.start_stream(callback=lambda result, error: q.put((result, error)))
    res, t0, done = ClientResult(), time.perf_counter(), False
    try:
        c.async_stream_infer(model, _inputs(grpcclient, request_arrays(**request)))
        while True:
            try:
                result, error = q.get(timeout=max(1e-3, timeout_s - (time.perf_counter() - t0)))
            except queue.Empty:
                raise UserError(f"no final response from {model} within {timeout_s:.0f} s") from None
            if error is not None:
                done = True  # an error response is the request's last
                raise UserError(f"server error: {error.message() if hasattr(error, 'message') else error}")
            if _absorb(res, result, t0, on_tokens):
                done = True
                return res
    finally:
        # left early (Ctrl-C, a timeout, a callback's exception): cancel the request on the server,
        # which stops it at its next round, instead of waiting for it to run to max_tokens
        c.stop_stream(cancel_requests=not done)
        if client is None:
            c.close()


# inputs whose tensor has a free dimension; the rest are sent as JSON scalars (Triton shape [1])
_LIST_INPUTS = ("input_ids", "stop_words")


def request_json(**request) -> dict:
    """The request as the generate extension's JSON body (same names and values as `request_arrays`)."""
    body = {}
    for k, v in request_arrays(**request).items():
        vals = [x.decode() if isinstance(x, bytes) else x for x in v.reshape(-1).tolist()]
        body[k] = vals if k in _LIST_INPUTS else vals[0]
    return body


def _sse_error(text: str) -> str:
    for line in text.splitlines():
        if line.startswith("data:"):
            try:
                return json.loads(line[5:]).get("error", text)
            except json.JSONDecodeError:
                break
    return text.strip()


class _Event:
    """One generate_stream event, read through the same accessors as a tritonclient result."""

    def __init__(self, d: dict):
        self.d = d

    def as_numpy(self, name: str):
        if name not in self.d:
            return None
        v = self.d[name]
        if name == "token_ids":
            return np.asarray(v if isinstance(v, list) else [v], np.int32)
        return np.array([v.encode() if isinstance(v, str) else v], dtype=object)


def generate_http(url: str, model: str = "dflow", on_tokens=None, timeout_s: float = 600, **request) -> ClientResult:
    """Stream one request over HTTP (generate_stream); raise UserError with the server's message.

    Leaving early closes the connection, but Triton 2.51's HTTP front end does not cancel on a
    closed connection: the request runs to its max_tokens (gRPC cancels; docs/serving.md)."""
    import urllib.error
    import urllib.request

    req = urllib.request.Request(f"http://{url}/v2/models/{model}/generate_stream",
                                 data=json.dumps(request_json(**request)).encode(),
                                 headers={"Content-Type": "application/json", "Accept": "text/event-stream"})
    res, t0 = ClientResult(), time.perf_counter()
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            for raw in r:
                line = raw.decode("utf-8", "replace").strip()
                if not line.startswith("data:"):
                    continue
                d = json.loads(line[5:])
                if "error" in d:
                    raise UserError(f"server error: {d['error']}")
                if _absorb(res, _Event(d), t0, on_tokens):
                    return res
    except urllib.error.HTTPError as e:
        raise UserError(f"server error: {_sse_error(e.read().decode('utf-8', 'replace'))}") from None
    except (urllib.error.URLError, OSError) as e:
        raise UserError(f"cannot reach {url} over HTTP: {e}") from None
    raise UserError(f"the stream from {model} ended without a final response")


def health(url: str, protocol: str = "grpc", model: str = "dflow") -> bool:
    if protocol == "http":
        import tritonclient.http as httpclient

        c = httpclient.InferenceServerClient(url)
    else:
        import tritonclient.grpc as grpcclient

        c = grpcclient.InferenceServerClient(url)
    try:
        return bool(c.is_server_live() and c.is_server_ready() and c.is_model_ready(model))
    except Exception:
        return False
