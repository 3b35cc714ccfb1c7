"""One decoding request as the server sees it: parsed from named numpy inputs and validated.

No Triton here: the Triton layer hands over `{input name: numpy array}` and gets a
`DecodeRequest` or a `RequestError` whose message goes back to the client as the error response.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..decoding.flow import HINT_TRUST
from ..decoding.options import DecodeOptions
from ..decoding.sampling import SamplingParams
from ..errors import UserError


class RequestError(UserError):
    """A request the server refuses; the message names the bad input and what is accepted."""


class Busy(UserError):
    """A well-formed request the server cannot take now (a budget is spent); retry later.
    Its message contains BUSY_WORDS, which is how a BLS caller tells it apart."""


BUSY_WORDS = "are busy"


MAX_BLOCK = 64  # drafts + anchor per round


@dataclass(frozen=True)
class Input:
    """One input of the decoding model, as Triton declares it and the client sends it."""

    name: str
    dtype: str  # numpy dtype name ("object": UTF-8 bytes)
    dims: tuple[int, ...] = (1,)
    required: bool = False


# The request schema: the model config (repository.py), the Triton layer's input list
# (triton_python.py) and the client's arrays (client.py) are all derived from it.
REQUEST = (
    Input("text_input", "object"), Input("input_ids", "int32", (-1,)), Input("max_tokens", "int32", required=True),
    Input("mode", "object"), Input("temperature", "float32"), Input("top_p", "float32"), Input("top_k", "int32"),
    Input("seed", "int64"), Input("stop_words", "object", (-1,)), Input("block_size", "int32"), Input("chat", "bool"),
    Input("verify_threshold", "float32"), Input("hint_trust", "float32"), Input("alternatives", "int32"),
)
REQUEST_INPUTS = {i.name: i for i in REQUEST}


def request_array(name: str, value) -> np.ndarray:
    """A request value as the array its schema entry declares (strings as UTF-8 bytes)."""
    i = REQUEST_INPUTS[name]
    values = list(value) if i.dims == (-1,) else [value]
    if i.dtype == "object":
        return np.array([v.encode() if isinstance(v, str) else v for v in values], dtype=object)
    return np.asarray(values, i.dtype)


@dataclass(frozen=True)
class Limits:
    max_tokens: int = 1024  # per request
    max_prompt_tokens: int = 4096
    max_prompt_bytes: int = 64 * 1024  # text_input, UTF-8
    max_stop_words: int = 16
    max_stop_word_bytes: int = 256
    max_request_bytes: int = 256 * 1024  # every input together


def request_bytes(inputs: dict[str, np.ndarray]) -> int:
    """What the client sent: tensor bytes, string elements by their length."""
    n = 0
    for a in inputs.values():
        a = np.asarray(a)
        n += sum(len(x) if isinstance(x, (bytes, str)) else 8 for x in a.reshape(-1)) if a.dtype == object else a.nbytes
    return n


@dataclass
class DecodeRequest:
    prompt: str | None
    input_ids: list[int] | None
    max_tokens: int
    mode: str = "dflow"
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_words: list[str] = field(default_factory=list)
    block_size: int | None = None
    chat: bool = False
    verify_threshold: float = 0.0  # verify only drafts the drafter is this sure of (0: the whole block)
    hint_trust: float = HINT_TRUST  # dflow: take the verifier's guess over drafts less sure than this (0: off)
    alternatives: int = 0  # greedy: also verify up to this many runner-ups for draft 1 (a token tree)

    def options(self) -> DecodeOptions:
        """What the loop is asked to do (validated there)."""
        return DecodeOptions(mode=self.mode, max_new_tokens=self.max_tokens,
                             sampling=SamplingParams(self.temperature, self.top_p, self.top_k, self.seed),
                             block_size=self.block_size, verify_threshold=self.verify_threshold,
                             hint_trust=self.hint_trust, alternatives=self.alternatives)


def _scalar(inputs: dict[str, np.ndarray], name: str, kind, default=None):
    a = inputs.get(name)
    if a is None:
        return default
    flat = np.asarray(a).reshape(-1)
    if flat.size != 1:
        raise RequestError(f"input {name!r} must hold one value, got shape {list(np.asarray(a).shape)}")
    v = flat[0]
    if kind is str:
        return v.decode("utf-8", "replace") if isinstance(v, (bytes, np.bytes_)) else str(v)
    return kind(v)


def _strings(a) -> list[bytes]:
    return [x if isinstance(x, bytes) else str(x).encode() for x in np.asarray(a).reshape(-1)]


def _check_sizes(inputs: dict[str, np.ndarray], limits: Limits) -> None:
    """Sizes first, before anything is converted or decoded."""
    n = request_bytes(inputs)
    if n > limits.max_request_bytes:
        raise RequestError(f"request is {n} bytes, more than the limit {limits.max_request_bytes}; send a shorter "
                           "prompt or fewer stop words")
    if "text_input" in inputs:
        size = sum(map(len, _strings(inputs["text_input"])))
        if size > limits.max_prompt_bytes:
            raise RequestError(f"text_input is {size} bytes, more than the limit {limits.max_prompt_bytes}; "
                               "send a shorter prompt")
    if "input_ids" in inputs and np.asarray(inputs["input_ids"]).size > limits.max_prompt_tokens:
        raise RequestError(f"prompt has {np.asarray(inputs['input_ids']).size} tokens, more than the limit "
                           f"{limits.max_prompt_tokens}; send a shorter prompt")
    if "stop_words" in inputs:
        words = _strings(inputs["stop_words"])
        if len(words) > limits.max_stop_words:
            raise RequestError(f"{len(words)} stop_words, more than the limit {limits.max_stop_words}")
        long = [w for w in words if len(w) > limits.max_stop_word_bytes]
        if long:
            raise RequestError(f"a stop word is {len(long[0])} bytes, more than the limit {limits.max_stop_word_bytes}")


def parse_request(inputs: dict[str, np.ndarray], limits: Limits = Limits()) -> DecodeRequest:
    """Validate and convert; raise RequestError naming the first bad input."""
    _check_sizes(inputs, limits)
    prompt = _scalar(inputs, "text_input", str)
    ids = inputs.get("input_ids")
    input_ids = [int(x) for x in np.asarray(ids).reshape(-1)] if ids is not None else None
    if input_ids is not None and not input_ids:
        input_ids = None
    if not prompt and not input_ids:
        raise RequestError("empty prompt: send a non-empty `text_input` or `input_ids`")
    if "max_tokens" not in inputs:
        raise RequestError("missing `max_tokens`: send how many tokens to generate (INT32)")
    max_tokens = _scalar(inputs, "max_tokens", int)
    if not 1 <= max_tokens <= limits.max_tokens:
        raise RequestError(f"max_tokens must be in 1..{limits.max_tokens}, got {max_tokens}")
    mode = _scalar(inputs, "mode", str, "dflow")
    block = _scalar(inputs, "block_size", int, 0)
    if block != 0 and not 2 <= block <= MAX_BLOCK:
        raise RequestError(f"block_size must be in 2..{MAX_BLOCK} (anchor + drafts), or 0 for the drafter's own; "
                           f"got {block}")
    seed = _scalar(inputs, "seed", int, None)
    verify_threshold = _scalar(inputs, "verify_threshold", float, 0.0)
    hint_trust = _scalar(inputs, "hint_trust", float, HINT_TRUST)
    alternatives = _scalar(inputs, "alternatives", int, 0)
    stop = inputs.get("stop_words")
    stop_words = [s.decode("utf-8", "replace") if isinstance(s, (bytes, np.bytes_)) else str(s)
                  for s in (np.asarray(stop).reshape(-1) if stop is not None else [])]
    req = DecodeRequest(prompt=prompt or None, input_ids=input_ids, max_tokens=max_tokens, mode=mode,
                        temperature=_scalar(inputs, "temperature", float, 0.0),
                        top_p=_scalar(inputs, "top_p", float, 1.0), top_k=_scalar(inputs, "top_k", int, 0),
                        seed=seed, stop_words=[s for s in stop_words if s], block_size=block or None,
                        chat=bool(_scalar(inputs, "chat", bool, False)), verify_threshold=verify_threshold,
                        hint_trust=hint_trust, alternatives=alternatives)
    try:  # the loop's own checks, the CLI's too: finite, in range (a NaN or denormal temperature is refused)
        req.options()
    except UserError as e:
        raise RequestError(str(e)) from None
    return req
