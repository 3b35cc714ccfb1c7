"""BLS orchestration: the decoding loop's Target and Drafter interfaces over the `target` and
`drafter` Triton models, and the stateless services those two models run.

Layout (docs/serving.md): the `drafter` model is stateless and the `target` model keeps
only KV caches, in sessions keyed by an id the decoding model picks (`op` = prefill / verify /
commit / release), so a verify costs the block, not the context. Everything else of a request
(committed tokens, context features, flow) stays in the decoding model: `RemoteTarget` keeps each
row's committed tokens, `RemoteDrafter` the committed context features. A target without
sessions (`op` absent) recomputes the whole sequence per call, which any back end can serve.
A session is released when the request's cache object is dropped (end, stop or cancellation),
and sessions idle longer than `idle_s` are evicted, so a crashed caller cannot leak them; the
budget and the checks on every call are in sessions.py.
In-process orchestration (the default) keeps both KV caches next to the loop: the fast path on
one host.

`remote(model_name, inputs: {name: ndarray}, output_names) -> {name: ndarray}` is the only link
to Triton; the Triton layer implements it with `pb_utils.InferenceRequest(...).exec()`.
"""

from __future__ import annotations

import json
import uuid
import weakref
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from ..decoding.interfaces import FlowState, Proposal, TargetInfo, TargetOutput
from ..decoding.loop import pad_left
from ..decoding.sampling import SamplingParams
from ..drafter.context import append_slots
from ..errors import UserError
from .lifecycle import stopping

Remote = Callable[[str, dict, list[str]], dict]


def _padded(rows: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    ids, lens = pad_left(rows, pad_id=0)  # [B, T], [B]
    return ids.numpy(), lens.numpy()


# ---------------------------------------------------------------- client side (decoding model)


@dataclass
class RemoteCache:
    committed: list[list[int]]  # per row: every token the target has committed
    pending: list[list[int]] | None = None  # last verified block, awaiting commit()
    session: str | None = None  # the target model's KV session (None: full recompute)


class RemoteTarget:
    """Target interface over the `target` model: KV sessions when it offers them, else full recompute."""

    def __init__(self, remote: Remote, model: str = "target", session_key: str | None = None):
        self.remote, self.model, self.session_key = remote, model, session_key
        out = remote(model, {"info_only": np.array([True])}, ["info"])
        d = json.loads(bytes(out["info"].reshape(-1)[0]).decode())
        self.sessions = bool(d.pop("kv_sessions", False))
        # a token tree (first-draft alternatives) needs the session's own cache to reorder
        trees = bool(d.pop("trees", False))
        self.supports_tree = self.sessions and trees
        for k in ("active_sessions", "max_sessions"):
            d.pop(k, None)
        self.info = TargetInfo(**{**d, "tap_layers": tuple(d["tap_layers"]), "eos_token_ids": tuple(d["eos_token_ids"])})

    def _call(self, inputs: dict, names=("logits", "hidden_states")) -> TargetOutput | None:
        out = self.remote(self.model, inputs, list(names))
        if "logits" not in names:
            return None
        return TargetOutput(logits=torch.from_numpy(np.array(out["logits"])),
                            taps=torch.from_numpy(np.array(out["hidden_states"])))

    def _op(self, op: str, sid: str) -> dict:
        x = {"op": np.array([op.encode()], dtype=object), "session_id": np.array([sid.encode()], dtype=object)}
        if self.session_key:
            x["session_key"] = np.array([self.session_key.encode()], dtype=object)
        return x

    def _release(self, sid: str) -> None:
        if stopping():  # the target model is unloading: a call now would wait for it in vain
            return
        try:
            self._call(self._op("release", sid), names=("info",))
        except Exception:  # noqa: BLE001 - the server evicts idle sessions anyway
            pass

    def prefill(self, input_ids: torch.Tensor, prompt_lens: torch.Tensor) -> tuple[RemoteCache, TargetOutput]:
        T = input_ids.shape[1]
        rows = [input_ids[b, T - int(n):].tolist() for b, n in enumerate(prompt_lens)]
        ids, lens = _padded(rows)
        x = {"input_ids": ids, "prompt_lens": lens, "num_last": np.array([T], np.int32)}
        if not self.sessions:
            return RemoteCache(committed=rows), self._call(x)
        sid = uuid.uuid4().hex  # one session per decoding request: it owns it and releases it
        # the loop reads the last position's logits and every position's taps
        out = self._call({**x, "num_logits": np.array([1], np.int32), **self._op("prefill", sid)})
        cache = RemoteCache(committed=rows, session=sid)
        weakref.finalize(cache, self._release, sid)  # the request ended, stopped or was cancelled
        return cache, out

    def verify(self, cache: RemoteCache, block_ids: torch.Tensor, parents: torch.Tensor | None = None) -> TargetOutput:
        if parents is not None and not self.supports_tree:
            raise UserError("the target model verifies chains only (no KV sessions or no tree support)")
        cache.pending = block_ids.tolist()
        S = block_ids.shape[1]
        if cache.session is not None:
            x = {"input_ids": block_ids.numpy().astype(np.int64), "num_last": np.array([S], np.int32)}
            if parents is not None:
                x["parents"] = parents.numpy().astype(np.int64)
            return self._call({**x, **self._op("verify", cache.session)})
        ids, lens = _padded([c + p for c, p in zip(cache.committed, cache.pending)])
        return self._call({"input_ids": ids, "prompt_lens": lens, "num_last": np.array([S], np.int32)})

    def commit(self, cache: RemoteCache, num_kept: torch.Tensor, path: torch.Tensor | None = None) -> None:
        order = None if path is None else path.tolist()
        for b, k in enumerate(num_kept.tolist()):
            row = cache.pending[b] if order is None else [cache.pending[b][i] for i in order[b]]
            cache.committed[b] += row[:k]
        cache.pending = None
        if cache.session is not None:
            x = {"num_kept": num_kept.numpy().astype(np.int64)}
            if path is not None:
                x["path"] = path.numpy().astype(np.int64)
            self._call({**x, **self._op("commit", cache.session)}, names=("info",))


@dataclass
class RemoteDrafterState:
    taps: torch.Tensor  # [B, C, F] committed context features, right-padded
    lens: torch.Tensor  # [B]
    block_size: int  # anchor + drafts, this request's
    round: int = 0


class RemoteDrafter:
    """Drafter interface over the stateless `drafter` model: sends the whole context each round."""

    def __init__(self, remote: Remote, mode: str, info: dict, model: str = "drafter"):
        self.remote, self.mode, self.model = remote, mode, model
        self.block_size = int(info["block_size"])  # the default; a request may ask for another
        self.uses_flow = bool(info["flow"])
        self.feature_size = int(info["feature_size"])

    @staticmethod
    def available(remote: Remote, model: str = "drafter") -> dict[str, dict]:
        out = remote(model, {"info_only": np.array([True])}, ["info"])
        return json.loads(bytes(out["info"].reshape(-1)[0]).decode())

    def new_state(self, batch_size: int, generator: torch.Generator | None = None,
                  block_size: int | None = None) -> RemoteDrafterState:
        return RemoteDrafterState(taps=torch.zeros(batch_size, 0, self.feature_size),
                                  lens=torch.zeros(batch_size, dtype=torch.long), block_size=block_size or self.block_size)

    def draft(self, state: RemoteDrafterState, context_taps: torch.Tensor, context_lens: torch.Tensor,
              anchor_ids: torch.Tensor, anchor_pos: torch.Tensor, flow: FlowState | None,
              sampler: SamplingParams, verify_threshold: float = 0.0) -> Proposal:
        # one graph call drafts the whole block; `verify_threshold` (may stop early) is not needed
        state.taps = append_slots(state.taps, state.lens, context_taps, context_lens, dim=1)  # [B, cap, F]
        state.lens, state.round = state.lens + context_lens, state.round + 1
        taps = state.taps[:, :int(state.lens.max())]  # [B, C, F] the whole context, right-padded
        S = state.block_size
        inputs = {"mode": np.array([self.mode.encode()], dtype=object), "block_size": np.array([S], np.int32),
                  "context_taps": taps.numpy().astype(np.float32), "context_lens": state.lens.numpy(),
                  "anchor_ids": anchor_ids.numpy().astype(np.int64), "anchor_pos": anchor_pos.numpy().astype(np.int64),
                  "temperature": np.array([sampler.temperature], np.float32),
                  "top_p": np.array([sampler.top_p], np.float32), "top_k": np.array([sampler.top_k], np.int32),
                  "seed": np.array([-1 if sampler.seed is None else (sampler.seed * 1_000_003 + state.round) % 2**63],
                                   np.int64)}
        if flow is not None:
            inputs.update(flow_taps=flow.taps.numpy().astype(np.float32), flow_token_ids=flow.token_ids.numpy(),
                          flow_hint_ids=flow.hint_ids.numpy(), flow_valid=flow.valid.numpy())
        names = ["draft_ids", "draft_confidence"] + (["alt_ids", "alt_confidence"] if sampler.greedy else ["draft_probs"])
        out = self.remote(self.model, inputs, names)
        probs = None if sampler.greedy else torch.from_numpy(np.array(out["draft_probs"]))
        alt_ids = alt_conf = None
        if sampler.greedy:
            alt_ids = torch.from_numpy(np.array(out["alt_ids"])).long()
            alt_conf = torch.from_numpy(np.array(out["alt_confidence"]))
        return Proposal(draft_ids=torch.from_numpy(np.array(out["draft_ids"])).long(), draft_probs=probs,
                        confidence=torch.from_numpy(np.array(out["draft_confidence"])), alt_ids=alt_ids,
                        alt_conf=alt_conf)


# the server side (what the `target` and `drafter` models compute) lives in sessions.py
from .sessions import DrafterService, TargetService  # noqa: E402,F401
