"""What the `target` and `drafter` models compute (the server side of the BLS layout), bounded.

The `target` model holds KV caches in sessions, which the `dflow_bls` model opens one per
decoding request (the request owns it and releases it when it ends, stops or is cancelled).
Triton gives a model no client identity, so the budget is kept like this:

- session calls need the server's session key (`DFLOW_TRT_SESSION_KEY`, which `start_server`
  sets and the `dflow_bls` model sends); other clients may only call the target statelessly;
- at most `max_sessions` are open; one idle for `idle_s` is evicted; a full budget answers
  "busy" (UNAVAILABLE), never blocks;
- a session is bound to its batch and grows at most to the target's context;
- every call is checked before any work: batch, block, context and response size, so one call
  cannot make the server return or hold hundreds of MiB.

A call that fails validation leaves its session as it was; a failure inside the target (a bug)
closes that session, so it is never left half-changed.
"""

from __future__ import annotations

import hmac
import json
import threading
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..decoding.interfaces import FlowState
from ..decoding.sampling import SamplingParams
from ..errors import UserError
from .requests import MAX_BLOCK, Busy


@dataclass(frozen=True)
class ServiceLimits:
    max_batch: int = 8  # rows per call
    max_response_bytes: int = 64 << 20
    max_sessions: int = 64
    idle_s: float = 30.0  # a session unused this long is evicted


@dataclass
class _Session:
    cache: Any
    rows: int
    length: int  # positions the session holds (prompt + committed)
    used: float


def _text(x: dict, name: str, limit: int = 128) -> str:
    a = np.asarray(x[name]).reshape(-1)
    if a.size != 1:
        raise UserError(f"input {name!r} must hold one value, got {a.size}")
    v = a[0] if isinstance(a[0], bytes) else str(a[0]).encode()
    if not v or len(v) > limit:
        raise UserError(f"input {name!r} must be 1..{limit} bytes, got {len(v)}")
    return v.decode("utf-8", "replace")


def _int(x: dict, name: str) -> int:
    a = np.asarray(x[name]).reshape(-1)
    if a.size != 1:
        raise UserError(f"input {name!r} must hold one value, got {a.size}")
    return int(a[0])


def _bounded(nbytes: int, limit: int, what: str) -> None:
    if nbytes > limit:
        raise UserError(f"{what} would return {nbytes / 2**20:.1f} MiB, more than the limit of "
                        f"{limit / 2**20:.0f} MiB; "
                        "ask for fewer rows or positions (or raise the model's max_response_mb)")


class _Bounded:
    limits: ServiceLimits

    def check_response(self, out: dict[str, np.ndarray]) -> None:
        """The last guard: whatever a call computed, the response stays under the limit."""
        _bounded(sum(np.asarray(v).nbytes for v in out.values()), self.limits.max_response_bytes, "this call")


class TargetService(_Bounded):
    """What the `target` model computes: logits and tap states, statelessly or in KV sessions."""

    def __init__(self, target, max_sessions: int = 64, idle_s: float = 30.0, session_key: str | None = None,
                 limits: ServiceLimits | None = None):
        self.target, self.session_key = target, session_key
        self.limits = limits or ServiceLimits()
        self.max_sessions, self.idle_s = max_sessions, idle_s
        self._sessions: dict[str, _Session] = {}
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
                           "max_context": i.max_context, "kv_sessions": True,
                           "trees": bool(getattr(self.target, "supports_tree", False)),
                           "active_sessions": self.active_sessions, "max_sessions": self.max_sessions}).encode()

    # ------------------------------------------------------------------ checks

    def _row_bytes(self, logits: int, taps: int) -> int:
        i = self.target.info
        return 4 * (logits * i.vocab_size + taps * i.hidden_size * len(i.tap_layers))

    def _check_ids(self, ids: torch.Tensor) -> None:
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.target.info.vocab_size):
            raise UserError(f"input_ids outside the vocabulary 0..{self.target.info.vocab_size - 1}")

    def _check_rows(self, B: int, T: int) -> None:
        ctx = self.target.info.max_context
        if not 1 <= B <= self.limits.max_batch:
            raise UserError(f"input_ids must have 1..{self.limits.max_batch} rows, got {B}")
        if T < 1 or (ctx and T > ctx):
            raise UserError(f"input_ids must have 1..{ctx} positions (the target's context), got {T}")

    # ------------------------------------------------------------------ stateless

    def forward_request(self, x: dict) -> dict[str, np.ndarray]:
        missing = [n for n in ("input_ids", "prompt_lens", "num_last") if n not in x]
        if missing:
            raise UserError(f"missing inputs {missing} (a stateless call needs input_ids, prompt_lens, num_last)")
        num_logits = _int(x, "num_logits") if "num_logits" in x else None
        logits, hidden = self.forward(x["input_ids"], x["prompt_lens"], _int(x, "num_last"), num_logits)
        return {"logits": logits, "hidden_states": hidden}

    @torch.inference_mode()
    def forward(self, input_ids: np.ndarray, prompt_lens: np.ndarray, num_last: int,
                num_logits: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Stateless: the whole (left-padded) sequence, outputs of the last `num_last` positions."""
        return self._prefill(input_ids, prompt_lens, num_last, num_logits)[1]

    def _prefill(self, input_ids, prompt_lens, num_last, num_logits=None):
        ids = torch.from_numpy(np.asarray(input_ids, dtype=np.int64))  # [B, T] left-padded
        lens = torch.from_numpy(np.asarray(prompt_lens, dtype=np.int64))
        num_logits = num_last if num_logits is None else num_logits
        if ids.ndim != 2 or lens.shape != (ids.shape[0],) or not 1 <= num_last <= ids.shape[1] \
                or not 1 <= num_logits <= num_last:
            raise UserError(f"target inputs: input_ids [B, T], prompt_lens [B], 1 <= num_logits <= num_last <= T; got "
                            f"{list(ids.shape)}, {list(lens.shape)}, {num_logits}, {num_last}")
        B, T = ids.shape
        self._check_rows(B, T)
        if int(lens.min()) < 1 or int(lens.max()) > T:
            raise UserError(f"prompt_lens must be in 1..{T} (the padded length)")
        _bounded(B * self._row_bytes(num_logits, num_last), self.limits.max_response_bytes, "this prefill")
        self._check_ids(ids)
        cache, out = self.target.prefill(ids, lens)
        return cache, (out.logits[:, -num_logits:].float().numpy(), out.taps[:, -num_last:].float().numpy())

    # ------------------------------------------------------------------ sessions

    def session_request(self, x: dict) -> dict[str, np.ndarray]:
        """A session call from the wire: the key first, then the op."""
        if self.session_key is not None:
            got = _text(x, "session_key") if "session_key" in x else ""
            if not hmac.compare_digest(got.encode(), self.session_key.encode()):
                raise UserError("target sessions are internal to the dflow_bls model (missing or wrong "
                                "session_key); call the target without `op` for stateless outputs")
        return self.session(_text(x, "op", 16), _text(x, "session_id"), x)

    def _evict_idle(self, now: float) -> None:
        with self._lock:
            for k in [k for k, s in self._sessions.items() if now - s.used > self.idle_s]:
                del self._sessions[k]  # abandoned by a caller that never released it

    @torch.inference_mode()
    def session(self, op: str, sid: str, x: dict) -> dict[str, np.ndarray]:
        """One step of a KV session: prefill (opens it), verify, commit, release."""
        now = time.monotonic()
        self._evict_idle(now)
        if op == "release":
            with self._lock:
                self._sessions.pop(sid, None)
            return {"info": np.array([b"released"], dtype=object)}
        if op == "prefill":
            return self._open(sid, x, now)
        if op not in ("verify", "commit"):
            raise UserError(f"unknown target op {op!r}; use prefill, verify, commit or release")
        with self._lock:
            s = self._sessions.get(sid)
        if s is None:
            raise UserError(f"no target session {sid!r} (never opened, released, or evicted after "
                            f"{self.idle_s:.0f} s idle)")
        s.used = now
        check = self._check_verify if op == "verify" else self._check_commit
        args = check(s, x)  # a refused call leaves the session as it was
        try:
            return self._verify(s, *args) if op == "verify" else self._commit(s, *args)
        except Exception:
            with self._lock:  # a failure inside the target may have left the cache half-changed
                self._sessions.pop(sid, None)
            raise

    def _open(self, sid: str, x: dict, now: float) -> dict[str, np.ndarray]:
        with self._lock:
            if sid in self._sessions:
                raise UserError(f"session {sid} already exists")
            if len(self._sessions) >= self.max_sessions:
                raise Busy(f"all {self.max_sessions} target sessions are busy (one idle for {self.idle_s:.0f} s is "
                           "evicted); retry shortly, or raise the target model's max_sessions")
        missing = [n for n in ("input_ids", "prompt_lens", "num_last") if n not in x]
        if missing:
            raise UserError(f"missing inputs {missing} (prefill needs input_ids, prompt_lens, num_last)")
        num_logits = _int(x, "num_logits") if "num_logits" in x else None
        cache, (logits, taps) = self._prefill(x["input_ids"], x["prompt_lens"], _int(x, "num_last"), num_logits)
        ids = np.asarray(x["input_ids"])
        with self._lock:
            self._sessions[sid] = _Session(cache, rows=ids.shape[0], length=ids.shape[1], used=now)
        return {"logits": logits, "hidden_states": taps}

    def _check_verify(self, s: _Session, x: dict):
        if getattr(s.cache, "pending", 0):
            raise UserError("this session has a verified block awaiting commit; commit it before the next verify")
        block = torch.from_numpy(np.asarray(x["input_ids"], dtype=np.int64))  # [B, S]
        if block.ndim != 2 or block.shape[0] != s.rows or not 1 <= block.shape[1] <= MAX_BLOCK:
            raise UserError(f"verify needs input_ids [{s.rows}, 1..{MAX_BLOCK}] (the session's rows), "
                            f"got {list(block.shape)}")
        ctx = self.target.info.max_context
        if ctx and s.length + block.shape[1] > ctx:
            raise UserError(f"the session holds {s.length} positions; {block.shape[1]} more exceed the target's "
                            f"context of {ctx}")
        self._check_ids(block)
        parents = None
        if "parents" in x:
            if not getattr(self.target, "supports_tree", False):
                raise UserError("this target back end verifies chains only; send no `parents`")
            parents = torch.from_numpy(np.asarray(x["parents"], dtype=np.int64)).reshape(-1)
        _bounded(s.rows * self._row_bytes(block.shape[1], block.shape[1]), self.limits.max_response_bytes,
                 "this verify")
        return block, parents

    def _verify(self, s: _Session, block, parents) -> dict[str, np.ndarray]:
        if parents is None:
            out = self.target.verify(s.cache, block)
        else:
            try:
                out = self.target.verify(s.cache, block, parents)
            except ValueError as e:  # a malformed tree, named by the target before the cache changes
                raise UserError(str(e)) from None
        s.length += block.shape[1]
        return {"logits": out.logits.float().numpy(), "hidden_states": out.taps.float().numpy()}

    def _check_commit(self, s: _Session, x: dict):
        pending = getattr(s.cache, "pending", 0)
        if not pending:
            raise UserError("nothing to commit: verify a block first")
        kept = torch.from_numpy(np.asarray(x["num_kept"], dtype=np.int64)).reshape(-1)
        if kept.shape != (s.rows,) or int(kept.min()) < 1 or int(kept.max()) > pending:
            raise UserError(f"num_kept needs {s.rows} values in 1..{pending} (the verified block), got "
                            f"{kept.tolist()[:8]}")
        path = None
        if "path" in x:
            if not getattr(self.target, "supports_tree", False):
                raise UserError("this target back end commits chains only; send no `path`")
            path = torch.from_numpy(np.asarray(x["path"], dtype=np.int64))
            if path.shape != (s.rows, pending) or not ((path >= 0) & (path < pending)).all():
                raise UserError(f"path needs [rows, block] = [{s.rows}, {pending}] slot indices of the verified "
                                f"block, got {list(path.shape)}")
        return kept, path, pending

    def _commit(self, s: _Session, kept, path, pending) -> dict[str, np.ndarray]:
        if path is None:
            self.target.commit(s.cache, kept)
        else:
            self.target.commit(s.cache, kept, path)
        s.length -= pending - int(kept.max())  # the cache keeps the longest row's slots
        return {"info": np.array([b"committed"], dtype=object)}


class DrafterService(_Bounded):
    """What the `drafter` model computes: one block of drafts from the full context, per mode."""

    def __init__(self, drafters: dict, limits: ServiceLimits | None = None):  # mode -> TorchDrafter
        self.drafters = drafters
        self.models = {m: d.model for m, d in drafters.items()}
        self.limits = limits or ServiceLimits()

    def info_json(self) -> bytes:
        return json.dumps({m: {"flow": d.config.flow, "block_size": d.config.block_size,
                               "feature_size": d.config.target.hidden_size * len(d.config.tap_layers),
                               "target_fingerprint": d.config.target.fingerprint,
                               "tap_layers": list(d.config.tap_layers),
                               "target_name": d.config.target.name}
                           for m, d in self.models.items()}).encode()

    def _check(self, mode: str, S: int, taps: torch.Tensor, anchors: torch.Tensor, sampler: SamplingParams) -> None:
        if mode not in self.models:
            raise UserError(f"drafter model serves {sorted(self.models)}, not {mode!r}")
        if not 2 <= S <= MAX_BLOCK:
            raise UserError(f"block_size must be in 2..{MAX_BLOCK}, got {S}")
        cfg = self.models[mode].config
        F = cfg.target.hidden_size * len(cfg.tap_layers)
        B = anchors.shape[0]
        if taps.ndim != 3 or taps.shape[0] != B or taps.shape[2] != F or not 1 <= B <= self.limits.max_batch:
            raise UserError(f"context_taps must be [B, C, {F}] with B = len(anchor_ids) in 1..{self.limits.max_batch}, "
                            f"got {list(taps.shape)} for {B} anchors")
        per_row = S * 4 * (2 + (0 if sampler.greedy else cfg.target.vocab_size))
        _bounded(B * per_row, self.limits.max_response_bytes, "this draft")

    @torch.inference_mode()
    def draft(self, inputs: dict) -> dict[str, np.ndarray]:
        mode, S = inputs["mode"], int(inputs["block_size"])
        seed = int(inputs["seed"])
        sampler = SamplingParams(float(inputs["temperature"]), float(inputs["top_p"]), int(inputs["top_k"]),
                                 None if seed < 0 else seed)
        taps = torch.from_numpy(np.asarray(inputs["context_taps"], np.float32))
        anchors = torch.from_numpy(np.asarray(inputs["anchor_ids"], np.int64)).reshape(-1)
        self._check(mode, S, taps, anchors, sampler)
        d = self.drafters[mode]
        lens = torch.from_numpy(np.asarray(inputs["context_lens"], np.int64))
        st = d.new_state(taps.shape[0], sampler.generator("cpu"), S)
        flow = None
        if "flow_taps" in inputs and d.uses_flow:
            flow = FlowState(taps=torch.from_numpy(np.asarray(inputs["flow_taps"], np.float32)),
                             token_ids=torch.from_numpy(np.asarray(inputs["flow_token_ids"], np.int64)),
                             hint_ids=torch.from_numpy(np.asarray(inputs["flow_hint_ids"], np.int64)),
                             valid=torch.from_numpy(np.asarray(inputs["flow_valid"], bool)))
        prop = d.draft(st, taps, lens, anchors, torch.from_numpy(np.asarray(inputs["anchor_pos"], np.int64)), flow,
                       sampler)
        out = {"draft_ids": prop.draft_ids.numpy().astype(np.int64),
               "draft_confidence": prop.confidence.float().numpy()}
        if prop.draft_probs is not None:
            out["draft_probs"] = prop.draft_probs.float().numpy()
        if prop.alt_ids is not None:
            out["alt_ids"] = prop.alt_ids.numpy().astype(np.int64)
            out["alt_confidence"] = prop.alt_conf.float().numpy()
        return out
