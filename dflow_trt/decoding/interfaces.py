"""The two interfaces the decoding loop sees: a target and a drafter.

Shapes: B = batch rows, S = block length (anchor + drafts), T = prompt length,
V = target vocabulary, F = flattened tap features (num_taps * target hidden size).

Back ends implement these and the loop never looks behind them: PyTorch (`targets/hf_target.py`,
`drafter/runtime.py`), ONNX Runtime (`backends/onnxruntime.py`), remote Triton models
(`serving/bls.py`); TensorRT-LLM runs its own loop (`backends/tensorrt_llm.py`). `loading.py`
picks them. State lives in explicit objects (a target cache, a drafter state) so one loaded
model serves many requests at once, each with its own state.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch


@dataclass(frozen=True)
class TargetInfo:
    """What a drafter must agree with to be used against this target."""

    name: str
    fingerprint: str  # hash of architecture + embedding weights; drafters record it
    vocab_size: int
    hidden_size: int
    num_layers: int
    tap_layers: tuple[int, ...]  # decoder layer indices whose *output* is tapped
    eos_token_ids: tuple[int, ...]
    max_context: int | None = None  # positions the target was trained for (prompt + output); None: unknown


@dataclass
class TargetOutput:
    logits: torch.Tensor  # [B, S, V] float32
    taps: torch.Tensor  # [B, S, F] concatenated tap hidden states at those positions


class Target(Protocol):
    info: TargetInfo
    supports_tree: bool  # verify takes any token tree; False: chains only (parents None)

    def prefill(self, input_ids: torch.Tensor, prompt_lens: torch.Tensor) -> tuple[Any, TargetOutput]:
        """Run left-padded prompts [B, T] (true lengths [B]); return (cache, output over all T).

        The cache then holds every prompt position; padding slots are masked for good.
        """

    def verify(self, cache: Any, block_ids: torch.Tensor, parents: torch.Tensor | None = None) -> TargetOutput:
        """Append block_ids [B, S] at each row's next positions; return their logits and taps.
        `parents` [S] (parents[0] = -1, parents[i] < i) makes slot i attend to its ancestors only, at
        position next_pos + its depth: a token tree. None: a chain (slot i's parent is i-1)."""

    def commit(self, cache: Any, num_kept: torch.Tensor, path: torch.Tensor | None = None) -> None:
        """Keep slots path[b, :num_kept[b]] (num_kept >= 1) of the last verified block [B, S], in
        order; drop the rest. None: the chain's first num_kept[b] slots."""


class RowBatching(Protocol):
    """Optional, on a target (over its caches) or a drafter (over its states) whose `joins_rows` is
    True: rows joining and leaving a running batch between rounds (continuous batching;
    `decoding.loop.DecodeBatch`). Neither may change a kept row's arithmetic."""

    joins_rows: bool

    def join(self, state: Any, other: Any) -> Any:
        """`state`'s rows then `other`'s (both committed, none pending); `other` is consumed."""

    def keep(self, state: Any, rows: torch.Tensor) -> Any:
        """Only these rows [R] (long, in this order); the others' memory is freed."""

    def append(self, state: Any, taps: torch.Tensor, lens: torch.Tensor) -> None:
        """Drafters: take committed context taps [B, N, F] (first lens[b] of row b) into the state
        now, as `draft` would (a joining row's prompt, so the batch's pending context is not padded
        to a prompt's length)."""


def batches_rows(obj: Any) -> bool:
    return bool(getattr(obj, "joins_rows", False))


@dataclass
class FlowState:
    """Verifier state at the previous round's rejected positions, aligned with the next block.

    Block position j of the next round sits at absolute position L' + j; if the previous verify
    covered that position with a rejected draft, `valid[b, j]` is True and `taps[b, j]`,
    `token_ids[b, j]` are the target's hidden states there and the rejected token it read, and
    `hint_ids[b, j]` the target's argmax there (its guess for position L' + j + 1).
    """

    taps: torch.Tensor  # [B, S, F]
    token_ids: torch.Tensor  # [B, S] long (0 where not valid)
    hint_ids: torch.Tensor  # [B, S] long (0 where not valid)
    valid: torch.Tensor  # [B, S] bool
    rows: int | None = None  # slots from here on are valid in no row, if the host knows it (None: ask `valid`)

    def select(self, rows: torch.Tensor) -> "FlowState":
        """These rows [R] only; `rows` stays a bound (the prefix of fewer rows is no longer)."""
        return FlowState(self.taps[rows], self.token_ids[rows], self.hint_ids[rows], self.valid[rows], self.rows)

    def prefix(self) -> int:
        """How many leading slots hold any row's flow (decoding's flow is a prefix); a host read
        of `valid` unless the loop already knows it."""
        if self.rows is None:
            cols = self.valid.any(0).nonzero()
            self.rows = int(cols.max()) + 1 if len(cols) else 0
        return self.rows


# How many runner-up tokens for draft 1 a drafter reports (`Proposal.alt_ids`) at most.
MAX_ALTERNATIVES = 7


@dataclass
class Proposal:
    draft_ids: torch.Tensor  # [B, K] target vocabulary ids, K = S-1 (fewer only under a verify threshold)
    draft_probs: torch.Tensor | None  # [B, K, V] the distribution drafts were sampled from (None: greedy)
    confidence: torch.Tensor | None = None  # [B, K] drafter's top probability per position, never a
    # function of the sampled draft itself (see sampling.propose); None: unknown
    alt_ids: torch.Tensor | None = None  # [B, A] greedy: the drafter's runner-up tokens for draft 1, best first
    alt_conf: torch.Tensor | None = None  # [B, A] their drafter probabilities (given whenever alt_ids is)


class Drafter(Protocol):
    block_size: int  # the block it was trained for (anchor + drafts): the default
    uses_flow: bool

    def new_state(self, batch_size: int, generator: torch.Generator | None = None,
                  block_size: int | None = None) -> Any:
        """Empty per-request state (context KV cache) for `batch_size` rows, drafting blocks of
        `block_size` (None: its own; a drafter is block-length agnostic); `generator` (None: the
        global RNG) draws the request's sampled drafts, so a seeded request is reproducible."""

    def draft(self, state: Any, context_taps: torch.Tensor, context_lens: torch.Tensor,
              anchor_ids: torch.Tensor, anchor_pos: torch.Tensor, flow: FlowState | None,
              sampler: "Any", verify_threshold: float = 0.0) -> Proposal:
        """Append newly committed context (taps [B, N, F], first context_lens[b] rows valid) to the
        state, then propose S-1 tokens (S: the state's block size) after anchor_ids [B] at absolute positions anchor_pos [B].

        With `verify_threshold` > 0 a drafter may stop early, after the first position where every
        row's cumulative confidence is below it: the loop never verifies past there."""
