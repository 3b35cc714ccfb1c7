"""BLS orchestration: the decoding loop's Target and Drafter interfaces over the `target` and
`drafter` Triton models, and the stateless services those two models run.

Layout (see README, "Serving"): the `drafter` model is stateless and the `target` model keeps
only KV caches, in sessions keyed by an id the decoding model picks (`op` = prefill / verify /
commit / release), so a verify costs the block, not the context. Everything else of a request
(committed tokens, context features, flow) stays in the decoding model: `RemoteTarget` keeps each
row's committed tokens, `RemoteDrafter` the committed context features. A target without
sessions (`op` absent) recomputes the whole sequence per call, which any back end can serve.
A session is released when the request's cache object is dropped (end, stop or cancellation),
and sessions idle longer than `idle_s` are evicted, so a crashed caller cannot leak them.
In-process orchestration (the default) keeps both KV caches next to the loop: the fast path on
one host.

`remote(model_name, inputs: {name: ndarray}, output_names) -> {name: ndarray}` is the only link
to Triton; the Triton layer implements it with `pb_utils.InferenceRequest(...).exec()`.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
import weakref
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from ..decoding.interfaces import FlowState, Proposal, TargetInfo, TargetOutput
from ..decoding.sampling import SamplingParams
from ..errors import UserError

Remote = Callable[[str, dict, list[str]], dict]


def _pad_left(rows: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    T = max(len(r) for r in rows)
    ids = np.zeros((len(rows), T), dtype=np.int64)
    for b, r in enumerate(rows):
        ids[b, T - len(r):] = r
    return ids, np.array([len(r) for r in rows], dtype=np.int64)


# ---------------------------------------------------------------- client side (decoding model)


@dataclass
class RemoteCache:
    committed: list[list[int]]  # per row: every token the target has committed
    pending: list[list[int]] | None = None  # last verified block, awaiting commit()
    session: str | None = None  # the target model's KV session (None: full recompute)


class RemoteTarget:
    """Target interface over the `target` model: KV sessions when it offers them, else full recompute."""

    def __init__(self, remote: Remote, model: str = "target"):
        self.remote, self.model = remote, model
        out = remote(model, {"info_only": np.array([True])}, ["info"])
        d = json.loads(bytes(out["info"].reshape(-1)[0]).decode())
        self.sessions = bool(d.pop("kv_sessions", False))
        # a token tree (first-draft alternatives) needs the session's own cache to reorder
        trees = bool(d.pop("trees", False))
        self.supports_tree = self.sessions and trees
        d.pop("active_sessions", None)
        self.info = TargetInfo(**{**d, "tap_layers": tuple(d["tap_layers"]), "eos_token_ids": tuple(d["eos_token_ids"])})

    def _call(self, inputs: dict, names=("logits", "hidden_states")) -> TargetOutput | None:
        out = self.remote(self.model, inputs, list(names))
        if "logits" not in names:
            return None
        return TargetOutput(logits=torch.from_numpy(np.array(out["logits"])),
                            taps=torch.from_numpy(np.array(out["hidden_states"])))

    @staticmethod
    def _op(op: str, sid: str) -> dict:
        return {"op": np.array([op.encode()], dtype=object), "session_id": np.array([sid.encode()], dtype=object)}

    def _release(self, sid: str) -> None:
        try:
            self._call(self._op("release", sid), names=("info",))
        except Exception:  # noqa: BLE001 - the server evicts idle sessions anyway
            pass

    def prefill(self, input_ids: torch.Tensor, prompt_lens: torch.Tensor) -> tuple[RemoteCache, TargetOutput]:
        T = input_ids.shape[1]
        rows = [input_ids[b, T - int(n):].tolist() for b, n in enumerate(prompt_lens)]
        ids, lens = _pad_left(rows)
        x = {"input_ids": ids, "prompt_lens": lens, "num_last": np.array([T], np.int32)}
        if not self.sessions:
            return RemoteCache(committed=rows), self._call(x)
        sid = uuid.uuid4().hex
        out = self._call({**x, **self._op("prefill", sid)})
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
        ids, lens = _pad_left([c + p for c, p in zip(cache.committed, cache.pending)])
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
    round: int = 0


class RemoteDrafter:
    """Drafter interface over the stateless `drafter` model: sends the whole context each round."""

    def __init__(self, remote: Remote, mode: str, info: dict, block_size: int | None, model: str = "drafter"):
        self.remote, self.mode, self.model = remote, mode, model
        self.block_size = block_size or info["block_size"]
        if self.block_size < 2:
            raise UserError(f"block size must be at least 2 (anchor + one draft), got {self.block_size}")
        self.uses_flow = bool(info["flow"])
        self.feature_size = int(info["feature_size"])

    @staticmethod
    def available(remote: Remote, model: str = "drafter") -> dict[str, dict]:
        out = remote(model, {"info_only": np.array([True])}, ["info"])
        return json.loads(bytes(out["info"].reshape(-1)[0]).decode())

    def new_state(self, batch_size: int, generator: torch.Generator | None = None) -> RemoteDrafterState:
        return RemoteDrafterState(taps=torch.zeros(batch_size, 0, self.feature_size),
                                  lens=torch.zeros(batch_size, dtype=torch.long))

    def draft(self, state: RemoteDrafterState, context_taps: torch.Tensor, context_lens: torch.Tensor,
              anchor_ids: torch.Tensor, anchor_pos: torch.Tensor, flow: FlowState | None,
              sampler: SamplingParams, verify_threshold: float = 0.0) -> Proposal:
        # one graph call drafts the whole block; `verify_threshold` (may stop early) is not needed
        B, N, F = context_taps.shape
        C = int((state.lens + context_lens).max())
        taps = torch.zeros(B, C, F)
        for b in range(B):  # compact append: row b's committed features stay in its first lens[b] slots
            n0, n1 = int(state.lens[b]), int(context_lens[b])
            taps[b, :n0] = state.taps[b, :n0]
            taps[b, n0:n0 + n1] = context_taps[b, :n1]
        state.taps, state.lens, state.round = taps, state.lens + context_lens, state.round + 1
        S = self.block_size
        inputs = {"mode": np.array([self.mode.encode()], dtype=object), "block_size": np.array([S], np.int32),
                  "context_taps": taps.numpy().astype(np.float32), "context_lens": state.lens.numpy(),
                  "anchor_ids": anchor_ids.numpy().astype(np.int64), "anchor_pos": anchor_pos.numpy().astype(np.int64),
                  "temperature": np.array([sampler.temperature], np.float32),
                  "top_p": np.array([sampler.top_p], np.float32), "top_k": np.array([sampler.top_k], np.int32),
                  "seed": np.array([-1 if sampler.seed is None else sampler.seed * 1_000_003 + state.round], np.int64)}
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


# ---------------------------------------------------------------- server side (target / drafter models)


class TargetService:
    """What the `target` model computes: logits and tap states, statelessly or in KV sessions."""

    def __init__(self, target, max_sessions: int = 64, idle_s: float = 600.0):
        self.target, self.max_sessions, self.idle_s = target, max_sessions, idle_s
        self._sessions: dict[str, list] = {}  # id -> [target cache, last use]
        self._lock = threading.Lock()

    @property
    def active_sessions(self) -> int:
        with self._lock:
            return len(self._sessions)

    def info_json(self) -> bytes:
        i = self.target.info
        return json.dumps({"name": i.name, "fingerprint": i.fingerprint, "vocab_size": i.vocab_size,
                           "hidden_size": i.hidden_size, "num_layers": i.num_layers,
                           "tap_layers": list(i.tap_layers), "eos_token_ids": list(i.eos_token_ids),
                           "max_context": i.max_context, "kv_sessions": True, "trees": bool(getattr(self.target, "supports_tree", False)),
                           "active_sessions": self.active_sessions}).encode()

    def _check_ids(self, ids: torch.Tensor) -> None:
        if int(ids.min()) < 0 or int(ids.max()) >= self.target.info.vocab_size:
            raise UserError(f"input_ids outside the vocabulary 0..{self.target.info.vocab_size - 1}")

    @torch.inference_mode()
    def forward(self, input_ids: np.ndarray, prompt_lens: np.ndarray, num_last: int) -> tuple[np.ndarray, np.ndarray]:
        """Stateless: the whole (left-padded) sequence, outputs of the last `num_last` positions."""
        return self._prefill(input_ids, prompt_lens, num_last)[1]

    def _prefill(self, input_ids, prompt_lens, num_last):
        ids = torch.from_numpy(np.asarray(input_ids, dtype=np.int64))  # [B, T] left-padded
        lens = torch.from_numpy(np.asarray(prompt_lens, dtype=np.int64))
        if ids.ndim != 2 or lens.shape != (ids.shape[0],) or not 1 <= num_last <= ids.shape[1]:
            raise UserError(f"target inputs: input_ids [B, T], prompt_lens [B], 1 <= num_last <= T; got "
                            f"{list(ids.shape)}, {list(lens.shape)}, {num_last}")
        self._check_ids(ids)
        cache, out = self.target.prefill(ids, lens)
        return cache, (out.logits[:, -num_last:].float().numpy(), out.taps[:, -num_last:].float().numpy())

    @torch.inference_mode()
    def session(self, op: str, sid: str, x: dict) -> dict[str, np.ndarray]:
        """One step of a KV session: prefill (opens it), verify, commit, release."""
        now = time.monotonic()
        with self._lock:
            for k in [k for k, (_, t) in self._sessions.items() if now - t > self.idle_s]:
                del self._sessions[k]  # abandoned by a caller that never released it
            entry = self._sessions.get(sid)
            if entry is not None:
                entry[1] = now
        if op == "release":
            with self._lock:
                self._sessions.pop(sid, None)
            return {"info": np.array([b"released"], dtype=object)}
        if op == "prefill":
            if entry is not None:
                raise UserError(f"session {sid} already exists")
            if self.active_sessions >= self.max_sessions:
                raise UserError(f"{self.max_sessions} target sessions are open; release some or raise max_sessions")
            cache, (logits, taps) = self._prefill(x["input_ids"], x["prompt_lens"], int(x["num_last"].reshape(-1)[0]))
            with self._lock:
                self._sessions[sid] = [cache, now]
            return {"logits": logits, "hidden_states": taps}
        if entry is None:
            raise UserError(f"no target session {sid!r} (never opened, released, or evicted after {self.idle_s:.0f} s idle)")
        cache = entry[0]
        if op == "verify":
            block = torch.from_numpy(np.asarray(x["input_ids"], dtype=np.int64))  # [B, S]
            if block.ndim != 2:
                raise UserError(f"verify needs input_ids [B, S], got {list(block.shape)}")
            self._check_ids(block)
            if "parents" in x:
                if not getattr(self.target, "supports_tree", False):
                    raise UserError("this target back end verifies chains only; send no `parents`")
                parents = torch.from_numpy(np.asarray(x["parents"], dtype=np.int64)).reshape(-1)
                try:
                    out = self.target.verify(cache, block, parents)
                except ValueError as e:  # a malformed tree or one of another length, named by the target
                    raise UserError(str(e)) from None
            else:
                out = self.target.verify(cache, block)
            return {"logits": out.logits.float().numpy(), "hidden_states": out.taps.float().numpy()}
        if op == "commit":
            kept = torch.from_numpy(np.asarray(x["num_kept"], dtype=np.int64))
            if "path" in x:
                if not getattr(self.target, "supports_tree", False):
                    raise UserError("this target back end commits chains only; send no `path`")
                path = torch.from_numpy(np.asarray(x["path"], dtype=np.int64))
                if path.shape != (kept.shape[0], cache.pending) or not ((path >= 0) & (path < cache.pending)).all():
                    raise UserError(f"path needs [rows, block] = [{kept.shape[0]}, {cache.pending}] slot indices "
                                    f"of the verified block, got {list(path.shape)}")
                self.target.commit(cache, kept, path)
            else:
                self.target.commit(cache, kept)
            return {"info": np.array([b"committed"], dtype=object)}
        raise UserError(f"unknown target op {op!r}; use prefill, verify, commit or release")


class DrafterService:
    """What the `drafter` model computes: one block of drafts from the full context, per mode."""

    def __init__(self, drafters: dict):  # mode -> DFlowDrafter
        self.models = drafters

    def info_json(self) -> bytes:
        return json.dumps({m: {"flow": d.config.flow, "block_size": d.config.block_size,
                               "feature_size": d.config.target.hidden_size * len(d.config.tap_layers),
                               "target_fingerprint": d.config.target.fingerprint,
                               "tap_layers": list(d.config.tap_layers),
                               "target_name": d.config.target.name}
                           for m, d in self.models.items()}).encode()

    @torch.inference_mode()
    def draft(self, inputs: dict) -> dict[str, np.ndarray]:
        from ..drafter.runtime import TorchDrafter

        mode = inputs["mode"]
        if mode not in self.models:
            raise UserError(f"drafter model serves {sorted(self.models)}, not {mode!r}")
        d = TorchDrafter(self.models[mode], int(inputs["block_size"]))
        sampler = SamplingParams(float(inputs["temperature"]), float(inputs["top_p"]), int(inputs["top_k"]),
                                 None if int(inputs["seed"]) < 0 else int(inputs["seed"]))
        taps = torch.from_numpy(np.asarray(inputs["context_taps"], np.float32))
        lens = torch.from_numpy(np.asarray(inputs["context_lens"], np.int64))
        st = d.new_state(taps.shape[0], sampler.generator("cpu"))
        flow = None
        if "flow_taps" in inputs and d.uses_flow:
            flow = FlowState(taps=torch.from_numpy(np.asarray(inputs["flow_taps"], np.float32)),
                             token_ids=torch.from_numpy(np.asarray(inputs["flow_token_ids"], np.int64)),
                             hint_ids=torch.from_numpy(np.asarray(inputs["flow_hint_ids"], np.int64)),
                             valid=torch.from_numpy(np.asarray(inputs["flow_valid"], bool)))
        prop = d.draft(st, taps, lens, torch.from_numpy(np.asarray(inputs["anchor_ids"], np.int64)),
                       torch.from_numpy(np.asarray(inputs["anchor_pos"], np.int64)), flow, sampler)
        out = {"draft_ids": prop.draft_ids.numpy().astype(np.int64),
               "draft_confidence": prop.confidence.float().numpy()}
        if prop.draft_probs is not None:
            out["draft_probs"] = prop.draft_probs.float().numpy()
        if prop.alt_ids is not None:
            out["alt_ids"] = prop.alt_ids.numpy().astype(np.int64)
            out["alt_confidence"] = prop.alt_conf.float().numpy()
        return out
