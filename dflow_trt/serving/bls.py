"""BLS orchestration: the decoding loop's Target and Drafter interfaces over the `target` and
`drafter` Triton models, and the stateless services those two models run.

Layout (see README, "Serving"): the `target` and `drafter` models are stateless, so any back end
can stand behind them (TensorRT-LLM on GPU hosts) and several decoding models can share them.
Per-request state therefore stays in the decoding model: `RemoteTarget` keeps each row's committed
tokens and sends the whole sequence on every verify (cost grows with the context; a KV-caching
back end keyed by request id removes that), `RemoteDrafter` keeps the committed context features.
In-process orchestration (the default) keeps both KV caches and is the fast path on one host.

`remote(model_name, inputs: {name: ndarray}, output_names) -> {name: ndarray}` is the only link
to Triton; the Triton layer implements it with `pb_utils.InferenceRequest(...).exec()`.
"""

from __future__ import annotations

import json
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


class RemoteTarget:
    """Target interface over the stateless `target` model (full-sequence forward per call)."""

    def __init__(self, remote: Remote, model: str = "target"):
        self.remote, self.model = remote, model
        out = remote(model, {"info_only": np.array([True])}, ["info"])
        d = json.loads(bytes(out["info"].reshape(-1)[0]).decode())
        self.info = TargetInfo(**{**d, "tap_layers": tuple(d["tap_layers"]), "eos_token_ids": tuple(d["eos_token_ids"])})

    def _run(self, rows: list[list[int]], last: int) -> TargetOutput:
        ids, lens = _pad_left(rows)
        out = self.remote(self.model, {"input_ids": ids, "prompt_lens": lens, "num_last": np.array([last], np.int32)},
                          ["logits", "hidden_states"])
        return TargetOutput(logits=torch.from_numpy(np.array(out["logits"])),
                            taps=torch.from_numpy(np.array(out["hidden_states"])))

    def prefill(self, input_ids: torch.Tensor, prompt_lens: torch.Tensor) -> tuple[RemoteCache, TargetOutput]:
        T = input_ids.shape[1]
        rows = [input_ids[b, T - int(n):].tolist() for b, n in enumerate(prompt_lens)]
        return RemoteCache(committed=rows), self._run(rows, T)

    def verify(self, cache: RemoteCache, block_ids: torch.Tensor) -> TargetOutput:
        cache.pending = block_ids.tolist()
        return self._run([c + p for c, p in zip(cache.committed, cache.pending)], block_ids.shape[1])

    def commit(self, cache: RemoteCache, num_kept: torch.Tensor) -> None:
        for b, k in enumerate(num_kept.tolist()):
            cache.committed[b] += cache.pending[b][:k]
        cache.pending = None


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
              sampler: SamplingParams) -> Proposal:
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
        names = ["draft_ids"] + ([] if sampler.greedy else ["draft_probs"])
        out = self.remote(self.model, inputs, names)
        probs = None if sampler.greedy else torch.from_numpy(np.array(out["draft_probs"]))
        return Proposal(draft_ids=torch.from_numpy(np.array(out["draft_ids"])).long(), draft_probs=probs)


# ---------------------------------------------------------------- server side (target / drafter models)


class TargetService:
    """What the `target` model computes: logits and tap states of the last `num_last` positions."""

    def __init__(self, target):
        self.target = target

    def info_json(self) -> bytes:
        i = self.target.info
        return json.dumps({"name": i.name, "fingerprint": i.fingerprint, "vocab_size": i.vocab_size,
                           "hidden_size": i.hidden_size, "num_layers": i.num_layers,
                           "tap_layers": list(i.tap_layers), "eos_token_ids": list(i.eos_token_ids)}).encode()

    @torch.inference_mode()
    def forward(self, input_ids: np.ndarray, prompt_lens: np.ndarray, num_last: int) -> tuple[np.ndarray, np.ndarray]:
        ids = torch.from_numpy(np.asarray(input_ids, dtype=np.int64))  # [B, T] left-padded
        lens = torch.from_numpy(np.asarray(prompt_lens, dtype=np.int64))
        if ids.ndim != 2 or lens.shape != (ids.shape[0],) or not 1 <= num_last <= ids.shape[1]:
            raise UserError(f"target inputs: input_ids [B, T], prompt_lens [B], 1 <= num_last <= T; got "
                            f"{list(ids.shape)}, {list(lens.shape)}, {num_last}")
        if int(ids.min()) < 0 or int(ids.max()) >= self.target.info.vocab_size:
            raise UserError(f"input_ids outside the vocabulary 0..{self.target.info.vocab_size - 1}")
        _, out = self.target.prefill(ids, lens)
        return out.logits[:, -num_last:].float().numpy(), out.taps[:, -num_last:].float().numpy()


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
        out = {"draft_ids": prop.draft_ids.numpy().astype(np.int64)}
        if prop.draft_probs is not None:
            out["draft_probs"] = prop.draft_probs.float().numpy()
        return out
