"""The decoding model's logic, without Triton: load back ends from config parameters, then run
one request's draft -> verify -> carry-flow rounds, streaming each round's committed tokens.

With `max_batch` > 1 and back ends that let rows join and leave a batch (PyTorch, static),
concurrent requests decode in shared batches (`scheduler.py`); otherwise each request runs its own
loop in its own thread. Either way every request has its own target cache rows, drafter state and
flow state. A request whose client cancels stops at the next round boundary and its state is freed.
"""

from __future__ import annotations

import contextlib
import itertools
import queue
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

import torch

from ..decoding.loop import RoundEvent, can_batch, generate
from ..loading import load_modes, open_build
from ..targets import load_tokenizer
from ..errors import UserError
from .lifecycle import session_key, stopping
from .requests import Busy, DecodeRequest, Limits, RequestError
from .scheduler import Done, Scheduler

BACKENDS = ("torch", "static", "onnxruntime", "tensorrt_llm")
ORCHESTRATIONS = ("inprocess", "bls")


_NO_LIMIT = contextlib.nullcontext()


@dataclass(frozen=True)
class ServeConfig:
    """The decoding model's config parameters (config.pbtxt `parameters`)."""

    target: str = "smollm2-135m"
    backend: str = "torch"
    build_dir: str = ""  # build/<name>/ from scripts/build_engines.py (onnxruntime, tensorrt_llm)
    dflash_drafter: str = ""  # drafter folder; "" = the target's shipped one (or the build's)
    dflow_drafter: str = ""
    orchestration: str = "inprocess"  # bls: call the `target` and `drafter` Triton models
    max_tokens: int = 1024
    max_concurrency: int = 8  # requests decoding at once without batching (max_batch 1, or back ends that cannot)
    max_batch: int = 8  # rows decoding together in one batch; 1: every request alone (no batching)
    max_queue: int = 64  # requests waiting for a batch row before the model answers busy
    verify_budget: int = 32  # most tokens a verify pass carries over a batch's rows (0: no cap; policy.Budgeted)
    trtllm_dflow: int = 0  # backend=tensorrt_llm: 1 serves dflow (the build's llm_api_dflow.json, the plug-in)
    threads: int = 0  # torch intra-op threads; 0 = torch's default

    @classmethod
    def from_parameters(cls, params: dict[str, str], repo_dir: Path | None = None) -> "ServeConfig":
        known = {f for f in cls.__dataclass_fields__}
        unknown = set(params) - known
        if unknown:
            raise UserError(f"unknown parameters {sorted(unknown)}; known: {sorted(known)}")
        kw: dict[str, Any] = {}
        for k, v in params.items():
            kind = type(getattr(cls, k))
            try:
                kw[k] = kind(v)
            except ValueError:
                raise UserError(f"parameter {k!r} must be {kind.__name__}, got {v!r}") from None
        from .services import resolve_path

        for k in ("build_dir", "dflash_drafter", "dflow_drafter"):
            if kw.get(k):
                kw[k] = resolve_path(kw[k], repo_dir)
        cfg = cls(**kw)
        if cfg.max_batch < 1 or cfg.max_queue < 0 or cfg.max_concurrency < 1 or cfg.verify_budget < 0:
            raise UserError(f"parameters max_batch and max_concurrency must be >= 1, max_queue and verify_budget "
                            f">= 0, got {cfg.max_batch}, {cfg.max_concurrency}, {cfg.max_queue}, {cfg.verify_budget}")
        if cfg.backend not in BACKENDS:
            raise UserError(f"parameter backend={cfg.backend!r}; use one of {', '.join(BACKENDS)}")
        if cfg.orchestration not in ORCHESTRATIONS:
            raise UserError(f"parameter orchestration={cfg.orchestration!r}; use one of {', '.join(ORCHESTRATIONS)}")
        if cfg.trtllm_dflow not in (0, 1) or (cfg.trtllm_dflow and cfg.backend != "tensorrt_llm"):
            raise UserError(f"parameter trtllm_dflow={cfg.trtllm_dflow} is 0 or 1, and 1 only with backend=tensorrt_llm "
                            f"(backend={cfg.backend!r}); drop it or set backend tensorrt_llm")
        return cfg


@dataclass
class Chunk:
    """One streamed response: a round's committed tokens, or the final statistics."""

    token_ids: list[int]
    text: str
    final: bool = False
    stats: dict | None = None


@dataclass
class _Loaded:
    target: Any  # decoding.interfaces.Target (None when `llm` runs the whole loop)
    drafter: Any | None  # Drafter (None: ar, or TensorRT-LLM drafting itself)
    llm: Any = None  # tensorrt_llm.LLM: drafts and verifies itself (backends/tensorrt_llm.py)
    block_size: int = 1  # the block an `llm` was loaded with


@dataclass
class _Active:
    mode: str
    started: float = field(default_factory=time.perf_counter)


class DecodingEngine:
    def __init__(self, cfg: ServeConfig, log: Callable[[str], None] = print,
                 remote: Callable[[str, dict, list[str]], dict] | None = None):
        """Load every mode's back ends now, so a bad artefact fails the model load, not a request.

        `remote(model_name, inputs, output_names)` runs another Triton model (BLS orchestration).
        """
        self.cfg, self.log = cfg, log
        self.limits = Limits(max_tokens=cfg.max_tokens)
        if cfg.threads > 0:
            torch.set_num_threads(cfg.threads)
        self._sem = threading.BoundedSemaphore(max(1, cfg.max_concurrency))
        self._active: dict[int, _Active] = {}
        self._lock = threading.Lock()
        self._tok_lock = threading.Lock()  # HF fast tokenizers are not safe to share across threads
        self._ids = itertools.count(1)
        self._remote, self._load_lock = remote, threading.Lock()
        self.vocab_size: int | None = None  # set by back ends without an `ar` Target
        self.scheduler: Scheduler | None = None  # continuous batching (max_batch > 1, back ends that allow it)
        if cfg.orchestration == "bls":
            if remote is None:
                raise UserError("orchestration=bls needs the Triton layer's BLS caller")
            # the `target`/`drafter` models may load after this one: connect at the first request
            self.modes, self.tokenizer = None, load_tokenizer(cfg.target)
            log(f"dflow engine ready: target={cfg.target} orchestration=bls (connects to the `target` and "
                "`drafter` models at the first request)")
            return
        self.modes, self.tokenizer = self._load_inprocess()
        batched = [m for m, x in self.modes.items() if x.llm is None and can_batch(x.target, x.drafter)]
        if cfg.max_batch > 1 and batched:
            self.scheduler = Scheduler(cfg.max_batch, cfg.max_queue, log)
        log(f"dflow engine ready: target={cfg.target} backend={cfg.backend} orchestration={cfg.orchestration} "
            f"modes={','.join(self.modes)} batching={','.join(batched) if self.scheduler else 'off'}")

    # ------------------------------------------------------------------ loading

    def _drafter_arg(self, mode: str) -> str | None:
        return getattr(self.cfg, f"{mode}_drafter") or None

    def _load_inprocess(self):
        cfg = self.cfg
        if cfg.backend == "tensorrt_llm":
            return self._load_tensorrt_llm()
        if cfg.backend == "onnxruntime" and not cfg.build_dir:
            raise UserError("backend=onnxruntime needs parameter build_dir (a folder written by "
                            "`python scripts/build_engines.py`)")
        loaded = load_modes(cfg.target, cfg.backend, {m: self._drafter_arg(m) for m in ("dflash", "dflow")},
                            build_dir=cfg.build_dir, log=self.log)
        modes = {m: _Loaded(x.target, x.drafter) for m, x in loaded.items()}
        return modes, modes["ar"].target.tokenizer

    def _load_tensorrt_llm(self):
        from ..backends.tensorrt_llm import llm_api_options, load_llm, served_modes

        if not self.cfg.build_dir:
            raise UserError("backend=tensorrt_llm needs parameter build_dir (a folder written by "
                            "`python scripts/build_engines.py`)")
        bdir, man = open_build(self.cfg.build_dir, self.cfg.target)
        opts = llm_api_options(bdir, dflow=bool(self.cfg.trtllm_dflow))
        llm = load_llm(opts)
        block = opts.get("speculative_config", {}).get("max_draft_len", 0) + 1
        self.vocab_size = man["target"]["vocab_size"]
        modes = served_modes(opts)
        self.log(f"backend=tensorrt_llm: TensorRT-LLM drafts and verifies itself, serving {', '.join(modes)}"
                 + ("" if "dflow" in modes else "; mode dflow needs parameter trtllm_dflow 1 (the DFlow plug-in, "
                    "docs/tensorrt_llm_dflow.md) or the BLS layout"))
        return {m: _Loaded(None, None, llm=llm, block_size=block) for m in modes}, load_tokenizer(self.cfg.target)

    def _ensure_loaded(self) -> None:
        if self.modes is None:
            with self._load_lock:
                if self.modes is None:
                    self.modes = self._load_bls(self._remote)

    def _load_bls(self, remote):
        from .bls import RemoteDrafter, RemoteTarget

        target = RemoteTarget(remote, session_key=session_key())
        if target.info.name != self.cfg.target:
            raise UserError(f"the `target` model serves {target.info.name!r}, this model is configured for "
                            f"{self.cfg.target!r}; make the two models' `target` parameters agree")
        modes: dict[str, _Loaded] = {"ar": _Loaded(target, None)}
        for mode, info in RemoteDrafter.available(remote).items():
            if info["target_fingerprint"] != target.info.fingerprint:
                raise UserError(f"the `drafter` model's {mode} drafter was trained for another target "
                                f"({info['target_name']}); point it at a drafter for {target.info.name}")
            if tuple(info["tap_layers"]) != target.info.tap_layers:
                raise UserError(f"the `target` model taps layers {list(target.info.tap_layers)}, the {mode} drafter "
                                f"reads {info['tap_layers']}; load the target model with that drafter's taps")
            modes[mode] = _Loaded(target, RemoteDrafter(remote, mode, info))
        return modes

    # ------------------------------------------------------------------ requests

    @property
    def active_requests(self) -> int:
        with self._lock:
            return len(self._active)

    def parse(self, inputs: dict) -> DecodeRequest:
        from .requests import parse_request

        return parse_request(inputs, self.limits)

    def _prompt_ids(self, req: DecodeRequest) -> list[int]:
        if req.input_ids is not None:
            V = self.vocab_size or self.modes["ar"].target.info.vocab_size
            bad = [t for t in req.input_ids if not 0 <= t < V]
            if bad:
                raise RequestError(f"input_ids {bad[:5]} are outside the vocabulary 0..{V - 1}")
            return req.input_ids
        from ..prompting import encode_prompt

        with self._tok_lock:
            ids = encode_prompt(self.tokenizer, req.prompt, req.chat)
        if not ids:
            raise RequestError("the prompt encodes to no tokens")
        if len(ids) > self.limits.max_prompt_tokens:
            raise RequestError(f"prompt has {len(ids)} tokens, more than the limit {self.limits.max_prompt_tokens}")
        return ids

    def _decode(self, ids: list[int]) -> str:
        with self._tok_lock:
            return self.tokenizer.decode(ids, skip_special_tokens=True)

    def run(self, req: DecodeRequest, emit: Callable[[Chunk], None],
            cancelled: Callable[[], bool] = lambda: False) -> dict:
        """Decode one request; emit a Chunk per round and a final one with the statistics.

        Stops at the next round boundary when `cancelled()` (the client went) or when the server
        is stopping (finish_reason "shutdown"; no final chunk then, the caller answers)."""
        if stopping():
            raise Busy("the server is shutting down; send the request to another server")
        self._ensure_loaded()
        if req.mode not in self.modes:
            raise RequestError(f"mode {req.mode!r} is not served by this model (served: {', '.join(self.modes)})")
        loaded = self.modes[req.mode]
        prompt_ids = self._prompt_ids(req)
        options = replace(req.options(), verify_budget=self.cfg.verify_budget)
        drafter = loaded.drafter
        if loaded.llm is not None and req.block_size and req.mode != "ar" and req.block_size != loaded.block_size:
            raise RequestError(f"this model drafts blocks of {loaded.block_size} (TensorRT-LLM fixes the block "
                               f"when it loads); omit block_size or send {loaded.block_size}")
        rid = next(self._ids)
        tokens: list[int] = []  # committed so far (after any stop-word cut)
        sent = {"n": 0, "text": "", "stopped": None, "cancelled": None}

        def on_round(ev: RoundEvent) -> bool:
            new = ev.new_tokens[0]
            if new:
                tokens.extend(new)
                if req.stop_words:
                    keep = self._stop_cut(tokens, len(tokens) - len(new), req.stop_words)
                    if keep is not None:
                        del tokens[keep:]
                        sent["stopped"] = "stop_word"
                text = self._decode(tokens)
                if sent["stopped"] is None:
                    text = text.rstrip("\ufffd")  # half a UTF-8 character: send it with the next round
                delta = text[len(sent["text"]):] if text.startswith(sent["text"]) else text
                sent["text"] = sent["text"] + delta
                emit(Chunk(token_ids=tokens[sent["n"]:], text=delta))
                sent["n"] = len(tokens)
            if sent["stopped"] is not None:
                return True
            if cancelled():
                sent["cancelled"] = "cancelled"
                return True
            if stopping():
                sent["cancelled"] = "shutdown"
                return True
            return False

        batched = self.scheduler is not None and loaded.llm is None and can_batch(loaded.target, drafter)
        with self._sem if not batched else _NO_LIMIT:
            with self._lock:
                self._active[rid] = _Active(req.mode)
            try:
                if batched:
                    res = self._run_batched(loaded, prompt_ids, options, on_round, cancelled)
                elif loaded.llm is not None:
                    from ..backends.tensorrt_llm import generate_llmapi

                    res = generate_llmapi(loaded.llm, prompt_ids, req.max_tokens, options.sampling, on_round=on_round)
                else:
                    res = generate(loaded.target, drafter, [prompt_ids], options, on_round=on_round)
            finally:
                with self._lock:
                    self._active.pop(rid, None)
        reason = sent["cancelled"] or sent["stopped"] or res.finish_reasons[0]
        acc = res.acceptance_lengths[0]
        stats = {"mode": req.mode, "num_tokens": len(tokens), "tau": res.tau, "acceptance_lengths": acc,
                 "rounds": res.rounds, "verified_drafts": res.verified_drafts, "hints_taken": res.hints_taken,
                 "alternatives_taken": res.alternatives_taken,
                 "finish_reason": reason,
                 "prefill_s": res.prefill_s, "draft_s": res.draft_s, "verify_s": res.verify_s, "total_s": res.total_s,
                 "tokens_per_s": len(tokens) / res.total_s if res.total_s > 0 else 0.0,
                 "block_size": (req.block_size or drafter.block_size) if drafter else loaded.block_size, "prompt_tokens": len(prompt_ids),
                 "active_requests": self.active_requests, "batch_rows": res.batch_rows,
                 "backend": self.cfg.backend, "scheduler": self.scheduler.state() if self.scheduler else None,
                 "orchestration": self.cfg.orchestration}
        if reason in ("cancelled", "shutdown"):
            self.log(f"request {rid} cancelled after {res.rounds} rounds ({reason}); its state is freed")
        else:
            full = self._decode(tokens)
            rest = full[len(sent["text"]):] if full.startswith(sent["text"]) else ""
            emit(Chunk(token_ids=[], text=rest, final=True, stats=stats))
        return stats

    def _run_batched(self, loaded: _Loaded, prompt_ids: list[int], options, on_round, cancelled):
        """The request as a row of the scheduler's batch: its events feed `on_round` here, in the
        request's thread; when that asks to stop (stop word, client gone, shutdown) the row leaves
        at the next round boundary, and what it decoded past the stop is never sent."""
        job = self.scheduler.submit(loaded.target, loaded.drafter, prompt_ids, options)
        seen, stopped = 0, False
        while True:
            try:
                ev = job.events.get(timeout=0.5)
            except queue.Empty:
                if not stopped and (cancelled() or stopping()):
                    on_round(RoundEvent(seen, [[]]))  # records why, sends nothing
                    job.cancel.set()
                    stopped = True
                continue
            if isinstance(ev, Done):
                if ev.error is not None:
                    raise ev.error
                res = ev.result
                res.batch_rows = job.peak_rows
                if stopped:  # the rounds decoded after the stop were never sent
                    res.acceptance_lengths[0] = res.acceptance_lengths[0][:max(0, seen - 1)]
                    res.rounds = len(res.acceptance_lengths[0])
                return res
            if stopped:
                continue
            if on_round(RoundEvent(seen, [ev])):
                job.cancel.set()
                stopped = True
            seen += 1

    def close(self) -> None:
        """Free the scheduler's rows (running requests end as shut down)."""
        if self.scheduler is not None:
            self.scheduler.close()

    def _stop_cut(self, tokens: list[int], start: int, stop_words: list[str]) -> int | None:
        """Length to keep (through the first token at which a stop word appears), or None if none does."""
        if not any(w in self._decode(tokens) for w in stop_words):
            return None
        for k in range(max(1, start), len(tokens) + 1):
            if any(w in self._decode(tokens[:k]) for w in stop_words):
                return k
        return len(tokens)
